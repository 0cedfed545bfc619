"""GPU numeric phase of a :class:`~sparse_scan.engine.plan.ScanPlan`: one RawKernel launch per scan level.

The steps of a scan level are independent. Each becomes a descriptor (a row of ``FIELDS`` int64s:
kind, first work item, samples, items per sample, device pointers and strides; layout in
``rawkernels/scan.cu``) in one table for the whole plan, and a level runs as one launch of
``scan_level<I, T>`` over its rows: SpMVs, general products, scalings and row-wise products alike.
Products with a selection (``gather`` plans) run as general products: the kernel tests the per-sample
operand first and skips the multiply-adds of its explicit zeros.

What depends only on the plan, the batch size and the value dtype is built once and cached in a
:class:`_Workspace`: the descriptor table, every intermediate buffer, and the plan's index arrays on the
device (one index dtype per plan: int32 while everything fits, int64 beyond). Per batch only the
pointers of the inputs (``g_n`` and the JT values) and of the returned gradients change: they are
patched into the table, which goes to the device in one copy queued on the current stream before the
level loop (:mod:`sparse_scan.engine._tables`, shared with the dense scan). The level loop itself only
launches kernels: a warm call never synchronises the host.

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

from .. import _gpu_kernels
from .._types import Array
from ..csr import BatchedCSR, Pattern, choose_index_dtype
from ._blocks import BlockProduct, multiply_blocks
from ._tables import (
    DescriptorTable,
    Field,
    Level,
    Patch,
    TableBuilder,
    allocate,
    cached_workspace,
    value_dtype,
)
from .plan import ScanPlan, Step
from .products import ProductPlan
from .schedule import Element

__all__ = ["PRODUCT_FALLBACKS", "multiply", "run_plan"]

KERNEL_FILE = "scan.cu"
FIELDS = 16
SPMV, PRODUCT, ROWWISE = 0, 1, 2
KERNEL_METHODS = ("gather", "general", "rowwise", "scale_columns", "scale_rows")

PRODUCT_FALLBACKS: dict[str, Callable[[ProductPlan, Array, Array], Array]] = {}
"""``method -> fn(product, a_data, b_data)`` for product methods the kernels do not implement.

