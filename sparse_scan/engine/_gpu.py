"""GPU numeric phase of a :class:`~sparse_scan.engine.plan.ScanPlan`: one RawKernel launch per scan level.

The steps of a scan level are independent. Each becomes a descriptor (a row of ``FIELDS`` int64s:
kind, first work item, samples, items per sample, device pointers and strides; layout in
``rawkernels/scan.cu``) in one host table for the whole plan, and a level runs as one launch of
``scan_level<I, T>`` over its rows: SpMVs, general products, scalings and row-wise products alike.
Products with a selection (``gather`` plans) run as general products: the kernel tests the per-sample
operand first and skips the multiply-adds of its explicit zeros.

What depends only on the plan, the batch size and the value dtype is built once and cached in a
:class:`_Workspace`: the descriptor table, every intermediate buffer, and the plan's index arrays on the
device (one index dtype per plan: int32 while everything fits, int64 beyond). Per batch only the
pointers of the inputs (``g_n`` and the JT values) and of the returned gradients change: they are
patched into the host table, which lives in pinned memory and goes to the device in one copy queued on
the current stream before the level loop (:class:`~sparse_scan._staging.StagedTable`). The level loop
itself only launches kernels: a warm call never synchronises the host.

Products whose method the kernels do not know are computed by a hook of :data:`PRODUCT_FALLBACKS` and
written into their (fixed) workspace buffer, so later levels' descriptors stay valid.

CuPy is imported lazily: this module imports on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import _kernels
from .._staging import StagedTable
from ..csr import Pattern, choose_index_dtype
from ._blocks import BlockProduct, multiply_blocks
from .plan import ScanPlan, Step
from .products import ProductPlan
from .schedule import Element

__all__ = ["PRODUCT_FALLBACKS", "multiply", "run_plan"]

KERNEL_FILE = "scan.cu"
FIELDS = 16
SPMV, PRODUCT, ROWWISE = 0, 1, 2
KERNEL_METHODS = ("gather", "general", "rowwise", "scale_columns", "scale_rows")
VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

PRODUCT_FALLBACKS: dict[str, Callable[[ProductPlan, Any, Any], Any]] = {}
"""``method -> fn(product, a_data, b_data)`` for product methods the kernels do not implement.

``fn`` returns ``C``'s values like :func:`sparse_scan.engine.run.multiply` (a CuPy array); they are
copied into the step's workspace buffer.
"""

_WORKSPACES: dict[int, dict[Any, "_Workspace"]] = {}
_DEVICE_INDEX: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()



# --- device index arrays, cached per pattern / product plan ---------------------------------------
def _device_index(owner: Any, name: str, host: Any, dtype: np.dtype) -> Any:
    """``host`` as a device array of ``dtype``, uploaded once per (``owner``, ``name``, ``dtype``)."""
    arrays = _DEVICE_INDEX.setdefault(owner, {})
    key = (name, dtype, _kernels.current_device())
    if key not in arrays:
        arrays[key] = _kernels.cupy_module().asarray(host, dtype=dtype)
    return arrays[key]


def _starts_with_end(product: ProductPlan) -> np.ndarray:
    """``starts`` with ``multiply_adds`` appended: entry ``e`` sums ``starts[e] .. starts[e + 1]``."""
    return np.append(np.asarray(product.starts, dtype=np.int64), product.multiply_adds)


# --- the values of one plan: shapes, sharing, patterns ---------------------------------------------
@dataclass(eq=False)
class _Layout:
    """Per scan value: its pattern (matrices), whether the batch shares it, its size per sample."""

    patterns: dict[Element, Pattern] = field(default_factory=dict)
    shared: dict[Element, bool] = field(default_factory=dict)
    sizes: dict[Element, int] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: ScanPlan, vector_size: int, jacobians: Sequence[Any]) -> "_Layout":
        """The layout of every input and step result of ``plan``."""
        layout = cls()
        layout.shared[Element(0, 0)], layout.sizes[Element(0, 0)] = False, vector_size
        for j, jt in enumerate(jacobians, start=1):
            element = Element(j, j)
            layout.patterns[element] = jt.pattern
            layout.shared[element] = jt.data.ndim == 1
            layout.sizes[element] = jt.pattern.nnz
        for step in plan.steps:
            if step.kind == "mv":
                layout.shared[step.out], layout.sizes[step.out] = False, step.shape[0]
            else:
                layout.patterns[step.out] = step.product.out
                layout.shared[step.out] = layout.shared[step.left] and layout.shared[step.right]
                layout.sizes[step.out] = step.product.out.nnz
        return layout

    def shape(self, element: Element, batch: int) -> tuple[int, ...]:
        """Array shape of ``element``'s values for ``batch`` samples."""
        size = self.sizes[element]
        return (size,) if self.shared[element] else (batch, size)

    def stride(self, element: Element) -> int:
        """Elements between consecutive samples' values (0 when shared)."""
        return 0 if self.shared[element] else self.sizes[element]


