"""A convolution's columns (im2col: the input element each kernel tap of each output reads) and their
adjoint (col2im: taps added back into the input), on the host and on the GPU.

The forward is one GEMM per group over the batch's columns, and so is ``JT @ g`` through the weights
(the transposed convolution: a GEMM, then col2im). On the host both run compiled
(:mod:`sparse_scan.layers._kernels`: :func:`~sparse_scan.layers._kernels.im2col`,
:func:`~sparse_scan.layers._kernels.col2im`, :func:`~sparse_scan.layers._kernels.col2im_pairs`), runs
of channels or planes per core; on the GPU as CuPy expressions. The two give equal arrays (col2im sums
in the same order). :func:`im2col` and :func:`col2im` are the dispatch.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import backend as _backend
from .._host_kernels import launch
from .._threads import even_parts, workers_for
from .._types import Array
from . import _kernels
from ._geometry import ConvGeometry

__all__ = ["COL2IM_ROWS_MIN_WIDTH", "col2im", "im2col"]


def _window_tuple(g: ConvGeometry) -> tuple[int, ...]:
    """The compiled kernels' geometry: ``(C, H, W, Ho, Wo, kh, kw, sh, sw, pt, pl, dh, dw)``."""
    return (g.in_channels, g.height, g.width, g.out_height, g.out_width, *g.kernel, *g.stride,
            g.pad_top, g.pad_left, *g.dilation)


def _host_pieces(count: int, values: int) -> list[tuple[int, int]]:
    """Runs of ``count`` planes or channels for a kernel writing ``values`` values: one per core from
    :data:`~sparse_scan._threads.THREAD_MIN_VALUES` (:func:`~sparse_scan._threads.workers_for`)."""
    return even_parts(count, workers_for(values))


def _im2col_cpu(be: _backend.Backend, x: np.ndarray, g: ConvGeometry, pads: tuple[int, ...]) -> np.ndarray:
    """Compiled (:func:`sparse_scan.layers._kernels.im2col`): one pass, no padded copy."""
    (kh, kw), batch = g.kernel, x.shape[0]
    columns = np.empty((g.in_channels * kh * kw, batch, g.out_height, g.out_width), dtype=x.dtype)
    launch(_kernels.im2col, (np.ascontiguousarray(x), _window_tuple(g), columns),
           _host_pieces(g.in_channels, columns.size))
    return columns.reshape(g.groups, g.cin_per_group * kh * kw, batch * g.out_height * g.out_width)


def _im2col_gpu(be: _backend.Backend, x: Array, g: ConvGeometry, pads: tuple[int, ...]) -> Array:
    """CuPy: the padded input, then one strided copy per kernel offset."""
    xp = be.xp
    top, bottom, left, right = pads
    batch = x.shape[0]
    padded = xp.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    channels = (padded.reshape(batch, g.groups, g.cin_per_group, *padded.shape[2:])
                .transpose(1, 2, 0, 3, 4))
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.stride, g.dilation
    rows, cols = (g.out_height - 1) * sh + 1, (g.out_width - 1) * sw + 1
    columns = xp.empty((g.groups, g.cin_per_group, kh, kw, batch, g.out_height, g.out_width),
                       dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            columns[:, :, i, j] = channels[..., i * dh:i * dh + rows:sh, j * dw:j * dw + cols:sw]
    return columns.reshape(g.groups, g.cin_per_group * kh * kw, batch * g.out_height * g.out_width)


def _col2im_cpu(be: _backend.Backend, taps: np.ndarray, g: ConvGeometry, pads: tuple[int, ...],
                batch: int) -> np.ndarray:
    """Compiled (:func:`sparse_scan.layers._kernels.col2im`): every input plane summed in one pass,
    in the CuPy twin's order (equal bit for bit)."""
    (kh, kw) = g.kernel
    taps = np.ascontiguousarray(taps).reshape(g.in_channels * kh * kw, batch, g.out_height, g.out_width)
    out = np.empty((batch, g.in_channels, g.height, g.width), dtype=taps.dtype)
    pieces = _host_pieces(batch * g.in_channels, out.size)
    if g.out_width < COL2IM_ROWS_MIN_WIDTH:
        launch(_kernels.col2im_pairs, (taps, *_col2im_pairs(_window_tuple(g), batch), out), pieces)
    else:
        launch(_kernels.col2im, (taps, _window_tuple(g), out), pieces)
    return out.reshape(batch, -1)


COL2IM_ROWS_MIN_WIDTH = 8
"""Output planes at least this wide take :func:`sparse_scan.layers._kernels.col2im` (a loop per row of
taps), narrower ones :func:`~sparse_scan.layers._kernels.col2im_pairs` (one table of the plane's
(tap, input) pairs). VGG-11's 3x3 convolutions at batch 4 and 16, ns per tap and thread, rows / pairs
(2 cores, one run): 2x2 planes 8.3-9.2 / 1.7-1.9, 4x4 1.9-5.5 / 1.1-2.8, 8x8 1.2-2.5 / 1.5-2.4, 16x16
0.9-1.2 / 1.1-1.9, 32x32 0.6-0.7 / 1.8 (the pairs' gathers cost more than long rows' loop)."""


@functools.lru_cache(maxsize=64)
def _col2im_pairs(window: tuple[int, ...], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sparse_scan.layers._kernels.col2im_pairs`' table of a geometry (:func:`_window_tuple`)
    and batch: per tap ``(i, j)`` in order, the flat offsets of its outputs inside the input, from the
    plane's first tap (``sources``), and of the input elements they fall on (``targets``)."""
    _, height, width, out_height, out_width, kh, kw, sh, sw, pt, pl, dh, dw = window
    rows, cols = np.meshgrid(np.arange(out_height), np.arange(out_width), indexing="ij")
    sources, targets = [], []
    for i in range(kh):
        for j in range(kw):
            in_rows, in_cols = rows * sh - pt + i * dh, cols * sw - pl + j * dw
            inside = (in_rows >= 0) & (in_rows < height) & (in_cols >= 0) & (in_cols < width)
            sources.append((i * kw + j) * batch * out_height * out_width + (rows * out_width + cols)[inside])
            targets.append((in_rows * width + in_cols)[inside])
    table = np.concatenate(sources), np.concatenate(targets)
    for array in table:
        array.flags.writeable = False
    return table


def _col2im_gpu(be: _backend.Backend, taps: Array, g: ConvGeometry, pads: tuple[int, ...],
                batch: int) -> Array:
    """CuPy: the taps added into the padded input at their strided positions, offset by offset; then
    the padding is cropped."""
    xp = be.xp
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.stride, g.dilation
    taps = taps.reshape(g.groups, g.cin_per_group, kh, kw, batch, g.out_height, g.out_width)
    top, bottom, left, right = pads
    padded = xp.zeros((batch, g.groups, g.cin_per_group, g.height + top + bottom,
                       g.width + left + right), dtype=taps.dtype)
    rows, cols = (g.out_height - 1) * sh + 1, (g.out_width - 1) * sw + 1
    for i in range(kh):
        for j in range(kw):
            padded[..., i * dh:i * dh + rows:sh, j * dw:j * dw + cols:sw] += (
                taps[:, :, i, j].transpose(2, 0, 1, 3, 4))
    return padded[..., top:top + g.height, left:left + g.width].reshape(batch, -1)


im2col = _backend.twin(cpu=_im2col_cpu, gpu=_im2col_gpu)
col2im = _backend.twin(cpu=_col2im_cpu, gpu=_col2im_gpu)
