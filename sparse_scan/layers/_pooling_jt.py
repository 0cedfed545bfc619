"""A pooling layer's transposed Jacobian: its pattern and the max-pool's values, on the host and on the
GPU, and the 2x2 max-pool's ``JT(x) @ g`` from its input.

The transposed Jacobian of a pooling layer has one row per input element ``(c, ih, iw)`` and one column
per output element ``(c, oh, ow)`` (both C-order); its pattern holds every pair where the input lies in
the output's window (padding holds no input element, so it gives no entry). Overlapping windows put
several entries in a row. Besides the pattern, the layer keeps a ``slot`` table of shape
``(kh * kw, C * Ho * Wo)``: the entry position of window offset ``k = i * kw + j`` of output ``o``, or
``-1`` where that offset lies in the padding (or past the input, for ``ceil_mode``'s last windows).

The pattern and the max-pool values have a host twin (NumPy, and the compiled
:func:`~sparse_scan.layers._kernels.max_pool_2x2` and :func:`~sparse_scan.layers._kernels.max_pool_windows`,
runs of planes per core) and a CUDA twin (``rawkernels/pooling.cu``), dispatched through
:func:`sparse_scan.backend.twin` (:func:`pattern`, :func:`max_selection`, :func:`max_pool_operator`);
both give identical arrays. :class:`~sparse_scan.layers.MaxPool2d` and
:class:`~sparse_scan.layers.AvgPool2d` call them. The host's 2x2 max-pool forward is compiled here too
(:func:`max_pool_2x2_forward`), beside the kernels it shares its windows' rule with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _gpu_kernels
from .. import backend as _backend
from .._host_kernels import launch
from .._threads import even_parts, workers_for
from .._types import Array
from . import _kernels
from ._geometry import PoolGeometry, axis_grid

__all__ = ["MAX_POOL_CHUNK", "MAX_POOL_THREAD_MIN_VALUES", "max_pool_operator", "max_selection", "pattern",
           "two_by_two"]

KERNEL_FILE = "pooling.cu"


@dataclass(frozen=True)
class _AxisTaps:
    """The (input, output, offset) triples of one axis, sorted by input then output.

    ``rank`` is each triple's place among those of its input position; ``counts[p]`` is the number of
    windows holding input position ``p``.
    """

    position: np.ndarray
    output: np.ndarray
    offset: np.ndarray
    rank: np.ndarray
    counts: np.ndarray


def _axis_taps(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> _AxisTaps:
    """Group one axis's (input, output, offset) triples by input position, outputs increasing."""
    position, outputs, offset, valid = axis_grid(size, out, kernel, stride, pad, dilation)
    position, outputs, offset = position[valid], outputs[valid], offset[valid]
    order = np.lexsort((outputs, position))
    position, outputs, offset = position[order], outputs[order], offset[order]
    counts = np.bincount(position, minlength=size)
    starts = np.cumsum(counts) - counts
    rank = np.arange(position.size) - starts[position]
    return _AxisTaps(position, outputs, offset, rank, counts)


# --- pattern twins -------------------------------------------------------------------------------
def _pattern_cpu(be: _backend.Backend, g: PoolGeometry, dtype: np.dtype) -> tuple[Array, Array, Array]:
    """NumPy twin: ``(indptr, indices, slot)``, built for one channel and tiled over channels."""
    th, tw = _axis_taps(*g.axis(0)), _axis_taps(*g.axis(1))
    plane_in, plane_out = g.height * g.width, g.out_height * g.out_width
    row_counts = np.outer(th.counts, tw.counts).ravel()
    rowptr = np.zeros(plane_in + 1, dtype=np.int64)
    np.cumsum(row_counts, out=rowptr[1:])
    per_channel = int(rowptr[-1])
    # entry of (height tap a, width tap b): its row's start + a's rank * row width + b's rank
    rows = th.position[:, None] * g.width + tw.position[None, :]
    pos = rowptr[rows] + th.rank[:, None] * tw.counts[tw.position][None, :] + tw.rank[None, :]
    cols = th.output[:, None] * g.out_width + tw.output[None, :]
    indices = np.empty(per_channel, dtype=np.int64)
    indices[pos] = cols
    slot = np.full((g.offsets, plane_out), -1, dtype=np.int64)
    slot[th.offset[:, None] * g.kernel[1] + tw.offset[None, :], cols] = pos

    channel = np.arange(g.channels, dtype=dtype)[:, None]
    step_in, step_out = dtype.type(per_channel), dtype.type(plane_out)
    indptr = np.empty(g.inputs + 1, dtype=dtype)
    indptr[:-1] = (rowptr[:-1].astype(dtype)[None, :] + channel * step_in).ravel()
    indptr[-1] = g.channels * per_channel
    indices = (indices.astype(dtype)[None, :] + channel * step_out).ravel()
    slot = slot.astype(dtype)[:, None, :]
    slot = np.where(slot >= 0, slot + channel[None] * step_in, dtype.type(-1))
    return indptr, indices, slot.reshape(g.offsets, g.outputs)


