"""2-D max and average pooling: PyTorch's ``MaxPool2d`` and ``AvgPool2d`` with sparse Jacobians.

The transposed Jacobian of a pooling layer has one row per input element ``(c, ih, iw)`` and one column
per output element ``(c, oh, ow)`` (both C-order); its pattern holds every pair where the input lies in
the output's window (padding holds no input element, so it gives no entry). Overlapping windows put
several entries in a row. Besides the pattern, the layer keeps a ``slot`` table of shape
``(kh * kw, C * Ho * Wo)``: the entry position of window offset ``k = i * kw + j`` of output ``o``, or
``-1`` where that offset lies in the padding (or past the input, for ``ceil_mode``'s last windows).

* Max pooling is a *selection*: per sample, the entry of the first maximum of each window (PyTorch's
  tie rule) is 1 and every other window entry is an explicit 0, so the pattern never changes.
* Average pooling is sample independent: every entry is ``1 / divisor`` of its output, with PyTorch's
  divisor (``count_include_pad``, windows clipped to the padded input).

The pattern and the max-pool values have a NumPy twin and a CUDA twin (``rawkernels/pooling.cu``),
dispatched through :func:`sparse_scan.backend.twin`; both give identical arrays.

Examples
--------
>>> import numpy as np
>>> from sparse_scan.layers._pooling import MaxPool2d
>>> pool = MaxPool2d(2)
>>> x = np.arange(16, dtype=np.float64).reshape(1, 1, 4, 4)
>>> pool(x)[0, 0]
array([[ 5.,  7.],
       [13., 15.]])
>>> jt = pool.transposed_jacobian(x)
>>> jt.shape, jt.nnz, int(jt.data.sum())
((16, 4), 16, 4)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from .. import _kernels
from .. import backend as _backend
from .._checks import flag
from .._host_kernels import kernels, launch
from .._threads import even_parts, workers_for
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._base import Layer, Shape
from ._geometry import IntPair, output_size, pair

__all__ = ["AvgPool2d", "MaxPool2d"]

KERNEL_FILE = "pooling.cu"


@dataclass(frozen=True)
class PoolGeometry:
    """Everything the pattern and values of one pooling layer depend on, for one input shape.

    Attributes
    ----------
    channels, height, width : int
        Per-sample input shape ``(C, H, W)``.
    out_height, out_width : int
        Output spatial size ``(Ho, Wo)``.
    kernel, stride, padding, dilation : (int, int)
        Window geometry along (height, width).
    """

    channels: int
    height: int
    width: int
    out_height: int
    out_width: int
    kernel: IntPair
    stride: IntPair
    padding: IntPair
    dilation: IntPair

    @property
    def inputs(self) -> int:
        """Input elements per sample (JT's rows)."""
        return self.channels * self.height * self.width

    @property
    def outputs(self) -> int:
        """Output elements per sample (JT's columns)."""
        return self.channels * self.out_height * self.out_width

    @property
    def offsets(self) -> int:
        """Window offsets ``kh * kw`` (the slot table's rows)."""
        return self.kernel[0] * self.kernel[1]

    def axis(self, axis: int) -> tuple[int, int, int, int, int, int]:
        """``(size, out, kernel, stride, pad, dilation)`` along axis 0 (height) or 1 (width)."""
        sizes = ((self.height, self.out_height), (self.width, self.out_width))[axis]
        return sizes + (self.kernel[axis], self.stride[axis], self.padding[axis],
                        self.dilation[axis])

    @property
    def nnz(self) -> int:
        """Entries of JT: per channel, every (height tap, width tap) pair."""
        return self.channels * _axis_tap_count(*self.axis(0)) * _axis_tap_count(*self.axis(1))

    def as_array(self) -> np.ndarray:
        """The 13 int64 the kernels read: C, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw."""
        return np.array(
            (self.channels, self.height, self.width, self.out_height, self.out_width,
             *self.kernel, *self.stride, *self.padding, *self.dilation),
            dtype=np.int64,
        )


# --- one axis ------------------------------------------------------------------------------------
def _axis_grid(
    size: int, out: int, kernel: int, stride: int, pad: int, dilation: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Input position of every (window offset, output) pair, shape ``(kernel, out)``, and validity."""
    offset = np.arange(kernel, dtype=np.int64)[:, None]
    outputs = np.arange(out, dtype=np.int64)[None, :]
    position = outputs * stride - pad + offset * dilation
    valid = (position >= 0) & (position < size)
    shape = position.shape
    return position, np.broadcast_to(outputs, shape), np.broadcast_to(offset, shape), valid


def _axis_tap_count(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """Number of (output, window offset) pairs along one axis that land on an input position."""
    return int(_axis_grid(size, out, kernel, stride, pad, dilation)[3].sum())


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
    position, outputs, offset, valid = _axis_grid(size, out, kernel, stride, pad, dilation)
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
    _kernels.launch(_kernels.function(KERNEL_FILE, "pool_row_counts", dtype), g.inputs,
                    (geometry, counts))
    indptr = cp.zeros(g.inputs + 1, dtype=dtype)
    cp.cumsum(counts, dtype=dtype, out=indptr[1:])
    indices = cp.empty(g.nnz, dtype=dtype)
    slot = cp.full((g.offsets, g.outputs), -1, dtype=dtype)
    _kernels.launch(_kernels.function(KERNEL_FILE, "pool_fill", dtype), g.inputs,
                    (geometry, indptr, indices, slot))
    return indptr, indices, slot


_pattern = _backend.twin(cpu=_pattern_cpu, gpu=_pattern_gpu)


# --- windows as strided views (the forward) ------------------------------------------------------
def _padded(xp: Any, x: Array, g: PoolGeometry, fill: float) -> Array:
    """``x`` inside a ``fill`` border wide enough for every window (``ceil_mode``'s included)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.stride, g.padding, g.dilation
    rows = max(ph + g.height, (kh - 1) * dh + (g.out_height - 1) * sh + 1)
    cols = max(pw + g.width, (kw - 1) * dw + (g.out_width - 1) * sw + 1)
    if (ph, pw, rows, cols) == (0, 0, g.height, g.width):
        return x
    padded = xp.full(x.shape[:2] + (rows, cols), fill, dtype=x.dtype)
    padded[:, :, ph:ph + g.height, pw:pw + g.width] = x
    return padded


def _window_views(xp: Any, x: Array, g: PoolGeometry, fill: float) -> Iterator[Array]:
    """Yield, per window offset in PyTorch's order, the ``(B, C, Ho, Wo)`` view of its elements."""
    padded = _padded(xp, x, g, fill)
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.stride, g.dilation
    rows, cols = (g.out_height - 1) * sh + 1, (g.out_width - 1) * sw + 1
    for i in range(kh):
        for j in range(kw):
            yield padded[:, :, i * dh:i * dh + rows:sh, j * dw:j * dw + cols:sw]


def _window_max(xp: Any, x: Array, g: PoolGeometry) -> Array:
    """Max over each window; NaN propagates, as in PyTorch."""
    views = _window_views(xp, x, g, -np.inf)
    best = next(views).copy()
    for view in views:
        xp.maximum(best, view, out=best)
    return best


# --- max-pool value twins ------------------------------------------------------------------------
_NAN_IN_WINDOW = "NaN in a pooling window: its maximum selects no element"

MAX_POOL_CHUNK = 512
"""Pairs of inputs per pass of the compiled 2x2 kernel (its temporaries stay in L1). Measured on
VGG-11's pools at batch 16 (one thread): 256-1024 alike, within 5 %."""

MAX_POOL_THREAD_MIN_VALUES = 2**22
"""Max-pool values fills of at least this many values run one run of planes per core. Measured on
2 cores (2x2 windows, float32): two threads lose below (2M values: 0.67 ms on one, 0.72 ms on two;
1M: 0.36 and 0.42 ms) and win above (4M: 1.28 and 0.77 ms; 13M: 11.7 and 7.2 ms)."""


def _max_selection_cpu(
    be: _backend.Backend, x: np.ndarray, aux: dict[str, Any], nnz: int
) -> tuple[np.ndarray, bool]:
    """CPU twin: 1 at each window's first maximum; also whether some window holds a NaN.

    Compiled kernels over runs of (sample, channel) planes, one run per core from
    :data:`MAX_POOL_THREAD_MIN_VALUES` values. 2x2 windows of stride 2 (VGG's pools) run a
    vectorised kernel (:func:`sparse_scan._numba_kernels.max_pool_2x2`) on the inputs they cover, in
    input order: the values are those inputs' shape (an odd last row or column, in no window, is cut
    off by a copy first). Every other geometry runs the window loop of the CUDA twin
    (:func:`sparse_scan._numba_kernels.max_pool_windows`).
    """
    g = aux["geometry"]
    batch = x.shape[0]
    pieces = _plane_pieces(g, batch, batch * nnz)
    data = np.empty((batch, nnz), dtype=x.dtype)
    if _two_by_two(g):
        covered = np.ascontiguousarray(x[:, :, :2 * g.out_height, :2 * g.out_width]).reshape(-1)
        kernel, pairs = kernels().max_pool_2x2, 2 * g.out_height * g.out_width  # pairs per plane
        args = [(covered, None, data.reshape(-1), g.out_width, p0 * pairs, p1 * pairs, MAX_POOL_CHUNK)
                for p0, p1 in pieces]
    else:  # the kernel zeroes each plane's entries
        kernel, geometry = kernels().max_pool_windows, tuple(g.as_array().tolist())
        args = [(np.ascontiguousarray(x).reshape(-1), aux["slot"], geometry, data, p0, p1)
                for p0, p1 in pieces]
    return data, _any_flag(kernel, args)


def _plane_pieces(g: PoolGeometry, batch: int, values: int) -> list[tuple[int, int]]:
    """Runs of the batch's (sample, channel) planes for a kernel writing ``values`` values: one per
    core from :data:`MAX_POOL_THREAD_MIN_VALUES`."""
    planes = batch * g.channels
    return even_parts(planes, workers_for(values, MAX_POOL_THREAD_MIN_VALUES))


def _any_flag(kernel: Callable[..., bool], args: list[tuple]) -> bool:
    """``kernel(*a)`` for every ``a`` of ``args`` (on the kernel pool when there are several): whether
    one of them returned True (a NaN seen)."""
    if len(args) == 1:
        return bool(kernel(*args[0]))
    flags = [False] * len(args)

    def run(index: int) -> None:
        flags[index] = kernel(*args[index])

    launch(run, (), [(index,) for index in range(len(args))])
    return any(flags)


def _max_pool_2x2_matvec(layer: MaxPool2d, g: PoolGeometry, x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``JT(x) @ grad`` of 2x2 windows of stride 2 for flat ``(B, outputs)`` gradients, without JT's
    values (:func:`sparse_scan._numba_kernels.max_pool_2x2` given the gradient, over the inputs the windows
    cover; an odd last row or column, in no window, gets 0). Raises as the values fill does on a
    NaN in a window."""
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
    if _any_flag(kernels().max_pool_2x2, args):
        raise layer._error("input", _NAN_IN_WINDOW)
    if exact:
        return values.reshape(batch, -1)
    out = np.zeros(x.shape, dtype=dtype)
    out[:, :, :rows, :cols] = values
    return out.reshape(batch, -1)


def _two_by_two(g: PoolGeometry) -> bool:
    """2x2 windows of stride 2, no padding or dilation, every window inside the input."""
    return (g.kernel == (2, 2) and g.stride == (2, 2) and g.padding == (0, 0) and g.dilation == (1, 1)
            and 2 * g.out_height <= g.height and 2 * g.out_width <= g.width)


def _max_selection_gpu(
    be: _backend.Backend, x: Array, aux: dict[str, Any], nnz: int
) -> tuple[Array, bool]:
    """CUDA twin: one thread per (sample, output) writes 1 at its window's first maximum."""
    cp = be.xp
    g = aux["geometry"]
    slot = aux["slot"]
    batch = x.shape[0]
    data = cp.zeros((batch, nnz), dtype=x.dtype)
    nan_found = cp.zeros(1, dtype=cp.int32)
    kernel = _kernels.function(KERNEL_FILE, "maxpool_values", slot.dtype, x.dtype)
    _kernels.launch(kernel, batch * g.outputs,
                    (aux["geometry_array"], np.int64(batch), cp.ascontiguousarray(x), slot,
                     np.int64(nnz), data, nan_found))
    return data, bool(nan_found[0])  # sync: the NaN check must raise before the values are used


_max_selection = _backend.twin(cpu=_max_selection_cpu, gpu=_max_selection_gpu)


_max_pool_operator = _backend.twin(
    cpu=lambda be, layer, g, x: functools.partial(_max_pool_2x2_matvec, layer, g, np.ascontiguousarray(x)),
    gpu=lambda be, layer, g, x: None)


# --- the layers ----------------------------------------------------------------------------------
class _Pool2d(Layer):
    """Argument parsing, shapes, pattern and slot table shared by the 2-D pooling layers."""

    def __init__(
        self, kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool
    ) -> None:
        super().__init__()
        self._geometries: dict[tuple[Shape, bool], PoolGeometry] = {}
        self.kernel_size, self.padding = kernel_size, padding
        self.ceil_mode = flag(ceil_mode, f"layer {self.label}: ceil_mode")
        self.stride = kernel_size if stride is None else stride
        self._kernel = pair(kernel_size, "kernel_size", self.label, 1)
        self._stride = pair(self.stride, "stride", self.label, 1)
        self._padding = pair(padding, "padding", self.label, 0)
        self._dilation = pair(dilation, "dilation", self.label, 1)
        if any(p > k // 2 for p, k in zip(self._padding, self._kernel, strict=True)):
            raise self._error(
                "padding",
                f"must be at most half of kernel_size, got padding={padding!r}, "
                f"kernel_size={kernel_size!r}",
            )

    def _geometry(self, in_shape: Shape) -> PoolGeometry:
        """Validate a per-sample ``(C, H, W)`` shape and compute the window geometry (kept per shape:
        every values fill asks for it)."""
        shape = tuple(int(s) for s in in_shape)
        known = self._geometries.get((shape, self.ceil_mode))
        if known is not None:
            return known
        if len(shape) != 3:
            raise self._error("input", f"expected a per-sample shape (C, H, W), got {shape}")
        if min(shape) < 1:
            raise self._error("input", f"sizes must be positive, got {shape}")
        out = tuple(
            output_size(size, k, s, p, p, d, self.ceil_mode)
            for size, k, s, p, d in zip(shape[1:], self._kernel, self._stride,
                                        self._padding, self._dilation, strict=True)
        )
        if min(out) < 1:
            raise self._error(
                "kernel_size",
                f"window {self.kernel_size!r} (dilation {self._dilation}) does not fit the input "
                f"{shape[1:]} padded by {self._padding}: output size {out}",
            )
        geometry = PoolGeometry(*shape, *out, self._kernel, self._stride, self._padding, self._dilation)
        self._geometries[(shape, self.ceil_mode)] = geometry
        return geometry

    def check_in_shape(self, in_shape: Shape) -> Shape:
        self._geometry(in_shape)
        return tuple(int(s) for s in in_shape)

    def output_shape(self, in_shape: Shape) -> Shape:
        g = self._geometry(in_shape)
        return (g.channels, g.out_height, g.out_width)

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        g = self._geometry(in_shape)
        dtype = choose_index_dtype(g.nnz, g.outputs, index_dtype)
        indptr, indices, slot = _pattern(be, g, dtype)
        aux = {"slot": slot, "geometry": g, "geometry_array": be.asarray(g.as_array())}
        return Pattern(indptr, indices, (g.inputs, g.outputs)), aux


class MaxPool2d(_Pool2d):
    """PyTorch's ``nn.MaxPool2d`` on a batch ``(B, C, H, W)``.

    Parameters
    ----------
    kernel_size : int or (int, int)
    stride : int or (int, int), optional
        Defaults to ``kernel_size``.
    padding : int or (int, int)
        Implicit ``-inf`` border; at most half of ``kernel_size``.
    dilation : int or (int, int)
    ceil_mode : bool
        Round the output size up (the last window may run past the padded input and is clipped).

    Notes
    -----
    JT is a selection: per sample, the entry of each window's first maximum (in window order, as
    PyTorch picks it on ties) holds 1 and the other window entries are explicit zeros. A NaN in a
    window makes that choice meaningless and raises ``ValueError``.
    """

    jacobian_kind = "selection"
    sample_independent = False

    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        dilation: Any = 1,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__(kernel_size, stride, padding, dilation, ceil_mode)
        self.dilation = dilation

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        return _window_max(_backend.of(x).xp, x, self._geometry(x.shape[1:]))

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        data, nan_found = _max_selection(be, x, aux, pattern.nnz)
        if nan_found:
            raise self._error("input", _NAN_IN_WINDOW)
        return data

    def input_matvec(self, x: Array) -> Callable[[Array], Array] | None:
        """``g -> JT(x) @ g`` in one compiled pass on the host for 2x2 windows of stride 2 (VGG's and
        LeNet's pools: :func:`_max_pool_2x2_matvec`); None for other geometries, whose JT is filled,
        and on the GPU."""
        x = self._check_input(x)
        g = self._geometry(x.shape[1:])
        return _max_pool_operator(_backend.of(x), self, g, x) if _two_by_two(g) else None

    def __repr__(self) -> str:
        return (f"MaxPool2d(kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, ceil_mode={self.ceil_mode})")


class AvgPool2d(_Pool2d):
    """PyTorch's ``nn.AvgPool2d`` on a batch ``(B, C, H, W)``.

    Parameters
    ----------
    kernel_size : int or (int, int)
    stride : int or (int, int), optional
        Defaults to ``kernel_size``.
    padding : int or (int, int)
        Implicit zero border; at most half of ``kernel_size``.
    ceil_mode : bool
        Round the output size up (the last window may run past the padded input and is clipped).
    count_include_pad : bool
        Divide by the window's size within the padded input (default) or by its count of real
        input elements.

    Notes
    -----
    JT does not depend on the sample: each entry is ``1 / divisor`` of its output, stored once.
    """

    jacobian_kind = "general"
    sample_independent = True

    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
    ) -> None:
        super().__init__(kernel_size, stride, padding, 1, ceil_mode)
        self.count_include_pad = flag(count_include_pad, f"layer {self.label}: count_include_pad")

    def _divisor(self, g: PoolGeometry) -> np.ndarray:
        """PyTorch's divisor per output position, float64, shape ``(Ho, Wo)``."""
        lengths = []
        for axis in (0, 1):
            size, out, kernel, stride, pad, _ = g.axis(axis)
            start = np.arange(out) * stride - pad
            end = np.minimum(start + kernel, size + pad)
            real = np.minimum(end, size) - np.maximum(start, 0)
            lengths.append((end - start) if self.count_include_pad else real)
        return np.outer(*lengths).astype(np.float64)

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        xp = _backend.of(x).xp
        g = self._geometry(x.shape[1:])
        views = _window_views(xp, x, g, 0.0)
        total = next(views).copy()
        for view in views:
            total += view
        return total / xp.asarray(self._divisor(g), dtype=x.dtype)

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        pattern, aux = super()._build_pattern(be, in_shape, index_dtype)
        inverse = np.tile(1.0 / self._divisor(aux["geometry"]).ravel(), aux["geometry"].channels)
        aux["inverse_divisor"] = be.asarray(inverse)
        return pattern, aux

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        key = f"values_{np.dtype(x.dtype).name}"
        if key not in aux:  # sample independent: one gather per dtype, reused by every batch
            aux[key] = be.xp.take(aux["inverse_divisor"].astype(x.dtype), pattern.indices)
        return aux[key]

    def __repr__(self) -> str:
        return (f"AvgPool2d(kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding})")
