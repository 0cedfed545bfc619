"""How a block's branches join: the output's shape, the forward join, and per branch where its
transposed Jacobian lies in the block's and what share of the output gradient it takes.

A block (:class:`~sparse_scan.layers.Block`) runs its input ``x`` through branches ``b_i`` (chains of
layers, or the identity) and joins their outputs:

- ``sum``: ``y = b_1(x) + b_2(x) + ...``, equal shapes: ``JT = JT_1 + JT_2 + ...``;
- ``concat``: ``y = cat([b_1(x), b_2(x), ...], 1)``, along the channels (the first per-sample axis),
  the other axes equal. A flat C-order sample holds the branches' outputs one after the other, so
  ``JT = [JT_1 JT_2 ...]``: each branch's JT over its column range (an offset, no arithmetic);
- ``product``: ``y = b_1(x) * b_2(x)`` of two branches, with broadcasting (an axis of size 1 in one
  branch spans the other's: a ``(C, 1, 1)`` gate over ``(C, H, W)``):
  ``JT = JT_1 E_1 diag(b_2) + JT_2 E_2 diag(b_1)``, ``E_i`` the broadcast's own JT (its output to the
  block's: one entry per column, so ``E_i g`` sums ``g`` over the positions it spans) and ``b_j`` the
  other branch's output spread over the block's.

So every branch's term is ``JT_i · M_i · D_i``: ``M_i`` its :class:`ColumnMap` (the identity, an
offset, a broadcast), ``D_i`` the diagonal a product scales it by (:func:`scales`; none for the sum
and the concatenation).

Examples
--------
>>> shape, maps = join_maps("product", ((2, 1, 1), (2, 3, 3)))
>>> shape, [m.kind for m in maps]
((2, 3, 3), ['broadcast', 'identity'])
>>> import numpy as np
>>> maps[0].gradient(np.ones((1, 18))).tolist()   # the gate's gradient: summed over 3 x 3 positions
[[9.0, 9.0]]
>>> shape, maps = join_maps("concat", ((2, 4, 4), (3, 4, 4)))
>>> shape, [(m.kind, m.offset) for m in maps]
((5, 4, 4), [('offset', 0), ('offset', 32)])
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .. import backend as _backend
from .._types import Array
from ..csr import Pattern, choose_index_dtype

__all__ = ["JOINS", "JOIN_TEXT", "ColumnMap", "fill_flops", "join_maps", "join_outputs", "scales"]

Shape = tuple[int, ...]

JOINS = ("sum", "concat", "product")
"""How a block joins its branches' outputs: their sum, their concatenation along the channels, their
product (two branches, with broadcasting)."""

JOIN_TEXT = {"sum": "y = b_1(x) + b_2(x) + ... needs equal shapes",
             "concat": "y = cat([b_1(x), b_2(x), ...], 1) needs equal shapes but for the channels (the "
                       "first axis of a sample)",
             "product": "y = b_1(x) * b_2(x) needs shapes of one length whose axes are equal or 1 "
                        "(broadcast)"}


@dataclass(frozen=True, eq=False)
class ColumnMap:
    """Where a branch's output lies in the block's: ``M_i``, of shape ``(size, out_size)``.

    Attributes
    ----------
    kind : {"identity", "offset", "broadcast"}
        ``identity``: the same positions; ``offset``: positions ``offset .. offset + size - 1`` of the
        block's output (a concatenation); ``broadcast``: the branch's output spread over the block's
        (axes of size 1 repeated).
    shape, out_shape : tuple of int
        The branch's and the block's per-sample output shapes.
    offset : int
        Of an ``offset`` map.
    """

    kind: str
    shape: Shape
    out_shape: Shape
    offset: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def out_size(self) -> int:
        return math.prod(self.out_shape)

    @functools.cached_property
    def source(self) -> np.ndarray:
        """A broadcast's: per column of the block's JT, the branch's column it repeats (int64)."""
        return np.broadcast_to(np.arange(self.size, dtype=np.int64).reshape(self.shape),
                               self.out_shape).ravel()

    def _spans(self) -> np.ndarray:
        """A broadcast's: per branch column, how many of the block's columns repeat it."""
        return np.full(self.size, self.out_size // self.size, dtype=np.int64)

    def columns(self, pattern: Pattern) -> tuple[Pattern, np.ndarray | None]:
        """The pattern of ``JT_i M_i`` (host, columns sorted within each row) and per entry the entry of
        ``pattern`` it copies (None: entry ``e`` copies entry ``e``)."""
        rows = pattern.shape[0]
        if self.kind == "identity":
            return pattern, None
        if self.kind == "offset":
            indices = np.asarray(pattern.indices, np.int64) + self.offset
            dtype = choose_index_dtype(pattern.nnz, self.out_size)
            return Pattern(np.asarray(pattern.indptr).astype(dtype), indices.astype(dtype),
                           (rows, self.out_size)), None
        order = np.argsort(self.source, kind="stable")  # the block's columns of each branch column
        starts = np.zeros(self.size + 1, dtype=np.int64)
        np.cumsum(self._spans(), out=starts[1:])
        branch_columns = np.asarray(pattern.indices, np.int64)
        per = self._spans()[branch_columns]
        copies = np.repeat(np.arange(pattern.nnz, dtype=np.int64), per)
        within = np.arange(len(copies), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
        columns = order[starts[branch_columns[copies]] + within]
        entry_rows = np.repeat(np.asarray(pattern.row_of_entries(), np.int64), per)
        sort = np.argsort(entry_rows * self.out_size + columns, kind="stable")
        dtype = choose_index_dtype(len(copies), self.out_size)
        indptr = np.zeros(rows + 1, dtype=dtype)
        np.cumsum(np.bincount(entry_rows, minlength=rows), out=indptr[1:])
        return Pattern(indptr, columns[sort].astype(dtype), (rows, self.out_size)), copies[sort]

    def branch_columns(self, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For columns of the block's JT (int64), the branch's column each repeats and whether it has one
        (a concatenation's other branches' columns have none)."""
        if self.kind == "identity":
            return columns, np.ones(len(columns), dtype=bool)
        if self.kind == "offset":
            inside = (columns >= self.offset) & (columns < self.offset + self.size)
            return np.where(inside, columns - self.offset, 0), inside
        return self.source[columns], np.ones(len(columns), dtype=bool)

    def gradient(self, g: Array) -> Array:
        """``M_i g`` for a batch ``(B, out_size)``: the branch's share of the block's output gradient."""
        if self.kind == "identity":
            return g
        if self.kind == "offset":
            return _backend.of(g).xp.ascontiguousarray(g[:, self.offset:self.offset + self.size])
        batch = g.shape[0]
        axes = tuple(axis + 1 for axis, (a, b) in enumerate(zip(self.shape, self.out_shape, strict=True))
                     if a != b)
        return g.reshape((batch,) + self.out_shape).sum(axis=axes, keepdims=True).reshape(batch, self.size)

    def spread(self, values: Array) -> Array:
        """The branch's outputs ``(B, *shape)`` over the block's: ``(B, out_size)`` (a broadcast's
        repeated, C-contiguous)."""
        batch = values.shape[0]
        if self.kind != "broadcast":
            return values.reshape(batch, self.size)
        xp = _backend.of(values).xp
        spread = xp.broadcast_to(values.reshape((batch,) + self.shape), (batch,) + self.out_shape)
        return xp.ascontiguousarray(spread).reshape(batch, self.out_size)


@functools.lru_cache(maxsize=256)
def join_maps(join: str, shapes: tuple[Shape, ...]) -> tuple[Shape, tuple[ColumnMap, ...]]:
    """The block's per-sample output shape and each branch's :class:`ColumnMap`, from the branches'
    output shapes.

    Raises
    ------
    ValueError
        The shapes do not join that way: the message says what the join needs (the caller names the
        layer and the shapes).
    """
    ranks = {len(shape) for shape in shapes}
    if join == "sum":
        problem, out = len(set(shapes)) != 1, shapes[0]
    elif join == "concat":
        problem = len(ranks) != 1 or not shapes[0] or len({shape[1:] for shape in shapes}) != 1
        out = () if problem else (sum(shape[0] for shape in shapes),) + shapes[0][1:]
    else:
        out = tuple(max(sizes) for sizes in zip(*shapes, strict=False))
        problem = len(ranks) != 1 or any(s not in (1, o) for shape in shapes
                                         for s, o in zip(shape, out, strict=True))
    if problem:
        raise ValueError(JOIN_TEXT[join])
    if join == "concat":
        offsets = np.cumsum([0] + [math.prod(shape) for shape in shapes[:-1]])
        return out, tuple(ColumnMap("offset", shape, out, int(offset))
                          for shape, offset in zip(shapes, offsets, strict=True))
    return out, tuple(ColumnMap("identity" if shape == out else "broadcast", shape, out) for shape in shapes)


def fill_flops(join: str, entries: Sequence[int]) -> int:
    """FLOPs of joining the branches' terms, of ``entries`` each, into the block's JT values: a sum
    adds every term but the first (written), a concatenation writes them, a product scales both
    terms and adds the second."""
    if join == "concat":
        return 0
    scalings = sum(entries) if join == "product" else 0
    return scalings + sum(entries[1:])


def join_outputs(join: str, outputs: Sequence[Array]) -> Array:
    """The block's output from its branches' (batches on one device)."""
    if join == "concat":
        return _backend.of(outputs[0]).xp.concatenate(list(outputs), axis=1)
    if join == "product":
        return outputs[0] * outputs[1]
    return functools.reduce(lambda a, b: a + b, outputs)


def scales(join: str, maps: Sequence[ColumnMap], outputs: Sequence[Array]) -> list[Array | None]:
    """Per branch, the diagonal ``D_i`` its term is scaled by, as ``(B, out_size)``: for a product the
    other branch's output spread over the block's; None for a sum or a concatenation."""
    if join != "product":
        return [None] * len(maps)
    return [maps[1].spread(outputs[1]), maps[0].spread(outputs[0])]

