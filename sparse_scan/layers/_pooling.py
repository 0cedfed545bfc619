"""2-D max and average pooling: PyTorch's ``MaxPool2d`` and ``AvgPool2d`` with sparse Jacobians.

The transposed Jacobian of a pooling layer has one row per input element and one column per output
element, an entry where the input lies in the output's window (:mod:`~sparse_scan.layers._pooling_jt`
builds its pattern and values on the host and on the GPU).

* Max pooling is a *selection*: per sample, the entry of each window's selected input (PyTorch's
  rule: the last NaN, else the first maximum) is 1 and every other window entry is an explicit 0, so
  the pattern never changes.
* Average pooling is sample independent: every entry is ``1 / divisor`` of its output, with PyTorch's
  divisor (``count_include_pad``, windows clipped to the padded input).

The layers' forward takes the windows as strided views (NumPy or CuPy alike); the host's 2x2 max-pool
of stride 2 is one compiled pass.

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

from typing import Any, Callable, Iterator

import numpy as np

from .. import backend as _backend
from .._checks import flag
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._base import Layer, Shape
from ._geometry import PoolGeometry, output_size, pair
from ._pooling_jt import max_pool_2x2_forward, max_pool_operator, max_selection, pattern, two_by_two

__all__ = ["AvgPool2d", "MaxPool2d"]


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
    """Max over each window, PyTorch's values: NaN propagates, and ties keep the earlier element, so the
    maximum of ``-0.0, 0.0`` is ``-0.0``. NumPy's ``maximum`` returns the second of two equal
    arguments (x86's max instructions do; tests/test_ieee.py checks the signs), so the running maximum
    goes second; CUDA's ``max``, CuPy's, may order two zeros by their signs instead."""
    views = _window_views(xp, x, g, -np.inf)
    best = next(views).copy()
    for view in views:
        xp.maximum(view, best, out=best)
    return best


_max_values = _backend.twin(
    cpu=lambda be, x, g: max_pool_2x2_forward(g, x) if two_by_two(g) else _window_max(np, x, g),
    gpu=lambda be, x, g: _window_max(be.xp, x, g))
"""``_max_values(be, x, g)``: the max-pool forward, PyTorch's values: on the host the compiled 2x2
kernel where the windows are 2x2 of stride 2 (:func:`~sparse_scan.layers._pooling_jt.max_pool_2x2_forward`),
else the windows' strided views (:func:`_window_max`), as on the GPU."""


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
        indptr, indices, slot = pattern(be, g, dtype)
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
    JT is a selection: per sample, the entry of each window's selected input holds 1 and the other
    window entries are explicit zeros. The selection is PyTorch's: in window order, an element
    replaces the one held if it is strictly greater or NaN, so a window's last NaN is selected (its
    gradient goes there) and otherwise its first maximum.
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
        return _max_values(_backend.of(x), x, self._geometry(x.shape[1:]))

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return max_selection(be, x, aux, pattern.nnz)

    def input_matvec(self, x: Array) -> Callable[[Array], Array] | None:
        """``g -> JT(x) @ g`` in one compiled pass on the host for 2x2 windows of stride 2 (VGG's and
        LeNet's pools: :mod:`~sparse_scan.layers._pooling_jt`); None for other geometries, whose JT is filled,
        and on the GPU."""
        x = self._check_input(x)
        g = self._geometry(x.shape[1:])
        return max_pool_operator(_backend.of(x), self, g, x) if two_by_two(g) else None

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
        total /= xp.asarray(self._divisor(g), dtype=x.dtype)
        total += x.dtype.type(0)  # PyTorch's zero averages are +0.0 (-0.0 windows, -3e-323 / 9 alike)
        return total

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
