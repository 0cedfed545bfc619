"""Sparse products with a fixed pattern: symbolic once, numeric every batch.

``C = A @ B`` for CSR operands whose patterns are fixed by the architecture. The symbolic phase
(:func:`plan_product`) enumerates every multiply-add ``(a entry, b entry) -> c entry`` and the exact
pattern of ``C``; the numeric phase (:func:`multiply`) then only gathers, multiplies and sums, with no
sorting, merging or allocation it could not know in advance. ``C``'s pattern is the symbolic one,
explicit zeros included (SciPy's ``@`` drops numerical zeros and serves only as an oracle).

Diagonal operands (ReLU, tanh, sigmoid, LeakyReLU, Flatten) are scalings, never general products:
``A @ D`` scales ``A``'s columns and ``D @ B`` scales ``B``'s rows, with ``C``'s pattern the other
operand's.

FLOPs follow ARCHITECTURE.md: a multiply-add counts 2, so ``A @ B`` costs
``2 * sum_k nnzcol_A(k) * nnzrow_B(k)`` and ``A @ v`` costs ``2 * nnz(A)``. A scaling costs one
multiply per stored entry of the result.

Examples
--------
>>> import numpy as np, scipy.sparse as sp
>>> from sparse_scan.csr import Pattern
>>> a = sp.random(5, 4, density=0.5, format="csr", random_state=0)
>>> b = sp.random(4, 3, density=0.5, format="csr", random_state=1)
>>> pa = Pattern(a.indptr, a.indices, a.shape)
>>> pb = Pattern(b.indptr, b.indices, b.shape)
>>> plan = plan_product(pa, pb, "general", "general")
>>> c = multiply(plan, a.data, b.data)
>>> np.allclose(sp.csr_matrix((c, plan.out.indices, plan.out.indptr), plan.out.shape).toarray(),
...             (a @ b).toarray())
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .csr import Pattern, choose_index_dtype

__all__ = ["ProductPlan", "RowReduction", "matvec", "multiply", "plan_product", "row_reduction"]


@dataclass(frozen=True, eq=False)
class ProductPlan:
    """The symbolic part of ``C = A @ B``, reused by every numeric product.

    Attributes
    ----------
    method : {"general", "scale_columns", "scale_rows"}
        ``general``: gather-multiply-segment-sum over ``products``; ``scale_columns``: ``B`` is
        diagonal and ``C = A`` with columns scaled; ``scale_rows``: ``A`` is diagonal.
    out : Pattern
        The pattern of ``C`` (exactly the symbolic one).
    a_pos, b_pos : ndarray or None
        For ``general``: the ``A`` and ``B`` entry of every multiply-add, grouped by ``C`` entry.
        For scalings: the index into the diagonal operand of every ``C`` entry (``b_pos`` for
        ``scale_columns``, ``a_pos`` for ``scale_rows``).
    starts : ndarray or None
        For ``general``: the first multiply-add of every ``C`` entry.
    multiply_adds : int
        Multiply-adds over the pattern (a scaling counts one per entry of ``C``).
    """

    method: str
    out: Pattern
    a_pos: Any
    b_pos: Any
    starts: Any
    multiply_adds: int

    @property
    def flops(self) -> int:
        """FLOPs over the pattern (2 per multiply-add, 1 per scaling multiply)."""
        return self.multiply_adds if self.method != "general" else 2 * self.multiply_adds

    @property
    def nbytes(self) -> int:
        """Bytes of index structure held by the plan (the output pattern included)."""
        arrays = (self.a_pos, self.b_pos, self.starts)
        return self.out.nbytes + sum(int(a.nbytes) for a in arrays if a is not None)


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _general_plan(a: Pattern, b: Pattern, index_dtype: Any) -> ProductPlan:
    a_rows = np.asarray(a.row_of_entries(), dtype=np.int64)
    a_cols = np.asarray(a.indices, dtype=np.int64)
    b_indptr = np.asarray(b.indptr, dtype=np.int64)
    per_entry = b_indptr[a_cols + 1] - b_indptr[a_cols]
    offsets = _exclusive_cumsum(per_entry)
    total = int(offsets[-1])
    a_pos = np.repeat(np.arange(a.nnz, dtype=np.int64), per_entry)
    b_pos = np.repeat(b_indptr[a_cols] - offsets[:-1], per_entry) + np.arange(total, dtype=np.int64)
    keys = a_rows[a_pos] * b.shape[1] + np.asarray(b.indices, dtype=np.int64)[b_pos]
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    first = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if total else keys
    out_keys = keys[first]
    rows, cols = np.divmod(out_keys, b.shape[1])
    dtype = choose_index_dtype(max(len(out_keys), total), b.shape[1], index_dtype)
    indptr = np.zeros(a.shape[0] + 1, dtype=dtype)
    np.cumsum(np.bincount(rows, minlength=a.shape[0]), out=indptr[1:])
    out = Pattern(indptr, cols.astype(dtype), (a.shape[0], b.shape[1]))
    return ProductPlan("general", out, a_pos[order].astype(dtype), b_pos[order].astype(dtype),
                       first.astype(dtype), total)


def plan_product(a: Pattern, b: Pattern, a_kind: str, b_kind: str,
                 index_dtype: Any = None) -> ProductPlan:
    """Symbolic phase of ``A @ B`` (host arrays).

    Parameters
    ----------
    a, b : Pattern
        Operand patterns, ``a.shape[1] == b.shape[0]``.
    a_kind, b_kind : str
        The operands' ``jacobian_kind`` (``"diagonal"`` operands become scalings).
    index_dtype : optional
        Force int32/int64 for the plan's index arrays.

    Returns
    -------
    ProductPlan
    """
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {a.shape} by {b.shape}")
    if b_kind == "diagonal":
        return ProductPlan("scale_columns", a, None, a.indices, None, a.nnz)
    if a_kind == "diagonal":
        return ProductPlan("scale_rows", b, b.row_of_entries(), None, None, b.nnz)
    return _general_plan(a, b, index_dtype)


def multiply(plan: ProductPlan, a_data: Any, b_data: Any) -> Any:
    """Numeric phase of ``A @ B``: values of ``C`` in ``plan.out``'s entry order.

    ``a_data``/``b_data`` are ``(nnz,)`` (shared by the batch) or ``(B, nnz)``; the result is
    ``(nnz_C,)`` when both are shared, else ``(B, nnz_C)``. A diagonal operand's data holds its
    diagonal.
    """
    if plan.method == "scale_columns":
        return a_data * b_data[..., plan.b_pos]
    if plan.method == "scale_rows":
        return a_data[..., plan.a_pos] * b_data
    products = a_data[..., plan.a_pos] * b_data[..., plan.b_pos]
    if products.shape[-1] == 0:
        return products
    return np.add.reduceat(products, plan.starts, axis=-1)


@dataclass(frozen=True, eq=False)
class RowReduction:
    """How to sum a CSR matrix's entry products into rows: the non-empty rows and their starts."""

    rows: Any
    starts: Any
    size: int


def row_reduction(pattern: Pattern) -> RowReduction:
    """Precompute the segment sums of :func:`matvec` for ``pattern`` (host arrays)."""
    indptr = np.asarray(pattern.indptr)
    rows = np.flatnonzero(np.diff(indptr) > 0)
    return RowReduction(rows, indptr[rows], pattern.shape[0])


def matvec(pattern: Pattern, reduction: RowReduction, data: Any, vectors: Any) -> Any:
    """``A @ v`` for a batch of vectors ``(B, cols)``: returns ``(B, rows)``.

    ``data`` is ``(nnz,)`` (one matrix for the batch) or ``(B, nnz)`` (one per sample).
    """
    out = np.zeros((vectors.shape[0], reduction.size), dtype=np.result_type(data, vectors))
    if pattern.nnz == 0:
        return out
    products = data * vectors[:, pattern.indices]
    out[:, reduction.rows] = np.add.reduceat(products, reduction.starts, axis=1)
    return out
