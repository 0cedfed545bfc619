"""A block's planning figures counted exactly from its layers' structure, no product planned (issues 38
and 46).

A scan plan asks a block (:class:`~sparse_scan.layers.Block`) for two integers: its JT's stored entries
(``pattern_nnz``: the union of its branches' terms ``JT_i M_i D_i``) and the FLOPs of filling its values
(``jacobian_fill_flops``: the steps :func:`~sparse_scan.engine.products.plan_product` plans along each
chain, and the join's). Planning those products symbolically enumerates and sorts every multiply-add:
a squeeze-and-excitation gate (``mean → fc → relu → fc → sigmoid``) makes a block's JT dense, and the
first backward of Inception-v3 and RegNet-Y spent 18-23 s there. This module counts the same integers
exactly from a compressed description of every pattern, a :class:`Structure`, whose size follows the
pattern's structure (its pixel reach and channel masks), never its entries.

**A pattern's structure.** A sample ``(C, *pixels)`` (``C`` channels of ``P`` pixels; a flat ``(F,)``
one: one channel of ``F`` pixels, :func:`factor`) is flattened channel-major, entry ``c * P + p``. A
JT's pattern is then a set of pixel pairs ``(p, q)``, each with a boolean *channel mask* ``c_rows ×
c_cols`` (which channels of input pixel ``p`` reach which channels of output pixel ``q``), and the
pixels are grouped into *classes*: pixels whose rows (columns) hold the same pairs with the same masks
are *twins*, one class, so that a listed pair joins two classes, not two pixels:

- a convolution (:func:`conv_structure`): a pixel pair per kernel tap reaching an input pixel, the
  tap's mask (its groups, and where pruned its weights' non-zeros); pixels are their own classes;
- a channel-wise layer (max and average pooling, adaptive pooling, upsampling): its one-channel
  pattern's pixel pairs, each with the mask ``eye(C)``; a diagonal one: the identity;
- a global reduction (adaptive pooling to 1x1, a dense linear layer) and every product it enters:
  every pixel of a class reaches every pixel of another, one listed pair instead of ``P_in · P_out``
  pixel pairs (a squeeze-and-excitation block's JT: one pair of classes with a dense mask);
- any other layer: its pattern's entries grouped by pixel pair (:func:`pattern_structure`).

**Products** (:func:`multiply`): ``(A B)(p, q) = OR_r A(p, r) B(r, q)``, and ``A(p, r)`` depends on
``r`` only through its column class ``β``, ``B(r, q)`` through its row class ``α'``. So the middle
pixels are read once, as the distinct *links* ``(β, α')`` they make, one side's pairs are OR-ed over
the links into the other side's classes, and the pairs meet on the shared class: each result pair's
mask is the OR of the boolean products of the masks meeting there (computed once per distinct pair of
masks, not per entry). Its multiply-adds, ``Σ_k nnzcol_A(k) · nnzrow_B(k)`` over the middle entries
``k`` (:func:`~sparse_scan.engine.products.count_multiply_adds`), come from the same links: per link,
the pixels the two sides' pairs span times the channel products of their masks.

**Joins** (:func:`block_counts`): each branch's term is its chain's product (the steps and FLOPs of
:meth:`~sparse_scan.layers._block.ChainProduct.plan`: a diagonal factor scales, one FLOP per entry of
the other operand, which keeps its pattern; two others multiply, two FLOPs per multiply-add) with its
columns mapped (:class:`~sparse_scan.layers._joins.ColumnMap`: a concatenation's channel offset, a
broadcast's own structure ``E_i``); the block's pattern is the union of the terms (:func:`union`: a
term whose pairs another one covers adds nothing; otherwise the classes are refined until both
terms' pairs are listed on common ones), and a nested block is a layer like any other (its union's
structure). A product's scalings ``D_i`` keep the pattern.

Everything is exact: the figures equal the planned pattern's ``nnz`` and the planned steps' FLOPs
(``tests/test_block_counts.py``). The cost grows with the listed pairs; a union that no term covers,
of a term with coarse classes and one with fine ones (a dense term beside a convolution's), lists
the pixel pairs ``P_in · P_out`` (still not the entries, which that many pairs times the channels'
products would be).

Examples
--------
>>> import numpy as np
>>> from sparse_scan.layers import AdaptiveAvgPool2d, Block, Conv2d, ReLU, Residual, Sigmoid
>>> block = Residual(Conv2d(2, 3, 3, padding=1, rng=0), ReLU(), Conv2d(3, 2, 3, padding=1, rng=1))
>>> layout = block._layout((2, 5, 5))
>>> counted = block_counts(block.join, block.branches, layout.branches, layout.maps)
>>> counted.nnz == block._plan((2, 5, 5)).union.nnz
True
>>> gate = [AdaptiveAvgPool2d(1), Conv2d(4, 2, 1, rng=2), ReLU(), Conv2d(2, 4, 1, rng=3), Sigmoid()]
>>> se = Block([], gate, join="product", names=[None, None])
>>> se.jt_structure((4, 6, 6)).nnz == (4 * 36) ** 2, len(se.jt_structure((4, 6, 6)).rows)   # dense: one pair
(True, 1)
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..csr import Pattern
from ._adaptive_pool import AdaptiveAvgPool2d
from ._base import Layer, Shape
from ._conv import Conv2d
from ._joins import ColumnMap, fill_flops
from ._pooling import AvgPool2d, MaxPool2d
from ._upsample import Upsample

__all__ = ["BlockCounts", "Structure", "block_counts", "conv_structure", "factor", "identity", "multiply",
           "pattern_structure", "union"]

CHANNELWISE = (AdaptiveAvgPool2d, AvgPool2d, MaxPool2d, Upsample)
"""Layers that treat every channel alike and alone: their JT is ``eye(C)`` times one channel's pattern."""

