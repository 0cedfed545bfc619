"""The GPU dense-block scan: ``rawkernels/dense_scan.cu`` and ``sparse_scan._dense_scan_gpu``.

Three layers of evidence (GPU.md): the kernel source compiled for the CPU on hand-built descriptor
tables against NumPy's batched matmul; the whole GPU orchestration (descriptor tables, pointer
patching, workspaces, output gather) run level by level on the CPU, NumPy standing in for CuPy and the
CPU build of the kernel for the RawKernel, against ``dense_scan`` on NumPy for every schedule; and
``gpu``-marked parity tests of ``dense_scan`` and of the RNN/GRU backward with CuPy inputs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_on_cpu import compile_for_cpu, pointer

from sparse_scan import _dense_scan_gpu, backend
from sparse_scan import dense_scan as dense_scan_module
from sparse_scan._dense_scan_gpu import COPY, FIELDS, MM, MV, TILE, TILE_THREADS, run_dense_plan_gpu
from sparse_scan.dense_scan import dense_plan, dense_scan
from sparse_scan.recurrent import GRU, RNN
from sparse_scan.recurrent import _base as recurrent_base
from sparse_scan.scan import depth

VALUE_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}
LENGTHS = [1, 2, 3, 5, 8, 21]
SIZES = [1, 3, 20, 33]
BATCHES = [1, 4]


def schedules(n: int):
    """Every method, and hybrid with every number of levels."""
    yield "linear", None
    yield "blelloch", None
    for levels in range(depth(n) + 1):
        yield "hybrid", levels


@pytest.fixture(scope="module")
def kernels():
    wrappers = "".join(
        f'extern "C" void dense_scan_level_{value}(int grid, int block, const long long* table,'
        f" long long steps, long long items)"
        f" {{ SHIM_LAUNCH(grid, block, (dense_scan_level<{value}>(table, steps, items))); }}\n"
        f'extern "C" void dense_scan_chain_{value}(int grid, int block, const long long* table,'
        f" long long steps)"
        f" {{ SHIM_LAUNCH(grid, block, (dense_scan_chain<{value}>(table, steps))); }}\n"
        f'extern "C" void dense_scan_tiled_{value}(int grid, int block, const long long* table,'
        f" long long steps, long long units)"
        f" {{ SHIM_LAUNCH(grid, block, (dense_scan_tiled<{value}>(table, steps, units))); }}\n"
        for value in VALUE_TYPES.values())
    return compile_for_cpu("dense_scan.cu", wrappers)


def kernel(library, dtype, name="dense_scan_level"):
    return getattr(library, f"{name}_{VALUE_TYPES[np.dtype(dtype)]}")


def chain(rng, n, batch, size, dtype, affine):
    """Blocks scaled so that long products stay of order one, and direct gradients."""
    blocks = rng.standard_normal((n, batch, size, size)) / np.sqrt(size)
    direct = rng.standard_normal((n, batch, size) if affine else (batch, size))
    return blocks.astype(dtype), direct.astype(dtype)


def assert_close(got, want, rtol):
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    assert float(np.abs(got - want).max(initial=0.0)) <= rtol * scale


# --- the kernel on hand-built tables (the layout of rawkernels/dense_scan.cu) -----------------------
class Table:
    """Descriptor rows of one launch; keeps every array it points at alive."""

    def __init__(self, batch, size, dtype):
        self.batch, self.size, self.dtype = batch, size, np.dtype(dtype)
        self.rows, self.keep, self.checks, self.items, self.units = [], [], [], 0, 0

    def ptr(self, array):
        if array is None:
            return 0
        assert array.flags.c_contiguous and array.dtype == self.dtype
        self.keep.append(array)
        return array.ctypes.data

    @staticmethod
    def stride(array, per_sample):
        return 0 if array is None or array.ndim == per_sample else int(np.prod(array.shape[1:]))

    def step(self, right, right_vector, left, left_vector, affine):
        """``left`` a block stack (mm) or None (mv); an operand without its batch axis is shared."""
        h, b = self.size, self.batch
        vector_product = np.matmul(right, left_vector[..., None])[..., 0] if left_vector is not None else None
        if affine:
            vector_product = vector_product + right_vector
        out_block = None if left is None else np.full((b, h, h), np.nan, self.dtype)
        out_vector = None if vector_product is None else np.full((b, h), np.nan, self.dtype)
        kind, per = (MM, h * h + (h if left_vector is not None else 0)) if left is not None else (MV, h)
        chunks = -(-h // TILE_THREADS)  # tiled units: 16x16 tiles of an mm, then vector chunks
        units = chunks if left is None else (-(-h // TILE)) ** 2 + (chunks if left_vector is not None else 0)
        self.rows.append([kind, self.items, b, per, h, int(affine),
                          self.ptr(right), self.stride(right, 2),
                          self.ptr(right_vector if affine else None), self.stride(right_vector, 1),
                          self.ptr(left), self.stride(left, 2),
                          self.ptr(left_vector), self.stride(left_vector, 1),
                          self.ptr(out_block), self.ptr(out_vector), self.units, units])
        self.items += b * per
        self.units += b * units
        if out_block is not None:
            self.checks.append((out_block, np.broadcast_to(np.matmul(right, left), (b, h, h))))
        if out_vector is not None:
            self.checks.append((out_vector, np.broadcast_to(vector_product, (b, h))))

    def copy(self, vector):
        out = np.full((self.batch, self.size), np.nan, self.dtype)
        self.rows.append([COPY, self.items, self.batch, self.size, self.size, 0, 0, 0, 0, 0, 0, 0,
                          self.ptr(vector), self.stride(vector, 1), 0, self.ptr(out), 0, 0])
        self.items += self.batch * self.size
        self.checks.append((out, np.broadcast_to(vector, out.shape)))

    def run(self, library, grid, block, tiled=False):
        table = np.array(self.rows, dtype=np.int64).reshape(-1)
        assert table.size == len(self.rows) * FIELDS
        if tiled:
            kernel(library, self.dtype, "dense_scan_tiled")(
                grid, TILE_THREADS, pointer(table), ctypes.c_longlong(len(self.rows)),
                ctypes.c_longlong(self.units))
        else:
            kernel(library, self.dtype)(grid, block, pointer(table), ctypes.c_longlong(len(self.rows)),
                                        ctypes.c_longlong(self.items))

    def check(self):
        for got, want in self.checks:
            np.testing.assert_allclose(got, want, rtol=TOLERANCE[self.dtype] * 10, atol=1e-5)


def steps_of_every_kind(table, rng, dtype, copies=True):
    """Every step kind and operand layout the level kernels meet, into ``table``."""
    h, b = table.size, table.batch

    def value(*shape):
        return np.ascontiguousarray(rng.standard_normal(shape), dtype=dtype)

    table.step(value(b, h, h), value(b, h), value(b, h, h), value(b, h), affine=True)  # mm affine
    table.step(value(b, h, h), None, value(b, h, h), None, affine=False)  # mm, blocks only
    table.step(value(b, h, h), value(b, h), None, value(b, h), affine=True)  # mv affine
    table.step(value(b, h, h), None, None, value(b, h), affine=False)  # mv
    table.step(value(h, h), value(h), value(b, h, h), value(b, h), affine=True)  # shared right
    table.step(value(b, h, h), value(b, h), value(h, h), value(h), affine=True)  # shared left
    table.step(value(h, h), None, None, value(b, h), affine=False)  # shared matrix of an mv
    if copies:
        table.copy(value(b, h))
        table.copy(value(h))  # a shared vector, copied to every sample


@pytest.mark.parametrize("grid", [1, 3])
@pytest.mark.parametrize("size", [1, 3, 17, 33])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tiled_kernel_runs_every_mm_and_mv_step_kind(kernels, grid, size, dtype):
    """``dense_scan_tiled``: whole and partial 16x16 tiles, vector chunks, shared operands."""
    table = Table(3, size, dtype)
    steps_of_every_kind(table, np.random.default_rng(size + grid), dtype, copies=False)
    table.run(kernels, grid, None, tiled=True)
    table.check()


@pytest.mark.parametrize("grid, block", [(1, 1), (3, 5), (16, 32)])
@pytest.mark.parametrize("size", [1, 3, 33])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_step_kind_in_one_table_matches_numpy(kernels, grid, block, size, dtype):
    rng = np.random.default_rng(size * grid + block)
    batch = 3

    table = Table(batch, size, dtype)
    steps_of_every_kind(table, rng, dtype)
    table.run(kernels, grid, block)
    table.check()


@pytest.mark.parametrize("grid, block", [(1, 1), (2, 3), (5, 32)])
@pytest.mark.parametrize("size", [1, 3, 33])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chain_kernel_runs_every_step_on_the_last_one(kernels, grid, block, size, affine, dtype):
    """``dense_scan_chain``: each step reads the vector the step before wrote (a barrier apart), with
    blocks per sample or shared, fewer or more thread blocks than samples and threads than entries."""
    rng = np.random.default_rng(size + 10 * block)
    batch, h, keep = 3, size, []

    def value(*shape):
        keep.append(np.ascontiguousarray(rng.standard_normal(shape) / np.sqrt(h), dtype=dtype))
        return keep[-1]

    vector, rows = value(batch, h), []
    want = vector.astype(np.float64)
    for step in range(7):
        right = value(h, h) if step == 2 else value(batch, h, h)  # one shared by the batch
        direct = value(batch, h) if affine else None
        out = np.full((batch, h), np.nan, dtype)
        keep.append(out)
        rows.append([MV, 0, batch, h, h, int(affine), right.ctypes.data, 0 if right.ndim == 2 else h * h,
                     0 if direct is None else direct.ctypes.data, h if affine else 0, 0, 0,
                     vector.ctypes.data, h, 0, out.ctypes.data, 0, 0])
        want = np.matmul(right.astype(np.float64), want[..., None])[..., 0]
        if affine:
            want = want + direct
        vector = out
    table = np.array(rows, dtype=np.int64).reshape(-1)
    kernel(kernels, dtype, "dense_scan_chain")(grid, block, pointer(table), ctypes.c_longlong(len(rows)))
    np.testing.assert_allclose(vector, want, rtol=TOLERANCE[np.dtype(dtype)] * 10, atol=1e-5)


def test_chain_blocks_hold_whole_warps_up_to_1024_threads():
    assert [_dense_scan_gpu.chain_threads(h) for h in (1, 20, 32, 33, 1000, 1025, 5000)] == [
        32, 32, 32, 64, 1024, 1024, 1024]


# --- the GPU orchestration on the CPU: NumPy for CuPy, the CPU build for the RawKernel ----------------
@pytest.fixture
def scan_on_cpu(kernels, monkeypatch):
    """Run ``run_dense_plan_gpu`` on the host; records every launch's number of steps (a chain's as
    ``("chain", steps)``, a tiled level's as ``("tiled", steps)``)."""
    launches, uploads = [], []

    def function(filename, name, dtype):
        assert filename == "dense_scan.cu" and name in ("dense_scan_level", "dense_scan_chain",
                                                        "dense_scan_tiled")
        return name, kernel(kernels, dtype, name)

    def launch(compiled, work_items, args):
        name, compiled = compiled
        table, steps, items = args
        assert name == "dense_scan_level"
        assert isinstance(steps, np.int64) and isinstance(items, np.int64), "explicit int64 scalars"
        assert table.flags.c_contiguous and table.dtype == np.int64 and table.size == steps * FIELDS
        assert work_items == items > 0
        launches.append(int(steps))
        compiled(3, 7, pointer(table), ctypes.c_longlong(steps), ctypes.c_longlong(items))

    def launch_blocks(compiled, blocks, threads, args):
        name, compiled = compiled
        table, steps = args[:2]
        assert isinstance(steps, np.int64)
        assert table.flags.c_contiguous and table.dtype == np.int64 and table.size == steps * FIELDS
        if name == "dense_scan_chain":
            assert blocks == table[2] and threads % 32 == 0 and 0 < threads <= 1024
            launches.append(("chain", int(steps)))
            compiled(min(blocks, 2), min(threads, 8), pointer(table), ctypes.c_longlong(steps))
            return
        assert name == "dense_scan_tiled" and threads == TILE_THREADS and isinstance(args[2], np.int64)
        last = table.reshape(-1, FIELDS)[-1]
        assert blocks == args[2] == last[16] + last[2] * last[17]  # every unit of the level
        launches.append(("tiled", int(steps)))
        compiled(min(blocks, 2), threads, pointer(table), ctypes.c_longlong(steps), ctypes.c_longlong(blocks))

    def upload(device, host):
        uploads.append(host.size)
        np.copyto(device, host)

    monkeypatch.setattr(_dense_scan_gpu, "_xp", lambda: np)
    monkeypatch.setattr(_dense_scan_gpu, "_pointer", lambda array: array.ctypes.data)
    monkeypatch.setattr(_dense_scan_gpu, "_device", lambda: 0)
    monkeypatch.setattr(_dense_scan_gpu, "_upload", upload)
    monkeypatch.setattr(_dense_scan_gpu, "_WORKSPACES", {})
    monkeypatch.setattr(_dense_scan_gpu._kernels, "function", function)
    monkeypatch.setattr(_dense_scan_gpu._kernels, "launch", launch)
    monkeypatch.setattr(_dense_scan_gpu._kernels, "launch_blocks", launch_blocks)
    return launches, uploads