def _index_dtype(plan: ScanPlan, layout: _Layout) -> np.dtype:
    """One index dtype for every index array of the plan on the device."""
    patterns = list(layout.patterns.values())
    largest = 0
    for step in plan.steps:
        if step.product is not None:
            largest = max(largest, step.product.multiply_adds)
            patterns.extend(step.product.operands or ())
    largest = max([largest] + [p.nnz for p in patterns])
    return choose_index_dtype(largest, max([1] + [max(p.shape) for p in patterns]))


# --- descriptor tables ----------------------------------------------------------------------------
class _TableBuilder:
    """Collects descriptor rows; pointers of per-call arrays become patch positions."""

    def __init__(self, slots: dict[Element, int], buffers: dict[Element, Any]) -> None:
        self.slots, self.buffers = slots, buffers
        self.rows: list[list[int]] = []
        self.patches: list[tuple[int, int]] = []
        self.keep: list[Any] = []

    def add(self, fields: Sequence[Any]) -> None:
        """Append one descriptor.

        A field is an int, a device array (its pointer; the array is kept alive) or an
        :class:`Element` (its values' pointer: a buffer's now, a per-call array's at every call).
        """
        row = []
        for column, value in enumerate(fields):
            if isinstance(value, Element):
                slot = self.slots.get(value)
                if slot is None:
                    value = self.buffers[value]
                else:
                    self.patches.append((len(self.rows) * FIELDS + column, slot))
                    value = 0
            if not isinstance(value, (int, np.integer)):
                self.keep.append(value)
                value = _kernels.device_pointer(value)
            row.append(int(value))
        self.rows.append(row + [0] * (FIELDS - len(row)))


def _spmv_fields(step: Step, layout: _Layout, dtype: np.dtype) -> list[Any]:
    pattern = layout.patterns[step.right]
    return [SPMV, 0, 0, step.shape[0],
            _device_index(pattern, "indptr", pattern.indptr, dtype),
            _device_index(pattern, "indices", pattern.indices, dtype),
            step.right, layout.stride(step.right), step.left, layout.stride(step.left), step.out]


def _product_fields(step: Step, layout: _Layout, dtype: np.dtype) -> list[Any]:
    return _product_row(step.product, dtype, (step.right, layout.stride(step.right)),
                        (step.left, layout.stride(step.left)), step.out,
                        layout.shared[step.right] and not layout.shared[step.left])


def _product_row(product: ProductPlan, dtype: np.dtype, a_values: tuple[Any, int], b_values: tuple[Any, int],
                 out: Any, per_sample_first: bool) -> list[Any]:
    """A PRODUCT descriptor: ``a_values``/``b_values`` are ``(values, sample stride)``; with
    ``per_sample_first`` (A shared, B per sample) the operands trade slots, so that the kernel tests
    the per-sample operand, which holds the explicit zeros, first."""
    positions = {"a": product.a_pos, "b": product.b_pos}
    if product.method == "scale_columns":
        positions["a"] = None
    elif product.method == "scale_rows":
        positions["b"] = None
    index = {k: 0 if v is None else _device_index(product, k + "_pos", v, dtype)
             for k, v in positions.items()}
    starts = 0
    if product.method in ("general", "gather") and product.starts is not None:
        starts = _device_index(product, "starts", _starts_with_end(product), dtype)
    a = (index["a"], *a_values)
    b = (index["b"], *b_values)
    if per_sample_first:
        a, b = b, a
    return [PRODUCT, 0, 0, product.out.nnz, a[0], b[0], starts, a[1], a[2], b[1], b[2], out]


def _rowwise_fields(step: Step, layout: _Layout, dtype: np.dtype) -> list[Any]:
    return _rowwise_row(step.product, dtype, (step.right, layout.stride(step.right)),
                        (step.left, layout.stride(step.left)), (step.out, layout.stride(step.out)))


