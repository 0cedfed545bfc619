"""Elementwise activations: ReLU, LeakyReLU, Tanh, Sigmoid.

Their transposed Jacobian is diagonal (``jacobian_kind = "diagonal"``): the pattern is the identity's,
and the values are the elementwise derivative, input-dependent zeros (ReLU's off units) kept explicit.
The values fill is an elementwise array expression, identical on NumPy and CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import number
from ..csr import Pattern
from ._base import Layer, Shape, diagonal_pattern

__all__ = ["LeakyReLU", "ReLU", "Sigmoid", "Tanh"]


class _Elementwise(Layer):
    jacobian_kind = "diagonal"

    def forward(self, x: Any) -> Any:
        return self._apply(self._check_input(x))

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        return diagonal_pattern(be, int(np.prod(in_shape)), index_dtype), {}

    def _values(self, be: _backend.Backend, x: Any, pattern: Pattern, aux: dict[str, Any]) -> Any:
        return self._derivative(x.reshape(x.shape[0], -1))

    def _apply(self, x: Any) -> Any:
        raise NotImplementedError

    def _derivative(self, x: Any) -> Any:
        """``d f(x) / dx`` elementwise, in ``x``'s dtype and array module."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReLU(_Elementwise):
    """``max(x, 0)``; derivative 1 where ``x > 0``, else 0 (PyTorch's convention at 0)."""

    def _apply(self, x: Any) -> Any:
        return x * (x > 0)

    def _derivative(self, x: Any) -> Any:
        return (x > 0).astype(x.dtype)


class LeakyReLU(_Elementwise):
    """``x`` where ``x > 0``, ``negative_slope * x`` elsewhere.

    Parameters
    ----------
    negative_slope : float
        Slope for ``x <= 0`` (PyTorch's default 0.01).
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.negative_slope = number(negative_slope, f"layer {self.label}: negative_slope")

    def _apply(self, x: Any) -> Any:
        return x * self._derivative(x)

    def _derivative(self, x: Any) -> Any:
        xp = _backend.of(x).xp
        return xp.where(x > 0, x.dtype.type(1), x.dtype.type(self.negative_slope))

    def __repr__(self) -> str:
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class Tanh(_Elementwise):
    """``tanh(x)``; derivative ``1 - tanh(x)**2``."""

    def _apply(self, x: Any) -> Any:
        return _backend.of(x).xp.tanh(x)

    def _derivative(self, x: Any) -> Any:
        y = self._apply(x)
        return 1 - y * y


class Sigmoid(_Elementwise):
    """``1 / (1 + exp(-x))``; derivative ``s (1 - s)``."""

    def _apply(self, x: Any) -> Any:
        xp = _backend.of(x).xp
        # exp of a non-positive argument only: no overflow warnings for large |x|.
        e = xp.exp(-xp.abs(x))
        return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)

    def _derivative(self, x: Any) -> Any:
        s = self._apply(x)
        return s * (1 - s)
