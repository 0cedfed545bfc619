"""The GPU dense-block scan: ``rawkernels/dense_scan.cu`` and ``sparse_scan.engine._dense_gpu``.

Three layers of evidence (GPU.md): the kernel source compiled for the CPU on hand-built descriptor
tables against NumPy's batched matmul, with odd grid and block sizes; the whole GPU orchestration
(descriptor tables, pointer patching, workspaces, output gather, the kernel and arguments of every
launch) against ``dense_scan`` on NumPy for every schedule; and parity tests of ``dense_scan`` and of
the RNN/GRU backward with CuPy inputs. The last two are ``gpu`` tests: they run on a GPU, or through the
CuPy stand-in (``tests/cupy_standin``) where there is none.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_on_cpu import compile_for_cpu, pointer

from sparse_scan import _gpu_kernels, backend
from sparse_scan.engine import _dense_gpu, _tables, run
from sparse_scan.engine._dense_gpu import COPY, FIELDS, MM, MV, TILE, TILE_THREADS
from sparse_scan.engine.dense_plan import build_dense_plan
from sparse_scan.engine.run import dense_scan
from sparse_scan.engine.schedule import depth
from sparse_scan.recurrent import GRU, RNN
from sparse_scan.recurrent import _base as recurrent_base

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
    assert [_dense_gpu.chain_threads(h) for h in (1, 20, 32, 33, 1000, 1025, 5000)] == [
        32, 32, 32, 64, 1024, 1024, 1024]


# --- the GPU orchestration: descriptor tables, pointer patching, workspaces, output gather ---------
# On the CuPy stand-in here (tests/cupy_standin: the kernels built by g++, launched with CuPy's calling
# convention) and unchanged on a GPU.
@pytest.fixture
def dense_launches(monkeypatch):
    """Every launch of the dense scan's kernels, its arguments checked: a level's number of steps,
    ``("chain", steps)`` for a chain of levels, ``("tiled", steps)`` for a tiled level. Starts with no
    cached workspace."""
    gpu = backend.get("gpu")
    launches, names = [], {}
    function, launch, launch_blocks = _gpu_kernels.function, _gpu_kernels.launch, _gpu_kernels.launch_blocks

    def named(filename, name, *dtypes):
        compiled = function(filename, name, *dtypes)
        names[id(compiled)] = name if filename == "dense_scan.cu" else None
        return compiled

    def check_table(table, steps):
        assert isinstance(steps, np.int64), "explicit int64 scalars"
        assert isinstance(table, gpu.xp.ndarray), "the descriptor table is on the device"
        assert table.flags.c_contiguous and table.dtype == np.int64 and table.size == steps * FIELDS
        return gpu.to_host(table).reshape(-1, FIELDS)

    def checked_launch(compiled, work_items, args):
        name = names.get(id(compiled))
        if name is not None:
            table, steps, items = args
            assert name == "dense_scan_level"
            assert isinstance(items, np.int64), "explicit int64 scalars"
            check_table(table, steps)
            assert work_items == items > 0
            launches.append(int(steps))
        launch(compiled, work_items, args)

    def checked_launch_blocks(compiled, blocks, threads, args):
        name = names.get(id(compiled))
        if name is not None:
            table, steps = args[:2]
            rows = check_table(table, steps)
            if name == "dense_scan_chain":
                assert len(args) == 2
                assert blocks == rows[0, 2] and threads % 32 == 0 and 0 < threads <= 1024  # a block a sample
                launches.append(("chain", int(steps)))
            else:
                last = rows[-1]
                assert name == "dense_scan_tiled" and threads == TILE_THREADS
                assert isinstance(args[2], np.int64), "explicit int64 scalars"
                assert blocks == args[2] == last[16] + last[2] * last[17]  # every unit of the level
                launches.append(("tiled", int(steps)))
        launch_blocks(compiled, blocks, threads, args)

    monkeypatch.setattr(_tables, "_WORKSPACES", {})
    monkeypatch.setattr(_gpu_kernels, "function", named)
    monkeypatch.setattr(_gpu_kernels, "launch", checked_launch)
    monkeypatch.setattr(_gpu_kernels, "launch_blocks", checked_launch_blocks)
    return launches


@pytest.fixture
def table_uploads(monkeypatch):
    """The number of descriptor-table uploads (``StagedTable.patch`` calls)."""
    uploads = []
    patch = _tables.StagedTable.patch

    def counted(self, positions, values):
        uploads.append(len(positions))
        patch(self, positions, values)

    monkeypatch.setattr(_tables.StagedTable, "patch", counted)
    return uploads


def on_device(*arrays):
    gpu = backend.get("gpu")
    return tuple(gpu.asarray(a) for a in arrays)


def to_host(array):
    gpu = backend.get("gpu")
    assert backend.of(array).name == "gpu"
    return gpu.to_host(array)


def overlap(a, b) -> bool:
    """Whether two device arrays' memory ranges intersect."""
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