def expected_launches(plan, size=1):
    """Per launch: the steps of a level (``("tiled", steps)`` for a level of block products when
    ``size`` reaches ``TILED_MIN_SIZE``), ``("chain", steps)`` for a chain of levels; then the gather."""
    launches, index = [], 0
    while index < plan.critical_steps:
        stop = plan.chains.get(index)
        if stop is None:
            groups = plan.levels_of_groups[index]
            steps = sum(len(group.ops) for group in groups)
            tiled = size >= _dense_scan_gpu.TILED_MIN_SIZE and any(group.kind == "mm" for group in groups)
            launches.append(("tiled", steps) if tiled else steps)
            index += 1
        else:
            launches.append(("chain", stop - index))
            index = stop
    return launches + [plan.n + 1]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_schedule_on_cpu_standin_equals_numpy(scan_on_cpu, n, size, affine, dtype):
    launches, _ = scan_on_cpu
    rng = np.random.default_rng(1000 * n + size)
    for batch in BATCHES:
        blocks, direct = chain(rng, n, batch, size, dtype, affine)
        for method, levels in schedules(n):
            plan = dense_plan(n, method, levels)
            got = run_dense_plan_gpu(plan, blocks, direct)
            assert_close(got, dense_scan(blocks, direct, method, levels, threads=1),
                         TOLERANCE[np.dtype(dtype)])
            # one launch per level or chain of levels, then the gather
            assert launches == expected_launches(plan)
            assert len(launches) == _dense_scan_gpu.launch_count(plan)
            launches.clear()


