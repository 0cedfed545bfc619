"""A learnable scale per channel: ConvNeXt's ``layer_scale`` (``x * gamma``, ``gamma`` of shape
``(C, 1, 1)``), timm's ``LayerScale2d``.

Its transposed Jacobian is diagonal (``jacobian_kind = "diagonal"``: products with it are scalings),
each element of channel ``c`` holding ``gamma[c]``, the same for every sample (``sample_independent``:
values ``(nnz,)``). The parameter gradient (paper Eq. 2) is ``sum(g * x)`` over the batch and the pixels
of each channel. The fills are array expressions, identical on NumPy and CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import integer, number
from .._types import Array
from ..csr import Pattern
from ._base import Shape, diagonal_pattern
from ._normalization import ParameterLayer

__all__ = ["LayerScale"]


class LayerScale(ParameterLayer):
    """``x * gamma`` per channel of a batch ``(B, C, H, W)``, ``gamma`` of shape ``(C, 1, 1)`` (ConvNeXt's
    ``layer_scale`` parameter; timm's ``LayerScale2d`` holds it as ``(C,)``: reshape it to assign it).

    Parameters
    ----------
    dim : int
        The channels ``C``.
    init_values : float
        ``gamma``'s initial value in every channel (timm's default 1e-5; torchvision's ConvNeXt 1e-6).
    dtype : numpy dtype, optional
        float32 (default) or float64, for ``gamma`` and the inputs it takes.

    Attributes
    ----------
    gamma : ndarray, shape (dim, 1, 1)

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import LayerScale
    >>> scale = LayerScale(2, dtype=np.float64)
    >>> scale.gamma = np.array([2.0, -1.0]).reshape(2, 1, 1)
    >>> x = np.ones((3, 2, 2, 2))
    >>> scale(x)[0, :, 0, 0]
    array([ 2., -1.])
    >>> jt = scale.transposed_jacobian(x)
    >>> jt.data, bool(jt.shared)
    (array([ 2.,  2.,  2.,  2., -1., -1., -1., -1.]), True)
    >>> scale.parameter_gradients(x, np.ones_like(x))["gamma"].ravel()
    array([12., 12.])
    """

    jacobian_kind = "diagonal"
    sample_independent = True
    parameter_names = ("gamma",)

    def __init__(self, dim: int, init_values: float = 1e-5, *, dtype: Any = None) -> None:
        super().__init__(dtype)
        self.dim = integer(dim, f"layer {self.label}: dim", 1)
        self.init_values = number(init_values, f"layer {self.label}: init_values")
        self._gamma = np.full((self.dim, 1, 1), self.init_values, self._dtype)

    @property
    def gamma(self) -> np.ndarray:
        """The scale per channel, shape ``(dim, 1, 1)``."""
        return self._gamma

    @gamma.setter
    def gamma(self, value: Any) -> None:
        self._gamma = self._checked_parameter("gamma", value, (self.dim, 1, 1))

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 3 or shape[0] != self.dim:
            raise self._error("input", f"expected a per-sample shape (C, H, W) with C = {self.dim} (dim), "
                              f"got {list(shape)}")
        return shape

    def _checked(self, x: Array) -> Array:
        x = self._check_input(x)
        self._check_dtype(x)
        return x

    def forward(self, x: Array) -> Array:
        x = self._checked(x)
        return x * _backend.of(x).asarray(self._gamma)

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        pixels = in_shape[1] * in_shape[2]
        return diagonal_pattern(be, int(np.prod(in_shape)), index_dtype), {"pixels": pixels}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        self._check_dtype(x)
        return be.xp.repeat(be.asarray(self._gamma).ravel(), aux["pixels"])

    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """The ``gamma`` gradient (paper Eq. 2), summed over the batch and the pixels, shape ``(dim, 1,
        1)``; on ``x``'s device."""
        x = self._checked(x)
        grad = _backend.of(x).asarray(grad_out).reshape(x.shape)
        return {"gamma": (grad * x).sum(axis=(0, 2, 3)).reshape(self.dim, 1, 1)}

    def __repr__(self) -> str:
        return f"LayerScale({self.dim}, init_values={self.init_values})"