PRODUCT_CHUNK = 2**25
"""Bytes of float32 operands per batch of channel-mask products."""


def factor(shape: Shape) -> tuple[int, int]:
    """``(channels, pixels)`` of a per-sample shape as a :class:`Structure` lays it out: ``(C, H·W…)``,
    and one channel of ``F`` pixels for a flat ``(F,)`` shape (a scalar: one of one)."""
    return (int(shape[0]), math.prod(shape[1:])) if len(shape) > 1 else (1, math.prod(shape))


@dataclass(frozen=True, eq=False)
class Structure:
    """A channel-major pattern as channel masks on pairs of pixel classes.

    Entry ``(c * P_rows + p, d * P_cols + q)`` is stored when the pair ``(row_class[p], col_class[q])``
    is listed, as pair ``i``, and ``masks[mask[i], c, d]``.

    Attributes
    ----------
    row_class, col_class : ndarray of int64
        Every row (column) pixel's class: ``0, 1, ...``, every class holding a pixel.
    rows, cols : ndarray of int64
        The listed pairs of classes, sorted, none twice.
    mask : ndarray of int64
        Each pair's mask.
    masks : ndarray of bool, shape (masks, c_rows, c_cols)
        The channel masks, none empty.
    """

    row_class: np.ndarray
    col_class: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    mask: np.ndarray
    masks: np.ndarray

    @functools.cached_property
    def row_sizes(self) -> np.ndarray:
        """Pixels per row class."""
        return np.bincount(self.row_class)

    @functools.cached_property
    def col_sizes(self) -> np.ndarray:
        """Pixels per column class."""
        return np.bincount(self.col_class)

    @property
    def classes(self) -> tuple[int, int]:
        """Row and column classes."""
        return len(self.row_sizes), len(self.col_sizes)

    @property
    def nnz(self) -> int:
        """Stored entries."""
        entries = self.masks.sum(axis=(1, 2), dtype=np.int64)
        return int((self.row_sizes[self.rows] * self.col_sizes[self.cols] * entries[self.mask]).sum())

    def transposed(self) -> "Structure":
        """The structure of the transposed pattern."""
        order = np.lexsort((self.rows, self.cols))
        return Structure(self.col_class, self.row_class, self.cols[order], self.rows[order], self.mask[order],
                         self.masks.transpose(0, 2, 1))


