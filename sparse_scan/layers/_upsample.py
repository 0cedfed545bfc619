"""Upsampling: PyTorch's ``nn.Upsample`` and ``F.interpolate`` on NCHW batches, modes ``nearest``,
``nearest-exact`` and ``bilinear`` (``align_corners`` either way), from ``size`` or ``scale_factor``.

Each output takes its inputs along each axis apart: along an axis of ``n`` inputs and ``m`` outputs,
output ``o`` reads input ``i0(o)`` (nearest), or ``i0(o)`` and ``i1(o)`` with weights ``l0(o)`` and
``l1(o)`` (bilinear), and a pixel's value is the product over the two axes. The indices and weights
are PyTorch's CPU kernel's (``aten/src/ATen/native/UpSample.h``, ``cpu/UpSampleKernel.cpp``), computed in
the input's dtype (PyTorch's ``opmath``: float32 for float32, float64 for float64) with its roundings:
the scale is ``1 / scale_factor`` where a ``scale_factor`` is passed to the kernel (PyTorch's default,
``recompute_scale_factor`` not true) and ``in / out`` otherwise, ``(in - 1) / (out - 1)`` with
``align_corners``; a source index ``scale · (o + 0.5) - 0.5`` (0 below 0) or ``scale · o``
(``align_corners``) is floored as a float32 (``floorf``) and clamped to ``n - 1``, its fraction clamped to
``[0, 1]``; an axis whose size does not change copies (weights 1 and 0). Nearest indices come from one
of two kernels, as in PyTorch: where the output is small (``Ho + Wo <= 128``) or a 1x1 input of more than
3 channels is channels-last contiguous too, ``nearest_idx`` (the index itself where ``m == n``, ``o / 2``
where ``m == 2n``, else ``floorf(o · s)`` with ``s`` a float32 scale), else the generic kernel's
``floorf(scale · o)`` in the input's dtype.

The output's size is ``size``, or ``floor(n · scale_factor)``. The bilinear forward is PyTorch's generic
kernel's ``(x[h0, w0] l0w + x[h0, w1] l1w) l0h + (x[h1, w0] l0w + x[h1, w1] l1w) l1h``: every weight
multiplies, so an infinity whose weight is 0 makes a NaN as in PyTorch; nearest gathers (exact).

The transposed Jacobian does not depend on the sample (``sample_independent``: values ``(nnz,)``, per
dtype): per channel the product of the two axes' matrices (``A[i0(o), o] = l0(o)``, ``A[i1(o), o] +=
l1(o)``; nearest: one 1 per column), an entry for every weight the forward multiplies (zeros included),
two weights on one input summed. Its pattern holds the entries of both dtypes' indices (they differ
only where a float32 and a float64 rounding put a source index on either side of an integer), so one
pattern serves both. Patterns and weights are built on the host once per shape (``O(n + m)`` per axis),
the channels tiled where the arrays live; the forward's gathers are array code, identical on NumPy and
CuPy.
"""

from __future__ import annotations

import fractions
import math
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from .. import backend as _backend
from .._checks import MAX_SIZE, is_int
from .._types import Array
from ..csr import Pattern
from ._adaptive_pool import separable_plane, tile_channels
from ._base import FLOAT_DTYPES, Layer, Shape

__all__ = ["MODES", "Upsample"]

MODES = ("nearest", "nearest-exact", "bilinear")
"""The interpolation modes of PyTorch's ``F.interpolate`` this layer computes (4-D inputs)."""


def _scales_value(scale: float | None, size: int, out: int, dtype: Any) -> np.floating:
    """PyTorch's ``compute_scales_value<T>``: ``1 / scale`` where one is given, else ``size / out``."""
    t = np.dtype(dtype).type
    return t(1.0 / scale) if scale is not None and scale > 0 else t(size) / t(out)


def _area_scale(size: int, out: int, align_corners: bool, scale: float | None, dtype: Any) -> np.floating:
    """PyTorch's ``area_pixel_compute_scale<T>``."""
    t = np.dtype(dtype).type
    if align_corners:
        return t(size - 1) / t(out - 1) if out > 1 else t(0)
    return _scales_value(scale, size, out, dtype)


def _fused(scale: np.floating, values: np.ndarray, shift: float) -> np.ndarray:
    """``scale · values + shift`` rounded once to ``scale``'s type, as a fused multiply-add rounds it:
    float32 through float64 (the product is exact there), float64 exactly (fractions)."""
    t = type(scale)
    if t is np.float32:
        return (np.float64(scale) * values.astype(np.float64) + shift).astype(np.float32)
    exact = fractions.Fraction(float(scale))
    return np.array([float(exact * fractions.Fraction(float(v)) + fractions.Fraction(shift)) for v in values],
                    dtype=t)


