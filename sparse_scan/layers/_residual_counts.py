"""A block's planning figures counted exactly without its symbolic product (issue 38).

A scan plan asks a block for two integers: its JT's stored entries (the union of its branches' terms:
a residual block's inner chain's product and its shortcut's pattern) and the FLOPs of filling its
values (the chains' products and the join's). :class:`~sparse_scan.layers.Block` would plan the
products symbolically for that (seconds on a ResNet-20); this module counts the same integers from the
layers' structure instead, for sums of two and concatenations of chains of
:class:`~sparse_scan.layers.Conv2d` and diagonal layers (ReLU, BatchNorm2d, Dropout, ...)
(:func:`block_counts`). For the other blocks, whose branches' products are planned, it counts the union
of their terms without forming it (:func:`terms_union_nnz`: a squeeze-and-excitation gate's term
holds every input-output pair of the block).

A channel-major pattern (row ``c * P + p``: channel ``c`` of pixel ``p``) is seen as a
:class:`PixelPattern`: the pixel pairs ``(p, q)`` holding entries, each with a boolean channel mask
``c_rows × c_cols``. A convolution's has one pixel pair per kernel tap reaching an input pixel, and
per tap one mask (its group structure, and where pruned its weights' non-zeros), so a few distinct
masks serve thousands of pixel pairs. The product of two such patterns is, per pixel pair
``(p, q)``, the union over the pixels ``r`` between of the boolean products of the masks of
``(p, r)`` and ``(r, q)``: it is computed once per distinct set of mask pairs, not per entry.
Multiply-adds follow :func:`~sparse_scan.engine.products.count_multiply_adds` (``sum_k
nnzcol_A(k) * nnzrow_B(k)``), and the chain's steps follow
:func:`~sparse_scan.engine.products.plan_product`: a diagonal factor scales (one FLOP per entry of
the other operand's pattern, which it keeps), two general ones multiply (two per multiply-add).

Examples
--------
>>> import numpy as np
>>> from sparse_scan.layers import Conv2d, ReLU, Residual
>>> block = Residual(Conv2d(2, 3, 3, padding=1, rng=0), ReLU(), Conv2d(3, 2, 3, padding=1, rng=1))
>>> counted = block_counts("sum", block.branches, block._layout((2, 5, 5)).branches)
>>> symbolic = block._plan((2, 5, 5))
>>> counted.nnz == symbolic.union.nnz, block.plan_builds
(True, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..csr import Pattern
from ._base import Layer, Shape
from ._conv import Conv2d
from ._joins import ColumnMap

__all__ = ["BlockCounts", "PixelPattern", "block_counts", "conv_pixels", "terms_union_nnz"]


@dataclass(frozen=True, eq=False)
class PixelPattern:
    """A channel-major pattern as channel masks on pixel pairs.

    Entry ``(c * P_rows + p, d * P_cols + q)`` is stored when ``(p, q)`` is a listed pixel pair ``i``
    (no pair listed twice) and ``masks[mask[i], c, d]``.

    Attributes
    ----------
    rows, cols : ndarray of int64
        The pixel pairs.
    mask : ndarray of int64
        Each pair's mask.
    masks : ndarray of bool, shape (masks, c_rows, c_cols)
        The distinct channel masks.
    pixels : tuple of int
        ``(P_rows, P_cols)``.
    """

    rows: np.ndarray
    cols: np.ndarray
    mask: np.ndarray
    masks: np.ndarray
    pixels: tuple[int, int]

    @property
    def nnz(self) -> int:
        """Stored entries."""
        uses = np.bincount(self.mask, minlength=len(self.masks))
        return int(uses @ self.masks.sum(axis=(1, 2), dtype=np.int64))

    @property
    def keys(self) -> np.ndarray:
        """``p * P_cols + q`` of every pixel pair."""
        return self.rows * self.pixels[1] + self.cols


@dataclass(frozen=True)
class BlockCounts:
    """A block's figures for one input shape.

    Attributes
    ----------
    nnz : int
        Stored entries of the block's JT (the union of its branches' terms).
    product_flops : int
        FLOPs of the branches' chain products and of the join
        (:func:`~sparse_scan.layers._joins.fill_flops`: a residual block's one add per shortcut
        entry); the layers' own fills not included.
    """

    nnz: int
    product_flops: int


def _axis_pairs(size: int, out_size: int, kernel: int, stride: int, pad: int,
                dilation: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per kernel offset along one axis, the (input, output) positions it links (inside the input)."""
    outputs = np.arange(out_size, dtype=np.int64)
    pairs = []
    for offset in range(kernel):
        inputs = outputs * stride - pad + offset * dilation
        inside = (inputs >= 0) & (inputs < size)
        pairs.append((inputs[inside], outputs[inside]))
    return pairs


