"""Layer normalisation: PyTorch's ``nn.LayerNorm`` over a sample's last dimensions, or over its channels.

Each sample's elements fall in groups of ``n`` (``n`` the product of ``normalized_shape``) that are
normalised by their own mean and (biased) variance, as PyTorch computes them::

    xhat = (x - mean) * rstd,    rstd = 1 / sqrt(var + eps),    y = xhat * weight + bias

``data_format="channels_last"`` (PyTorch's ``nn.LayerNorm``): a group is one position of the leading
dimensions, over the last ``len(normalized_shape)`` ones. ``data_format="channels_first"``: a group is
one position of an NCHW sample, over its ``C`` channels: what ConvNeXt's ``x.permute(0, 2, 3, 1)``,
``nn.LayerNorm(C)``, ``x.permute(0, 3, 1, 2)`` and torchvision's ``LayerNorm2d`` compute (the name is
ConvNeXt's own ``LayerNorm(..., data_format="channels_first")``). Both are one layout: a sample seen
as ``(A, n, P)``, normalised over its middle axis (``A`` groups of ``n`` contiguous elements, ``P = 1``;
or ``A = 1`` and ``P`` positions, the channel axis strided by ``P``).

A group couples its elements, so the transposed Jacobian is a dense ``n × n`` block per group and
sample (``jacobian_kind = "general"``, values per sample): with ``w`` the weight,

    JT[(g, j), (g, i)] = d y_i / d x_j = w_i rstd (δ_ij - (1 + xhat_i xhat_j) / n)

Its pattern is block-diagonal, fixed by the shape: row ``(a, j, p)`` holds the columns ``(a, i, p)``
for every ``i``, in order (``size · n`` entries per sample). The parameter gradients (paper Eq. 2) are
``sum(g * xhat)`` (``weight``) and ``sum(g)`` (``bias``) over the batch and the groups.

IEEE values are PyTorch's: a group holding an infinity or a NaN is NaN throughout (its mean is), an
exact zero comes out ``+0.0`` (PyTorch adds the bias, zero without one). A group whose squares overflow
(``1e30`` in float32) has an infinite variance here, so ``rstd`` 0 and ``y = bias``; PyTorch's answer
there depends on its vectorised moments (0 or NaN, by the group's length).

The fills are array expressions, identical on NumPy and CuPy; the parameters live where they were
assigned and are uploaded by each call that needs them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._checks import MAX_SIZE, flag, is_int, number
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._base import Shape
from ._normalization import AffineLayer

__all__ = ["DATA_FORMATS", "LayerNorm"]

DATA_FORMATS = ("channels_last", "channels_first")
"""Where a group's elements lie: the last dimensions (PyTorch's ``nn.LayerNorm``), or the channels of
an NCHW sample (ConvNeXt's and torchvision's ``LayerNorm2d``)."""


def _normalized_shape(value: Any, label: str) -> tuple[int, ...]:
    """PyTorch's ``normalized_shape``: an int or a non-empty sequence of positive ints."""
    entries = (value,) if is_int(value) else value
    if (not isinstance(entries, (tuple, list)) or not entries
            or not all(is_int(v) and 1 <= v <= MAX_SIZE for v in entries)):
        raise ValueError(f"layer {label}: normalized_shape: expected a positive int or a non-empty list of "
                         f"positive ints, got {value!r}")
    return tuple(int(v) for v in entries)


