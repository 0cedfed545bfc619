"""Adaptive average pooling: PyTorch's ``AdaptiveAvgPool2d``, windows chosen by the output size.

Along an axis of ``n`` inputs pooled to ``m`` outputs, output ``i`` averages the inputs
``[floor(i n / m), ceil((i + 1) n / m))`` (PyTorch's rule): windows of unequal lengths that overlap by
one element where ``m`` does not divide ``n``, and repeat inputs where ``m > n``. A 2-D window is the
product of its axes' windows, so output ``(c, i, j)`` is the mean of ``len_h(i) · len_w(j)`` inputs.

The transposed Jacobian has one row per input ``(c, h, w)`` and one column per output ``(c, i, j)``
(C-order), an entry for every input in the output's window, valued ``1 / (len_h(i) · len_w(j))``: it
does not depend on the sample (``sample_independent``: values ``(nnz,)``, computed once per dtype).
Its pattern is one channel's, built on the host from the two axes' windows (``O(nnz / C)``), then
repeated over the channels where the arrays live. The forward pass sums each window and divides by its
size: on the host, a batch of finite values by two small 0/1 window matrices (BLAS products); any other
batch, and every batch on the GPU (no synchronisation to look at the values), over the window's elements
gathered by a table of positions, a zero appended past the input for the shorter windows' ends (a
product with the window matrices would multiply every infinity or NaN by the zeros of the windows it is
not in: NaN where PyTorch's outputs are finite, tests/test_ieee.py). Both are array code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from .. import backend as _backend
from .._checks import MAX_SIZE, is_int
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._base import Layer, Shape

__all__ = ["AdaptiveAvgPool2d"]


def adaptive_windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the ``out`` windows over ``size`` inputs, PyTorch's rule.

    Examples
    --------
    >>> adaptive_windows(5, 3)
    (array([0, 1, 3]), array([2, 4, 5]))
    >>> adaptive_windows(2, 3)
    (array([0, 0, 1]), array([1, 2, 2]))
    """
    index = np.arange(out, dtype=np.int64)
    return (index * size) // out, -((-(index + 1) * size) // out)


def _lengths(size: int, out: int) -> np.ndarray:
    """Each window's length."""
    starts, ends = adaptive_windows(size, out)
    return ends - starts


