"""The GPU numeric phase of a scan plan: ``rawkernels/scan.cu`` and ``sparse_scan.engine._gpu``.

Three layers of evidence (GPU.md): the kernel source compiled for the CPU against the NumPy twins
``spgemm.multiply`` / ``spgemm.matvec``, with odd grid and block sizes; the whole GPU orchestration
(descriptor tables, pointer patching, workspaces, fallbacks, the arguments of every launch) against the
host's numeric phase; and parity tests of ``Sequential.backward``. The last two are ``gpu`` tests: they
run on a GPU, or through the CuPy stand-in (``tests/cupy_standin``) where there is none.
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref

import numpy as np
import pytest
import scipy.sparse as sp
from cuda_on_cpu import compile_for_cpu, pointer
from test_scan import random_chain, schedules

from sparse_scan import _gpu_kernels, backend
from sparse_scan.csr import Pattern
from sparse_scan.engine import _cpu as host
from sparse_scan.engine import _gpu, _tables
from sparse_scan.engine import products as product_planning
from sparse_scan.engine._gpu import FIELDS, PRODUCT, ROWWISE, SPMV
from sparse_scan.engine.plan import ScanPlan
from sparse_scan.engine.products import plan_product
from sparse_scan.engine.run import multiply

INDEX_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
VALUE_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-10}
GRIDS = [(1, 1), (3, 5), (16, 32)]


def _wrappers() -> str:
    return "".join(
        f'extern "C" void scan_level_{index.replace(" ", "_")}_{value}(int grid, int block,'
        f" const long long* table, long long steps, long long items)"
        f" {{ SHIM_LAUNCH(grid, block, (scan_level<{index}, {value}>(table, steps, items))); }}\n"
        for index in INDEX_TYPES.values() for value in VALUE_TYPES.values())


@pytest.fixture(scope="module")
def kernels():
    return compile_for_cpu("scan.cu", _wrappers())


def kernel(library, index_dtype, value_dtype):
    tag = INDEX_TYPES[np.dtype(index_dtype)].replace(" ", "_")
    return getattr(library, f"scan_level_{tag}_{VALUE_TYPES[np.dtype(value_dtype)]}")


# --- random operands -------------------------------------------------------------------------------
def random_pattern(rng, rows, cols, density, index_dtype) -> Pattern:
    """A random CSR pattern; its first and last rows are empty."""
    matrix = sp.random(rows, cols, density=density, format="lil", random_state=rng)
    matrix[0, :], matrix[rows - 1, :] = 0, 0
    matrix = matrix.tocsr()
    matrix.eliminate_zeros()
    matrix.sort_indices()
    return Pattern(matrix.indptr.astype(index_dtype), matrix.indices.astype(index_dtype), (rows, cols))


def selection_pattern(rng, rows, cols, index_dtype) -> Pattern:
    """At most one entry per row: every product entry has one multiply-add (``starts`` is None)."""
    live = rng.random(rows) < 0.7
    indptr = np.concatenate(([0], np.cumsum(live))).astype(index_dtype)
    return Pattern(indptr, rng.integers(0, cols, int(live.sum())).astype(index_dtype), (rows, cols))


def diagonal_pattern(size, index_dtype) -> Pattern:
    return Pattern(np.arange(size + 1, dtype=index_dtype), np.arange(size, dtype=index_dtype),
                   (size, size))


def values(rng, shape, dtype, zeros=0.3):
    """Random values with explicit zeros (ReLU's off units, non-max pool entries)."""
    data = rng.standard_normal(shape)
    data[rng.random(shape) < zeros] = 0.0
    return np.ascontiguousarray(data, dtype=dtype)


# --- descriptor tables built by hand (the layout of rawkernels/scan.cu) ----------------------------
class Table:
    """Descriptor rows of one launch; keeps every array it points at alive."""

    def __init__(self, batch):
        self.batch, self.rows, self.keep, self.checks = batch, [], [], []

    def ptr(self, array):
        if array is None:
            return 0
        array = np.ascontiguousarray(array)
        self.keep.append(array)
        return array.ctypes.data

    def _add(self, kind, per, shared, fields, out, want):
        samples = 1 if shared else self.batch
        offset = sum(r[2] * r[3] for r in self.rows)
        row = [kind, offset, samples, per] + fields
        self.rows.append(row + [0] * (FIELDS - len(row)))
        self.checks.append((out, want))

    def spmv(self, pattern, data, vec):
        out = np.full((self.batch, pattern.shape[0]), np.nan, dtype=vec.dtype)
        stride = 0 if data.ndim == 1 else pattern.nnz
        self._add(SPMV, pattern.shape[0], False,
                  [self.ptr(pattern.indptr), self.ptr(pattern.indices), self.ptr(data), stride,
                   self.ptr(vec), pattern.shape[1], self.ptr(out)],
                  out, host.matvec(pattern, data, vec))

    def product(self, plan, a, b, index_dtype):
        shared = a.ndim == b.ndim == 1
        out = np.full((plan.out.nnz,) if shared else (self.batch, plan.out.nnz), np.nan, dtype=a.dtype)
        want = multiply(plan, a, b)
        strides = [0 if x.ndim == 1 else x.shape[-1] for x in (a, b)]
        if plan.method == "rowwise":
            (pa, pb), pc = plan.operands, plan.out
            arrays = [self.ptr(x.astype(index_dtype)) for p in (pa, pb, pc) for x in (p.indptr, p.indices)]
            self._add(ROWWISE, pc.shape[0], shared,
                      arrays + [self.ptr(a), strides[0], self.ptr(b), strides[1], self.ptr(out), pc.nnz],
                      out, want)
            return
        a_pos = None if plan.method == "scale_columns" else plan.a_pos
        b_pos = None if plan.method == "scale_rows" else plan.b_pos
        starts = None if plan.starts is None else np.append(plan.starts, plan.multiply_adds)
        index = [self.ptr(None if x is None else x.astype(index_dtype)) for x in (a_pos, b_pos, starts)]
        self._add(PRODUCT, plan.out.nnz, shared,
                  index + [self.ptr(a), strides[0], self.ptr(b), strides[1], self.ptr(out)], out, want)

    def run(self, library, index_dtype, value_dtype, grid, block):
        table = np.array(self.rows, dtype=np.int64).reshape(-1)
        items = sum(r[2] * r[3] for r in self.rows)
        kernel(library, index_dtype, value_dtype)(grid, block, pointer(table),
                                                  ctypes.c_longlong(len(self.rows)),
                                                  ctypes.c_longlong(items))

    def check(self, rtol):
        for out, want in self.checks:
            assert out.shape == want.shape
            np.testing.assert_allclose(out, want, rtol=rtol, atol=rtol)


def random_products(rng, index_dtype, value_dtype, batch):
    """``(plan, a, b)`` for every product method and sharing of the operands."""
    dt = value_dtype
    a = random_pattern(rng, 12, 9, 0.3, index_dtype)
    b = random_pattern(rng, 9, 11, 0.3, index_dtype)
    general = plan_product(a, b, "general", "general")
    rowwise = plan_product(a, b, "general", "general", budget_bytes=general.multiply_adds * 11)
    assert (general.method, rowwise.method) == ("general", "rowwise") and general.starts is not None
    select = selection_pattern(rng, 10, 12, index_dtype)
    # random values break a selection's one-live-entry-per-column contract: plan it as general
    # (real max-pool JTs reach the kernel as gather plans in the schedule tests below)
    single = plan_product(select, a, "general", "general")
    assert single.starts is None
    empty = plan_product(Pattern(np.zeros(4, index_dtype), np.zeros(0, index_dtype), (3, 12)), a,
                         "general", "general")
    assert empty.out.nnz == 0
    columns = plan_product(a, diagonal_pattern(9, index_dtype), "general", "diagonal")
    rows = plan_product(diagonal_pattern(12, index_dtype), a, "diagonal", "general")
    assert (columns.method, rows.method) == ("scale_columns", "scale_rows")
    shared_a, shared_b = values(rng, a.nnz, dt), values(rng, b.nnz, dt)
    batched_a, batched_b = values(rng, (batch, a.nnz), dt), values(rng, (batch, b.nnz), dt)
    return [
        (general, batched_a, shared_b), (general, shared_a, batched_b), (general, shared_a, shared_b),
        (general, batched_a, batched_b), (empty, values(rng, (batch, 0), dt), shared_a),
        (rowwise, batched_a, shared_b), (rowwise, shared_a, batched_b), (rowwise, shared_a, shared_b),
        (single, values(rng, (batch, select.nnz), dt, zeros=0.5), shared_a),
        (single, values(rng, select.nnz, dt), batched_a),
        (columns, shared_a, values(rng, (batch, 9), dt)), (columns, batched_a, values(rng, 9, dt)),
        (rows, values(rng, (batch, 12), dt), shared_a), (rows, values(rng, 12, dt), batched_a),
    ]


@pytest.mark.parametrize("grid, block", GRIDS)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_every_step_kind_in_one_table_matches_numpy(kernels, grid, block, index_dtype, value_dtype):
    rng = np.random.default_rng(grid * block)
    batch = 3
    table = Table(batch)
    matrix = random_pattern(rng, 14, 10, 0.3, index_dtype)
    assert (np.diff(matrix.indptr) == 0).any(), "empty rows are part of the test"
    vec = values(rng, (batch, 10), value_dtype)
    table.spmv(matrix, values(rng, matrix.nnz, value_dtype), vec)
    for plan, a, b in random_products(rng, index_dtype, value_dtype, batch):
        table.product(plan, a, b, index_dtype)
    table.spmv(matrix, values(rng, (batch, matrix.nnz), value_dtype, zeros=0.6), vec)
    table.spmv(Pattern(np.zeros(1, index_dtype), np.zeros(0, index_dtype), (0, 10)),
               values(rng, 0, value_dtype), vec)
    table.run(kernels, index_dtype, value_dtype, grid, block)
    table.check(TOLERANCE[np.dtype(value_dtype)])


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_each_step_alone_matches_numpy(kernels, index_dtype, value_dtype):
    rng = np.random.default_rng(1)
    for plan, a, b in random_products(rng, index_dtype, value_dtype, batch=2):
        table = Table(2)
        table.product(plan, a, b, index_dtype)
        table.run(kernels, index_dtype, value_dtype, 2, 3)
        table.check(TOLERANCE[np.dtype(value_dtype)])


def test_a_zero_factor_skips_the_other_operand(kernels):
    # a zero in the `a` slot never reads `b`: an infinite `b` value does not turn the sum into NaN
    rng = np.random.default_rng(2)
    a = random_pattern(rng, 8, 6, 0.5, np.int32)
    b = random_pattern(rng, 6, 7, 0.5, np.int32)
    plan = plan_product(a, b, "general", "general")
    a_data, b_data = np.zeros((2, a.nnz)), np.full(b.nnz, np.inf)
    table = Table(2)
    with np.errstate(invalid="ignore"):  # NumPy's twin multiplies 0 * inf
        table.product(plan, a_data, b_data, np.int32)
    table.run(kernels, np.int32, np.float64, 2, 4)
    assert np.all(table.keep[-1] == 0.0)


# --- the GPU orchestration: descriptor tables, pointer patching, workspaces, fallbacks ----------------
# On the CuPy stand-in here (tests/cupy_standin: the kernel built by g++, launched with CuPy's calling
# convention) and unchanged on a GPU.
@pytest.fixture
def scan_launches(monkeypatch):
    """Steps per launch of ``scan_level`` (each launch's arguments checked), with empty device caches.

    Other kernels (a forward pass's JT kernels) pass through unrecorded."""
    gpu = backend.get("gpu")
    launches, names = [], {}
    function, launch = _gpu_kernels.function, _gpu_kernels.launch

    def named(filename, kernel, *dtypes):
        compiled = function(filename, kernel, *dtypes)
        names[id(compiled)] = (filename, kernel)
        return compiled

    def checked(compiled, work_items, args):
        if names.get(id(compiled)) == ("scan.cu", "scan_level"):
            table, steps, items = args
            assert isinstance(steps, np.int64) and isinstance(items, np.int64), "explicit int64 scalars"
            assert isinstance(table, gpu.xp.ndarray), "the descriptor table is on the device"
            assert table.flags.c_contiguous and table.dtype == np.int64 and table.size == steps * FIELDS
            assert work_items == items
            launches.append(int(steps))
        launch(compiled, work_items, args)

    monkeypatch.setattr(_gpu, "_DEVICE_INDEX", weakref.WeakKeyDictionary())
    monkeypatch.setattr(_tables, "_WORKSPACES", {})
    monkeypatch.setattr(_gpu_kernels, "function", named)
    monkeypatch.setattr(_gpu_kernels, "launch", checked)
    return launches


def on_device(jts):
    """The JTs with their values and patterns on the GPU."""
    gpu = backend.get("gpu")
    return [dataclasses.replace(jt, data=gpu.asarray(jt.data), pattern=jt.pattern.to("gpu")) for jt in jts]


def to_host(arrays):
    gpu = backend.get("gpu")
    assert all(backend.of(a).name == "gpu" for a in arrays)
    return [gpu.to_host(a) for a in arrays]


def overlap(a, b) -> bool:
    """Whether two device arrays' memory ranges intersect."""
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_gpu_multiply_is_one_launch_per_product(scan_launches, index_dtype, value_dtype):
    """``spgemm.multiply``'s GPU twin: one launch of a one-row table per product, every method and
    sharing of the operands, equal to the host's numeric phase."""
    gpu = backend.get("gpu")
    rng = np.random.default_rng(11)
    products = random_products(rng, index_dtype, value_dtype, batch=3)
    for plan, a, b in products:
        got = _gpu.multiply(plan, gpu.asarray(a), gpu.asarray(b))
        want = multiply(plan, a, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(to_host([got])[0], want, rtol=TOLERANCE[np.dtype(value_dtype)], atol=1e-6)
    assert scan_launches == [1] * len(products)


@pytest.mark.gpu
def test_gpu_multiply_block_products_and_bad_dtypes(scan_launches, monkeypatch):
    gpu = backend.get("gpu")
    monkeypatch.setattr(product_planning, "BLOCK_MIN_INNER", 1)
    monkeypatch.setattr(product_planning, "BLOCK_MIN_OUTER", 1)
    model, in_shape, _, _ = chain_inputs(13, seed=33, batch=2, dtype=np.float64)
    products = [step.product for step in model.plan(in_shape, "blelloch").steps if step.method == "block"]
    assert products
    for product in products:  # block products go to batched GEMMs, no launch of the scan kernel
        a, b = rng_values(product.blocks.a.gather.size, 2), rng_values(product.blocks.b.gather.size, 3)
        got = _gpu.multiply(product, gpu.asarray(a), gpu.asarray(b[:2]))
        np.testing.assert_allclose(to_host([got])[0], multiply(product, a, b[:2]), rtol=1e-12)
    assert scan_launches == []
    plan, a, b = random_products(np.random.default_rng(1), np.int32, np.float64, batch=2)[0]
    with pytest.raises(TypeError, match="float32 or float64"):
        _gpu.multiply(plan, gpu.asarray(a.astype(np.float16)), gpu.asarray(b.astype(np.float16)))


def rng_values(nnz, batch):
    return np.random.default_rng(nnz).standard_normal((batch, nnz))


def chain_inputs(n, seed, batch, dtype):
    """A random chain after a forward pass, an output gradient, and the scan's JTs (scan order)."""
    model, in_shape = random_chain(n, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    y = model.forward(rng.standard_normal((batch,) + in_shape).astype(dtype))
    grad_out = rng.standard_normal((batch, int(np.prod(y.shape[1:])))).astype(dtype)
    return model, in_shape, grad_out, model.transposed_jacobians()[::-1]


def assert_close(got, want, rtol):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = max(float(np.abs(w).max(initial=0.0)), 1e-30)
        assert float(np.abs(g - w).max(initial=0.0)) <= rtol * scale


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 6, 13])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_run_plan_equals_run_plan_for_every_schedule(scan_launches, block_products, n, dtype):
    gpu = backend.get("gpu")
    model, in_shape, grad_out, jts = chain_inputs(n, seed=20 + n, batch=3, dtype=dtype)
    device_grad, device_jts = gpu.asarray(grad_out), on_device(jts)
    methods = set()
    for method, levels in schedules(n):
        plan = model.plan(in_shape, method, levels)
        got = _gpu.run_plan(plan, device_grad, device_jts)
        assert_close(to_host(got), host.run_plan(plan, grad_out, jts), TOLERANCE[np.dtype(dtype)])
        assert len(scan_launches) <= plan.critical_steps  # one launch per level or fewer
        scan_launches.clear()
        methods.update(step.method for step in plan.steps)
    if n == 13:
        assert {"general", "scale_columns"} <= methods
        assert ("block" in methods) == (block_products == "all"), methods


@pytest.mark.gpu
def test_gpu_int64_indices_and_lean_products(scan_launches, monkeypatch):
    gpu = backend.get("gpu")
    model, in_shape, grad_out, jts = chain_inputs(8, seed=13, batch=2, dtype=np.float64)
    general = [s for s in model.plan(in_shape, "blelloch").steps if s.method == "general"]
    model.memory_budget = max(s.product.multiply_adds for s in general) * 12 - 1
    plan = model.plan(in_shape, "blelloch")
    assert {"rowwise", "general", "scale_rows"} <= {step.method for step in plan.steps}
    want = host.run_plan(plan, grad_out, jts)
    device_grad, device_jts = gpu.asarray(grad_out), on_device(jts)
    assert_close(to_host(_gpu.run_plan(plan, device_grad, device_jts)), want, 1e-10)
    assert next(iter(_tables.workspaces(plan).values())).index_dtype == np.int32
    monkeypatch.setattr(_gpu, "_index_dtype", lambda plan, layout: np.dtype(np.int64))
    monkeypatch.setattr(_tables, "_WORKSPACES", {})
    assert_close(to_host(_gpu.run_plan(plan, device_grad, device_jts)), want, 1e-10)
    assert next(iter(_tables.workspaces(plan).values())).index_dtype == np.int64


@pytest.mark.gpu
def test_gpu_workspace_is_built_once_and_results_stay(scan_launches, monkeypatch):
    """One workspace per batch size and per device, reused by later calls; the returned gradients are
    not workspace memory. The JTs come from forward passes on the GPU."""
    gpu = backend.get("gpu")
    model, in_shape = random_chain(6, seed=3, dtype=np.float64)
    rng = np.random.default_rng(9)
    plan = model.plan(in_shape, "hybrid", 1)
    calls = []
    for _ in range(2):
        x = rng.standard_normal((4,) + in_shape)
        grad_out = rng.standard_normal((4, int(np.prod(model.forward(gpu.asarray(x)).shape[1:]))))
        device_jts = model.transposed_jacobians()[::-1]
        assert all(backend.of(jt.data).name == "gpu" for jt in device_jts)
        model.forward(x)
        calls.append((grad_out, model.transposed_jacobians()[::-1], gpu.asarray(grad_out), device_jts))
    (_, _, grad_0, jts_0), (grad_out, jts, device_grad, device_jts) = calls
    first = _gpu.run_plan(plan, grad_0, jts_0)
    kept = to_host(first)
    workspace = next(iter(_tables.workspaces(plan).values()))
    second = _gpu.run_plan(plan, device_grad, device_jts)
    assert list(_tables.workspaces(plan).values()) == [workspace]
    assert_close(to_host(second), host.run_plan(plan, grad_out, jts), 1e-10)
    assert_close(to_host(first), kept, 0.0)  # returned gradients are not workspace buffers
    assert not any(overlap(g, buffer) for g in first + second for buffer in workspace.buffers.values())
    _gpu.run_plan(plan, device_grad[:2], [jt if jt.shared else dataclasses.replace(jt, data=jt.data[:2])
                                         for jt in device_jts])
    assert len(_tables.workspaces(plan)) == 2  # one per batch size
    indices = len(_gpu._DEVICE_INDEX)
    monkeypatch.setattr(_gpu_kernels, "current_device", lambda: 1)  # another current GPU: its own memory
    assert_close(to_host(_gpu.run_plan(plan, device_grad, device_jts)), to_host(second), 0.0)
    assert len(_tables.workspaces(plan)) == 3
    assert all(any(key[-1] == 1 for key in arrays) for arrays in _gpu._DEVICE_INDEX.values())
    assert len(_gpu._DEVICE_INDEX) == indices


@pytest.mark.gpu
def test_gpu_intermediates_share_memory_across_levels(scan_launches):
    gpu = backend.get("gpu")
    model, in_shape, grad_out, jts = chain_inputs(21, seed=2, batch=2, dtype=np.float64)
    plan = model.plan(in_shape, "blelloch")
    got = _gpu.run_plan(plan, gpu.asarray(grad_out), on_device(jts))
    assert_close(to_host(got), host.run_plan(plan, grad_out, jts), 1e-10)
    buffers = next(iter(_tables.workspaces(plan).values())).buffers
    starts = {buffer.data.ptr for buffer in buffers.values()}
    assert len(starts) < len(buffers)
    level = {step.out: step.level for step in plan.steps}
    for element, buffer in buffers.items():  # a level's results never alias each other
        for other, other_buffer in buffers.items():
            if other != element and level[other] == level[element]:
                assert not overlap(buffer, other_buffer)


def with_method(plan: ScanPlan, method: str) -> ScanPlan:
    """``plan`` with every general product's method renamed (a method the kernels do not know)."""
    steps = [dataclasses.replace(s, product=dataclasses.replace(s.product, method=method))
             if s.method == "general" else s for s in plan.steps]
    return ScanPlan(plan.method, plan.levels, plan.n, steps, plan.outputs, plan.element_bytes)


@pytest.mark.gpu
def test_gpu_unknown_product_methods_go_to_the_fallbacks(scan_launches, monkeypatch):
    gpu = backend.get("gpu")
    model, in_shape, grad_out, jts = chain_inputs(8, seed=5, batch=2, dtype=np.float64)
    device_grad, device_jts = gpu.asarray(grad_out), on_device(jts)
    plan = model.plan(in_shape, "blelloch")
    custom = with_method(plan, "custom")
    assert "custom" in {step.method for step in custom.steps}
    with pytest.raises(NotImplementedError, match="'custom'"):
        _gpu.run_plan(custom, device_grad, device_jts)
    calls = []

    def fallback(product, a_data, b_data):
        calls.append(product.method)
        assert backend.of(a_data).name == backend.of(b_data).name == "gpu"
        return multiply(dataclasses.replace(product, method="general"), a_data, b_data)

    monkeypatch.setitem(_gpu.PRODUCT_FALLBACKS, "custom", fallback)
    assert_close(to_host(_gpu.run_plan(custom, device_grad, device_jts)), host.run_plan(plan, grad_out, jts),
                 1e-10)
    assert calls and set(calls) == {"custom"}


def test_module_imports_without_cupy():
    import subprocess
    import sys

    code = "import sys, sparse_scan.engine._gpu, sparse_scan._sequential; print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- on the GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 8, 21])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_backward_equals_cpu_for_every_schedule(n, dtype):
    gpu = backend.get("gpu")
    model, in_shape = random_chain(n, seed=40 + n, dtype=dtype)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5,) + in_shape).astype(dtype)
    grad_out = rng.standard_normal(model.forward(x).shape).astype(dtype)
    for method, levels in schedules(n):
        model.forward(x)
        want = model.backward(grad_out, method=method, levels=levels, device="cpu")
        model.forward(gpu.asarray(x))
        got = model.backward(gpu.asarray(grad_out), method=method, levels=levels, device="gpu")
        assert all(backend.of(g).name == "gpu" for g in got)
        assert_close([gpu.to_host(g) for g in got], want, TOLERANCE[np.dtype(dtype)])


