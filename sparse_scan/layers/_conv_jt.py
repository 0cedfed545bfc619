"""A convolution's transposed Jacobian: its pattern and its values, on the host and on the GPU.

The transposed Jacobian has one row per input element ``(ci, ih, iw)`` and one column per output
element ``(co, oh, ow)``. Entry ``(ci, ih, iw) -> (co, oh, ow)`` exists when ``co`` is in ``ci``'s group
and the input pixel is tapped by kernel offset ``(kh, kw)`` of that output pixel; its value is
``weight[co, ci % cin_per_group, kh, kw]``. The offset is unique (``kh = (ih + pad_top - oh*stride)/
dilation``), so every entry is one weight and the values are sample-independent.

Along each axis, the taps of an input position depend only on its position class (border, or the
stride's residue in the interior). The host's pattern and values fill exploit that (a fill plan per
geometry): the rows of one class pair hold the same weights in the same order and lie at affine
offsets, so each class pair is one strided block copy instead of an ``nnz``-long gather. On the GPU,
``rawkernels/conv.cu`` computes every entry from the geometry. :func:`structural_pattern`,
:func:`fill_plan` and :func:`fill_values` are the dispatch (:func:`sparse_scan.backend.twin`);
:class:`~sparse_scan.layers.Conv2d` calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _gpu_kernels
from .. import backend as _backend
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._geometry import ConvGeometry

__all__ = ["axis_taps", "fill_plan", "fill_values", "inside_taps", "structural_pattern"]

KERNEL_FILE = "conv.cu"


def axis_taps(size: int, kernel: int, stride: int, pad_lo: int, dilation: int,
              out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kernel offsets and output positions reaching each input position along one axis.

    Returns
    -------
    offsets, outputs : ndarray, shape (size, kernel)
        Row ``i`` lists the taps of input position ``i`` in increasing output position (decreasing
        kernel offset), valid taps first; invalid slots hold -1.
    counts : ndarray, shape (size,)
        Number of valid taps per position.
    """
    i = np.arange(size)[:, None]
    k = np.arange(kernel - 1, -1, -1)[None, :]  # decreasing offset = increasing output
    numerator = i + pad_lo - k * dilation
    out = numerator // stride
    valid = (numerator % stride == 0) & (out >= 0) & (out < out_size)
    order = np.argsort(~valid, axis=1, kind="stable")  # valid first, order kept
    offsets = np.where(valid, np.broadcast_to(k, valid.shape), -1)
    outputs = np.where(valid, out, -1)
    take = np.take_along_axis
    return take(offsets, order, 1), take(outputs, order, 1), valid.sum(axis=1)


# --- host twins --------------------------------------------------------------------------------
def inside_taps(size: int, out_size: int, kernel: int, stride: int, pad_lo: int,
                 dilation: int) -> np.ndarray:
    """Per kernel offset along one axis, how many output positions read an input position (not the
    padding) through it."""
    positions = (np.arange(out_size)[None, :] * stride - pad_lo
                 + np.arange(kernel)[:, None] * dilation)
    return ((positions >= 0) & (positions < size)).sum(axis=1)


def _taps(g: ConvGeometry) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    rows = axis_taps(g.height, g.kernel[0], g.stride[0], g.pad_top, g.dilation[0], g.out_height)
    cols = axis_taps(g.width, g.kernel[1], g.stride[1], g.pad_left, g.dilation[1], g.out_width)
    return rows, cols


def _row_counts(g: ConvGeometry) -> np.ndarray:
    (_, _, count_h), (_, _, count_w) = _taps(g)
    per_pixel = g.cout_per_group * count_h[:, None] * count_w[None, :]
    return np.broadcast_to(per_pixel, (g.in_channels, g.height, g.width)).ravel()