@dataclass(frozen=True)
class BlockCounts:
    """A block's figures for one input shape.

    Attributes
    ----------
    nnz : int
        Stored entries of the block's JT (the union of its branches' terms).
    product_flops : int
        FLOPs of the branches' chain products and of the join
        (:func:`~sparse_scan.layers._joins.fill_flops`); the layers' own fills not included.
    structure : Structure
        The JT's pattern, for a block holding this one.
    """

    nnz: int
    product_flops: int
    structure: Structure


# --- grouping ------------------------------------------------------------------------------------------
def _runs(sorted_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a sorted array and each element's rank among them."""
    if not len(sorted_values):
        return sorted_values, np.zeros(0, dtype=np.int64)
    new = np.concatenate(([True], sorted_values[1:] != sorted_values[:-1]))
    return sorted_values[new], np.cumsum(new) - 1


def _ranked(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values (sorted) and each value's index among them (``np.unique``'s inverse, without
    its argsort)."""
    distinct = np.unique(values)
    return distinct, np.searchsorted(distinct, values)


def _matches(left: np.ndarray, right: np.ndarray, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(i, j)`` with ``left[i] == right[j]`` (values below ``keys``)."""
    order = np.argsort(right, kind="stable")
    starts = _starts(np.bincount(right, minlength=keys))
    per = starts[left + 1] - starts[left]
    return np.repeat(np.arange(len(left), dtype=np.int64), per), order[_ranges(starts[left], per)]


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _set_hash(member: np.ndarray, starts: np.ndarray, salt: np.uint64) -> np.ndarray:
    """Per owner (its members ``member[starts[i]:starts[i + 1]]``) the wrapping sum of its members'
    SplitMix64 mixes with ``salt``: equal sets hash equal."""
    z = (member.astype(np.uint64) ^ salt) * _MIX[0]
    z = (z ^ (z >> np.uint64(30))) * _MIX[1]
    z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    total = np.zeros(len(member) + 1, dtype=np.uint64)
    np.cumsum(z ^ (z >> np.uint64(31)), out=total[1:])
    return total[starts[1:]] - total[starts[:-1]]


def _equal_sets(owner: np.ndarray, member: np.ndarray, owners: int) -> tuple[np.ndarray, np.ndarray]:
    """Group ``owners`` by their sets of members, exactly.

    ``owner`` is ascending and ``member`` increasing within an owner. Owners are grouped by their sets'
    sizes and two salted hashes, then every owner's members are compared with its group's first
    owner's; on a collision (two 64-bit hashes: never seen) the grouping is redone with new salts.

    Returns
    -------
    group : ndarray of int64, shape (owners,)
        Every owner's group, ``0, 1, ...``.
    first : ndarray of int64
        Each group's first owner.
    """
    lengths = np.bincount(owner, minlength=owners)
    starts = _starts(lengths)
    position = np.arange(len(member), dtype=np.int64) - starts[owner]
    salts = np.random.default_rng(0)
    while True:
        salt = salts.integers(0, 2**63, size=2).astype(np.uint64)
        keys = (lengths, _set_hash(member, starts, salt[0]), _set_hash(member, starts, salt[1]))
        order = np.lexsort(keys[::-1])
        new = np.zeros(owners, dtype=bool)
        new[:1] = True
        for key in keys:
            new[1:] |= key[order][1:] != key[order][:-1]
        group = np.empty(owners, dtype=np.int64)
        group[order] = np.cumsum(new) - 1
        first = order[new]
        if np.array_equal(member, member[starts[first[group]][owner] + position]):
            return group, first


def _starts(lengths: np.ndarray) -> np.ndarray:
    """``[0, l_0, l_0 + l_1, ...]``: where each run of ``lengths`` starts, and the total last."""
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + l) for s, l in zip(starts, lengths)])``."""
    return np.repeat(starts - _starts(lengths)[:-1], lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _summed(keys: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``keys`` (sorted) and the int64 sum of each one's ``weights``."""
    order = np.argsort(keys, kind="stable")
    distinct, rank = _runs(keys[order])
    if not len(distinct):
        return distinct, np.zeros(0, dtype=np.int64)
    firsts = np.flatnonzero(np.diff(rank, prepend=-1))
    return distinct, np.add.reduceat(weights[order].astype(np.int64), firsts)