``fn`` returns ``C``'s values like :func:`sparse_scan.engine.run.multiply` (a CuPy array); they are
copied into the step's workspace buffer.
"""

_DEVICE_INDEX: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
"""Device copies of the index arrays of patterns and product plans: owner -> (name, dtype, device) ->
array, dropped with the owner."""


# --- device index arrays, cached per pattern / product plan ---------------------------------------
def _device_index(owner: Pattern | ProductPlan, name: str, host: np.ndarray, dtype: np.dtype) -> Array:
    """``host`` as a device array of ``dtype``, uploaded once per (``owner``, ``name``, ``dtype``)."""
    arrays = _DEVICE_INDEX.setdefault(owner, {})
    key = (name, dtype, _gpu_kernels.current_device())
    if key not in arrays:
        arrays[key] = _gpu_kernels.cupy_module().asarray(host, dtype=dtype)
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
    def of(cls, plan: ScanPlan, vector_size: int, jacobians: Sequence[BatchedCSR]) -> "_Layout":
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


# --- descriptor rows --------------------------------------------------------------------------------
def _spmv_fields(step: Step, layout: _Layout, dtype: np.dtype) -> list[Field | Element]:
    pattern = layout.patterns[step.right]
    return [SPMV, 0, 0, step.shape[0],
            _device_index(pattern, "indptr", pattern.indptr, dtype),
            _device_index(pattern, "indices", pattern.indices, dtype),
            step.right, layout.stride(step.right), step.left, layout.stride(step.left), step.out]


def _product_fields(step: Step, layout: _Layout, dtype: np.dtype) -> list[Field | Element]:
    return _product_row(step.product, dtype, (step.right, layout.stride(step.right)),
                        (step.left, layout.stride(step.left)), step.out,
                        layout.shared[step.right] and not layout.shared[step.left])


def _product_row(product: ProductPlan, dtype: np.dtype, a_values: tuple[Element | Array, int],
                 b_values: tuple[Element | Array, int], out: Element | Array,
                 per_sample_first: bool) -> list[Field | Element]:
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


def _rowwise_fields(step: Step, layout: _Layout, dtype: np.dtype) -> list[Field | Element]:
    return _rowwise_row(step.product, dtype, (step.right, layout.stride(step.right)),
                        (step.left, layout.stride(step.left)), (step.out, layout.stride(step.out)))


def _rowwise_row(product: ProductPlan, dtype: np.dtype, a_values: tuple[Element | Array, int],
                 b_values: tuple[Element | Array, int],
                 out: tuple[Element | Array, int]) -> list[Field | Element]:
    """A ROWWISE descriptor (arguments as :func:`_product_row`'s, ``out`` with its stride too)."""
    arrays = []
    for pattern in (*product.operands, product.out):
        arrays += [_device_index(pattern, "indptr", pattern.indptr, dtype),
                   _device_index(pattern, "indices", pattern.indices, dtype)]
    return [ROWWISE, 0, 0, product.out.shape[0], *arrays, *a_values, *b_values, *out]


_FIELD_BUILDERS = {"general": _product_fields, "gather": _product_fields,
                   "scale_columns": _product_fields, "scale_rows": _product_fields,
                   "rowwise": _rowwise_fields}


def _step_fields(step: Step, layout: _Layout, dtype: np.dtype, batch: int) -> list[Field | Element]:
    """A step's descriptor fields, ``[2]`` (samples: 1 when shared) set; the caller sets ``[1]``.

    An :class:`Element` field stands for the pointer of its values."""
    fields = (_spmv_fields if step.kind == "mv" else _FIELD_BUILDERS[step.method])(step, layout, dtype)
    fields[2] = 1 if layout.shared[step.out] else batch
    return fields


# --- the workspace ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Level(Level):
    """One scan level: a launch of ``scan_level`` over its rows, after the steps run by a fallback."""

    fallbacks: list[Step] = field(default_factory=list)


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
    table : DescriptorTable
        Descriptors of every level; per call it receives the pointers of the inputs (slot 0: ``g_n``,
        ``j``: JT ``j``) and of ``fresh``.
    levels : list of _Level
    """

    index_dtype: np.dtype
    value_dtype: np.dtype
    layout: _Layout
    buffers: dict[Element, Array]
    fresh: list[Element]
    table: DescriptorTable
    levels: list[_Level]

    def bind(self, inputs: Sequence[Array], outputs: Sequence[Array]) -> dict[Element, Array]:
        """Point the table at the per-call arrays (its upload queued); return every value."""
        self.table.bind([_gpu_kernels.device_pointer(a) for a in (*inputs, *outputs)])
        values = dict(self.buffers)
        values.update({Element(j, j): a for j, a in enumerate(inputs)})
        values.update(zip(self.fresh, outputs, strict=True))
        return values


def _intermediates(plan: ScanPlan, layout: _Layout, batch: int,
                   kept: set[Element]) -> list[tuple[list[tuple[Element, tuple[int, ...]]], list[Element]]]:
    """Per level, what :func:`~sparse_scan.engine._tables.allocate` needs: the values its steps
    compute into workspace buffers (all but ``kept``), with their shapes, and the values they release."""
    levels: dict[int, tuple[list[tuple[Element, tuple[int, ...]]], list[Element]]] = {}
    for step, released in zip(plan.steps, plan.releases, strict=True):
        computed, freed = levels.setdefault(step.level, ([], []))
        if step.out not in kept:
            computed.append((step.out, layout.shape(step.out, batch)))
        freed += released
    return [levels[level] for level in sorted(levels)]


def _build_workspace(plan: ScanPlan, jacobians: Sequence[BatchedCSR], batch: int, vector_size: int,
                     dtype: np.dtype) -> _Workspace:
    """Allocate the intermediates and build the descriptor tables of every level."""
    layout = _Layout.of(plan, vector_size, jacobians)
    index_dtype = _index_dtype(plan, layout)
    kept = set(plan.outputs)
    fresh = [step.out for step in plan.steps if step.out in kept]
    buffers = allocate(_intermediates(plan, layout, batch, kept), dtype)
    per_call = [Element(j, j) for j in range(plan.n + 1)] + fresh  # pointers bound at every call
    values: dict[Element, Array | Patch] = {**buffers, **{e: Patch(k) for k, e in enumerate(per_call)}}
    builder = TableBuilder(FIELDS)
    bounds: list[tuple[int, int, int, list[Step]]] = []
    for level in plan.levels_of_steps:
        first, items, fallbacks = len(builder), 0, []
        for step in (plan.steps[index] for index in level):
            if step.kind == "mm" and step.method not in KERNEL_METHODS:
                fallbacks.append(step)
                continue
            fields = _step_fields(step, layout, index_dtype, batch)
            fields[1] = items
            items += fields[2] * fields[3]
            builder.add([values[f] if isinstance(f, Element) else f for f in fields])
        bounds.append((first, len(builder) - first, items, fallbacks))
    table = builder.build()
    levels = [_Level(table.rows(first, steps), steps, items, fallbacks)
              for first, steps, items, fallbacks in bounds]
    return _Workspace(index_dtype, dtype, layout, buffers, fresh, table, levels)


# --- the numeric phase ------------------------------------------------------------------------------
def _run_fallback(step: Step, values: dict[Element, Array]) -> None:
    method = step.product.method
    fallback = PRODUCT_FALLBACKS.get(method)
    if fallback is None:
        raise NotImplementedError(f"no GPU kernel for product method {method!r} and no entry for it "
                                  "in sparse_scan.engine._gpu.PRODUCT_FALLBACKS")
    values[step.out][...] = fallback(step.product, values[step.right], values[step.left])


def _device_blocks(product: ProductPlan) -> BlockProduct:
    """``product``'s block structure with its index arrays on the device (uploaded once)."""
    arrays = _DEVICE_INDEX.setdefault(product, {})
    key = ("blocks", _gpu_kernels.current_device())
    if key not in arrays:
        blocks, xp = product.blocks, _gpu_kernels.cupy_module()
        arrays[key] = dataclasses.replace(
            blocks,
            a=dataclasses.replace(blocks.a, gather=xp.asarray(blocks.a.gather)),
            b=dataclasses.replace(blocks.b, gather=xp.asarray(blocks.b.gather)),
            scatter=xp.asarray(blocks.scatter),
            slots=[tuple(xp.asarray(index) for index in slot) for slot in blocks.slots])
    return arrays[key]


def _multiply_blocks_on_device(product: ProductPlan, a_data: Array, b_data: Array) -> Array:
    """``block`` products: one batched GEMM per slot (cuBLAS through CuPy's ``matmul``)."""
    return multiply_blocks(_device_blocks(product), a_data, b_data, xp=_gpu_kernels.cupy_module())


PRODUCT_FALLBACKS["block"] = _multiply_blocks_on_device


def run_plan(plan: ScanPlan, grad_out: Array, jacobians: Sequence[BatchedCSR]) -> list[Array]:
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
    xp = _gpu_kernels.cupy_module()
    dtype = value_dtype("the GPU scan", grad_out.dtype, *(jt.data.dtype for jt in jacobians))
    inputs = [xp.ascontiguousarray(grad_out, dtype=dtype)]
    inputs += [xp.ascontiguousarray(jt.data, dtype=dtype) for jt in jacobians]
    batch, vector_size = (int(s) for s in grad_out.shape)
    key = (batch, vector_size, dtype, tuple(jt.data.ndim == 1 for jt in jacobians))
    workspace = cached_workspace(plan, key, lambda: _build_workspace(plan, jacobians, batch, vector_size,
                                                                      dtype))
    outputs = [xp.empty(workspace.layout.shape(e, batch), dtype=dtype) for e in workspace.fresh]
    values = workspace.bind(inputs, outputs)
    kernel = _gpu_kernels.function(KERNEL_FILE, "scan_level", workspace.index_dtype, dtype)
    for level in workspace.levels:
        for step in level.fallbacks:
            _run_fallback(step, values)
        if level.items:
            _gpu_kernels.launch(kernel, level.items, level.arguments)
    return [values[element] for element in plan.outputs]


def multiply(plan: ProductPlan, a_data: Array, b_data: Array) -> Array:
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
    xp = _gpu_kernels.cupy_module()
    dtype = value_dtype("the GPU product", a_data.dtype, b_data.dtype)
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
    builder = TableBuilder(FIELDS)
    builder.add(fields)
    level = Level(xp.asarray(builder.host()), 1, fields[2] * fields[3])
    kernel = _gpu_kernels.function(KERNEL_FILE, "scan_level", index_dtype, dtype)
    _gpu_kernels.launch(kernel, level.items, level.arguments)
    return out