def _structural_pattern_cpu(be: _backend.Backend, g: ConvGeometry,
                            index_dtype: Any) -> tuple[Pattern, np.ndarray]:
    """Pattern and ``widx`` by strided block writes, one per (row class, column class) run."""
    counts = _row_counts(g)
    nnz = int(counts.sum())
    dtype = choose_index_dtype(nnz, g.shape[1], index_dtype)
    indptr = np.zeros(g.shape[0] + 1, dtype=dtype)
    np.cumsum(counts, out=indptr[1:])
    blocks, weight_index, column_template = _fill_plan_cpu(be, g, indptr)
    weight_index, column_template = weight_index.astype(dtype), column_template.astype(dtype)
    indices = np.empty(nnz, dtype=dtype)
    widx = np.empty(nnz, dtype=dtype)
    for block in blocks:
        channels, h_len, w_len, length = block.shape
        span = slice(block.template_start, block.template_start + channels * length)
        steps = (np.arange(h_len, dtype=dtype)[:, None] * dtype.type(block.column_steps[0])
                 + np.arange(w_len, dtype=dtype)[None, :] * dtype.type(block.column_steps[1]))
        np.add(column_template[span].reshape(channels, 1, 1, length), steps[None, :, :, None],
               out=_block_view(indices, block))
        _block_view(widx, block)[...] = weight_index[span].reshape(channels, 1, 1, length)
    return Pattern(indptr, indices, g.shape), widx


@dataclass(frozen=True)
class AxisRun:
    """Input positions along one axis with the same taps, at arithmetic positions and row offsets."""

    taps: np.ndarray
    outputs: np.ndarray
    offset: int
    offset_step: int
    position_step: int
    length: int


def _axis_runs(taps: np.ndarray, outputs: np.ndarray, counts: np.ndarray,
               row_offsets: np.ndarray) -> list[AxisRun]:
    """Group one axis's positions by tap class, split into runs arithmetic in position and offset."""
    runs = []
    classes: dict[bytes, list[int]] = {}
    for position, row in enumerate(taps):
        classes.setdefault(row.tobytes(), []).append(position)
    for positions in classes.values():
        offsets = row_offsets[positions]
        start = 0
        while start < len(positions):
            stop = start + 1
            step = int(offsets[stop] - offsets[start]) if stop < len(positions) else 0
            pos_step = positions[stop] - positions[start] if stop < len(positions) else 0
            while (stop < len(positions) and offsets[stop] - offsets[stop - 1] == step
                   and positions[stop] - positions[stop - 1] == pos_step):
                stop += 1
            first, count = positions[start], int(counts[positions[start]])
            runs.append(AxisRun(taps[first, :count], outputs[first, :count], int(offsets[start]),
                                step, pos_step, stop - start))
            start = stop
    return runs


@dataclass(frozen=True)
class FillBlock:
    """One strided block of the CSR arrays: the rows of one (row-class run, column-class run) pair.

    Entries ``[start + ci*s0 + p*s1 + q*s2 + e]`` for ``shape = (channels, p, q, e)``; every channel's
    rows share a template of ``e`` entries, whose columns advance by ``column_steps`` per (p, q).
    """

    start: int
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]
    template_start: int
    column_steps: tuple[int, int]


def _block_view(array: np.ndarray, block: FillBlock) -> np.ndarray:
    item = array.itemsize
    return np.lib.stride_tricks.as_strided(
        array[block.start:], shape=block.shape, strides=tuple(s * item for s in block.strides))


