"""The CuPy stand-in is at least as strict as CuPy: each way a test could pass on the CPU and fail on a
GPU is refused here (host arrays in device calls, names and keywords CuPy lacks, kernel scalars of the
wrong width, launch sizes beyond CUDA's limits, missing name expressions, barriers not every thread
reaches, reads of unwritten memory), and synchronising calls are counted.

These tests run only where the stand-in is installed (``tests/conftest.py``); on a GPU machine the same
rules are CuPy's own.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STANDIN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not STANDIN, reason="tests of the CuPy stand-in")]

SOURCE = r"""
template <typename T>
__global__ void axpy(int n, T alpha, const T* x, T* y) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    y[i] += alpha * x[i];
}
__global__ void diverging(float* out) {
  if (threadIdx.x > 0) __syncthreads();
  out[threadIdx.x] = 1.0f;
}
__global__ void skipped_by_some(float* out) {
  if (threadIdx.x < 3) __syncthreads();
  out[threadIdx.x] = 1.0f;
}
__global__ void two_barriers(float* out) {
  if (threadIdx.x % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}
__global__ void reverse(float* out, const float* in, int n) {
  __shared__ float tile[1024];
  tile[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = tile[n - 1 - threadIdx.x];
}
__global__ void __launch_bounds__(64) bounded(float* out) { out[threadIdx.x] = 2.0f; }
"""
EXPRESSIONS = ["axpy<float>", "axpy<double>", "diverging", "skipped_by_some", "two_barriers", "reverse",
               "bounded"]


@pytest.fixture(scope="module")
def module():
    import cupy

    return cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=EXPRESSIONS)


@pytest.fixture
def cupy():
    import cupy

    return cupy


# --- kernels -----------------------------------------------------------------------------------------
def test_a_correct_launch_runs_every_thread_and_is_recorded(module, cupy, device_stats):
    x = cupy.arange(1000, dtype=np.float32)
    y = cupy.ones(1000, dtype=np.float32)
    module.get_function("axpy<float>")((3,), (128,), (np.int32(1000), np.float32(2), x, y))
    np.testing.assert_array_equal(y.get(), 1 + 2 * np.arange(1000, dtype=np.float32))  # grid-stride wrap
    assert device_stats.launches == [("axpy<float>", (3, 1, 1), (128, 1, 1))]


def test_barriers_order_a_block_through_shared_memory(module, cupy):
    data = cupy.asarray(np.arange(512, dtype=np.float32))
    out = cupy.empty(512, dtype=np.float32)
    module.get_function("reverse")((1,), (512,), (out, data, np.int32(512)))
    np.testing.assert_array_equal(out.get(), np.arange(512, dtype=np.float32)[::-1])


@pytest.mark.parametrize("kernel, message", [
    ("diverging", "which thread 0 of its block finished without reaching"),
    ("skipped_by_some", "finished while the others wait at the __syncthreads"),
    ("two_barriers", "wait at different __syncthreads"),
])
def test_a_barrier_that_not_every_thread_reaches_is_an_error(module, cupy, kernel, message):
    from cupy_standin._raw import LaunchError

    with pytest.raises(LaunchError, match=message):
        module.get_function(kernel)((2,), (8,), (cupy.zeros(8, dtype=np.float32),))


@pytest.mark.parametrize("args, error, message", [
    (lambda c: (1000, np.float32(2), c.x, c.y), "LaunchError", r"int64 scalar given for a 32-bit signed"),
    (lambda c: (np.int32(1000), 2.0, c.x, c.y), "LaunchError", r"float64 scalar given for a 32-bit floating"),
    (lambda c: (np.int32(1000), np.float32(2), c.x.get(), c.y), "TypeError", "host array"),
    (lambda c: (np.int32(1000), np.float32(2), c.x.astype(np.float64), c.y), "LaunchError",
     "array of float64 given for a pointer"),
    (lambda c: (np.int32(1000), np.float32(2), c.x[::2], c.y), "LaunchError", "not C-contiguous"),
    (lambda c: (np.int32(1000), np.float32(2), c.x), "LaunchError", "takes 4 arguments"),
    (lambda c: [np.int32(1000), np.float32(2), c.x, c.y], "TypeError", "args must be a tuple"),
    (lambda c: (np.int32(1000), c.x, c.x, c.y), "LaunchError", "device array given for a 32-bit floating"),
])
def test_kernel_arguments_are_checked_against_the_parameters(module, cupy, args, error, message):
    from cupy_standin import _raw

    class Operands:
        x = cupy.arange(1000, dtype=np.float32)
        y = cupy.ones(1000, dtype=np.float32)

    expected = TypeError if error == "TypeError" else _raw.LaunchError
    with pytest.raises(expected, match=message):
        module.get_function("axpy<float>")((3,), (128,), args(Operands))


@pytest.mark.parametrize("grid, block, kernel, message", [
    ((1,), (1025,), "axpy<float>", r"block\[0\] = 1025 is outside"),
    ((1,), (512, 4), "axpy<float>", "2048 threads per block exceed 1024"),
    ((1,), (32, 32, 2), "axpy<float>", "2048 threads per block"),
    ((1,), (1, 1, 65), "axpy<float>", r"block\[2\] = 65 is outside"),
    ((2**31,), (32,), "axpy<float>", r"grid\[0\] = 2147483648 is outside"),
    ((1, 65536), (32,), "axpy<float>", r"grid\[1\] = 65536 is outside"),
    ((0,), (32,), "axpy<float>", r"grid\[0\] = 0 is outside"),
    ((1,), (128,), "bounded", "exceed its __launch_bounds__ of 64"),
])
def test_launch_sizes_beyond_cuda_limits_are_refused(module, cupy, grid, block, kernel, message):
    from cupy_standin._raw import LaunchError

    x = cupy.zeros(1, dtype=np.float32)
    args = (np.int32(1), np.float32(1), x, x) if kernel.startswith("axpy") else (x,)
    with pytest.raises(LaunchError, match=message):
        module.get_function(kernel)(grid, block, args)


def test_grid_and_block_must_be_tuples_of_ints(module, cupy):
    x = cupy.zeros(1, dtype=np.float32)
    with pytest.raises(TypeError, match="grid must be a tuple"):
        module.get_function("bounded")(1, (32,), (x,))
    with pytest.raises(TypeError, match=r"block\[0\] must be an int"):
        module.get_function("bounded")((1,), (32.0,), (x,))


def test_only_the_name_expressions_are_in_the_module(module, cupy):
    from cupy_standin._raw import LaunchError

    with pytest.raises(LaunchError, match="named symbol not found"):
        module.get_function("axpy<long long>")
    with pytest.raises(LaunchError, match="named symbol not found"):
        cupy.RawModule(code=SOURCE, name_expressions=["axpy<float>"]).get_function("axpy<double>")


def test_a_source_that_does_not_build_is_a_compile_error(cupy):
    from cupy_standin._raw import CompileException

    broken = SOURCE.replace("y[i] += alpha * x[i];", "y[i] += alpha * x[i] +;")
    with pytest.raises(CompileException, match="could not build"):
        cupy.RawModule(code=broken, name_expressions=["axpy<float>"]).get_function("axpy<float>")


# --- arrays ---------------------------------------------------------------------------------------
def test_host_arrays_are_refused_where_cupy_refuses_them(cupy):
    device, host = cupy.arange(3.0), np.arange(3.0)
    for operation in (lambda: device + host, lambda: host * device, lambda: cupy.multiply(device, host),
                      lambda: cupy.concatenate([device, host]), lambda: cupy.ascontiguousarray(host),
                      lambda: cupy.empty_like(host), lambda: np.asarray(device), lambda: np.array(device)):
        with pytest.raises(TypeError):
            operation()


def test_names_and_keywords_cupy_lacks_are_refused(cupy):
    device = cupy.arange(3.0)
    with pytest.raises(AttributeError, match="has no attribute 'insert'"):
        cupy.insert(device, 0, 1.0)
    with pytest.raises(TypeError):  # a NumPy function CuPy does not implement
        np.insert(device, 0, 1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        cupy.zeros(3, dtyp=np.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        device.sum(initial=0.0)  # NumPy's sum has `initial`, CuPy's has not
    with pytest.raises(AttributeError, match="'cupy.ndarray' object has no attribute 'resize'"):
        device.resize(4)  # NumPy's ndarray has it
    with pytest.raises(TypeError, match="Unsupported dtype object"):
        cupy.zeros(2, dtype=object)


def test_numpy_functions_dispatch_to_cupy_and_stay_on_the_device(cupy, device_stats):
    device = cupy.arange(6.0).reshape(2, 3)
    stacked = np.concatenate([device, device])
    total = np.sum(device)
    assert type(stacked) is cupy.ndarray and type(total) is cupy.ndarray and total.ndim == 0
    assert type(np.exp(device)) is cupy.ndarray
    assert device_stats.syncs == []


def test_scalars_from_the_device_are_counted_synchronisations(cupy, device_stats):
    device = cupy.arange(4, dtype=np.int64)
    assert int(device.sum()) == 6 and bool(device[1] == 1) and float(device.max()) == 3.0
    assert device[1:].get().tolist() == [1, 2, 3]
    assert len(device_stats.syncs) == 4 and "test_cupy_standin.py" in device_stats.syncs[0]


def test_uploads_from_pageable_memory_synchronise_and_from_pinned_memory_do_not(cupy, device_stats):
    import cupyx

    device = cupy.zeros(4)
    device.set(np.ones(4))
    assert len(device_stats.syncs) == 1
    pinned = cupyx.empty_pinned(4)
    pinned[...] = 2.0
    device.set(pinned, stream=cupy.cuda.get_current_stream())
    assert len(device_stats.syncs) == 1 and device_stats.uploads == 2
    np.testing.assert_array_equal(device.get(), 2.0)


def test_empty_memory_holds_nan_or_a_byte_pattern(cupy):
    assert np.isnan(cupy.empty(3).get()).all()
    assert (cupy.empty(2, dtype=np.int32).get() == 0x5A5A5A5A).all()
    assert np.isnan(cupy.empty_like(cupy.zeros((2, 2), dtype=np.float32)).get()).all()


def test_the_device_is_on_only_during_gpu_tests(cupy):
    from sparse_scan import backend

    assert cupy.cuda.is_available() and backend.get("auto").name == "gpu"
    assert type(cupy.zeros(1)).__module__ == "cupy" and backend.of(cupy.zeros(1)).name == "gpu"