@pytest.mark.parametrize("n", [5, 21])
@pytest.mark.parametrize("size", [3, 17])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
def test_tiled_levels_on_cpu_standin_equal_numpy(scan_on_cpu, monkeypatch, n, size, affine):
    """Levels of block products through ``dense_scan_tiled`` (its threshold lowered to these sizes)."""
    launches, _ = scan_on_cpu
    monkeypatch.setattr(_dense_scan_gpu, "TILED_MIN_SIZE", 2)
    blocks, direct = chain(np.random.default_rng(n + size), n, 2, size, np.float64, affine)
    for method, levels in [("blelloch", None), ("hybrid", 1), ("linear", None)]:
        plan = dense_plan(n, method, levels)
        assert_close(run_dense_plan_gpu(plan, blocks, direct), dense_scan(blocks, direct, method, levels),
                     1e-12)
        assert launches == expected_launches(plan, size)
        assert method == "linear" or any(isinstance(launch, tuple) and launch[0] == "tiled"
                                         for launch in launches)
        launches.clear()


def test_dense_scan_gpu_twin_runs_the_kernels_on_cpu_standin(scan_on_cpu):
    launches, _ = scan_on_cpu
    rng = np.random.default_rng(5)
    blocks, direct = chain(rng, 5, 2, 3, np.float64, affine=True)
    plan = dense_plan(5, "blelloch")
    gpu_twin = dense_scan_module._scan.twins["gpu"]
    got = gpu_twin(backend.get("cpu"), plan, blocks, direct, None)
    assert len(launches) == plan.critical_steps + 1 == _dense_scan_gpu.launch_count(plan)  # no chain
    assert_close(got, dense_scan(blocks, direct), 1e-12)