def expected_launches(plan, size=1):
    """Per launch: the steps of a level (``("tiled", steps)`` for a level of block products when
    ``size`` reaches ``TILED_MIN_SIZE``), ``("chain", steps)`` for a chain of levels; then the gather."""
    launches, index = [], 0
    while index < plan.critical_steps:
        stop = plan.chains.get(index)
        if stop is None:
            groups = plan.levels_of_groups[index]
            steps = sum(len(group.ops) for group in groups)
            tiled = size >= _dense_gpu.TILED_MIN_SIZE and any(group.kind == "mm" for group in groups)
            launches.append(("tiled", steps) if tiled else steps)
            index += 1
        else:
            launches.append(("chain", stop - index))
            index = stop
    return launches + [plan.n + 1]


@pytest.mark.gpu
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_every_schedule_launches_per_level_and_equals_numpy(dense_launches, n, size, affine, dtype):
    rng = np.random.default_rng(1000 * n + size)
    for batch in BATCHES:
        blocks, direct = chain(rng, n, batch, size, dtype, affine)
        device_blocks, device_direct = on_device(blocks, direct)
        for method, levels in schedules(n):
            plan = build_dense_plan(n, method, levels)
            got = _dense_gpu.run_dense_plan(plan, device_blocks, device_direct)
            assert_close(to_host(got), dense_scan(blocks, direct, method, levels, threads=1),
                         TOLERANCE[np.dtype(dtype)] * 10)
            # one launch per level or chain of levels, then the gather
            assert dense_launches == expected_launches(plan)
            assert len(dense_launches) == _dense_gpu.launch_count(plan)
            dense_launches.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [5, 21])
@pytest.mark.parametrize("size", [3, 17])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
def test_gpu_tiled_levels_equal_numpy(dense_launches, monkeypatch, n, size, affine):
    """Levels of block products through ``dense_scan_tiled`` (its threshold lowered to these sizes)."""
    monkeypatch.setattr(_dense_gpu, "TILED_MIN_SIZE", 2)
    blocks, direct = chain(np.random.default_rng(n + size), n, 2, size, np.float64, affine)
    device_blocks, device_direct = on_device(blocks, direct)
    for method, levels in [("blelloch", None), ("hybrid", 1), ("linear", None)]:
        plan = build_dense_plan(n, method, levels)
        assert_close(to_host(_dense_gpu.run_dense_plan(plan, device_blocks, device_direct)),
                     dense_scan(blocks, direct, method, levels), 1e-12)
        assert dense_launches == expected_launches(plan, size)
        assert method == "linear" or any(isinstance(launch, tuple) and launch[0] == "tiled"
                                         for launch in dense_launches)
        dense_launches.clear()