def _conv_masks(conv: Conv2d, in_channels: int) -> np.ndarray:
    """Per kernel tap (row-major), the ``in × out`` channels it links: within a group, where the
    weights' support is non-zero when the pattern is pruned."""
    out_channels, cin_group, kh, kw = conv.weight.shape
    support = (np.asarray(conv._support()) != 0 if conv.prune_pattern
               else np.ones(conv.weight.shape, dtype=bool))
    per_tap = support.transpose(2, 3, 1, 0).reshape(kh * kw, cin_group, out_channels)
    masks = np.zeros((kh * kw, in_channels, out_channels), dtype=bool)
    groups = in_channels // cin_group
    cout_group = out_channels // groups
    for group in range(groups):
        outs = slice(group * cout_group, (group + 1) * cout_group)
        masks[:, group * cin_group:(group + 1) * cin_group, outs] = per_tap[:, :, outs]
    return masks


def conv_pixels(conv: Conv2d, in_shape: Shape) -> PixelPattern:
    """The :class:`PixelPattern` of a convolution's JT for ``in_shape``, from its geometry and
    weights (one mask per kernel tap), without building its pattern."""
    conv._structure_key()  # a non-finite weight cannot define a pruned pattern
    g = conv.geometry(in_shape)
    heights = _axis_pairs(g.height, g.out_height, g.kernel[0], g.stride[0], g.pad_top, g.dilation[0])
    widths = _axis_pairs(g.width, g.out_width, g.kernel[1], g.stride[1], g.pad_left, g.dilation[1])
    rows, cols, mask = [], [], []
    for tap_h, (in_h, out_h) in enumerate(heights):
        for tap_w, (in_w, out_w) in enumerate(widths):
            rows.append((in_h[:, None] * g.width + in_w[None, :]).ravel())
            cols.append((out_h[:, None] * g.out_width + out_w[None, :]).ravel())
            mask.append(np.full(rows[-1].shape, tap_h * g.kernel[1] + tap_w, dtype=np.int64))
    return PixelPattern(np.concatenate(rows), np.concatenate(cols), np.concatenate(mask),
                        _conv_masks(conv, g.in_channels),
                        (g.height * g.width, g.out_height * g.out_width))


def _identity_pixels(shape: Shape) -> PixelPattern:
    """The identity's :class:`PixelPattern` on ``(C, H, W)``."""
    pixels = int(np.prod(shape[1:]))
    every = np.arange(pixels, dtype=np.int64)
    return PixelPattern(every, every, np.zeros(pixels, dtype=np.int64),
                        np.eye(int(shape[0]), dtype=bool)[None], (pixels, pixels))


def _meeting(a: PixelPattern, b: PixelPattern) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of an ``a`` pixel pair ``(p, r)`` and a ``b`` pixel pair ``(r, q)``: their indices."""
    order = np.argsort(b.rows, kind="stable")
    starts = np.zeros(b.pixels[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(b.rows, minlength=b.pixels[0]), out=starts[1:])
    per = starts[a.cols + 1] - starts[a.cols]
    total = int(per.sum())
    first = np.cumsum(per) - per
    within = np.arange(total, dtype=np.int64) - np.repeat(first, per)
    b_pair = order[np.repeat(starts[a.cols], per) + within]
    return np.repeat(np.arange(len(a.rows), dtype=np.int64), per), b_pair


def _runs(sorted_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a sorted array and each element's rank among them."""
    new = np.concatenate(([True], sorted_values[1:] != sorted_values[:-1]))
    return sorted_values[new], np.cumsum(new) - 1