@pytest.mark.parametrize("cell", [RNN, GRU])
@pytest.mark.parametrize("last_only", [False, True], ids=["every-step", "last-only"])
def test_recurrent_bp_gpu_twin_is_one_chain_launch_on_cpu_standin(scan_on_cpu, monkeypatch, cell, last_only):
    """On a GPU, BP fills the blocks and runs their chain in one launch: equal to BP through the
    factors (the CPU twin), which fills nothing."""
    launches, _ = scan_on_cpu
    gpu_scan = dense_scan_module._scan.twins["gpu"]
    monkeypatch.setattr(recurrent_base, "dense_scan", lambda blocks, direct, method: gpu_scan(
        backend.get("cpu"), dense_plan(len(blocks), method), blocks, direct, None))
    steps, batch, hidden = 9, 3, 5
    layer = cell(2, hidden, dtype=np.float64, rng=1)
    rng = np.random.default_rng(6)
    layer.forward(rng.standard_normal((batch, steps, 2)))
    direct = rng.standard_normal((batch, hidden) if last_only else (steps, batch, hidden))
    cpu = backend.get("cpu")
    got = recurrent_base._back_propagate.twins["gpu"](cpu, layer, direct, None)
    assert launches == [("chain", steps), steps + 1]
    assert_close(got, recurrent_base._back_propagate.twins["cpu"](cpu, layer, direct, None), 1e-12)