def _source(scale: np.floating, out: int, align_corners: bool) -> np.ndarray:
    """PyTorch's ``area_pixel_compute_source_index<T>`` for every output (not cubic: 0 below 0). Its
    ``scale · (o + 0.5) - 0.5`` is one fused multiply-add in PyTorch's compiled kernels (x86 with FMA,
    ARM), rounded once: so here (:func:`_fused`)."""
    t = type(scale)
    index = np.arange(out).astype(t)
    if align_corners:
        return scale * index
    source = _fused(scale, index + t(0.5), -0.5)
    return np.where(source < 0, t(0), source)


def _floorf(values: np.ndarray, size: int) -> np.ndarray:
    """``min(floorf(v), size - 1)``: the value rounded to float32 first, as C's ``floorf`` takes it."""
    return np.minimum(np.floor(values.astype(np.float32)).astype(np.int64), size - 1)


def axis_weights(size: int, out: int, mode: str, align_corners: bool, scale: float | None, dtype: Any,
                 small_kernel: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PyTorch's indices and weights along one axis of ``size`` inputs and ``out`` outputs:
    ``(i0, i1, l0, l1)`` per output (nearest modes: ``i1 = i0``, ``l0 = 1``, ``l1 = 0``), weights in
    ``dtype``. ``scale`` is the scale factor passed to the kernel (None: none), ``small_kernel`` whether
    PyTorch takes its channels-last nearest kernel (the module docstring).

    Examples
    --------
    >>> axis_weights(3, 6, "bilinear", False, 2.0, np.float64, False)[2:]
    (array([1.  , 0.75, 0.25, 0.75, 0.25, 0.75]), array([0.  , 0.25, 0.75, 0.25, 0.75, 0.25]))
    >>> axis_weights(3, 5, "nearest", False, None, np.float32, True)[0]
    array([0, 0, 1, 1, 2])
    """
    t = np.dtype(dtype).type
    ones, zeros = np.ones(out, dtype), np.zeros(out, dtype)
    if mode == "bilinear":
        if out == size:  # PyTorch's copy: weights 1 and 0 on the same input
            index = np.arange(out)
            return index, index, ones, zeros
        source = _source(_area_scale(size, out, align_corners, scale, dtype), out, align_corners)
        i0 = _floorf(source, size)
        l1 = np.minimum(np.maximum(source - i0.astype(t), t(0)), t(1))
        return i0, i0 + (i0 < size - 1), t(1) - l1, l1
    index = np.arange(out)
    if small_kernel:  # nearest_idx, nearest_exact_idx: a float32 scale
        s32 = _scales_value(scale, size, out, np.float32)
        if mode == "nearest-exact":
            i0 = _floorf((index + 0.5) * np.float64(s32), size)
        elif out == size:
            i0 = index
        elif out == 2 * size:
            i0 = index >> 1
        else:
            i0 = _floorf(index.astype(np.float32) * s32, size)
    elif mode == "nearest-exact":  # HelperInterpNearestExact: the source index of the dtype, plus a half
        i0 = _floorf(_source(_area_scale(size, out, False, scale, dtype), out, False) + t(0.5), size)
    else:  # HelperInterpNearest
        i0 = _floorf(_source(_area_scale(size, out, False, scale, dtype), out, True), size)
    return i0, i0, ones, zeros


@dataclass(frozen=True)
class _Axis:
    """One axis' matrix ``A`` (``size × out``) as sorted entries ``(rows, cols)`` holding both dtypes'
    entries, its values per dtype name (``weights``), and the forward's ``(i0, i1, l0, l1)`` per dtype
    name (``tables``)."""

    rows: np.ndarray
    cols: np.ndarray
    weights: dict[str, np.ndarray]
    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


def _axis(size: int, out: int, mode: str, align_corners: bool, scale: float | None,
          small_kernel: bool) -> _Axis:
    """The axis' tables in both dtypes and its matrix over the union of their entries."""
    tables = {dtype.name: axis_weights(size, out, mode, align_corners, scale, dtype, small_kernel)
              for dtype in FLOAT_DTYPES}
    keys = {name: np.concatenate([i0, i1]) * out + np.tile(np.arange(out), 2)
            for name, (i0, i1, _, _) in tables.items()}
    union = np.unique(np.concatenate(list(keys.values())))
    weights = {}
    for name, (_, _, l0, l1) in tables.items():
        summed = np.zeros(union.size, l0.dtype)
        np.add.at(summed, np.searchsorted(union, keys[name]), np.concatenate([l0, l1]))  # l0, then l1
        weights[name] = summed
    return _Axis(union // out, union % out, weights, tables)


def _pair(value: Any, field: str, label: str, check: Any, what: str) -> tuple[Any, Any]:
    """An int/float or a pair of them, each passing ``check``, as a pair."""
    entries = value if isinstance(value, (tuple, list)) else (value, value)
    if len(entries) != 2 or not all(check(v) for v in entries):
        raise ValueError(f"layer {label}: {field}: expected {what} or a pair of them (h, w), got {value!r}")
    return tuple(entries)  # type: ignore[return-value]


def _positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


class Upsample(Layer):
    """PyTorch's ``nn.Upsample`` (``F.interpolate``) on a batch ``(B, C, H, W)``.

    Parameters
    ----------
    size : int or (int, int), optional
        The output's ``(Ho, Wo)``; exactly one of ``size`` and ``scale_factor``.
    scale_factor : float or (float, float), optional
        The output is ``floor(H · scale_factor)`` by ``floor(W · scale_factor)``.
    mode : {"nearest", "nearest-exact", "bilinear"}
        PyTorch's default ``"nearest"``.
    align_corners : bool, optional
        Bilinear only (None: False, PyTorch's default); the nearest modes take None.
    recompute_scale_factor : bool, optional
        True: the kernel's scale is ``in / out`` of the computed sizes, not ``1 / scale_factor`` (with
        ``scale_factor`` only).

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import Upsample
    >>> x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    >>> Upsample(scale_factor=2)(x)[0, 0]
    array([[1., 1., 2., 2.],
           [1., 1., 2., 2.],
           [3., 3., 4., 4.],
           [3., 3., 4., 4.]])
    >>> Upsample(size=3, mode="bilinear", align_corners=True)(x)[0, 0]
    array([[1. , 1.5, 2. ],
           [2. , 2.5, 3. ],
           [3. , 3.5, 4. ]])
    >>> jt = Upsample(scale_factor=2, mode="bilinear").transposed_jacobian(x)
    >>> jt.shape, jt.nnz, jt.data.shape, round(float(jt.data.sum()), 6)   # every output's weights sum to 1
    ((4, 16), 49, (49,), 16.0)
    """

    jacobian_kind = "general"
    sample_independent = True

    def __init__(self, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                 align_corners: bool | None = None, recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        if (size is None) == (scale_factor is None):
            raise self._error("size", "exactly one of size and scale_factor must be given, got "
                              f"size={size!r}, scale_factor={scale_factor!r}")
        if mode not in MODES:
            raise self._error("mode", f"must be one of {', '.join(MODES)} (PyTorch's for a 4-D input), got "
                              f"{mode!r}")
        if align_corners is not None and (mode != "bilinear" or not isinstance(align_corners, bool)):
            raise self._error("align_corners", "true or false, and only with the interpolating mode bilinear "
                              f"(None for the nearest modes), got {align_corners!r} with mode {mode!r}")
        if recompute_scale_factor is not None and not isinstance(recompute_scale_factor, bool):
            raise self._error("recompute_scale_factor", f"must be None, true or false, got "
                              f"{recompute_scale_factor!r}")
        if recompute_scale_factor and size is not None:
            raise self._error("recompute_scale_factor", "is not meaningful with an explicit size")
        if size is not None:
            self._size = _pair(size, "size", self.label, lambda v: is_int(v) and 1 <= v <= MAX_SIZE,
                               "a positive int")
            self._scales: tuple[float, float] | None = None
        else:
            self._size = None
            self._scales = tuple(float(v) for v in _pair(scale_factor, "scale_factor", self.label,
                                                         _positive_number, "a positive number"))
        # PyTorch's attributes, as nn.Upsample keeps them
        self._shown = (list(size) if isinstance(size, list) else size,
                       None if scale_factor is None else (tuple(float(v) for v in scale_factor)
                                                          if isinstance(scale_factor, (tuple, list))
                                                          else float(scale_factor)))
        self._mode = mode
        self._align_corners = bool(align_corners)
        self._recompute = bool(recompute_scale_factor)
        self._axes: dict[Hashable, tuple[_Axis, _Axis]] = {}
        self._gathers: dict[Hashable, tuple[Array, ...]] = {}

    # --- PyTorch's attributes (read only: the patterns depend on them) -------------------------------
    @property
    def size(self) -> Any:
        """``size`` as given, or None."""
        return self._shown[0]

    @property
    def scale_factor(self) -> Any:
        """``scale_factor`` as a float or a tuple of floats (nn.Upsample's; a list is a tuple here), or
        None."""
        return self._shown[1]

    @property
    def mode(self) -> str:
        """The interpolation mode."""
        return self._mode

    @property
    def align_corners(self) -> bool | None:
        """Bilinear: whether the corners' centres align (False by default); None for nearest modes."""
        return self._align_corners if self._mode == "bilinear" else None

    @property
    def recompute_scale_factor(self) -> bool:
        """Whether the kernel's scale is recomputed from the sizes."""
        return self._recompute

    # --- shapes ----------------------------------------------------------------------------------
    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 3:
            raise self._error("input", f"expected a per-sample shape (C, H, W), got {list(shape)}")
        return shape

    def output_shape(self, in_shape: Shape) -> Shape:
        channels, height, width = self.check_in_shape(in_shape)
        if self._size is not None:
            out = self._size
        else:
            out = tuple(int(math.floor(size * scale))
                        for size, scale in zip((height, width), self._scales, strict=True))
        if min(out) < 1 or max(out) > MAX_SIZE:
            raise self._error("input", f"input and output sizes must be positive (and at most {MAX_SIZE}), "
                              f"got input (H: {height}, W: {width}) output (H: {out[0]}, W: {out[1]})")
        return (channels, out[0], out[1])

    def _kernel_scales(self) -> tuple[float | None, float | None]:
        """The scale factors PyTorch's kernel receives: none with ``size`` or when recomputed."""
        return (None, None) if self._scales is None or self._recompute else self._scales

    def _axis_pair(self, in_shape: Shape) -> tuple[_Axis, _Axis]:
        """Both axes' tables for ``in_shape``, once per shape."""
        axes = self._axes.get(in_shape)
        if axes is None:
            channels, height, width = in_shape
            _, out_h, out_w = self.output_shape(in_shape)
            small = out_h + out_w <= 128 or (height == width == 1 and channels > 3)
            axes = self._axes[in_shape] = tuple(
                _axis(size, out, self._mode, self._align_corners, scale, small)
                for size, out, scale in zip((height, width), (out_h, out_w), self._kernel_scales(),
                                            strict=True))
        return axes

    def pattern_nnz(self, in_shape: Shape) -> int:
        """The channels times the product of the two axes' entries, from their tables alone."""
        shape = self.check_in_shape(self._sizes(in_shape))
        rows, cols = self._axis_pair(shape)
        return shape[0] * rows.rows.size * cols.rows.size

    # --- forward, pattern, values ----------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        be = _backend.of(x)
        in_shape = tuple(int(s) for s in x.shape[1:])
        key = (in_shape, be.device_key(), np.dtype(x.dtype).name)
        tables = self._gathers.get(key)
        if tables is None:  # once per shape, device and dtype
            rows, cols = self._axis_pair(in_shape)
            name = np.dtype(x.dtype).name
            tables = self._gathers[key] = tuple(be.asarray(table) for table in
                                                rows.tables[name] + cols.tables[name])
        h0, h1, lh0, lh1, w0, w1, lw0, lw1 = tables
        if self._mode != "bilinear":
            return x[:, :, h0[:, None], w0[None, :]]
        top, bottom = x[:, :, h0, :], x[:, :, h1, :]  # (B, C, Ho, W): the rows each output reads
        return ((top[..., w0] * lw0 + top[..., w1] * lw1) * lh0[:, None]
                + (bottom[..., w0] * lw0 + bottom[..., w1] * lw1) * lh1[:, None])

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        channels, height, width = in_shape
        _, out_h, out_w = self.output_shape(in_shape)
        rows, cols = self._axis_pair(in_shape)
        indptr, indices, order = separable_plane(rows.rows, rows.cols, cols.rows, cols.cols, height, width,
                                                 out_w)
        pattern = tile_channels(be, indptr, indices, channels, out_h * out_w, index_dtype)
        return pattern, {"order": order, "channels": channels, "axes": (rows, cols)}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        name = np.dtype(x.dtype).name
        key = f"values_{name}"
        if key not in aux:  # sample independent: once per dtype, reused by every batch
            rows, cols = aux["axes"]
            plane = np.outer(rows.weights[name], cols.weights[name]).ravel()[aux["order"]]
            aux[key] = be.xp.tile(be.asarray(plane), aux["channels"])
        return aux[key]

    def __repr__(self) -> str:
        shown = (f"scale_factor={self.scale_factor!r}" if self.scale_factor is not None
                 else f"size={self.size!r}")
        return f"Upsample({shown}, mode={self._mode!r})"