class LayerNorm(AffineLayer):
    """PyTorch's ``nn.LayerNorm``, over the last dimensions or (``data_format="channels_first"``) over
    the channels of an NCHW sample.

    Parameters
    ----------
    normalized_shape : int or sequence of int
        The shape each group normalises: the sample's last dimensions; with ``channels_first``, one int,
        the channels ``C``.
    eps : float
        Added to the variance (PyTorch's default 1e-5; ConvNeXt's 1e-6), non-negative.
    elementwise_affine : bool
        Whether the layer has ``weight`` (ones) and, with ``bias``, ``bias`` (zeros), of shape
        ``normalized_shape``.
    bias : bool
        Whether an affine layer has ``bias``.
    data_format : {"channels_last", "channels_first"}
        Keyword-only: where a group's elements lie (the module docstring).
    dtype : numpy dtype, optional
        float32 (default) or float64, for the parameters and the inputs they take.

    Attributes
    ----------
    weight, bias : ndarray of shape ``normalized_shape``, or None

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import LayerNorm
    >>> norm = LayerNorm(3, dtype=np.float64)
    >>> x = np.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]]])         # one sample, two groups of 3
    >>> norm(x).round(4)
    array([[[-1.2247,  0.    ,  1.2247],
            [-0.7071, -0.7071,  1.4142]]])
    >>> jt = norm.transposed_jacobian(x)
    >>> jt.shape, jt.nnz, jt.data.shape                            # two 3x3 blocks per sample
    ((6, 6), 18, (1, 18))
    >>> channels = LayerNorm(4, data_format="channels_first")      # ConvNeXt's, over NCHW channels
    >>> channels.pattern((4, 5, 5)).nnz                            # a 4x4 block per pixel
    400
    """

    jacobian_kind = "general"
    sample_independent = False
    parameter_names = ("weight", "bias")
    affine_flag = "elementwise_affine"

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, data_format: str = "channels_last", dtype: Any = None) -> None:
        super().__init__(dtype)
        self.normalized_shape = _normalized_shape(normalized_shape, self.label)
        self.eps = number(eps, f"layer {self.label}: eps", 0.0)
        self.elementwise_affine = flag(elementwise_affine, f"layer {self.label}: elementwise_affine")
        has_bias = flag(bias, f"layer {self.label}: bias") and self.elementwise_affine
        if data_format not in DATA_FORMATS:
            raise self._error("data_format", f"must be one of {', '.join(DATA_FORMATS)}, got {data_format!r}")
        if data_format == "channels_first" and len(self.normalized_shape) != 1:
            raise self._error("normalized_shape", "channels_first normalises over the channels: one int "
                              f"(C), got {list(self.normalized_shape)}")
        self.data_format = data_format
        self._weight = np.ones(self.normalized_shape, self._dtype) if self.elementwise_affine else None
        self._bias = np.zeros(self.normalized_shape, self._dtype) if has_bias else None

    # --- parameters ------------------------------------------------------------------------------
    def _affine_shape(self) -> Shape:
        return self.normalized_shape

    # --- shapes ----------------------------------------------------------------------------------
    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if self.data_format == "channels_first":
            if not shape or shape[0] != self.normalized_shape[0]:
                raise self._error("input", f"channels_first expects a per-sample shape (C, ...) with C = "
                                  f"{self.normalized_shape[0]} (normalized_shape), got {list(shape)}")
        elif shape[len(shape) - len(self.normalized_shape):] != self.normalized_shape:
            raise self._error("input", f"the per-sample shape {list(shape)} does not end with "
                              f"normalized_shape {list(self.normalized_shape)}")
        return shape

    def _layout(self, in_shape: Shape) -> tuple[int, int, int]:
        """``(A, n, P)``: a sample as ``A`` groups' leading positions, the ``n`` normalised elements and
        ``P`` trailing positions (the module docstring)."""
        size, n = math.prod(in_shape), math.prod(self.normalized_shape)
        return (size // n, n, 1) if self.data_format == "channels_last" else (1, n, size // n)

    def pattern_nnz(self, in_shape: Shape) -> int:
        """``size · n``: a dense ``n × n`` block per group, counted from the shape."""
        shape = self.check_in_shape(self._sizes(in_shape))
        return math.prod(shape) * math.prod(self.normalized_shape)

    # --- the normalisation -------------------------------------------------------------------------
    def _checked(self, x: Array) -> Array:
        x = self._check_input(x)
        self._check_dtype(x)
        return x

    def _normalised(self, x: Array) -> tuple[Array, Array]:
        """``(xhat, rstd)`` of a batch laid out as ``(B, A, n, P)`` (rstd with ``n`` kept as 1)."""
        xp = _backend.of(x).xp
        grouped = x.reshape((x.shape[0],) + self._layout(x.shape[1:]))
        centred = grouped - grouped.mean(axis=2, keepdims=True)
        variance = (centred * centred).mean(axis=2, keepdims=True)
        rstd = 1 / xp.sqrt(variance + x.dtype.type(self.eps))
        return centred * rstd, rstd

    def _affine(self, be: _backend.Backend) -> tuple[Array, Array]:
        """``weight`` and ``bias`` on ``be`` as ``(n, 1)`` columns (ones and zeros where the layer has
        none: PyTorch multiplies by 1 and adds 0 then, which makes an exact zero ``+0.0``)."""
        n = math.prod(self.normalized_shape)
        weight = np.ones(n, self._dtype) if self._weight is None else self._weight
        bias = np.zeros(n, self._dtype) if self._bias is None else self._bias
        return be.asarray(weight).reshape(n, 1), be.asarray(bias).reshape(n, 1)

    def forward(self, x: Array) -> Array:
        x = self._checked(x)
        xhat, _ = self._normalised(x)
        weight, bias = self._affine(_backend.of(x))
        return (xhat * weight + bias).reshape(x.shape)

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        groups, n, positions = self._layout(in_shape)
        size = groups * n * positions
        dtype = choose_index_dtype(size * n, size, index_dtype)
        xp = be.xp
        # row (a, j, p) holds the columns (a, i, p) of every i, in order
        columns = (xp.arange(groups, dtype=dtype)[:, None, None, None] * dtype.type(n * positions)
                   + xp.arange(positions, dtype=dtype)[None, None, :, None]
                   + xp.arange(n, dtype=dtype)[None, None, None, :] * dtype.type(positions))
        indices = xp.broadcast_to(columns, (groups, n, positions, n)).ravel()
        indptr = xp.arange(0, size * n + 1, n, dtype=dtype)
        return Pattern(indptr, indices, (size, size)), {}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        self._check_dtype(x)
        xhat, rstd = self._normalised(x)
        n = xhat.shape[2]
        weight, _ = self._affine(be)
        by_position = xhat.transpose(0, 1, 3, 2)  # (B, A, P, n)
        outer = by_position[..., :, None] * by_position[..., None, :]  # [b, a, p, j, i]
        eye = be.xp.eye(n, dtype=x.dtype)
        block = (eye - (1 + outer) / x.dtype.type(n)) * rstd.transpose(0, 1, 3, 2)[..., None] * weight[:, 0]
        return block.transpose(0, 1, 3, 2, 4).reshape(x.shape[0], -1)  # rows (a, j, p), columns i

    def input_matvec(self, x: Array) -> Callable[[Array], Array] | None:
        """``g -> JT @ g`` on the host without the ``n × n`` blocks (:func:`_layer_norm_matvec`: per
        group ``rstd · (w g - mean(w g) - x̂ · mean(w g x̂))``, ``O(n)`` instead of ``O(n²)``; rounded
        as those sums round, not as the block's SpMV); None on the GPU."""
        x = self._checked(x)
        return _layer_norm_operator(_backend.of(x), self, x)

    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """``weight`` and ``bias`` gradients (paper Eq. 2), summed over the batch and the groups like
        PyTorch (none without affine parameters); on ``x``'s device."""
        x = self._checked(x)
        if self._weight is None:
            return {}
        xhat, _ = self._normalised(x)
        grad = _backend.of(x).asarray(grad_out).reshape(xhat.shape)
        grads = {"weight": (grad * xhat).sum(axis=(0, 1, 3)).reshape(self.normalized_shape)}
        if self._bias is not None:
            grads["bias"] = grad.sum(axis=(0, 1, 3)).reshape(self.normalized_shape)
        return grads

    def __repr__(self) -> str:
        layout = "" if self.data_format == "channels_last" else f", data_format={self.data_format!r}"
        return (f"LayerNorm({self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self._bias is not None}{layout})")


def _layer_norm_matvec(xhat: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                       grad: np.ndarray) -> np.ndarray:
    """``JT @ g`` of a LayerNorm for flat ``(B, size)`` gradients, from its input's ``(x̂, rstd)`` laid out
    as ``(B, A, n, P)``: ``rstd · (w g - mean_n(w g) - x̂ · mean_n(w g x̂))``, each group's mean over its
    ``n`` normalised elements."""
    if grad.shape != (xhat.shape[0], xhat[0].size):
        raise ValueError(f"LayerNorm's JT @ g: expected gradients of shape "
                         f"{(xhat.shape[0], xhat[0].size)}, got {grad.shape}")
    scaled = grad.reshape(xhat.shape) * weight
    out = scaled - scaled.mean(axis=2, keepdims=True) - xhat * (scaled * xhat).mean(axis=2, keepdims=True)
    return (out * rstd).reshape(grad.shape)


def _layer_norm_host(be: _backend.Backend, layer: LayerNorm, x: np.ndarray) -> Callable[[Array], Array]:
    xhat, rstd = layer._normalised(x)
    weight, _ = layer._affine(be)
    return functools.partial(_layer_norm_matvec, xhat, rstd, weight)


_layer_norm_operator = _backend.twin(cpu=_layer_norm_host, gpu=lambda be, layer, x: None)