def test_workspace_is_built_once_and_results_stay_on_cpu_standin(scan_on_cpu, monkeypatch):
    _, uploads = scan_on_cpu
    rng = np.random.default_rng(3)
    plan = dense_plan(13, "hybrid", 2)
    blocks, direct = chain(rng, 13, 2, 5, np.float64, affine=True)
    first = run_dense_plan_gpu(plan, blocks, direct)
    kept = first.copy()
    workspace = next(iter(_dense_scan_gpu._workspaces(plan).values()))
    assert len(uploads) == 1
    second = run_dense_plan_gpu(plan, blocks, 2 * direct)  # same blocks: no new upload
    assert len(uploads) == 1
    np.testing.assert_allclose(second, 2 * kept, rtol=1e-12)
    new_blocks, new_direct = chain(rng, 13, 2, 5, np.float64, affine=True)
    third = run_dense_plan_gpu(plan, new_blocks, new_direct)
    assert len(uploads) == 2  # the blocks moved: their pointers are patched and uploaded once
    assert list(_dense_scan_gpu._workspaces(plan).values()) == [workspace]
    assert_close(third, dense_scan(new_blocks, new_direct, "hybrid", 2), 1e-12)
    assert_close(first, kept, 0.0)  # returned gradients are not workspace buffers
    run_dense_plan_gpu(plan, blocks[:, :1], direct[:, :1])
    run_dense_plan_gpu(plan, blocks, direct[-1])
    run_dense_plan_gpu(plan, blocks.astype(np.float32), direct.astype(np.float32))
    assert len(_dense_scan_gpu._workspaces(plan)) == 4  # per batch, affine flag and dtype
    monkeypatch.setattr(_dense_scan_gpu, "_device", lambda: 1)  # another current GPU
    assert_close(run_dense_plan_gpu(plan, blocks, direct), kept, 1e-12)
    assert len(_dense_scan_gpu._workspaces(plan)) == 5  # its own device memory


def test_non_contiguous_blocks_on_cpu_standin(scan_on_cpu):
    rng = np.random.default_rng(4)
    blocks, direct = chain(rng, 8, 3, 4, np.float64, affine=True)
    plan = dense_plan(8, "blelloch")
    transposed = np.swapaxes(np.swapaxes(blocks, 2, 3).copy(), 2, 3)  # same values, F-order blocks
    assert not transposed.flags.c_contiguous
    assert_close(run_dense_plan_gpu(plan, transposed, direct), dense_scan(blocks, direct), 1e-12)


