"""Compile a RawKernel source with g++ for the CPU and load it with ctypes.

Most kernels are grid-stride loops without shared memory or barriers, so running every (block, thread)
of a small grid one after another on the host (``SHIM_LAUNCH``) executes exactly the source the GPU
runs. Kernels with ``__syncthreads`` run through ``SHIM_LAUNCH_THREADS``: the blocks one after another,
the threads of a block as host threads meeting at a ``std::barrier`` (so ``__shared__`` may be one
static array, reused block after block). Tests compare this against the NumPy twins, which checks
index arithmetic, bounds, barriers and dtype handling without a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

RAWKERNELS = pathlib.Path(__file__).resolve().parents[1] / "rawkernels"

SHIM = r"""
#include <barrier>
#include <cassert>
#include <thread>
#include <vector>
struct dim3 { unsigned int x, y, z; };
static thread_local dim3 threadIdx;
static dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* shim_block_barrier = nullptr;
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
static inline void __syncthreads() {
  assert(shim_block_barrier && "__syncthreads outside a SHIM_LAUNCH_THREADS launch");
  shim_block_barrier->arrive_and_wait();
}
#define SHIM_LAUNCH_THREADS(grid, block, ...)                                           \
  do {                                                                                  \
    gridDim = {(unsigned)(grid), 1u, 1u};                                               \
    blockDim = {(unsigned)(block), 1u, 1u};                                             \
    std::barrier<> barrier_(blockDim.x);                                                \
    shim_block_barrier = &barrier_;                                                     \
    for (unsigned b_ = 0; b_ < gridDim.x; ++b_) {                                       \
      blockIdx = {b_, 0u, 0u};                                                          \
      std::vector<std::thread> threads_;                                                \
      for (unsigned t_ = 0; t_ < blockDim.x; ++t_)                                      \
        threads_.emplace_back([&, t_] { threadIdx = {t_, 0u, 0u}; __VA_ARGS__; });      \
      for (auto& thread_ : threads_) thread_.join();                                    \
    }                                                                                   \
    shim_block_barrier = nullptr;                                                       \
  } while (0)
#define SHIM_LAUNCH(grid, block, ...)                                                   \
  do {                                                                                  \
    gridDim = {(unsigned)(grid), 1u, 1u};                                               \
    blockDim = {(unsigned)(block), 1u, 1u};                                             \
    for (unsigned b_ = 0; b_ < gridDim.x; ++b_)                                         \
      for (unsigned t_ = 0; t_ < blockDim.x; ++t_) {                                    \
        blockIdx = {b_, 0u, 0u};                                                        \
        threadIdx = {t_, 0u, 0u};                                                       \
        __VA_ARGS__;                                                                    \
      }                                                                                 \
  } while (0)
"""


def compile_for_cpu(cu_file: str, wrappers: str) -> ctypes.CDLL:
    """Build ``rawkernels/<cu_file>`` plus C wrappers into a shared library (cached by content).

    ``wrappers`` defines ``extern "C"`` functions taking ``int grid, int block`` plus the kernel's
    arguments and calling ``SHIM_LAUNCH(grid, block, kernel<...>(...))`` (or ``SHIM_LAUNCH_THREADS``
    for a kernel with barriers).
    """
    if shutil.which("g++") is None:
        pytest.skip("g++ is not available to run kernel sources on the CPU")
    path = RAWKERNELS / cu_file
    text = SHIM + f'#include "{path}"\n' + wrappers
    digest = hashlib.sha256((text + path.read_text()).encode()).hexdigest()[:16]
    build_dir = pathlib.Path(tempfile.gettempdir()) / "sparse-scan-cuda-on-cpu"
    build_dir.mkdir(exist_ok=True)
    library = build_dir / f"{path.stem}-{digest}.so"
    if not library.exists():
        cpp = build_dir / f"{path.stem}-{digest}.cpp"
        cpp.write_text(text)
        partial = library.with_suffix(".tmp.so")
        result = subprocess.run(
            ["g++", "-std=c++20", "-pthread", "-O1", "-shared", "-fPIC", "-Wall", "-Werror",
             "-Wno-unused-variable", "-o", str(partial), str(cpp)],
            capture_output=True, text=True,
        )
        if result.returncode:
            raise RuntimeError(f"g++ could not build {cu_file} for the CPU:\n{result.stderr}")
        partial.replace(library)
    return ctypes.CDLL(str(library))


def pointer(array: np.ndarray) -> ctypes.c_void_p:
    """A ctypes pointer to a C-contiguous array's buffer."""
    assert array.flags.c_contiguous, "kernels take contiguous arrays"
    return ctypes.c_void_p(array.ctypes.data)