def _rowwise_row(product: ProductPlan, dtype: np.dtype, a_values: tuple[Any, int], b_values: tuple[Any, int],
                 out: tuple[Any, int]) -> list[Any]:
    """A ROWWISE descriptor (arguments as :func:`_product_row`'s, ``out`` with its stride too)."""
    arrays = []
    for pattern in (*product.operands, product.out):
        arrays += [_device_index(pattern, "indptr", pattern.indptr, dtype),
                   _device_index(pattern, "indices", pattern.indices, dtype)]
    return [ROWWISE, 0, 0, product.out.shape[0], *arrays, *a_values, *b_values, *out]


_FIELD_BUILDERS = {"general": _product_fields, "gather": _product_fields,
                   "scale_columns": _product_fields, "scale_rows": _product_fields,
                   "rowwise": _rowwise_fields}


def _step_fields(step: Step, layout: _Layout, dtype: np.dtype, batch: int) -> list[Any]:
    """A step's descriptor fields, ``[2]`` (samples: 1 when shared) set; the caller sets ``[1]``."""
    fields = (_spmv_fields if step.kind == "mv" else _FIELD_BUILDERS[step.method])(step, layout, dtype)
    fields[2] = 1 if layout.shared[step.out] else batch
    return fields


# --- the workspace ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Level:
    """One scan level: its rows of the device table, work items, and steps run by a fallback."""

    table: Any
    steps: int
    items: int
    fallbacks: list[Step]


@dataclass(eq=False)
class _Workspace:
    """Everything one (plan, batch size, value dtype) needs on the device, built once.

    Attributes
    ----------
    index_dtype, value_dtype : numpy.dtype
    layout : _Layout
    buffers : dict
        Intermediate values (neither inputs nor returned gradients), allocated once; values whose
        lifetimes do not overlap share memory.
    fresh : list of Element
        Returned gradients computed by a step: allocated per call, so results of earlier calls stay.
    table : StagedTable
        Descriptors of every level (pinned host memory and its device copy); ``patch_positions``
        receive the pointers of the per-call arrays ``patch_slots`` (0: ``g_n``, ``j``: JT ``j``, then
        ``fresh``).
    levels : list of _Level
    keep : list
        Device index arrays the table points at.
    """

    index_dtype: np.dtype
    value_dtype: np.dtype
    layout: _Layout
    buffers: dict[Element, Any]
    fresh: list[Element]
    table: StagedTable
    patch_positions: np.ndarray
    patch_slots: np.ndarray
    levels: list[_Level]
    keep: list[Any]

    def bind(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> dict[Element, Any]:
        """Patch the per-call pointers into the table and queue its upload; return every value."""
        arrays = [*inputs, *outputs]
        if self.patch_positions.size:
            pointers = np.array([_kernels.device_pointer(a) for a in arrays], dtype=np.int64)
            self.table.patch(self.patch_positions, pointers[self.patch_slots])
        values = dict(self.buffers)
        values.update({Element(j, j): a for j, a in enumerate(inputs)})
        values.update(zip(self.fresh, outputs, strict=True))
        return values


def _allocate(plan: ScanPlan, layout: _Layout, batch: int, dtype: np.dtype,
              kept: set[Element]) -> dict[Element, Any]:
    """Buffers of the intermediate values; a value's memory is reused from the level after its last use.

    Steps of one level run concurrently, so a level's results never take memory released in it.
    """
    xp = _kernels.cupy_module()
    levels: dict[int, list[tuple[Step, list[Element]]]] = {}
    for step, released in zip(plan.steps, plan.releases, strict=True):
        levels.setdefault(step.level, []).append((step, released))
    buffers: dict[Element, Any] = {}
    owners: dict[Element, Any] = {}
    free: list[Any] = []
    for level in sorted(levels):
        for step, _ in levels[level]:
            if step.out in kept:
                continue
            shape = layout.shape(step.out, batch)
            size = int(np.prod(shape))
            fits = [(flat.size, k) for k, flat in enumerate(free) if flat.size >= size]
            flat = free.pop(min(fits)[1]) if fits else xp.empty(size, dtype=dtype)  # best fit
            owners[step.out], buffers[step.out] = flat, flat[:size].reshape(shape)
        free += [owners.pop(e) for _, released in levels[level] for e in released if e in owners]
    return buffers


def _build_workspace(plan: ScanPlan, jacobians: Sequence[Any], batch: int, vector_size: int,
                     dtype: np.dtype) -> _Workspace:
    """Allocate the intermediates and build the descriptor tables of every level."""
    layout = _Layout.of(plan, vector_size, jacobians)
    index_dtype = _index_dtype(plan, layout)
    kept = set(plan.outputs)
    fresh = [step.out for step in plan.steps if step.out in kept]
    buffers = _allocate(plan, layout, batch, dtype, kept)
    slots = {Element(j, j): j for j in range(plan.n + 1)}
    slots.update({element: plan.n + 1 + k for k, element in enumerate(fresh)})
    builder = _TableBuilder(slots, buffers)
    bounds: list[tuple[int, int, int, list[Step]]] = []
    for level in plan.levels_of_steps:
        first, items, fallbacks = len(builder.rows), 0, []
        for step in (plan.steps[index] for index in level):
            if step.kind == "mm" and step.method not in KERNEL_METHODS:
                fallbacks.append(step)
                continue
            fields = _step_fields(step, layout, index_dtype, batch)
            fields[1] = items
            items += fields[2] * fields[3]
            builder.add(fields)
        bounds.append((first, len(builder.rows) - first, items, fallbacks))
    table = StagedTable(np.array(builder.rows, dtype=np.int64).reshape(-1))
    levels = [_Level(table.device[first * FIELDS:(first + steps) * FIELDS], steps, items, fallbacks)
              for first, steps, items, fallbacks in bounds]
    positions = np.array([p for p, _ in builder.patches], dtype=np.int64)
    patch_slots = np.array([s for _, s in builder.patches], dtype=np.int64)
    return _Workspace(index_dtype, dtype, layout, buffers, fresh, table, positions, patch_slots, levels,
                      builder.keep)


def _workspaces(plan: ScanPlan) -> dict[Any, _Workspace]:
    """The workspaces cached for ``plan`` (dropped with the plan)."""
    return _kernels.per_plan(_WORKSPACES, plan)


def _workspace(plan: ScanPlan, jacobians: Sequence[Any], batch: int, vector_size: int,
               dtype: np.dtype) -> _Workspace:
    cache = _workspaces(plan)
    key = (batch, vector_size, dtype, tuple(jt.data.ndim == 1 for jt in jacobians),
           _kernels.current_device())
    if key not in cache:
        cache[key] = _build_workspace(plan, jacobians, batch, vector_size, dtype)
    return cache[key]


# --- the numeric phase ------------------------------------------------------------------------------
def _value_dtype(grad_out: Any, jacobians: Sequence[Any]) -> np.dtype:
    dtype = np.result_type(grad_out.dtype, *(jt.data.dtype for jt in jacobians))
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"the GPU scan runs in float32 or float64; the inputs promote to {dtype}")
    return dtype