@pytest.mark.gpu
def test_gpu_dense_scan_twin_is_a_launch_per_level(dense_launches):
    gpu = backend.get("gpu")
    rng = np.random.default_rng(5)
    blocks, direct = chain(rng, 5, 2, 3, np.float64, affine=True)
    plan = build_dense_plan(5, "blelloch")
    gpu_twin = run._run_dense_plan.twins["gpu"]
    got = gpu_twin(gpu, plan, *on_device(blocks, direct), None)
    assert len(dense_launches) == plan.critical_steps + 1 == _dense_gpu.launch_count(plan)  # no chain
    assert_close(to_host(got), dense_scan(blocks, direct), 1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", [RNN, GRU])
@pytest.mark.parametrize("last_only", [False, True], ids=["every-step", "last-only"])
def test_gpu_recurrent_bp_twin_is_one_chain_launch(dense_launches, cell, last_only):
    """On a GPU, BP fills the blocks and runs their chain in one launch: its totals equal BP through
    the factors (``factored_chain``, which fills nothing), its gradients the CPU twin's (the cell's
    compiled kernel)."""
    gpu, cpu = backend.get("gpu"), backend.get("cpu")
    steps, batch, hidden = 9, 3, 5
    layer = cell(2, hidden, dtype=np.float64, rng=1)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((batch, steps, 2))
    direct = rng.standard_normal((batch, hidden) if last_only else (steps, batch, hidden))
    layer.forward(gpu.asarray(x))
    got = recurrent_base._bp_gradients.twins["gpu"](gpu, layer._single_run(), gpu.asarray(direct), None)
    assert dense_launches == [("chain", steps), steps + 1]
    layer.forward(x)
    assert_close(to_host(got["state"]), layer.factored_chain(direct), 1e-12)
    want = recurrent_base._bp_gradients.twins["cpu"](cpu, layer._single_run(), direct, None)
    assert sorted(got) == sorted(want)
    # every step runs on the GPU; on the CPU too here (float64 over 9 steps: nothing vanishes)
    assert got.pop("horizon") is None
    horizon = want.pop("horizon")
    assert (horizon.steps, horizon.time_steps) == (steps, steps) if last_only else horizon is None
    for key, value in want.items():
        assert_close(to_host(got[key]), value, 1e-12)


@pytest.mark.gpu
def test_gpu_workspace_is_built_once_and_results_stay(dense_launches, table_uploads, monkeypatch):
    """One workspace per batch, affine flag, dtype and device; the table goes up again only when the
    blocks moved; the returned gradients are not workspace memory."""
    rng = np.random.default_rng(3)
    plan = build_dense_plan(13, "hybrid", 2)
    blocks, direct = chain(rng, 13, 2, 5, np.float64, affine=True)
    device_blocks, device_direct = on_device(blocks, direct)
    first = _dense_gpu.run_dense_plan(plan, device_blocks, device_direct)
    kept = to_host(first)
    workspace = next(iter(_tables.workspaces(plan).values()))
    assert len(table_uploads) == 1
    second = _dense_gpu.run_dense_plan(plan, device_blocks, 2 * device_direct)  # same blocks: no new upload
    assert len(table_uploads) == 1
    np.testing.assert_allclose(to_host(second), 2 * kept, rtol=1e-12)
    new_blocks, new_direct = chain(rng, 13, 2, 5, np.float64, affine=True)
    third = _dense_gpu.run_dense_plan(plan, *on_device(new_blocks, new_direct))
    assert len(table_uploads) == 2  # the blocks moved: their pointers are patched and uploaded once
    assert list(_tables.workspaces(plan).values()) == [workspace]
    assert_close(to_host(third), dense_scan(new_blocks, new_direct, "hybrid", 2), 1e-12)
    assert_close(to_host(first), kept, 0.0)  # returned gradients are not workspace buffers
    buffers = [workspace.inputs, workspace.result, *workspace.blocks.values(), *workspace.vectors.values()]
    assert not any(overlap(got, buffer) for got in (first, second, third) for buffer in buffers)
    _dense_gpu.run_dense_plan(plan, device_blocks[:, :1], device_direct[:, :1])
    _dense_gpu.run_dense_plan(plan, device_blocks, device_direct[-1])
    _dense_gpu.run_dense_plan(plan, *on_device(blocks.astype(np.float32), direct.astype(np.float32)))
    assert len(_tables.workspaces(plan)) == 4  # per batch, affine flag and dtype
    monkeypatch.setattr(_gpu_kernels, "current_device", lambda: 1)  # another current GPU
    assert_close(to_host(_dense_gpu.run_dense_plan(plan, device_blocks, device_direct)), kept, 1e-12)
    assert len(_tables.workspaces(plan)) == 5  # its own device memory


@pytest.mark.gpu
def test_gpu_non_contiguous_blocks(dense_launches):
    gpu = backend.get("gpu")
    rng = np.random.default_rng(4)
    blocks, direct = chain(rng, 8, 3, 4, np.float64, affine=True)
    plan = build_dense_plan(8, "blelloch")
    transposed = gpu.xp.swapaxes(gpu.asarray(np.swapaxes(blocks, 2, 3).copy()), 2, 3)  # F-order blocks
    assert not transposed.flags.c_contiguous
    got = _dense_gpu.run_dense_plan(plan, transposed, gpu.asarray(direct))
    assert_close(to_host(got), dense_scan(blocks, direct), 1e-12)


@pytest.mark.gpu
def test_gpu_intermediates_share_memory_across_levels(dense_launches):
    rng = np.random.default_rng(2)
    plan = build_dense_plan(21, "blelloch")
    blocks, direct = chain(rng, 21, 2, 3, np.float64, affine=True)
    assert_close(to_host(_dense_gpu.run_dense_plan(plan, *on_device(blocks, direct))),
                 dense_scan(blocks, direct), 1e-12)
    workspace = next(iter(_tables.workspaces(plan).values()))
    buffers = [(buffer, array) for values in (workspace.blocks, workspace.vectors)
               for buffer, array in values.items()]
    level = {group.buffer: index for index, groups in enumerate(plan.levels_of_groups) for group in groups}
    shared = 0
    for k, (buffer, array) in enumerate(buffers):
        for other, other_array in buffers[k + 1:]:
            if overlap(array, other_array):
                shared += 1
                assert level[other] != level[buffer], "a level's results never alias each other"
    assert shared > 0


@pytest.mark.gpu
def test_gpu_rejects_other_dtypes_and_shapes():
    xp = backend.get("gpu").xp
    plan = build_dense_plan(3, "blelloch")
    with pytest.raises(TypeError, match="float32 or float64"):
        _dense_gpu.run_dense_plan(plan, xp.zeros((3, 1, 2, 2), np.float16), xp.zeros((3, 1, 2), np.float16))
    with pytest.raises(ValueError, match=r"\(3, B, H, H\)"):
        _dense_gpu.run_dense_plan(plan, xp.zeros((4, 1, 2, 2)), xp.zeros((4, 1, 2)))


def test_module_imports_without_cupy():
    import subprocess
    import sys

    code = "import sys, sparse_scan.engine._dense_gpu, sparse_scan.engine.run; print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- on the GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "last-only"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tiled_from", [_dense_gpu.TILED_MIN_SIZE, 2], ids=["default", "all-tiled"])
def test_gpu_dense_scan_equals_numpy(n, affine, dtype, tiled_from, monkeypatch):
    gpu = backend.get("gpu")
    monkeypatch.setattr(_dense_gpu, "TILED_MIN_SIZE", tiled_from)
    monkeypatch.setattr(_tables, "_WORKSPACES", {})
    launches = []
    launch = _dense_gpu._gpu_kernels.launch
    launch_blocks = _dense_gpu._gpu_kernels.launch_blocks
    monkeypatch.setattr(_dense_gpu._gpu_kernels, "launch",
                        lambda *args: (launches.append(args[1]), launch(*args)))
    monkeypatch.setattr(_dense_gpu._gpu_kernels, "launch_blocks",
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
                assert len(launches) == _dense_gpu.launch_count(build_dense_plan(n, method, levels))
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
