"""Sparse products with a fixed pattern: the symbolic phase, done once per pair of patterns.

``C = A @ B`` for CSR operands whose patterns are fixed by the architecture. The symbolic phase
(:func:`plan_product`) enumerates every multiply-add ``(a entry, b entry) -> c entry`` and the exact
pattern of ``C``; the numeric phase (:func:`sparse_scan.engine.run.multiply`) then only gathers,
multiplies and sums, with no sorting, merging or allocation it could not know in advance. ``C``'s
pattern is the symbolic one, explicit zeros included (SciPy's ``@`` drops numerical zeros and serves
only as an oracle).

Diagonal operands (ReLU, tanh, sigmoid, LeakyReLU, Flatten) are scalings, never general products:
``A @ D`` scales ``A``'s columns and ``D @ B`` scales ``B``'s rows, with ``C``'s pattern the other
operand's. Selection operands (max-pool) make gathers over their live entries only
(:mod:`sparse_scan.engine._selection`).

FLOPs follow docs/design.md (FLOP counting): a multiply-add counts 2, so ``A @ B`` costs
``2 * sum_k nnzcol_A(k) * nnzrow_B(k)`` and ``A @ v`` costs ``2 * nnz(A)``. A scaling costs one
multiply per stored entry of the result.

Examples
--------
>>> import scipy.sparse as sp
>>> from sparse_scan.csr import Pattern
>>> a = sp.random(5, 4, density=0.5, format="csr", random_state=0)
>>> b = sp.random(4, 3, density=0.5, format="csr", random_state=1)
>>> pa, pb = Pattern(a.indptr, a.indices, a.shape), Pattern(b.indptr, b.indices, b.shape)
>>> plan = plan_product(pa, pb, "general", "general")
>>> plan.method, plan.out.shape, plan.out.nnz == (abs(a) @ abs(b)).nnz   # C's pattern, symbolically
('general', (5, 3), True)
>>> plan.multiply_adds == count_multiply_adds(pa, pb), plan.flops == 2 * plan.multiply_adds
(True, True)

Its numeric phase, :func:`sparse_scan.engine.run.multiply`, has the example of the values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._blocks import BlockProduct, block_layout, plan_block_product
from ._selection import SelectionGather, live_multiply_adds, plan_selection_gather

__all__ = ["PlanBudgetError", "ProductPlan", "count_multiply_adds", "plan_product"]


SCRATCH_BYTES = 256 * 2**20
"""Default bound on a ``block`` product's temporary GEMM operands (per call, all samples together)."""

PRODUCT_PLAN_BYTES = 12
"""Stored bytes per multiply-add of a ``general`` plan (two int32 positions, a share of ``starts``)."""

SELECTION_PLAN_BYTES = 8
"""Further bytes per multiply-add of a ``gather`` plan (its multiply-adds regrouped by selection entry)."""

PRODUCT_BUILD_BYTES = 48
"""Transient bytes per multiply-add while a chunk of products is expanded and sorted."""

BLOCK_MIN_INNER = 8
"""Dense-block products need at least this many inner channels (shorter GEMMs stay scalar)."""

BLOCK_MIN_OUTER = 64
"""... and at least this many entries per result block (``c1 * c3``)."""


class PlanBudgetError(MemoryError):
    """A product cannot be planned within the memory budget, even with the lean method."""

    def __init__(self, needed: int, budget: int) -> None:
        super().__init__(f"needs {needed} bytes, over the budget of {budget} bytes")
        self.needed, self.budget = needed, budget