def _pattern_gpu(be: _backend.Backend, g: PoolGeometry, dtype: np.dtype) -> tuple[Array, Array, Array]:
    """CUDA twin: per-row counts, CuPy cumsum, per-row fill of sorted indices and slots."""
    cp = be.xp
    geometry = cp.asarray(g.as_array())
    counts = cp.empty(g.inputs, dtype=dtype)
    _gpu_kernels.launch(_gpu_kernels.function(KERNEL_FILE, "pool_row_counts", dtype), g.inputs,
                    (geometry, counts))
    indptr = cp.zeros(g.inputs + 1, dtype=dtype)
    cp.cumsum(counts, dtype=dtype, out=indptr[1:])
    indices = cp.empty(g.nnz, dtype=dtype)
    slot = cp.full((g.offsets, g.outputs), -1, dtype=dtype)
    _gpu_kernels.launch(_gpu_kernels.function(KERNEL_FILE, "pool_fill", dtype), g.inputs,
                    (geometry, indptr, indices, slot))
    return indptr, indices, slot


pattern = _backend.twin(cpu=_pattern_cpu, gpu=_pattern_gpu)


# --- max-pool value twins ------------------------------------------------------------------------
MAX_POOL_CHUNK = 512
"""Pairs of inputs per pass of the compiled 2x2 kernel (its temporaries stay in L1). Measured on
VGG-11's pools at batch 16 (one thread): 256-1024 alike, within 5 %."""

MAX_POOL_THREAD_MIN_VALUES = 2**22
"""Max-pool values fills of at least this many values run one run of planes per core. Measured on
2 cores (2x2 windows, float32): two threads lose below (2M values: 0.67 ms on one, 0.72 ms on two;
1M: 0.36 and 0.42 ms) and win above (4M: 1.28 and 0.77 ms; 13M: 11.7 and 7.2 ms)."""


def _max_selection_cpu(be: _backend.Backend, x: np.ndarray, aux: dict[str, Any], nnz: int) -> np.ndarray:
    """CPU twin: 1 at each window's selected input (PyTorch's: the last NaN, else the first maximum).

    Compiled kernels over runs of (sample, channel) planes, one run per core from
    :data:`MAX_POOL_THREAD_MIN_VALUES` values. 2x2 windows of stride 2 (VGG's pools) run a
    vectorised kernel (:func:`sparse_scan.layers._kernels.max_pool_2x2`) on the inputs they cover, in
    input order: the values are those inputs' shape (an odd last row or column, in no window, is cut
    off by a copy first). Every other geometry runs the window loop of the CUDA twin
    (:func:`sparse_scan.layers._kernels.max_pool_windows`).
    """
    g = aux["geometry"]
    batch = x.shape[0]
    pieces = _plane_pieces(g, batch, batch * nnz)
    data = np.empty((batch, nnz), dtype=x.dtype)
    if two_by_two(g):
        covered = np.ascontiguousarray(x[:, :, :2 * g.out_height, :2 * g.out_width]).reshape(-1)
        kernel, pairs = _kernels.max_pool_2x2, 2 * g.out_height * g.out_width  # pairs per plane
        args = [(covered, None, data.reshape(-1), g.out_width, p0 * pairs, p1 * pairs, MAX_POOL_CHUNK)
                for p0, p1 in pieces]
    else:  # the kernel zeroes each plane's entries
        kernel, geometry = _kernels.max_pool_windows, tuple(g.as_array().tolist())
        args = [(np.ascontiguousarray(x).reshape(-1), aux["slot"], geometry, data, p0, p1)
                for p0, p1 in pieces]
    launch(kernel, (), args)
    return data