def test_intermediates_share_memory_across_levels_on_cpu_standin(scan_on_cpu):
    rng = np.random.default_rng(2)
    plan = dense_plan(21, "blelloch")
    blocks, direct = chain(rng, 21, 2, 3, np.float64, affine=True)
    assert_close(run_dense_plan_gpu(plan, blocks, direct), dense_scan(blocks, direct), 1e-12)
    workspace = next(iter(_dense_scan_gpu._workspaces(plan).values()))
    buffers = [(buffer, array) for values in (workspace.blocks, workspace.vectors)
               for buffer, array in values.items()]
    level = {group.buffer: index for index, groups in enumerate(plan.levels_of_groups) for group in groups}
    shared = 0
    for k, (buffer, array) in enumerate(buffers):
        for other, other_array in buffers[k + 1:]:
            if np.shares_memory(array, other_array):
                shared += 1
                assert level[other] != level[buffer], "a level's results never alias each other"
    assert shared > 0


def test_rejects_other_dtypes_and_shapes(scan_on_cpu):
    plan = dense_plan(3, "blelloch")
    with pytest.raises(TypeError, match="float32 or float64"):
        run_dense_plan_gpu(plan, np.zeros((3, 1, 2, 2), np.float16), np.zeros((3, 1, 2), np.float16))
    with pytest.raises(ValueError, match=r"\(3, B, H, H\)"):
        run_dense_plan_gpu(plan, np.zeros((4, 1, 2, 2)), np.zeros((4, 1, 2)))


def test_module_imports_without_cupy():
    import subprocess
    import sys

    code = "import sys, sparse_scan._dense_scan_gpu, sparse_scan.dense_scan; print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- on the GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tiled_from", [_dense_scan_gpu.TILED_MIN_SIZE, 2], ids=["default", "all-tiled"])
def test_gpu_dense_scan_equals_numpy(n, affine, dtype, tiled_from, monkeypatch):
    gpu = backend.get("gpu")
    monkeypatch.setattr(_dense_scan_gpu, "TILED_MIN_SIZE", tiled_from)
    monkeypatch.setattr(_dense_scan_gpu, "_WORKSPACES", {})
    launches = []
    launch = _dense_scan_gpu._kernels.launch
    launch_blocks = _dense_scan_gpu._kernels.launch_blocks
    monkeypatch.setattr(_dense_scan_gpu._kernels, "launch",
                        lambda *args: (launches.append(args[1]), launch(*args)))
    monkeypatch.setattr(_dense_scan_gpu._kernels, "launch_blocks",
                        lambda *args: (launches.append(args[1]), launch_blocks(*args)))
    rng = np.random.default_rng(n)
    for size in SIZES + [70]:  # 70: tiled by default, partial tiles
        for batch in BATCHES:
            blocks, direct = chain(rng, n, batch, size, dtype, affine)
            for method, levels in schedules(n):
                want = dense_scan(blocks, direct, method, levels)
                got = dense_scan(gpu.asarray(blocks), gpu.asarray(direct), method, levels)
                assert backend.of(got).name == "gpu"
                assert_close(gpu.to_host(got), want, TOLERANCE[np.dtype(dtype)] * 10)
                assert len(launches) == _dense_scan_gpu.launch_count(dense_plan(n, method, levels))
                launches.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("cell", [RNN, GRU])
@pytest.mark.parametrize("last_only", [False, True], ids=["every-step", "last-only"])
def test_gpu_recurrent_backward_equals_numpy(cell, last_only):
    gpu = backend.get("gpu")
    steps, batch, inputs, hidden = 21, 4, 3, 33
    layer = cell(inputs, hidden, dtype=np.float64, rng=7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((batch, steps, inputs))
    grad_h = rng.standard_normal((batch, hidden) if last_only else (batch, steps, hidden))
    for method, levels in schedules(steps):
        layer.forward(x)
        want = layer.backward(grad_h, method, levels)
        layer.forward(gpu.asarray(x))
        got = layer.backward(gpu.asarray(grad_h), method, levels)
        assert set(got) == set(want)
        for key, value in want.items():
            assert backend.of(got[key]).name == "gpu", key
            assert_close(gpu.to_host(got[key]), value, 1e-10)