@pytest.mark.gpu
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_gpu_multiply_equals_cpu(value_dtype):
    gpu = backend.get("gpu")
    rng = np.random.default_rng(12)
    for plan, a, b in random_products(rng, np.int32, value_dtype, batch=3):
        got = multiply(plan, gpu.asarray(a), gpu.asarray(b))
        assert backend.of(got).name == "gpu"
        np.testing.assert_allclose(gpu.to_host(got), multiply(plan, a, b),
                                   rtol=TOLERANCE[np.dtype(value_dtype)], atol=1e-6)
    with pytest.raises(ValueError, match="must both be NumPy or both CuPy arrays"):
        multiply(plan, gpu.asarray(a), b)


@pytest.mark.gpu
def test_gpu_lean_products_and_fallbacks(monkeypatch):
    gpu = backend.get("gpu")
    model, in_shape = random_chain(8, seed=13, dtype=np.float64)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3,) + in_shape)
    grad_out = rng.standard_normal(model.forward(x).shape)
    jts = model.transposed_jacobians()[::-1]
    model.forward(gpu.asarray(x))
    gpu_jts = model.transposed_jacobians()[::-1]  # before the budget below, which they would not fit
    flat = grad_out.reshape(3, -1)
    general = [s for s in model.plan(in_shape, "blelloch").steps if s.method == "general"]
    model.memory_budget = max(s.product.multiply_adds for s in general) * 12 - 1
    plan = model.plan(in_shape, "blelloch")
    assert "rowwise" in {step.method for step in plan.steps}
    want = host.run_plan(plan, flat, jts)
    assert_close([gpu.to_host(g) for g in _gpu.run_plan(plan, gpu.asarray(flat), gpu_jts)], want, 1e-10)

    def fallback(product, a_data, b_data):
        general = dataclasses.replace(product, method="general")
        return gpu.asarray(multiply(general, gpu.to_host(a_data), gpu.to_host(b_data)))

    model.memory_budget = None
    plan = model.plan(in_shape, "blelloch")
    monkeypatch.setitem(_gpu.PRODUCT_FALLBACKS, "custom", fallback)
    got = _gpu.run_plan(with_method(plan, "custom"), gpu.asarray(flat), gpu_jts)
    assert_close([gpu.to_host(g) for g in got], host.run_plan(plan, flat, jts), 1e-10)


@pytest.mark.gpu
def test_gpu_second_backward_reuses_the_workspace():
    gpu = backend.get("gpu")
    model, in_shape = random_chain(8, seed=4, dtype=np.float32)
    rng = np.random.default_rng(4)
    results = []
    for _ in range(2):
        x = rng.standard_normal((6,) + in_shape).astype(np.float32)
        grad_out = rng.standard_normal(model.forward(gpu.asarray(x)).shape).astype(np.float32)
        got = model.backward(gpu.asarray(grad_out), method="blelloch")
        model.forward(x)
        results.append((got, model.backward(grad_out, method="blelloch")))
        workspaces = _tables.workspaces(model.plan(in_shape, "blelloch"))
        if len(results) == 1:
            first = list(workspaces.values())
    assert list(workspaces.values()) == first and len(first) == 1
    for got, want in results:
        assert_close([gpu.to_host(g) for g in got], want, 1e-4)
