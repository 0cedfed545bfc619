"""Batch normalisation with frozen statistics: PyTorch's ``BatchNorm2d`` in eval mode.

With frozen statistics (``training=False``, PyTorch's ``module.eval()``) the layer is a per-channel
affine map, computed as PyTorch's CPU kernel computes it::

    alpha = weight / sqrt(running_var + eps),    beta = bias - running_mean * alpha
    y[b, c, h, w] = x[b, c, h, w] * alpha[c] + beta[c]

so its transposed Jacobian is diagonal (``jacobian_kind = "diagonal"``: products with it are
scalings), each element of channel ``c`` holding ``alpha[c]``, the same for every sample
(``sample_independent``: the values are ``(nnz,)``, never copied per sample). The parameter gradients
(paper Eq. 2) are ``sum(g * x_hat)`` (``weight``) and ``sum(g)`` (``bias``) over the batch and the
pixels of each channel, with ``x_hat = (x - running_mean) / sqrt(running_var + eps)``.

In training mode PyTorch normalises a batch by its own mean and variance, so every output depends on
every sample of the batch: the Jacobian couples the samples (per channel a diagonal plus a rank-two
term over the whole batch), which a scan over per-sample Jacobians cannot hold. The layer refuses
that mode with a ``ValueError`` saying how to freeze it: ``layer.eval()``, or
``BatchNorm2d(..., training=False)``. ``track_running_stats=False`` (batch statistics in eval mode
too) is refused for the same reason.

The fills are array expressions, identical on NumPy and CuPy; the parameters live on the host and
each forward, values fill or parameter-gradient call uploads the two per-channel vectors it needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import as_float_dtype, flag, integer, number
from .._types import Array
from ..csr import Pattern
from ._base import FLOAT_DTYPES, Layer, Shape, diagonal_pattern
from ._weighted import device_or_host

__all__ = ["AffineLayer", "BatchNorm2d", "ParameterLayer"]


class ParameterLayer(Layer):
    """A layer holding a few float parameters by PyTorch's names (:attr:`parameter_names`, each kept as
    ``_<name>``, None where the layer has none) in one dtype (:attr:`dtype`), which its inputs must
    have: :class:`BatchNorm2d`, :class:`~sparse_scan.layers.LayerNorm`,
    :class:`~sparse_scan.layers.LayerScale`. Assigned values are checked (:meth:`_checked_parameter`)
    and kept where they live (NumPy, or CuPy: the PyTorch bridge's views of CUDA tensors)."""

    parameter_names: tuple[str, ...] = ()

    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self._dtype = as_float_dtype(dtype, self.label)

    @property
    def dtype(self) -> np.dtype:
        """The parameter dtype (inputs must have it)."""
        return self._dtype

    def _checked_parameter(self, field: str, value: Any, shape: Shape) -> Array:
        """``value`` as a contiguous array of ``shape`` in the layer's dtype, where it lives."""
        array = device_or_host(value)
        if array.dtype not in FLOAT_DTYPES:
            raise self._error(field, f"dtype must be float32 or float64, got {array.dtype}")
        if array.dtype != self._dtype:
            raise self._error(field, f"dtype {array.dtype} differs from the layer's {self._dtype} "
                              "(convert the layer with layer.astype(...))")
        if tuple(array.shape) != tuple(shape):
            raise self._error(field, f"expected shape {tuple(shape)}, got {tuple(array.shape)}")
        return _backend.of(array).xp.ascontiguousarray(array)

    def astype(self, dtype: Any) -> "ParameterLayer":
        """Convert the parameters to ``dtype`` (float32 or float64) in place; return self."""
        self._dtype = as_float_dtype(dtype, self.label)
        for name in self.parameter_names:
            value = getattr(self, f"_{name}")
            if value is not None:
                setattr(self, f"_{name}", value.astype(self._dtype))
        return self

    def _check_dtype(self, x: Array) -> None:
        """Refuse an input whose dtype is not the parameters'."""
        if np.dtype(x.dtype) != self._dtype:
            raise self._error("input", f"dtype {x.dtype} does not match the parameters' {self._dtype}; "
                              "convert one of them (layer.astype(...))")


class AffineLayer(ParameterLayer):
    """A :class:`ParameterLayer` with PyTorch's optional affine parameters: ``weight`` (the scale) and
    ``bias`` (the shift), both of :meth:`_affine_shape`, None where the module has none (its
    :attr:`affine_flag` false, or ``bias=False``): :class:`BatchNorm2d`,
    :class:`~sparse_scan.layers.LayerNorm`."""

    affine_flag = "affine"
    """The constructor argument that turns both parameters off (``affine``, ``elementwise_affine``)."""

    def _affine_shape(self) -> Shape:
        """The parameters' shape."""
        raise NotImplementedError

    @property
    def weight(self) -> np.ndarray | None:
        """The scale, or None without affine parameters."""
        return self._weight

    @weight.setter
    def weight(self, value: Any) -> None:
        if self._weight is None:
            raise self._error("weight", f"the layer has none ({self.affine_flag}=False)")
        self._weight = self._checked_parameter("weight", value, self._affine_shape())

    @property
    def bias(self) -> np.ndarray | None:
        """The shift, or None without affine parameters or with ``bias=False``."""
        return self._bias

    @bias.setter
    def bias(self, value: Any) -> None:
        if self._bias is None:
            raise self._error("bias", f"the layer has none ({self.affine_flag}=False or bias=False)")
        self._bias = self._checked_parameter("bias", value, self._affine_shape())


class BatchNorm2d(AffineLayer):
    """PyTorch's ``nn.BatchNorm2d`` on a batch ``(B, C, H, W)``, with frozen statistics.

    Parameters
    ----------
    num_features : int
        The channels ``C``.
    eps : float
        Added to the variance (positive; PyTorch's default 1e-5).
    momentum : float or None
        PyTorch's running-statistics update factor (0.1; None: a cumulative average). Kept for
        PyTorch's signature and repr: frozen statistics are never updated.
    affine : bool
        Whether the layer has ``weight`` (ones) and, with ``bias``, ``bias`` (zeros).
    track_running_stats : bool
        Must be True: without running statistics PyTorch normalises by the batch's statistics in
        eval mode too, which couples the samples.
    bias : bool
        Whether an affine layer has ``bias`` (keyword-only, as in PyTorch).
    training : bool
        PyTorch's mode (a module starts in training mode). Training mode is refused by
        :meth:`forward`, :meth:`transposed_jacobian` and :meth:`parameter_gradients`; freeze the
        statistics with ``training=False`` or :meth:`eval`.
    dtype : numpy dtype, optional
        float32 (default) or float64, for the parameters and the inputs they take.

    Attributes
    ----------
    weight, bias : ndarray, shape (num_features,), or None
        The affine parameters (None when ``affine=False``; ``bias`` None when ``bias=False``).
    running_mean, running_var : ndarray, shape (num_features,)
        The frozen statistics (zeros and ones until set, as in PyTorch).

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import BatchNorm2d
    >>> bn = BatchNorm2d(2, dtype=np.float64).eval()
    >>> bn.running_var = np.array([4.0, 0.25])
    >>> bn.weight = np.array([1.0, 3.0])
    >>> x = np.ones((5, 2, 3, 3))
    >>> bn(x)[0, :, 0, 0].round(4)
    array([0.5   , 5.9999])
    >>> jt = bn.transposed_jacobian(x)
    >>> jt.shape, jt.data.shape, bn.jacobian_kind
    ((18, 18), (18,), 'diagonal')
    >>> sorted(bn.parameter_gradients(x, np.ones_like(x)))
    ['bias', 'weight']
    >>> BatchNorm2d(2).forward(x.astype(np.float32))
    Traceback (most recent call last):
    ...
    ValueError: layer BatchNorm2d: training: ...
    """

    jacobian_kind = "diagonal"
    sample_independent = True
    parameter_names = ("weight", "bias", "running_mean", "running_var")

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        bias: bool = True,
        training: bool = True,
        dtype: Any = None,
    ) -> None:
        super().__init__(dtype)
        self.num_features = integer(num_features, f"layer {self.label}: num_features", 1)
        self.eps = number(eps, f"layer {self.label}: eps", 0.0, inclusive=False)
        if momentum is not None:
            momentum = number(momentum, f"layer {self.label}: momentum", 0.0)
            if momentum > 1:
                raise self._error("momentum", f"must be None or between 0 and 1, got {momentum!r}")
        self.momentum = momentum
        self.affine = flag(affine, f"layer {self.label}: affine")
        self.track_running_stats = flag(track_running_stats, f"layer {self.label}: track_running_stats")
        if not self.track_running_stats:
            raise self._error("track_running_stats", "False normalises every batch by its own statistics, "
                              "in eval mode too, which couples the samples of a batch; only frozen running "
                              "statistics (True, in eval mode) are supported")
        self.training = training
        shape = (self.num_features,)
        self._weight = np.ones(shape, self._dtype) if self.affine else None
        has_bias = flag(bias, f"layer {self.label}: bias") and self.affine
        self._bias = np.zeros(shape, self._dtype) if has_bias else None
        self._running_mean = np.zeros(shape, self._dtype)
        self._running_var = np.ones(shape, self._dtype)

    def _check_frozen(self) -> None:
        if self.training:
            raise self._error(
                "training", "in training mode BatchNorm2d normalises by the batch's own mean and variance, "
                "so every output depends on every sample of the batch and its Jacobian is not one per "
                "sample; freeze the statistics with layer.eval() (or BatchNorm2d(..., training=False)) "
                "to normalise by running_mean and running_var")

    # --- parameters ----------------------------------------------------------------------------
    def _affine_shape(self) -> Shape:
        return (self.num_features,)

    @property
    def running_mean(self) -> np.ndarray:
        """The frozen mean ``(num_features,)``."""
        return self._running_mean

    @running_mean.setter
    def running_mean(self, value: Any) -> None:
        self._running_mean = self._checked_parameter("running_mean", value, (self.num_features,))

    @property
    def running_var(self) -> np.ndarray:
        """The frozen variance ``(num_features,)``, non-negative."""
        return self._running_var

    @running_var.setter
    def running_var(self, value: Any) -> None:
        variance = self._checked_parameter("running_var", value, (self.num_features,))
        if not bool(_backend.of(variance).xp.all(variance >= 0)):  # on the GPU: one read back per setting
            raise self._error("running_var", "must be non-negative (a variance)")
        self._running_var = variance

    # --- shapes --------------------------------------------------------------------------------
    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 3:
            raise self._error("input", f"expected a per-sample shape (C, H, W), got {shape}")
        if shape[0] != self.num_features:
            raise self._error("input", f"expected {self.num_features} channels (num_features), got "
                              f"{shape[0]} (shape {shape})")
        return shape

    def output_shape(self, in_shape: Shape) -> Shape:
        return self.check_in_shape(in_shape)

    # --- the affine map ----------------------------------------------------------------------------
    def _checked(self, x: Array) -> Array:
        """A validated batch that the frozen affine map may take (eval mode, the parameters' dtype)."""
        x = self._check_input(x)
        self._check_frozen_dtype(x)
        return x

    def _check_frozen_dtype(self, x: Array) -> None:
        self._check_frozen()
        self._check_dtype(x)

    def _scale_shift(self, be: _backend.Backend) -> Array:
        """``[alpha, beta]`` of shape ``(2, C)`` on ``be``, in the parameters' dtype: computed where the
        parameters live, in float64, from the parameters as they are now (an optimizer updates them in
        place); host parameters then go to the GPU in one upload."""
        xp = _backend.of(self._running_var).xp
        invstd = 1.0 / xp.sqrt(self._running_var.astype(np.float64) + self.eps)
        alpha = invstd if self._weight is None else self._weight * invstd
        beta = -self._running_mean * alpha
        if self._bias is not None:
            beta = beta + self._bias
        return be.asarray(xp.stack([alpha, beta]).astype(self._dtype))

    def forward(self, x: Array) -> Array:
        x = self._checked(x)
        alpha, beta = self._scale_shift(_backend.of(x))[:, :, None, None]
        return x * alpha + beta

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        return diagonal_pattern(be, int(np.prod(in_shape)), index_dtype), {"in_shape": in_shape}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        self._check_frozen_dtype(x)
        _, height, width = aux["in_shape"]
        return be.xp.repeat(self._scale_shift(be)[0], height * width)

    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """``weight`` and ``bias`` gradients (paper Eq. 2), summed over the batch and the pixels like
        PyTorch (those the layer has: none when ``affine=False``). On ``x``'s device, wherever the
        backward ran."""
        x = self._checked(x)
        if not self.affine:
            return {}
        be = _backend.of(x)
        grad = be.asarray(grad_out).reshape(x.shape)
        xp = _backend.of(self._running_var).xp
        statistics = xp.stack([self._running_mean.astype(np.float64),
                               1.0 / xp.sqrt(self._running_var.astype(np.float64) + self.eps)])
        mean, invstd = be.asarray(statistics.astype(self._dtype))[:, :, None, None]
        grads = {"weight": (grad * ((x - mean) * invstd)).sum(axis=(0, 2, 3))}
        if self._bias is not None:
            grads["bias"] = grad.sum(axis=(0, 2, 3))
        return grads

    def __repr__(self) -> str:
        return (f"BatchNorm2d({self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self._bias is not None}, "
                f"track_running_stats={self.track_running_stats})")