def _run_fallback(step: Step, values: dict[Element, Any]) -> None:
    method = step.product.method
    fallback = PRODUCT_FALLBACKS.get(method)
    if fallback is None:
        raise NotImplementedError(f"no GPU kernel for product method {method!r} and no entry for it "
                                  "in sparse_scan.engine._gpu.PRODUCT_FALLBACKS")
    values[step.out][...] = fallback(step.product, values[step.right], values[step.left])


def _device_blocks(product: ProductPlan) -> BlockProduct:
    """``product``'s block structure with its index arrays on the device (uploaded once)."""
    arrays = _DEVICE_INDEX.setdefault(product, {})
    key = ("blocks", _kernels.current_device())
    if key not in arrays:
        blocks, xp = product.blocks, _kernels.cupy_module()
        arrays[key] = dataclasses.replace(
            blocks,
            a=dataclasses.replace(blocks.a, gather=xp.asarray(blocks.a.gather)),
            b=dataclasses.replace(blocks.b, gather=xp.asarray(blocks.b.gather)),
            scatter=xp.asarray(blocks.scatter),
            slots=[tuple(xp.asarray(index) for index in slot) for slot in blocks.slots])
    return arrays[key]


def _multiply_blocks_on_device(product: ProductPlan, a_data: Any, b_data: Any) -> Any:
    """``block`` products: one batched GEMM per slot (cuBLAS through CuPy's ``matmul``)."""
    return multiply_blocks(_device_blocks(product), a_data, b_data, xp=_kernels.cupy_module())


PRODUCT_FALLBACKS["block"] = _multiply_blocks_on_device