WORD_BITS = 62
"""Members of a set packed per int64 word of a signature."""


def _group_sets(row: np.ndarray, member: np.ndarray, rows: int,
                members: int) -> tuple[np.ndarray, np.ndarray]:
    """Group the sets ``{member[i] : row[i] == r}`` (no pair repeated) by equality.

    Returns
    -------
    sets : ndarray of bool, shape (distinct sets, members)
    of_row : ndarray, shape (rows,)
        Each row's set.
    """
    words = -(-members // WORD_BITS)
    signature = np.zeros((rows, words), dtype=np.int64)
    np.add.at(signature, (row, member // WORD_BITS), np.left_shift(1, member % WORD_BITS))
    order = np.lexsort(signature.T[::-1])
    ordered = signature[order]
    new = np.concatenate(([True], np.any(ordered[1:] != ordered[:-1], axis=1)))
    of_row = np.empty(rows, dtype=np.int64)
    of_row[order] = np.cumsum(new) - 1
    distinct = ordered[new]
    bits = np.arange(members)
    sets = (distinct[:, bits // WORD_BITS] >> (bits % WORD_BITS)) & 1
    return sets.astype(bool), of_row


def _or_of(members: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """``masks`` (``(n, r, c)`` bool) OR-ed over each row of ``members`` (``(m, n)`` bool)."""
    hits = members.astype(np.float32) @ masks.reshape(len(masks), -1).astype(np.float32)
    return (hits > 0).reshape((len(members),) + masks.shape[1:])


def multiply(a: PixelPattern, b: PixelPattern) -> tuple[PixelPattern, int]:
    """The pattern of ``A @ B`` (the boolean product, as the symbolic one) and its multiply-adds."""
    a_pair, b_pair = _meeting(a, b)
    if not len(a_pair):
        none = np.zeros(0, dtype=np.int64)
        shape = (0, a.masks.shape[1], b.masks.shape[2])
        return PixelPattern(none, none, none, np.zeros(shape, dtype=bool), (a.pixels[0], b.pixels[1])), 0
    kinds = len(b.masks)
    pair = a.mask[a_pair] * kinds + b.mask[b_pair]
    weights = a.masks.sum(axis=1, dtype=np.int64) @ b.masks.sum(axis=2, dtype=np.int64).T
    multiply_adds = int(np.bincount(pair, minlength=weights.size) @ weights.ravel())
    combos, _ = _runs(np.sort((a.rows[a_pair] * b.pixels[1] + b.cols[b_pair]) * weights.size + pair))
    keys, pairs = np.divmod(combos, weights.size)
    out_keys, row = _runs(keys)
    present = np.zeros(weights.size, dtype=bool)
    present[pairs] = True
    used = np.flatnonzero(present)
    column = np.cumsum(present)[pairs] - 1
    products = (a.masks[used // kinds].astype(np.float32) @ b.masks[used % kinds].astype(np.float32)) > 0
    sets, mask = _group_sets(row, column, len(out_keys), len(used))
    masks = _or_of(sets, products)
    live = masks.any(axis=(1, 2))[mask]
    rows, cols = np.divmod(out_keys[live], b.pixels[1])
    return PixelPattern(rows, cols, mask[live], masks, (a.pixels[0], b.pixels[1])), multiply_adds


def union_nnz(a: PixelPattern, b: PixelPattern) -> int:
    """Stored entries of the union of two :class:`PixelPattern` of one shape."""
    keys, _ = _runs(np.sort(np.concatenate((a.keys, b.keys))))
    code = np.zeros(len(keys), dtype=np.int64)
    span = len(b.masks) + 1
    code[np.searchsorted(keys, a.keys)] += (a.mask + 1) * span
    code[np.searchsorted(keys, b.keys)] += b.mask + 1
    uses = np.bincount(code)
    codes = np.flatnonzero(uses)
    none = np.zeros((1,) + a.masks.shape[1:], dtype=bool)
    a_masks, b_masks = np.concatenate((none, a.masks)), np.concatenate((none, b.masks))
    counts = (a_masks[codes // span] | b_masks[codes % span]).sum(axis=(1, 2), dtype=np.int64)
    return int(uses[codes] @ counts)


def _counted(layer: Layer) -> bool:
    """Whether the counts know ``layer``'s pattern: a convolution's, or a diagonal's (kept)."""
    return type(layer) is Conv2d or layer.jacobian_kind == "diagonal"


def _chain(layers: Sequence[Layer], shapes: Sequence[Shape]) -> tuple[PixelPattern, int] | None:
    """The chain product's pattern and its steps' FLOPs, as
    :meth:`~sparse_scan.layers._block.ChainProduct.plan` plans them; None for a chain of diagonals alone
    (whose product keeps the first one's pattern)."""
    first = layers[0]
    product = None if first.jacobian_kind == "diagonal" else conv_pixels(first, shapes[0])
    diagonal_nnz = first.pattern_nnz(shapes[0]) if product is None else 0
    flops = 0
    for layer, shape in zip(layers[1:], shapes[1:], strict=False):
        if layer.jacobian_kind == "diagonal":  # scales the columns: the pattern is kept
            flops += diagonal_nnz if product is None else product.nnz
        elif product is None:  # a diagonal scales the rows of the first convolution
            product = conv_pixels(layer, shape)
            flops += product.nnz
        else:
            product, multiply_adds = multiply(product, conv_pixels(layer, shape))
            flops += 2 * multiply_adds
    return None if product is None else (product, flops)


def block_counts(join: str, branches: Sequence[Sequence[Layer]],
                 shapes: Sequence[Sequence[Shape]]) -> BlockCounts | None:
    """A block's :class:`BlockCounts`, its branches' layers taking ``shapes`` (per branch, input first,
    output last); None where the join is no sum of two branches nor a concatenation, some layer is
    neither a :class:`~sparse_scan.layers.Conv2d` nor diagonal, the tensors are not ``(C, H, W)``, or a
    chain holds no convolution (the caller then plans the block)."""
    if join == "product" or (join == "sum" and len(branches) != 2) or len(shapes[0][0]) != 3 or not all(
            _counted(layer) for chain in branches for layer in chain):
        return None
    counted = [_chain(chain, chain_shapes) if chain else (_identity_pixels(chain_shapes[0]), 0)
               for chain, chain_shapes in zip(branches, shapes, strict=True)]
    if any(count is None for count in counted):
        return None
    flops = sum(count[1] for count in counted)
    if join == "concat":  # the terms lie side by side: no entry shared, no arithmetic
        return BlockCounts(sum(count[0].nnz for count in counted), flops)
    (inner, _), (short, _) = counted
    return BlockCounts(union_nnz(inner, short), flops + short.nnz)


def terms_union_nnz(patterns: Sequence[Pattern], maps: Sequence[ColumnMap]) -> int:
    """Stored entries of the union of a block's terms ``JT_i M_i`` (``patterns``: the branches' JT
    patterns, host; ``maps``: their :class:`~sparse_scan.layers._joins.ColumnMap`), the largest term
    never formed: the others' entries are, and looked up in the largest one's branch pattern."""
    entries = [column_map.columns_nnz(pattern) for pattern, column_map in zip(patterns, maps, strict=True)]
    largest = max(range(len(entries)), key=entries.__getitem__)
    out_size = maps[largest].out_size
    keys = []
    for index, (pattern, column_map) in enumerate(zip(patterns, maps, strict=True)):
        if index != largest:
            term, _ = column_map.columns(pattern)
            keys.append(np.asarray(term.row_of_entries(), np.int64) * out_size
                        + np.asarray(term.indices, np.int64))
    others = np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)
    rows, columns = np.divmod(others, out_size)
    big, big_map = patterns[largest], maps[largest]
    branch_columns, mapped = big_map.branch_columns(columns)
    width = big.shape[1]
    big_keys = np.sort(np.asarray(big.row_of_entries(), np.int64) * width + np.asarray(big.indices, np.int64))
    query = rows * width + branch_columns
    found = np.minimum(np.searchsorted(big_keys, query), max(len(big_keys) - 1, 0))
    shared = mapped & (big_keys[found] == query) if len(big_keys) else np.zeros(len(query), dtype=bool)
    return entries[largest] + len(others) - int(np.count_nonzero(shared))