def _plane_pieces(g: PoolGeometry, batch: int, values: int) -> list[tuple[int, int]]:
    """Runs of the batch's (sample, channel) planes for a kernel writing ``values`` values: one per
    core from :data:`MAX_POOL_THREAD_MIN_VALUES`."""
    planes = batch * g.channels
    return even_parts(planes, workers_for(values, MAX_POOL_THREAD_MIN_VALUES))


def _max_pool_2x2_matvec(layer: Any, g: PoolGeometry, x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``JT(x) @ grad`` of 2x2 windows of stride 2 for flat ``(B, outputs)`` gradients, without JT's
    values (:func:`sparse_scan.layers._kernels.max_pool_2x2` given the gradient, over the inputs the windows
    cover; an odd last row or column, in no window, gets 0)."""
    batch = x.shape[0]
    if grad.shape != (batch, g.outputs):  # the kernel reads without bounds checks
        raise ValueError(f"layer {layer.label}: JT @ g expects gradients of shape {(batch, g.outputs)}, "
                         f"got {grad.shape}")
    dtype = np.result_type(x, grad)
    rows, cols = 2 * g.out_height, 2 * g.out_width
    exact = (rows, cols) == (g.height, g.width)
    covered = x if exact else np.ascontiguousarray(x[:, :, :rows, :cols])
    values = np.empty(covered.shape, dtype=dtype)
    pairs = rows * g.out_width  # horizontal input pairs per plane
    flat_grad = np.ascontiguousarray(grad).reshape(-1)
    args = [(covered.reshape(-1), flat_grad, values.reshape(-1), g.out_width, p0 * pairs, p1 * pairs,
             MAX_POOL_CHUNK) for p0, p1 in _plane_pieces(g, batch, values.size)]
    launch(_kernels.max_pool_2x2, (), args)
    if exact:
        return values.reshape(batch, -1)
    out = np.zeros(x.shape, dtype=dtype)
    out[:, :, :rows, :cols] = values
    return out.reshape(batch, -1)


def two_by_two(g: PoolGeometry) -> bool:
    """2x2 windows of stride 2, no padding or dilation, every window inside the input."""
    return (g.kernel == (2, 2) and g.stride == (2, 2) and g.padding == (0, 0) and g.dilation == (1, 1)
            and 2 * g.out_height <= g.height and 2 * g.out_width <= g.width)


def _max_selection_gpu(be: _backend.Backend, x: Array, aux: dict[str, Any], nnz: int) -> Array:
    """CUDA twin: one thread per (sample, output) writes 1 at its window's selected input."""
    cp = be.xp
    g = aux["geometry"]
    slot = aux["slot"]
    batch = x.shape[0]
    data = cp.zeros((batch, nnz), dtype=x.dtype)
    kernel = _gpu_kernels.function(KERNEL_FILE, "maxpool_values", slot.dtype, x.dtype)
    _gpu_kernels.launch(kernel, batch * g.outputs,
                    (aux["geometry_array"], np.int64(batch), cp.ascontiguousarray(x), slot,
                     np.int64(nnz), data))
    return data


max_selection = _backend.twin(cpu=_max_selection_cpu, gpu=_max_selection_gpu)


def max_pool_2x2_forward(g: PoolGeometry, x: np.ndarray) -> np.ndarray:
    """The host's max-pool forward of 2x2 windows of stride 2 (:func:`two_by_two`): PyTorch's values
    (:func:`sparse_scan.layers._kernels.max_pool_2x2_values`), runs of planes per core."""
    x = np.ascontiguousarray(x)
    batch = x.shape[0]
    out = np.empty((batch, g.channels, g.out_height, g.out_width), dtype=x.dtype)
    sizes = (g.height, g.width, g.out_height, g.out_width)
    launch(_kernels.max_pool_2x2_values, (x.reshape(-1), sizes, out.reshape(-1)),
           _plane_pieces(g, batch, x.size))
    return out


max_pool_operator = _backend.twin(
    cpu=lambda be, layer, g, x: functools.partial(_max_pool_2x2_matvec, layer, g, np.ascontiguousarray(x)),
    gpu=lambda be, layer, g, x: None)