def _axis_members(size: int, out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (input position, output) pair of one axis, and each output's window length."""
    starts, ends = adaptive_windows(size, out)
    lengths = ends - starts
    outputs = np.repeat(np.arange(out, dtype=np.int64), lengths)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.repeat(starts, lengths) + np.arange(outputs.size, dtype=np.int64) - first
    return positions, outputs, lengths


def separable_plane(rows_h: np.ndarray, cols_h: np.ndarray, rows_w: np.ndarray, cols_w: np.ndarray,
                    height: int, width: int, out_width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One channel's JT pattern of an operator acting on each axis apart: entry ``(i, o)`` of the height
    axis' matrix and ``(j, p)`` of the width axis' give the entry ``((i, j), (o, p))``. Returns
    ``(indptr, indices, order)``, int64, rows sorted: ``order`` takes the outer product of the two axes'
    entries (height major, ``np.outer(h, w).ravel()``) to the pattern's entry order (for the values).

    Examples
    --------
    >>> indptr, indices, order = separable_plane(np.array([0, 0]), np.array([0, 1]), np.array([0, 1]),
    ...                                          np.array([0, 0]), 1, 2, 1)   # (1 1) (x) (1 1)^T
    >>> indptr.tolist(), indices.tolist(), order.tolist()
    ([0, 2, 4], [0, 1, 0, 1], [0, 2, 1, 3])
    """
    rows = (rows_h[:, None] * width + rows_w[None, :]).ravel()
    cols = (cols_h[:, None] * out_width + cols_w[None, :]).ravel()
    order = np.lexsort((cols, rows))
    indptr = np.zeros(height * width + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=height * width), out=indptr[1:])
    return indptr, cols[order], order


def tile_channels(be: _backend.Backend, indptr: np.ndarray, indices: np.ndarray, channels: int,
                  plane_out: int, index_dtype: Any) -> Pattern:
    """The pattern of an operator applying one channel's JT (``indptr``, ``indices``: a plane of
    ``len(indptr) - 1`` inputs and ``plane_out`` outputs) to every channel alike, built where ``be``
    computes."""
    per_channel, plane_in = indices.size, indptr.size - 1
    dtype = choose_index_dtype(channels * per_channel, channels * plane_out, index_dtype)
    xp = be.xp
    channel = xp.arange(channels, dtype=dtype)[:, None]
    starts = (be.asarray(indptr[:-1].astype(dtype))[None, :] + channel * dtype.type(per_channel)).ravel()
    full_indptr = xp.concatenate([starts, xp.full(1, channels * per_channel, dtype=dtype)])
    full_indices = (be.asarray(indices.astype(dtype))[None, :] + channel * dtype.type(plane_out)).ravel()
    return Pattern(full_indptr, full_indices, (channels * plane_in, channels * plane_out))


def plane_pattern(height: int, width: int, out_height: int, out_width: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One channel's JT on the host: ``(indptr, indices, values)``, int64 and float64, rows sorted.

    Examples
    --------
    >>> indptr, indices, values = plane_pattern(1, 3, 1, 2)     # windows [0, 2) and [1, 3)
    >>> indptr.tolist(), indices.tolist(), values.tolist()
    ([0, 1, 3, 4], [0, 0, 1, 1], [0.5, 0.5, 0.5, 0.5])
    """
    pos_h, out_h, len_h = _axis_members(height, out_height)
    pos_w, out_w, len_w = _axis_members(width, out_width)
    indptr, cols, _ = separable_plane(pos_h, out_h, pos_w, out_w, height, width, out_width)
    inverse_area = 1.0 / np.outer(len_h, len_w).ravel()
    return indptr, cols, inverse_area[cols]


def _window_matrix(size: int, out: int) -> np.ndarray:
    """``(out, size)``: 1 where input ``p`` lies in window ``i``."""
    starts, ends = adaptive_windows(size, out)
    position = np.arange(size)[None, :]
    return ((position >= starts[:, None]) & (position < ends[:, None])).astype(np.float64)


def window_positions(size: int, out: int) -> np.ndarray:
    """``(out, longest window)``: window ``i``'s input positions, then ``size`` (a zero appended to the
    input) past its end.

    Examples
    --------
    >>> window_positions(5, 3).tolist()       # windows [0, 2), [1, 4), [3, 5)
    [[0, 1, 5], [1, 2, 3], [3, 4, 5]]
    """
    starts, ends = adaptive_windows(size, out)
    positions = starts[:, None] + np.arange(int((ends - starts).max()))[None, :]
    return np.where(positions < ends[:, None], positions, size)


@dataclass(frozen=True)
class _WindowSums:
    """A forward's tables for one input shape, device and dtype: the 0/1 window matrices ``rows``
    ``(Ho, H)`` and ``cols`` ``(W, Wo)``, the windows' positions along each axis
    (:func:`window_positions`) and the windows' sizes ``(Ho, Wo)``."""

    rows: Array
    cols: Array
    row_positions: Array
    col_positions: Array
    area: Array


def _gathered_means(xp: Any, x: Array, tables: _WindowSums) -> Array:
    """Each window's sum over its elements gathered along the width, then along the height (a zero
    appended to each axis for the shorter windows), divided by its size: exact for any values."""
    batch, channels, height, _ = x.shape
    padded = xp.concatenate([x, xp.zeros((batch, channels, height, 1), dtype=x.dtype)], axis=3)
    sums = padded[:, :, :, tables.col_positions].sum(axis=-1)  # (B, C, H, Wo)
    padded = xp.concatenate([sums, xp.zeros((batch, channels, 1, sums.shape[3]), dtype=x.dtype)], axis=2)
    return padded[:, :, tables.row_positions, :].sum(axis=3) / tables.area


def _means_cpu(be: _backend.Backend, x: np.ndarray, tables: _WindowSums) -> np.ndarray:
    """Host twin: BLAS products with the window matrices where every value is finite, else
    :func:`_gathered_means`."""
    if np.isfinite(x).all():
        return tables.rows @ x @ tables.cols / tables.area
    return _gathered_means(np, x, tables)


_window_means = _backend.twin(cpu=_means_cpu, gpu=lambda be, x, tables: _gathered_means(be.xp, x, tables))


def _output_size(value: Any, label: str) -> tuple[int | None, int | None]:
    """PyTorch's ``output_size``: an int, or an (h, w) pair of ints or None (the input's size)."""
    entries = (value, value) if is_int(value) else value
    if (not isinstance(entries, (tuple, list)) or len(entries) != 2
            or not all(v is None or (is_int(v) and 1 <= v <= MAX_SIZE) for v in entries)):
        raise ValueError(f"layer {label}: output_size: expected a positive int or an (h, w) pair of positive "
                         f"ints or None (None: the input's size), got {value!r}")
    return tuple(None if v is None else int(v) for v in entries)  # type: ignore[return-value]


class AdaptiveAvgPool2d(Layer):
    """PyTorch's ``nn.AdaptiveAvgPool2d`` on a batch ``(B, C, H, W)``.

    Parameters
    ----------
    output_size : int or (int or None, int or None)
        ``(Ho, Wo)``; an int gives a square output, None keeps that axis' input size.

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import AdaptiveAvgPool2d
    >>> pool = AdaptiveAvgPool2d((2, None))
    >>> x = np.arange(15, dtype=np.float64).reshape(1, 1, 5, 3)
    >>> pool(x)[0, 0]                         # rows [0, 3) and [2, 5)
    array([[ 3.,  4.,  5.],
           [ 9., 10., 11.]])
    >>> jt = pool.transposed_jacobian(x)
    >>> jt.shape, jt.nnz, jt.data.shape       # row 2 lies in both windows
    ((15, 6), 18, (18,))
    >>> AdaptiveAvgPool2d(1).output_shape((64, 7, 7))
    (64, 1, 1)
    """

    jacobian_kind = "general"
    sample_independent = True

    def __init__(self, output_size: Any) -> None:
        super().__init__()
        self._output_size = _output_size(output_size, self.label)
        self.output_size = output_size if is_int(output_size) else tuple(output_size)
        self._window_sums: dict[Hashable, _WindowSums] = {}

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 3:
            raise self._error("input", f"expected a per-sample shape (C, H, W), got {shape}")
        return shape

    def output_shape(self, in_shape: Shape) -> Shape:
        channels, height, width = self.check_in_shape(in_shape)
        out_h, out_w = self._output_size
        return (channels, height if out_h is None else out_h, width if out_w is None else out_w)

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        be = _backend.of(x)
        in_shape = tuple(int(s) for s in x.shape[1:])
        key = (in_shape, be.device_key(), np.dtype(x.dtype).name)
        tables = self._window_sums.get(key)
        if tables is None:  # once per shape, device and dtype
            _, height, width = in_shape
            _, out_h, out_w = self.output_shape(in_shape)
            area = np.outer(_lengths(height, out_h), _lengths(width, out_w))
            tables = _WindowSums(
                *(be.asarray(table, dtype=x.dtype) for table in (_window_matrix(height, out_h),
                                                                  _window_matrix(width, out_w).T)),
                be.asarray(window_positions(height, out_h)), be.asarray(window_positions(width, out_w)),
                be.asarray(area, dtype=x.dtype))
            self._window_sums[key] = tables
        return _window_means(be, x, tables)

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        channels, height, width = in_shape
        _, out_h, out_w = self.output_shape(in_shape)
        rowptr, cols, values = plane_pattern(height, width, out_h, out_w)
        aux = {"plane_values": be.asarray(values), "channels": channels}
        return tile_channels(be, rowptr, cols, channels, out_h * out_w, index_dtype), aux

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        key = f"values_{np.dtype(x.dtype).name}"
        if key not in aux:  # sample independent: once per dtype, reused by every batch
            aux[key] = be.xp.tile(aux["plane_values"].astype(x.dtype), aux["channels"])
        return aux[key]

    def __repr__(self) -> str:
        return f"AdaptiveAvgPool2d(output_size={self.output_size!r})"