def run_plan(plan: ScanPlan, grad_out: Any, jacobians: Sequence[Any]) -> list[Any]:
    """Numeric phase of ``plan`` for one batch on the GPU: the contract of
    :func:`sparse_scan.engine.run.run_plan`.

    Parameters
    ----------
    plan : ScanPlan
    grad_out : cupy.ndarray, shape (B, size of x_n)
        ``g_n``, flattened per sample.
    jacobians : sequence of BatchedCSR
        ``jacobians[j - 1]`` is scan element ``j``, with CuPy values; their patterns are the ones the
        plan was built from (cached on the device at the first call).

    Returns
    -------
    list of cupy.ndarray
        ``grads[i]`` of shape ``(B, size of x_i)``, ``i = 0..n``, in the promoted value dtype
        (float32 or float64).

    Raises
    ------
    NotImplementedError
        A product's method has neither a kernel nor an entry in :data:`PRODUCT_FALLBACKS`.
    """
    if len(jacobians) != plan.n or grad_out.ndim != 2:
        raise ValueError(f"the plan needs grad_out of shape (B, size) and {plan.n} JTs; got shape "
                         f"{tuple(grad_out.shape)} and {len(jacobians)} JTs")
    xp = _kernels.cupy_module()
    dtype = _value_dtype(grad_out, jacobians)
    inputs = [xp.ascontiguousarray(grad_out, dtype=dtype)]
    inputs += [xp.ascontiguousarray(jt.data, dtype=dtype) for jt in jacobians]
    batch, vector_size = (int(s) for s in grad_out.shape)
    workspace = _workspace(plan, jacobians, batch, vector_size, dtype)
    outputs = [xp.empty(workspace.layout.shape(e, batch), dtype=dtype) for e in workspace.fresh]
    values = workspace.bind(inputs, outputs)
    kernel = _kernels.function(KERNEL_FILE, "scan_level", workspace.index_dtype, dtype)
    for level in workspace.levels:
        for step in level.fallbacks:
            _run_fallback(step, values)
        if level.items:
            _kernels.launch(kernel, level.items,
                            (level.table, np.int64(level.steps), np.int64(level.items)))
    return [values[element] for element in plan.outputs]


def multiply(plan: ProductPlan, a_data: Any, b_data: Any) -> Any:
    """One numeric product on the GPU (the contract of :func:`sparse_scan.engine.run.multiply`).

    A product the scan kernel knows (general, gather, scalings, row-wise) is one launch of
    ``scan_level`` over a one-row descriptor table; its index arrays go to the device once per plan.
    Block products are batched GEMMs (:data:`PRODUCT_FALLBACKS`).

    Parameters
    ----------
    plan : ProductPlan
    a_data, b_data : cupy.ndarray, shape (nnz,) or (B, nnz)
        Values of ``A`` and ``B`` (a diagonal's data holds its diagonal); ``(nnz,)`` when shared by
        the batch.

    Returns
    -------
    cupy.ndarray, shape (nnz_C,) or (B, nnz_C)
        Values of ``C`` in ``plan.out``'s entry order, in the promoted dtype (float32 or float64).
    """
    xp = _kernels.cupy_module()
    dtype = np.result_type(a_data.dtype, b_data.dtype)
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"the GPU product runs in float32 or float64; the operands promote to {dtype}")
    a, b = xp.ascontiguousarray(a_data, dtype=dtype), xp.ascontiguousarray(b_data, dtype=dtype)
    if plan.method not in KERNEL_METHODS:
        fallback = PRODUCT_FALLBACKS.get(plan.method)
        if fallback is None:
            raise NotImplementedError(f"no GPU kernel for product method {plan.method!r}")
        return fallback(plan, a, b)
    batch = max(a.shape[0] if a.ndim == 2 else 1, b.shape[0] if b.ndim == 2 else 1)
    shared = a.ndim == b.ndim == 1
    out = xp.empty((plan.out.nnz,) if shared else (batch, plan.out.nnz), dtype=dtype)
    patterns = list(plan.operands or ()) + [plan.out]
    largest = max([plan.multiply_adds, a.shape[-1], b.shape[-1]] + [p.nnz for p in patterns])  # positions
    index_dtype = choose_index_dtype(largest, max(max(p.shape) for p in patterns))
    strides = [0 if x.ndim == 1 else x.shape[1] for x in (a, b)]
    if plan.method == "rowwise":
        fields = _rowwise_row(plan, index_dtype, (a, strides[0]), (b, strides[1]),
                              (out, 0 if shared else plan.out.nnz))
    else:
        fields = _product_row(plan, index_dtype, (a, strides[0]), (b, strides[1]), out,
                              a.ndim == 1 and b.ndim == 2)
    fields[2] = 1 if shared else batch
    builder = _TableBuilder({}, {})
    builder.add(fields)
    table = xp.asarray(np.array(builder.rows[0], dtype=np.int64))
    items = fields[2] * fields[3]
    kernel = _kernels.function(KERNEL_FILE, "scan_level", index_dtype, dtype)
    _kernels.launch(kernel, items, (table, np.int64(1), np.int64(items)))
    return out