def _fill_plan_cpu(be: _backend.Backend, g: ConvGeometry,
                   indptr: np.ndarray) -> tuple[list[FillBlock], np.ndarray, np.ndarray]:
    """Blocks of the structured fills, with the weight index and columns of every block's template.

    Row ``(ci, ih, iw)`` starts at ``ci * channel_len + h_offset[ih] + cout * nh(ih) * w_offset[iw]``;
    within one class pair and arithmetic run that is affine in ``(ci, ih, iw)``; every row of channel
    ``ci`` holds the weights ``weight[co, ci, taps_h][..., taps_w]``, and its columns shift by a
    constant per step of the run.
    """
    (kh, oh, count_h), (kw, ow, count_w) = _taps(g)
    channel_len = int(indptr[g.height * g.width])
    h_offsets = np.concatenate(([0], np.cumsum(g.cout_per_group * count_h * count_w.sum())))[:-1]
    w_offsets = np.concatenate(([0], np.cumsum(count_w)))[:-1]
    ci = np.arange(g.in_channels)[:, None, None, None]
    co = (ci // g.cin_per_group) * g.cout_per_group + np.arange(g.cout_per_group)[:, None, None]
    blocks, weight_index, columns, template_start = [], [], [], 0
    for run_h in _axis_runs(kh, oh, count_h, h_offsets):
        row_scale = g.cout_per_group * len(run_h.taps)
        for run_w in _axis_runs(kw, ow, count_w, w_offsets):
            if len(run_h.taps) == 0 or len(run_w.taps) == 0:
                continue
            taps = run_h.taps[:, None] * g.kernel[1] + run_w.taps[None, :]
            flat = ((co * g.cin_per_group + ci % g.cin_per_group) * g.kernel[0] * g.kernel[1]
                    + taps[None, None]).reshape(g.in_channels, -1)
            cols = ((co * g.out_height + run_h.outputs[:, None]) * g.out_width
                    + run_w.outputs[None, :]).reshape(g.in_channels, -1)
            blocks.append(FillBlock(
                start=run_h.offset + row_scale * run_w.offset,
                shape=(g.in_channels, run_h.length, run_w.length, flat.shape[1]),
                strides=(channel_len, run_h.offset_step, row_scale * run_w.offset_step, 1),
                template_start=template_start,
                column_steps=(run_h.position_step // g.stride[0] * g.out_width,
                              run_w.position_step // g.stride[1]),
            ))
            weight_index.append(flat.ravel())
            columns.append(cols.ravel())
            template_start += flat.size
    if not blocks:
        empty = np.zeros(0, np.int64)
        return blocks, empty, empty
    return blocks, np.concatenate(weight_index), np.concatenate(columns)


def _fill_values_cpu(be: _backend.Backend, g: ConvGeometry, pattern: Pattern, aux: dict[str, Any],
                     weight: np.ndarray) -> np.ndarray:
    """Structured fill: gather the small templates, then one strided block copy per block."""
    blocks, weight_index, _ = aux["fill_plan"]
    templates = weight.ravel()[weight_index]
    data = np.empty(pattern.nnz, dtype=weight.dtype)
    for block in blocks:
        channels, _, _, length = block.shape
        span = slice(block.template_start, block.template_start + channels * length)
        _block_view(data, block)[...] = templates[span].reshape(channels, 1, 1, length)
    return data


# --- GPU twins ---------------------------------------------------------------------------------
def _structural_pattern_gpu(be: _backend.Backend, g: ConvGeometry, index_dtype: Any) -> tuple[Pattern, Array]:
    cp = be.xp
    rows, cols = g.shape
    host_counts = _row_counts(g)  # analytic, tiny host work
    nnz = int(host_counts.sum())
    counts = cp.asarray(host_counts)
    dtype = choose_index_dtype(nnz, cols, index_dtype)
    indptr = cp.zeros(rows + 1, dtype=dtype)
    cp.cumsum(counts, out=indptr[1:])
    indices = cp.empty(nnz, dtype=dtype)
    widx = cp.empty(nnz, dtype=dtype)
    kernel = _gpu_kernels.function(KERNEL_FILE, "conv_jt_fill_pattern", dtype)
    _gpu_kernels.launch(kernel, rows * g.cout_per_group, g.kernel_args() + (indptr, indices, widx))
    return Pattern(indptr, indices, g.shape), widx


def _fill_values_gpu(be: _backend.Backend, g: ConvGeometry, pattern: Pattern, aux: dict[str, Any],
                     weight: Array) -> Array:
    data = be.xp.empty(pattern.nnz, dtype=weight.dtype)
    kernel = _gpu_kernels.function(KERNEL_FILE, "conv_jt_fill_values", pattern.index_dtype, weight.dtype)
    _gpu_kernels.launch(kernel, g.shape[0] * g.cout_per_group,
                    g.kernel_args() + (pattern.indptr, be.xp.ascontiguousarray(weight), data))
    return data


structural_pattern = _backend.twin(cpu=_structural_pattern_cpu, gpu=_structural_pattern_gpu)
fill_values = _backend.twin(cpu=_fill_values_cpu, gpu=_fill_values_gpu)
# The GPU kernel computes every entry from the geometry: it needs no fill plan.
fill_plan = _backend.twin(cpu=_fill_plan_cpu, gpu=lambda be, g, indptr: None)