@dataclass(frozen=True, eq=False)
class ProductPlan:
    """The symbolic part of ``C = A @ B``, reused by every numeric product.

    Attributes
    ----------
    method : {"block", "gather", "general", "rowwise", "scale_columns", "scale_rows"}
        ``block``: both operands are dense channel blocks (unpruned convolutions, linear layers, and
        their scalings): batched dense GEMMs per slot (:mod:`sparse_scan.engine._blocks`);
        ``general``: gather-multiply-segment-sum over stored multiply-adds; ``gather``: one operand
        is a selection (max-pool JT), only its live entries' multiply-adds run (the ``general``
        arrays are kept too, for kernels that skip zeros instead); ``rowwise``: the lean
        method for products whose multiply-add lists would exceed the memory budget (only ``C``'s
        pattern is stored; the numeric phase expands the products of a few rows at a time and sums
        them into the known pattern); ``scale_columns``: ``B`` is diagonal, ``C = A`` with columns
        scaled; ``scale_rows``: ``A`` is diagonal.
    out : Pattern
        The pattern of ``C`` (exactly the symbolic one, on the host).
    a_pos, b_pos : ndarray or None
        ``general``: the ``A`` and ``B`` entry of every multiply-add, grouped by ``C`` entry.
        Scalings: the index into the diagonal of every ``C`` entry (``b_pos`` for
        ``scale_columns``, ``a_pos`` for ``scale_rows``).
    starts : ndarray or None
        ``general``: the first multiply-add of every ``C`` entry (None when every entry has exactly
        one, e.g. a product with a non-overlapping pool's selection: then no sum is needed).
    multiply_adds : int
        Multiply-adds over the pattern (a scaling counts one per entry of ``C``).
    operands : tuple of Pattern
        ``(A, B)``, kept by ``rowwise`` plans to expand products in the numeric phase, and by
        ``general`` and ``gather`` plans for hosts that expand them row by row to skip the dead
        entries of a per-sample ``A`` (:func:`sparse_scan.engine._cpu.multiply`).
    blocks : BlockProduct or None
        The block structure of a ``block`` plan.
    selection : SelectionGather or None
        The live-entry structure of a ``gather`` plan whose ``C`` entries sum several multiply-adds
        (None when each has one: every backend then streams the ``general`` arrays).
    live_multiply_adds : int or None
        A ``gather`` plan's multiply-adds per sample over the live selection entries.
    """

    method: str
    out: Pattern
    a_pos: Array | None
    b_pos: Array | None
    starts: Array | None
    multiply_adds: int
    operands: tuple[Pattern, Pattern] | None = None
    blocks: BlockProduct | None = None
    selection: SelectionGather | None = None
    live_multiply_adds: int | None = None

    @property
    def flops(self) -> int:
        """FLOPs over the pattern (2 per multiply-add, 1 per scaling multiply)."""
        return self.multiply_adds if self.method.startswith("scale") else 2 * self.multiply_adds

    @property
    def flops_live(self) -> int:
        """FLOPs over the live entries: a ``gather`` needs one selection entry per column (at most
        ``2 * live_multiply_adds``); other methods run their whole pattern. (The host runs a
        ``gather`` with one multiply-add per ``C`` entry over the whole pattern: streaming every
        entry costs it less than scattering the live ones; the GPU kernel skips the dead ones.)"""
        return self.flops if self.live_multiply_adds is None else 2 * self.live_multiply_adds

    @property
    def nbytes(self) -> int:
        """Bytes of index structure held by the plan (the output pattern included)."""
        if self.blocks is not None:
            return self.blocks.nbytes
        arrays = (self.a_pos, self.b_pos, self.starts)
        extra = 0 if self.selection is None else self.selection.nbytes
        return self.out.nbytes + extra + sum(int(a.nbytes) for a in arrays if a is not None)


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _products_per_row(a: Pattern, b: Pattern) -> np.ndarray:
    """Multiply-adds of every row of ``A @ B``: ``sum over A's row of B's row lengths``."""
    b_lengths = np.diff(np.asarray(b.indptr, dtype=np.int64))
    cumulative = _exclusive_cumsum(b_lengths[np.asarray(a.indices, dtype=np.int64)])
    a_indptr = np.asarray(a.indptr, dtype=np.int64)
    return cumulative[a_indptr[1:]] - cumulative[a_indptr[:-1]]


def count_multiply_adds(a: Pattern, b: Pattern) -> int:
    """Multiply-adds of ``A @ B`` over the patterns, without expanding them."""
    b_lengths = np.diff(np.asarray(b.indptr, dtype=np.int64))
    return int(b_lengths[np.asarray(a.indices, dtype=np.int64)].sum())


def _row_chunks(per_row: np.ndarray, limit: int) -> np.ndarray:
    """Row boundaries ``[0, ..., rows]`` of chunks of at most ``limit`` products (or one row)."""
    bounds, start, cumulative = [0], 0, np.cumsum(per_row)
    rows = len(per_row)
    while start < rows:
        base = cumulative[start - 1] if start else 0
        stop = int(np.searchsorted(cumulative, base + limit, side="right"))
        stop = max(stop, start + 1)
        bounds.append(min(stop, rows))
        start = bounds[-1]
    return np.asarray(bounds, dtype=np.int64)


