"""Dense channel blocks: products of convolution-like JTs as batched dense GEMMs.

A tensor ``(C, H, W)`` is flattened channel-major, so entry ``c * P + p`` is channel ``c`` of pixel
``p`` (``P = H * W``; a flat ``(F,)`` tensor is ``F`` channels of one pixel). An unpruned
convolution's transposed Jacobian links every input channel to every output channel of each pixel
pair it links at all: its pattern is a union of dense ``c_rows × c_cols`` blocks, one per pixel pair
of a much smaller *pixel pattern* (a linear layer's is a single block). Products of such operands
(and of their scalings by ReLU-like diagonals, which keep the pattern) are then block products:

    C(p, q) = sum over r of A(p, r) · B(r, q),        every term a dense c1×c2 by c2×c3 GEMM.

:func:`block_layout` recognises the layout of a pattern (``None`` when some block is not dense, e.g.
a pruned or grouped convolution: those products stay scalar), and :func:`plan_block_product` does the
symbolic work once: the pixel pattern of ``C``, its CSR pattern (explicit zeros included, equal to the
boolean product of the operands' patterns), and the pairs of blocks to multiply, grouped into *slots*
in which each ``C`` block appears once, and per ``C`` block the list of its pairs. The numeric phase
runs on the host as a compiled kernel (:func:`multiply_blocks_host`: the blocks read where they lie,
``C`` written in CSR order) and on the GPU as array operations (:func:`multiply_blocks`: gather the
operands' values into block arrays, one batched ``matmul`` per slot through cuBLAS, scatter back to
CSR order).

Examples
--------
>>> import numpy as np
>>> from sparse_scan.layers import Conv2d
>>> conv = Conv2d(4, 8, 3, padding=1, dtype=np.float64, rng=0)
>>> layout = block_layout(conv.pattern((4, 5, 5)), 4, 8)
>>> layout.channels, layout.pixels, layout.blocks
((4, 8), (25, 25), 169)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from .._host_kernels import launch, parts, rows2d
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._kernels import block_products

__all__ = ["BLOCK_COLUMNS", "BlockLayout", "BlockProduct", "block_layout", "multiply_blocks",
           "multiply_blocks_host", "plan_block_product"]

_LAYOUTS: "weakref.WeakKeyDictionary[Pattern, dict[tuple[int, int], BlockLayout | None]]" = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """A pattern seen as dense ``c_rows × c_cols`` blocks on a pixel pattern.

    Attributes
    ----------
    channels : tuple of int
        ``(c_rows, c_cols)``.
    pixels : tuple of int
        ``(p_rows, p_cols)``: the pixel pattern's shape.
    pixel_pattern : Pattern
        Which pixel pairs hold a block; block ``b`` is the ``b``-th entry of this CSR pattern.
    gather : ndarray, shape (blocks, c_rows, c_cols)
        The CSR entry of every block element: ``values[..., gather]`` are the blocks.
    """

    channels: tuple[int, int]
    pixels: tuple[int, int]
    pixel_pattern: Pattern
    gather: np.ndarray

    @property
    def blocks(self) -> int:
        """Number of dense blocks."""
        return self.pixel_pattern.nnz


def block_layout(pattern: Pattern, c_rows: int, c_cols: int) -> BlockLayout | None:
    """The dense-block layout of a host ``pattern`` with ``c_rows``/``c_cols`` channels, or None.

    Cached per pattern object and channel pair; costs ``O(nnz)`` the first time.
    """
    cache = _LAYOUTS.setdefault(pattern, {})
    key = (int(c_rows), int(c_cols))
    if key not in cache:
        cache[key] = _detect(pattern, *key)
    return cache[key]


def _detect(pattern: Pattern, c_rows: int, c_cols: int) -> BlockLayout | None:
    rows, cols = pattern.shape
    if c_rows <= 0 or c_cols <= 0 or rows % c_rows or cols % c_cols or pattern.nnz == 0:
        return None
    p_rows, p_cols = rows // c_rows, cols // c_cols
    entry_rows = np.asarray(pattern.row_of_entries(), dtype=np.int64)
    channel_r, pixel_r = np.divmod(entry_rows, p_rows)
    channel_c, pixel_c = np.divmod(np.asarray(pattern.indices, dtype=np.int64), p_cols)
    key = pixel_r * p_cols + pixel_c
    present = np.zeros(p_rows * p_cols, dtype=bool)
    present[key] = True
    blocks = int(present.sum())
    if pattern.nnz != blocks * c_rows * c_cols:
        return None  # some block is not dense (pruned, grouped, or not channel-structured)
    # entries are distinct (row, col) pairs, so nnz of them fill every (block, c_r, c_c) cell once
    block_of_key = np.cumsum(present) - 1
    dtype = choose_index_dtype(pattern.nnz, pattern.nnz)
    gather = np.empty((blocks, c_rows, c_cols), dtype=dtype)
    gather[block_of_key[key], channel_r, channel_c] = np.arange(pattern.nnz, dtype=dtype)
    present_keys = np.flatnonzero(present)
    pixel_dtype = choose_index_dtype(blocks, p_cols)
    indptr = np.zeros(p_rows + 1, dtype=pixel_dtype)
    np.cumsum(np.bincount(present_keys // p_cols, minlength=p_rows), out=indptr[1:])
    pixel_pattern = Pattern(indptr, (present_keys % p_cols).astype(pixel_dtype), (p_rows, p_cols))
    return BlockLayout((c_rows, c_cols), (p_rows, p_cols), pixel_pattern, gather)


@dataclass(frozen=True, eq=False)
class BlockProduct:
    """The symbolic part of a block product ``C = A @ B``.

    Attributes
    ----------
    a, b : BlockLayout
        The operands' layouts.
    out : Pattern
        ``C``'s CSR pattern (every block dense, channel-major like the operands).
    scatter : ndarray, shape (C blocks, c1, c3)
        The CSR entry of ``C`` of every block element.
    slots : list of (ndarray, ndarray, ndarray)
        ``(a_block, b_block, c_block)`` index arrays; within a slot every ``C`` block appears at most
        once, so a slot is one batched GEMM whose results add into distinct blocks.
    pair_starts : ndarray, shape (C blocks + 1,)
        ``C`` block ``c`` is the sum of the products of the pairs ``pair_starts[c]:pair_starts[c + 1]``.
    pair_a, pair_b : ndarray
        Every pair's ``a`` block and ``b`` block, grouped by ``C`` block (the pairs of the slots).
    b_block_rows : ndarray, shape (b blocks,)
        The pixel row of every ``b`` block.
    """

    a: BlockLayout
    b: BlockLayout
    out: Pattern
    scatter: np.ndarray
    slots: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    pair_starts: np.ndarray
    pair_a: np.ndarray
    pair_b: np.ndarray
    b_block_rows: np.ndarray

    @property
    def nbytes(self) -> int:
        """Index bytes held for the numeric phase (operand gathers, scatter, slots, pair lists,
        ``C``'s pattern)."""
        slots = sum(int(a.nbytes + b.nbytes + c.nbytes) for a, b, c in self.slots)
        pairs = int(self.pair_starts.nbytes + self.pair_a.nbytes + self.pair_b.nbytes
                    + self.b_block_rows.nbytes)
        return (self.out.nbytes + int(self.scatter.nbytes) + int(self.a.gather.nbytes)
                + int(self.b.gather.nbytes) + slots + pairs)


def _block_pairs(a: Pattern, b: Pattern) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair of an ``a`` entry and a ``b`` entry that meet: a entry, b entry, ``C`` key."""
    a_indptr = np.asarray(a.indptr, dtype=np.int64)
    b_indptr = np.asarray(b.indptr, dtype=np.int64)
    a_cols = np.asarray(a.indices, dtype=np.int64)
    a_rows = np.repeat(np.arange(a.shape[0]), np.diff(a_indptr))
    per_entry = b_indptr[a_cols + 1] - b_indptr[a_cols]
    a_entry = np.repeat(np.arange(a.nnz, dtype=np.int64), per_entry)
    first = np.repeat(b_indptr[a_cols], per_entry)
    within = np.arange(int(per_entry.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(per_entry) - per_entry, per_entry)
    b_entry = first + within
    keys = a_rows[a_entry] * b.shape[1] + np.asarray(b.indices, dtype=np.int64)[b_entry]
    return a_entry, b_entry, keys


def plan_block_product(a: BlockLayout, b: BlockLayout) -> BlockProduct:
    """Symbolic phase of a block product (host arrays); ``a.channels[1] == b.channels[0]``."""
    if a.channels[1] != b.channels[0] or a.pixels[1] != b.pixels[0]:
        raise ValueError(f"block layouts do not chain: {a.channels}/{a.pixels} by {b.channels}/{b.pixels}")
    (c1, _), (_, c3) = a.channels, b.channels
    p1, p3 = a.pixels[0], b.pixels[1]
    a_block, b_block, keys = _block_pairs(a.pixel_pattern, b.pixel_pattern)
    order = np.argsort(keys, kind="stable")
    a_block, b_block, keys = a_block[order], b_block[order], keys[order]
    new = np.concatenate(([True], keys[1:] != keys[:-1])) if keys.size else np.zeros(0, bool)
    c_block = np.cumsum(new) - 1
    c_keys = keys[new]
    slot = np.arange(keys.size) - np.flatnonzero(new)[c_block] if keys.size else keys
    # C's pixel pattern (blocks sorted by pixel row, then column) and its CSR pattern
    pixel_row, pixel_col = np.divmod(c_keys, p3)
    per_pixel_row = np.bincount(pixel_row, minlength=p1)
    pixel_start = np.cumsum(per_pixel_row) - per_pixel_row
    nnz = c_keys.size * c1 * c3
    dtype = choose_index_dtype(nnz, c3 * p3)
    row_length = np.tile(per_pixel_row * c3, c1)  # row i * p1 + r holds c3 columns per C block of r
    indptr = np.zeros(c1 * p1 + 1, dtype=np.int64)
    np.cumsum(row_length, out=indptr[1:])
    # block b, element (i, j) -> row i * p1 + r_b, position j * blocks_in_row(r_b) + rank of b there
    rank = np.arange(c_keys.size) - pixel_start[pixel_row]
    channel_in = np.arange(c1)[None, :, None]
    channel_out = np.arange(c3)[None, None, :]
    scatter = (indptr[channel_in * p1 + pixel_row[:, None, None]]
               + channel_out * per_pixel_row[pixel_row][:, None, None] + rank[:, None, None])
    indices = np.empty(nnz, dtype=dtype)
    columns = (channel_out * p3 + pixel_col[:, None, None]).repeat(c1, axis=1)
    indices[scatter.reshape(-1)] = columns.reshape(-1)
    out = Pattern(indptr.astype(dtype), indices, (c1 * p1, c3 * p3))
    index = choose_index_dtype(max(a.blocks, b.blocks, c_keys.size, keys.size), 0)
    slots = []
    for s in range(int(slot.max()) + 1 if slot.size else 0):
        chosen = slot == s
        slots.append((a_block[chosen].astype(index), b_block[chosen].astype(index),
                      c_block[chosen].astype(index)))
    pair_starts = np.append(np.flatnonzero(new), keys.size).astype(index)
    b_rows = b.pixel_pattern.row_of_entries().astype(b.pixel_pattern.indptr.dtype)
    return BlockProduct(a, b, out, scatter.astype(dtype), slots, pair_starts, a_block.astype(index),
                        b_block.astype(index), b_rows)


def multiply_blocks(plan: BlockProduct, a_data: Array, b_data: Array, xp: ModuleType = np,
                    scratch_bytes: int = 256 * 2**20) -> Array:
    """Numeric phase of a block product as array operations (the GPU's, through CuPy): values of
    ``C`` in ``plan.out``'s entry order.

    ``a_data``/``b_data`` are ``(nnz,)`` (shared by the batch) or ``(B, nnz)``; ``xp`` is the array
    module they live in (the plan's index arrays must live there too). The operands' blocks are
    gathered by ``take`` along the last axis (on the host several times faster than fancy indexing of
    a batch). Each slot's GEMM results are computed in chunks of at most ``scratch_bytes``.
    """
    a_blocks = xp.take(a_data, plan.a.gather, axis=-1)
    b_blocks = xp.take(b_data, plan.b.gather, axis=-1)
    lead = np.broadcast_shapes(a_data.shape[:-1], b_data.shape[:-1])
    (c1, c2), c3 = plan.a.channels, plan.b.channels[1]
    dtype = xp.result_type(a_data, b_data)
    c_blocks = xp.zeros(lead + (plan.scatter.shape[0], c1, c3), dtype=dtype)
    batch = int(np.prod(lead)) if lead else 1
    per_block = max(1, scratch_bytes // max(1, batch * (c1 * c2 + c2 * c3 + c1 * c3) * dtype.itemsize))
    for a_block, b_block, c_block in plan.slots:
        for start in range(0, a_block.shape[0], per_block):
            piece = slice(start, start + per_block)
            c_blocks[..., c_block[piece], :, :] += xp.matmul(a_blocks[..., a_block[piece], :, :],
                                                             b_blocks[..., b_block[piece], :, :])
    out = xp.empty(lead + (plan.out.nnz,), dtype=dtype)
    out[..., plan.scatter.reshape(-1)] = c_blocks.reshape(lead + (-1,))
    return out


BLOCK_COLUMNS = 128
"""Columns of a ``C`` block computed at a time by :func:`multiply_blocks_host`: its accumulator is
``c1 × 128`` at most, and each pass over a ``B`` tile reads ``c2 × 128`` of it."""


def multiply_blocks_host(plan: BlockProduct, a_data: np.ndarray, b_data: np.ndarray,
                         workers: int = 1) -> np.ndarray:
    """Numeric phase of a block product on the host: values of ``C`` in ``plan.out``'s entry order.

    ``a_data``/``b_data`` are ``(nnz,)`` (shared by the batch) or ``(B, nnz)``; the result is
    ``(nnz_C,)`` when both are shared, else ``(B, nnz_C)``, in their result dtype. Compiled
    (:func:`sparse_scan.engine._kernels.block_products`): every ``C`` block summed over its pairs and
    written in CSR order, with no scatter pass. Each thread copies the operands' blocks it needs into
    contiguous tiles as it first meets them (``nnz_A + nnz_B`` values per thread, reused sample after
    sample; once for all samples for a shared operand). ``workers`` threads take one run of samples
    each, or, with fewer samples than threads, runs of ``C`` blocks of about equal pairs.
    """
    dtype = np.result_type(a_data, b_data)
    lead = np.broadcast_shapes(a_data.shape[:-1], b_data.shape[:-1])
    out = np.empty(lead + (plan.out.nnz,), dtype=dtype)
    rows = out.reshape(-1, plan.out.nnz)
    batch, count = rows.shape[0], plan.pair_starts.size - 1
    pieces = parts(batch, count, workers)
    if len(pieces) > 1 and batch < len(pieces):  # cut C blocks by pairs, not by blocks
        starts = plan.pair_starts
        targets = np.linspace(0, int(starts[-1]), len(pieces) + 1)[1:-1].astype(starts.dtype)
        cuts = np.concatenate(([0], np.searchsorted(starts, targets), [count])).astype(np.int64)
        pieces = [(0, batch, int(c0), int(c1)) for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True)
                  if c1 > c0]
    if rows.size:
        launch(block_products,
               (rows2d(a_data, dtype), rows2d(b_data, dtype), plan.a.gather, plan.b.gather,
                plan.b.pixel_pattern.indptr, plan.b_block_rows, plan.pair_starts, plan.pair_a, plan.pair_b,
                plan.scatter, BLOCK_COLUMNS, rows), pieces)
    return out