def _or_of_sets(member: np.ndarray, starts: np.ndarray, owners: np.ndarray,
                item_masks: np.ndarray) -> np.ndarray:
    """Per owner of ``owners``, the OR of ``item_masks`` over its members (``member[starts[o]:starts[o +
    1]]``), one position of the sets at a time."""
    lengths = starts[owners + 1] - starts[owners]
    out = item_masks[member[starts[owners]]]
    for position in range(1, int(lengths.max(initial=1))):
        longer = np.flatnonzero(lengths > position)
        out[longer] |= item_masks[member[starts[owners[longer]] + position]]
    return out


def _distinct_masks(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct non-empty masks of ``masks`` and each one's index among them (-1: empty)."""
    packed = np.ascontiguousarray(np.packbits(masks.reshape(len(masks), math.prod(masks.shape[1:])), axis=1))
    rows = packed.view(np.dtype((np.void, max(packed.shape[1], 1)))).reshape(-1)
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    empty = ~packed[first].any(axis=1)
    rank = np.cumsum(~empty) - 1
    return masks[first[~empty]], np.where(empty[inverse], -1, rank[inverse])


def _built(row_class: np.ndarray, col_class: np.ndarray, rows: np.ndarray, cols: np.ndarray,
           items: np.ndarray, item_masks: np.ndarray, merge: bool = True) -> Structure:
    """The structure whose pair ``(rows[i], cols[i])`` of classes holds ``item_masks[items[i]]``, OR-ed
    over a pair's items; its masks distinct and non-empty (a pair whose OR is empty is not listed), and
    with ``merge`` its twins merged (:func:`_merged`)."""
    column_classes = int(col_class.max()) + 1
    count = max(len(item_masks), 1)
    combos, _ = _runs(np.sort((rows * column_classes + cols) * count + items))
    keys, owner = _runs(combos // count)
    member = combos % count
    group, first = _equal_sets(owner, member, len(keys))
    masks, index = _distinct_masks(_or_of_sets(member, _starts(np.bincount(owner, minlength=len(keys))),
                                               first, item_masks))
    mask = index[group]
    kept = mask >= 0
    pair_rows, pair_cols = np.divmod(keys[kept], column_classes)
    structure = Structure(row_class, col_class, pair_rows, pair_cols, mask[kept], masks)
    return _merged(structure) if merge else structure


def _merged_rows(structure: Structure) -> Structure:
    """``structure`` with its twin row classes (the same pairs with the same masks) merged."""
    rows, _ = structure.classes
    group, first = _equal_sets(structure.rows, structure.cols * len(structure.masks) + structure.mask, rows)
    if len(first) == rows:
        return structure
    kept = np.zeros(rows, dtype=bool)
    kept[first] = True
    chosen = kept[structure.rows]
    new_rows, cols = group[structure.rows[chosen]], structure.cols[chosen]
    order = np.lexsort((cols, new_rows))
    return Structure(group[structure.row_class], structure.col_class, new_rows[order], cols[order],
                     structure.mask[chosen][order], structure.masks)


def _merged(structure: Structure) -> Structure:
    """``structure`` with its twin classes merged, rows and columns, until none are left."""
    while True:
        merged = _merged_rows(_merged_rows(structure).transposed()).transposed()
        if merged.classes == structure.classes:
            return merged
        structure = merged


# --- the structures of layers --------------------------------------------------------------------------
def identity(shape: Shape) -> Structure:
    """The identity's structure on ``shape``."""
    channels, pixels = factor(shape)
    every = np.arange(pixels, dtype=np.int64)
    return Structure(every, every, every, every, np.zeros(pixels, dtype=np.int64),
                     np.eye(channels, dtype=bool)[None])


def _pixel_pairs(rows: np.ndarray, cols: np.ndarray, mask: np.ndarray, masks: np.ndarray,
                 pixels: tuple[int, int]) -> Structure:
    """The structure of pixel pairs ``(rows[i], cols[i])`` holding ``masks[mask[i]]``."""
    return _built(np.arange(pixels[0], dtype=np.int64), np.arange(pixels[1], dtype=np.int64), rows, cols,
                  mask, masks)


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


def conv_structure(conv: Conv2d, in_shape: Shape) -> Structure:
    """A convolution's JT structure for ``in_shape``, from its geometry and weights (one mask per kernel
    tap), without building its pattern."""
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
    return _pixel_pairs(np.concatenate(rows), np.concatenate(cols), np.concatenate(mask),
                        _conv_masks(conv, g.in_channels), (g.height * g.width, g.out_height * g.out_width))


def pattern_structure(pattern: Pattern, in_shape: Shape, out_shape: Shape) -> Structure:
    """The structure of a JT's ``pattern`` (host) from ``in_shape`` to ``out_shape``: its entries grouped
    by pixel pair, each pair's channel pairs its mask."""
    (in_channels, in_pixels), (out_channels, out_pixels) = factor(in_shape), factor(out_shape)
    channel, pixel = np.divmod(np.asarray(pattern.row_of_entries(), np.int64), in_pixels)
    out_channel, out_pixel = np.divmod(np.asarray(pattern.indices, np.int64), out_pixels)
    members = in_channels * out_channels
    entries = np.sort((pixel * out_pixels + out_pixel) * members + channel * out_channels + out_channel)
    pairs, owner = _runs(entries // members)
    group, first = _equal_sets(owner, entries % members, len(pairs))
    is_first = np.zeros(len(pairs), dtype=bool)
    is_first[first] = True
    chosen = is_first[owner]
    masks = np.zeros((len(first), members), dtype=bool)
    masks[group[owner[chosen]], entries[chosen] % members] = True
    return _pixel_pairs(pairs // out_pixels, pairs % out_pixels, group,
                        masks.reshape(len(first), in_channels, out_channels), (in_pixels, out_pixels))


def _channelwise(layer: Layer, in_shape: Shape, out_shape: Shape) -> Structure:
    """A channel-wise layer's structure: its one-channel pattern's, each mask ``eye(C)``."""
    one = pattern_structure(layer.pattern((1,) + tuple(in_shape[1:])), (1,) + tuple(in_shape[1:]),
                            (1,) + tuple(out_shape[1:]))
    eye = np.eye(int(in_shape[0]), dtype=bool)
    return Structure(one.row_class, one.col_class, one.rows, one.cols, one.mask,
                     np.broadcast_to(eye, (len(one.masks),) + eye.shape))


def layer_structure(layer: Layer, in_shape: Shape, out_shape: Shape) -> Structure | None:
    """``layer``'s JT structure from ``in_shape`` to ``out_shape``; None for the identity (a diagonal
    layer that keeps the layout)."""
    if layer.jacobian_kind == "diagonal" and factor(in_shape) == factor(out_shape):
        return None
    if type(layer) is Conv2d:
        return conv_structure(layer, in_shape)
    if isinstance(layer, CHANNELWISE) and len(in_shape) > 1:
        return _channelwise(layer, in_shape, out_shape)
    jt_structure = getattr(layer, "jt_structure", None)  # a block: its union's, counted the same way
    if jt_structure is not None:
        return jt_structure(in_shape)
    return pattern_structure(layer.pattern(in_shape), in_shape, out_shape)


# --- products and unions -------------------------------------------------------------------------------
def _mask_products(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``left[i] @ right[i] > 0`` for boolean mask stacks: a full mask's product is the other's rows
    (columns) OR-ed, the others batched float32 GEMMs."""
    count, rows, inner = left.shape
    cols = right.shape[2]
    out = np.empty((count, rows, cols), dtype=bool)
    left_full = left.reshape(count, rows * inner).all(axis=1)
    right_full = right.reshape(count, inner * cols).all(axis=1) & ~left_full
    out[left_full] = right[left_full].any(axis=1)[:, None, :]
    out[right_full] = left[right_full].any(axis=2)[:, :, None]
    general = np.flatnonzero(~(left_full | right_full))
    step = max(1, PRODUCT_CHUNK // (4 * (rows * inner + inner * cols + rows * cols)))
    for start in range(0, len(general), step):
        part = general[start:start + step]
        out[part] = np.matmul(left[part].astype(np.float32), right[part].astype(np.float32)) > 0
    return out


def _multiply_adds(a: Structure, b: Structure, via_a: np.ndarray, via_b: np.ndarray,
                   links: np.ndarray) -> int:
    """``Σ_k nnzcol_A(k) · nnzrow_B(k)`` over the middle entries ``k = (d, r)``: per link ``(β, α')`` of
    ``links`` middle pixels, every pair of ``a`` in column class ``β`` (``|α|`` pixels, mask ``m``)
    times every pair of ``b`` in row class ``α'`` (``|γ|`` pixels, mask ``n``) times the channels they
    meet through, ``Σ_d colsum(m)[d] · rowsum(n)[d]``."""
    a_masks, b_masks = max(len(a.masks), 1), max(len(b.masks), 1)
    a_keys, a_weight = _summed(a.cols * a_masks + a.mask, a.row_sizes[a.rows])
    b_keys, b_weight = _summed(b.rows * b_masks + b.mask, b.col_sizes[b.cols])
    a_line, a_mask = np.divmod(a_keys, a_masks)
    b_line, b_mask = np.divmod(b_keys, b_masks)
    link, a_index = _matches(via_a, a_line, a.classes[1])
    at, b_index = _matches(via_b[link], b_line, b.classes[0])
    a_index = a_index[at]
    combos, totals = _summed(a_mask[a_index] * b_masks + b_mask[b_index],
                             links[link[at]] * a_weight[a_index] * b_weight[b_index])
    channels = (a.masks[combos // b_masks].sum(axis=1, dtype=np.int64)
                * b.masks[combos % b_masks].sum(axis=2, dtype=np.int64)).sum(axis=1)
    return sum(map(operator.mul, totals.tolist(), channels.tolist()))


def multiply(a: Structure, b: Structure) -> tuple[Structure, int]:
    """The structure of ``A @ B`` (the boolean product, as the symbolic one) and its multiply-adds.

    Examples
    --------
    >>> from sparse_scan.layers import Conv2d
    >>> first, second = Conv2d(2, 3, 3, padding=1, rng=0), Conv2d(3, 1, 1, rng=1)
    >>> product, multiply_adds = multiply(conv_structure(first, (2, 4, 4)), conv_structure(second, (3, 4, 4)))
    >>> product.nnz, multiply_adds   # 2 x 1 channels of the 3x3 reach of 16 pixels; 3 per entry
    (200, 600)
    """
    a_cols, b_rows = a.classes[1], b.classes[0]
    keys, link_of = _ranked(a.col_class * b_rows + b.row_class)
    via_a, via_b = np.divmod(keys, b_rows)
    links = np.bincount(link_of, minlength=len(keys))
    multiply_adds = _multiply_adds(a, b, via_a, via_b, links)
    if a_cols <= b_rows:  # b's rows OR-ed into a's column classes
        link, pair = _matches(via_b, b.rows, b_rows)
        left = a
        right = _built(a.col_class, b.col_class, via_a[link], b.cols[pair], b.mask[pair], b.masks,
                       merge=False)
    else:  # a's columns OR-ed into b's row classes
        pair, link = _matches(a.cols, via_a, a_cols)
        left = _built(a.row_class, b.row_class, a.rows[pair], via_b[link], a.mask[pair], a.masks, merge=False)
        right = b
    left_pair, right_pair = _matches(left.cols, right.rows, left.classes[1])
    count = max(len(right.masks), 1)
    combos, items = _ranked(left.mask[left_pair] * count + right.mask[right_pair])
    products = _mask_products(left.masks[combos // count], right.masks[combos % count])
    return _built(a.row_class, b.col_class, left.rows[left_pair], right.cols[right_pair], items,
                  products), multiply_adds


def _refined(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The common refinement of two classings of the same pixels: every pixel's class in it, and each
    refined class's class in ``first`` and in ``second``."""
    width = int(second.max()) + 1
    keys, refined = _ranked(first * width + second)
    return refined, keys // width, keys % width


def _lifted(structure: Structure, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, ...]:
    """``structure``'s pairs on refined classes (``rows[ρ]``, ``cols[σ]``: the class each refined one
    lies in): refined rows, refined columns and masks."""
    pair, row = _matches(structure.rows, rows, structure.classes[0])
    at, col = _matches(structure.cols[pair], cols, structure.classes[1])
    return row[at], col, structure.mask[pair[at]]


def _covers(big: Structure, small: Structure, rows: tuple[np.ndarray, np.ndarray],
            cols: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether ``big`` holds every entry of ``small`` (``rows``, ``cols``: the refined classes' classes in
    ``small`` and in ``big``), lifting only ``small``'s pairs."""
    refined_rows, refined_cols, mask = _lifted(small, rows[0], cols[0])
    keys = big.rows * big.classes[1] + big.cols
    wanted = rows[1][refined_rows] * big.classes[1] + cols[1][refined_cols]
    found = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
    if not len(keys) or not np.array_equal(keys[found], wanted):
        return not len(wanted)
    combos = np.unique(mask * len(big.masks) + big.mask[found])
    return not np.any(small.masks[combos // len(big.masks)] & ~big.masks[combos % len(big.masks)])


def union(a: Structure, b: Structure) -> Structure:
    """The structure of the union of two patterns of one shape: the one that covers the other (checked
    by lifting the other's pairs onto the common refinement of their classes), else both lifted."""
    row_class, rows_a, rows_b = _refined(a.row_class, b.row_class)
    col_class, cols_a, cols_b = _refined(a.col_class, b.col_class)

    def lifting(structure: Structure, rows: np.ndarray, cols: np.ndarray) -> int:
        return int((np.bincount(rows)[structure.rows] * np.bincount(cols)[structure.cols]).sum())

    if lifting(a, rows_a, cols_a) > lifting(b, rows_b, cols_b):
        a, b, rows_a, rows_b, cols_a, cols_b = b, a, rows_b, rows_a, cols_b, cols_a
    if _covers(b, a, (rows_a, rows_b), (cols_a, cols_b)):
        return b
    if _covers(a, b, (rows_b, rows_a), (cols_b, cols_a)):
        return a
    a_rows, a_cols, a_mask = _lifted(a, rows_a, cols_a)
    b_rows, b_cols, b_mask = _lifted(b, rows_b, cols_b)
    return _built(row_class, col_class, np.concatenate((a_rows, b_rows)), np.concatenate((a_cols, b_cols)),
                  np.concatenate((a_mask, b_mask + len(a.masks))), np.concatenate((a.masks, b.masks)))


def _broadcast(column_map: ColumnMap) -> Structure:
    """A broadcast's own structure ``E``: each of the branch's positions to every one of the block's
    that repeats it (the branch's pixel classes on both sides; the channels' ``eye`` or, a broadcast
    channel, a row of ones)."""
    shape, out_shape = column_map.shape, column_map.out_shape
    channels, pixels = factor(shape)
    out_channels, out_pixels = factor(out_shape)
    pixel_shape = shape[1:] if len(shape) > 1 else shape
    source = np.broadcast_to(np.arange(pixels, dtype=np.int64).reshape(pixel_shape),
                             out_shape[1:] if len(shape) > 1 else out_shape).ravel()
    every = np.arange(pixels, dtype=np.int64)
    mask = (np.eye(channels, dtype=bool) if channels == out_channels
            else np.ones((1, out_channels), dtype=bool))
    return Structure(every, source.copy(), every, every, np.zeros(pixels, dtype=np.int64), mask[None])


def _mapped(structure: Structure, column_map: ColumnMap) -> Structure:
    """A branch term's structure ``JT_i M_i`` (:class:`~sparse_scan.layers._joins.ColumnMap`)."""
    if column_map.kind == "identity":
        return structure
    if column_map.kind == "broadcast":
        return multiply(structure, _broadcast(column_map))[0]
    channels, pixels = factor(column_map.out_shape)
    if len(column_map.out_shape) > 1:  # a concatenation's channels: the masks placed at their offset
        start = column_map.offset // pixels
        masks = np.zeros(structure.masks.shape[:2] + (channels,), dtype=bool)
        masks[:, :, start:start + structure.masks.shape[2]] = structure.masks
        return Structure(structure.row_class, structure.col_class, structure.rows, structure.cols,
                         structure.mask, masks)
    # flat: the offset is in pixels; the block's other pixels form a class with no pairs
    outside = structure.classes[1]
    col_class = np.full(pixels, outside, dtype=np.int64)
    col_class[column_map.offset:column_map.offset + column_map.size] = structure.col_class
    return Structure(structure.row_class, _ranked(col_class)[1], structure.rows, structure.cols,
                     structure.mask, structure.masks)


# --- chains and blocks ---------------------------------------------------------------------------------
def chain_counts(layers: Sequence[Layer], shapes: Sequence[Shape]) -> tuple[Structure | None, int]:
    """The structure of a chain's JT product (None: the identity, a chain of diagonals that keep the
    layout) and its steps' FLOPs as :meth:`~sparse_scan.layers._block.ChainProduct.plan` plans them: a
    diagonal on the right scales the columns (one FLOP per entry of the product so far), on the left
    the rows (one per entry of the layer's), two others multiply (two per multiply-add)."""
    product = layer_structure(layers[0], shapes[0], shapes[1])
    diagonal, flops = layers[0].jacobian_kind == "diagonal", 0
    for layer, in_shape, out_shape in zip(layers[1:], shapes[1:-1], shapes[2:], strict=True):
        this = layer_structure(layer, in_shape, out_shape)
        if layer.jacobian_kind == "diagonal":
            flops += math.prod(in_shape) if product is None else product.nnz
        elif diagonal:
            flops += this.nnz
        if this is not None:
            product, multiply_adds = (this, 0) if product is None else multiply(product, this)
            flops += 0 if diagonal or layer.jacobian_kind == "diagonal" else 2 * multiply_adds
        diagonal = diagonal and layer.jacobian_kind == "diagonal"
    return product, flops


def block_counts(join: str, branches: Sequence[Sequence[Layer]], shapes: Sequence[Sequence[Shape]],
                 maps: Sequence[ColumnMap]) -> BlockCounts:
    """A block's :class:`BlockCounts`, its branches' layers taking ``shapes`` (per branch, input first,
    output last), each branch's output placed in the block's by ``maps``."""
    terms, flops = [], 0
    for chain, chain_shapes, column_map in zip(branches, shapes, maps, strict=True):
        product, chain_flops = chain_counts(chain, chain_shapes) if chain else (None, 0)
        flops += chain_flops
        terms.append(_mapped(identity(chain_shapes[0]) if product is None else product, column_map))
    whole = functools.reduce(union, terms)
    return BlockCounts(whole.nnz, flops + fill_flops(join, [term.nnz for term in terms]), whole)