def _expand(a: Pattern, b: Pattern, row_start: int, row_stop: int) -> tuple[np.ndarray, ...]:
    """Multiply-adds of rows ``row_start:row_stop`` of ``A @ B``: A entry, B entry, C key."""
    a_indptr = np.asarray(a.indptr, dtype=np.int64)
    first, last = int(a_indptr[row_start]), int(a_indptr[row_stop])
    a_cols = np.asarray(a.indices[first:last], dtype=np.int64)
    a_rows = np.repeat(np.arange(row_start, row_stop), np.diff(a_indptr[row_start:row_stop + 1]))
    b_indptr = np.asarray(b.indptr, dtype=np.int64)
    per_entry = b_indptr[a_cols + 1] - b_indptr[a_cols]
    offsets = _exclusive_cumsum(per_entry)
    total = int(offsets[-1])
    a_pos = np.repeat(np.arange(first, last, dtype=np.int64), per_entry)
    b_pos = np.repeat(b_indptr[a_cols] - offsets[:-1], per_entry) + np.arange(total, dtype=np.int64)
    keys = np.repeat(a_rows, per_entry) * b.shape[1] + np.asarray(b.indices, dtype=np.int64)[b_pos]
    return a_pos, b_pos, keys


def _sorted_unique(keys: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting (NumPy 2's hash-based ``unique`` is ~10x slower on these keys)."""
    keys = np.sort(keys)
    return keys[np.concatenate(([True], keys[1:] != keys[:-1]))] if len(keys) else keys


def _stable_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.argsort(keys, kind="stable")`` and the sorted keys, for non-negative int64 keys: one
    ``np.sort`` of every key packed with its position into an int64 where both fit (the order is the
    stable one; about 3x faster than NumPy's stable argsort on 4M keys), else the stable argsort."""
    count = len(keys)
    bits = max(count - 1, 1).bit_length()
    if count and int(keys.max()).bit_length() + bits <= 62:
        packed = np.sort((keys << bits) | np.arange(count, dtype=np.int64))
        return packed & ((1 << bits) - 1), packed >> bits
    order = np.argsort(keys, kind="stable")
    return order, keys[order]


def _pattern_from_keys(keys: list[np.ndarray], rows: int, cols: int, dtype: np.dtype) -> Pattern:
    out_keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    out_rows, out_cols = np.divmod(out_keys, cols)
    indptr = np.zeros(rows + 1, dtype=dtype)
    np.cumsum(np.bincount(out_rows, minlength=rows), out=indptr[1:])
    return Pattern(indptr, out_cols.astype(dtype), (rows, cols))


def _reported(bounds: np.ndarray, progress: Callable[[int, int], None] | None) -> Iterator[tuple[int, int]]:
    """The chunks ``(row_start, row_stop)`` of ``bounds``, reporting each one's end to ``progress`` once
    it is done (so that a product of minutes shows that it moves)."""
    rows = int(bounds[-1])
    for row_start, row_stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        yield row_start, row_stop
        if progress is not None:
            progress(row_stop, rows)


def _general_plan(a: Pattern, b: Pattern, total: int, chunk_products: int, index_dtype: Any,
                  progress: Callable[[int, int], None] | None = None) -> ProductPlan:
    dtype = choose_index_dtype(max(total, a.nnz, b.nnz), b.shape[1], index_dtype)
    bounds = _row_chunks(_products_per_row(a, b), chunk_products)
    a_parts, b_parts, start_parts, key_parts, done = [], [], [], [], 0
    for row_start, row_stop in _reported(bounds, progress):
        a_pos, b_pos, keys = _expand(a, b, row_start, row_stop)
        order, keys = _stable_order(keys)
        first = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if len(keys) else keys
        a_parts.append(a_pos[order].astype(dtype))
        b_parts.append(b_pos[order].astype(dtype))
        start_parts.append((first + done).astype(dtype))
        key_parts.append(keys[first])
        done += len(keys)
    out = _pattern_from_keys(key_parts, a.shape[0], b.shape[1], dtype)
    starts = np.concatenate(start_parts) if start_parts else np.zeros(0, dtype)
    single = out.nnz == total  # every C entry has exactly one multiply-add: no sums needed
    return ProductPlan("general", out, np.concatenate(a_parts) if a_parts else starts,
                       np.concatenate(b_parts) if b_parts else starts,
                       None if single else starts, total, operands=(a, b))


def _rowwise_plan(a: Pattern, b: Pattern, total: int, chunk_products: int, budget: int, index_dtype: Any,
                  progress: Callable[[int, int], None] | None = None) -> ProductPlan:
    dtype = choose_index_dtype(max(total, a.nnz, b.nnz), b.shape[1], index_dtype)
    bounds = _row_chunks(_products_per_row(a, b), chunk_products)
    key_parts, stored = [], 0
    for row_start, row_stop in _reported(bounds, progress):
        keys = _sorted_unique(_expand(a, b, row_start, row_stop)[2])
        stored += keys.size * (dtype.itemsize + 4)  # indices + one float32 value per entry
        if stored > budget:
            raise PlanBudgetError(stored, budget)
        key_parts.append(keys)
    out = _pattern_from_keys(key_parts, a.shape[0], b.shape[1], dtype)
    return ProductPlan("rowwise", out, None, None, None, total, operands=(a, b))


def _block_plan(a: Pattern, b: Pattern, channels: tuple[int, int, int], total: int,
                budget: int | None) -> ProductPlan | None:
    """A ``block`` plan when both operands are dense channel blocks worth a GEMM, else None."""
    c1, c2, c3 = channels
    if c2 < BLOCK_MIN_INNER or c1 * c3 < BLOCK_MIN_OUTER:
        return None
    a_layout, b_layout = block_layout(a, c1, c2), block_layout(b, c2, c3)
    if a_layout is None or b_layout is None:
        return None
    blocks = plan_block_product(a_layout, b_layout)
    if budget is not None and blocks.nbytes + 4 * blocks.out.nnz > budget:
        return None  # the scalar methods decide: the lean one, or a clear error
    return ProductPlan("block", blocks.out, None, None, None, total, blocks=blocks)


def plan_product(a: Pattern, b: Pattern, a_kind: str, b_kind: str, index_dtype: Any = None,
                 budget_bytes: int | None = None,
                 chunk_products: int = 2**22,
                 channels: tuple[int, int, int] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> ProductPlan:
    """Symbolic phase of ``A @ B`` (host arrays).

    Parameters
    ----------
    a, b : Pattern
        Operand patterns, ``a.shape[1] == b.shape[0]``.
    a_kind, b_kind : str
        The operands' ``jacobian_kind`` (``"diagonal"`` operands become scalings).
    index_dtype : optional
        Force int32/int64 for the plan's index arrays (and plan a scalar product).
    budget_bytes : int, optional
        Memory the plan may hold. A ``general`` plan stores ~12 bytes per multiply-add; past the
        budget the ``rowwise`` method stores only ``C``'s pattern. If even that (with one float32
        value per entry) exceeds the budget, :class:`PlanBudgetError` says how much it needs.
    chunk_products : int
        Multiply-adds expanded at once while planning (bounds the transient memory).
    channels : tuple of int, optional
        ``(c1, c2, c3)``: channels of ``A``'s rows, of the shared dimension and of ``B``'s columns
        (flattened channel-major). When both operands are dense ``c1×c2`` and ``c2×c3`` blocks on
        pixel pairs, and the blocks are large enough (``BLOCK_MIN_INNER``, ``BLOCK_MIN_OUTER``), the
        product is planned as batched GEMMs (``block``); otherwise as a scalar product.
    progress : callable, optional
        ``progress(rows_done, rows)`` after each chunk of ``A``'s rows a scalar product expands
        (the product of two residual blocks' JTs can take minutes).

    Returns
    -------
    ProductPlan
    """
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {a.shape} by {b.shape}")
    if b_kind == "diagonal":
        return ProductPlan("scale_columns", a, None, np.asarray(a.indices), None, a.nnz)
    if a_kind == "diagonal":
        return ProductPlan("scale_rows", b, np.asarray(b.row_of_entries()), None, None, b.nnz)
    total = count_multiply_adds(a, b)
    if channels is not None and index_dtype is None:
        plan = _block_plan(a, b, channels, total, budget_bytes)
        if plan is not None:
            return plan
    if budget_bytes is not None:
        chunk_products = max(1, min(chunk_products, budget_bytes // PRODUCT_BUILD_BYTES))
        if total * PRODUCT_PLAN_BYTES > budget_bytes:
            return _rowwise_plan(a, b, total, chunk_products, budget_bytes, index_dtype, progress)
    plan = _general_plan(a, b, total, chunk_products, index_dtype, progress)
    if "selection" not in (a_kind, b_kind):
        return plan
    operand = "a" if a_kind == "selection" else "b"
    selection, selected = (a, plan.a_pos) if operand == "a" else (b, plan.b_pos)
    if plan.starts is None:  # one multiply-add per C entry: no live-entry tables to build
        return dataclasses.replace(plan, method="gather",
                                   live_multiply_adds=live_multiply_adds(selection, selected))
    if budget_bytes is None or total * (PRODUCT_PLAN_BYTES + SELECTION_PLAN_BYTES) <= budget_bytes:
        gather = plan_selection_gather(selection, operand, plan.out.nnz, plan.a_pos, plan.b_pos,
                                       plan.starts)
        if gather is not None:
            plan = dataclasses.replace(plan, method="gather", selection=gather,
                                       live_multiply_adds=gather.live_multiply_adds)
    return plan
