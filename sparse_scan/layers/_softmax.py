"""Softmax and LogSoftmax over the features of a flat sample (PyTorch's ``dim=1`` of a ``(B, n)`` batch).

Their per-sample Jacobians are dense ``n × n`` blocks: with ``s = softmax(x)``,

- ``log_softmax``: ``d y_i / d x_j = δ_ij - s_j``, so ``JT[j, i] = δ_ij - s_j`` (``JT @ g = g - s Σ g``);
- ``softmax``: ``d y_i / d x_j = s_i (δ_ij - s_j)``, so ``JT[j, i] = s_i (δ_ij - s_j)``
  (``JT @ g = s (g - Σ s g)``, PyTorch's backward).

The pattern is the full block (``n²`` entries, rows in order, columns sorted), the values are filled per
sample with array expressions, identical on NumPy and CuPy. A classifier's last layer (``n`` its
classes) is where people put them; a wide ``n`` costs ``n²`` values per sample.
"""

from __future__ import annotations

from typing import Any

from .. import backend as _backend
from .._checks import is_int
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._base import Layer, Shape

__all__ = ["LogSoftmax", "Softmax"]


class _OverFeatures(Layer):
    """What Softmax and LogSoftmax share: ``dim`` 1 (or -1) of a flat sample, a dense JT block."""

    jacobian_kind = "general"

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        if not is_int(dim) or dim not in (1, -1):
            raise ValueError(f"layer {self.label}: dim: must be 1 or -1 (the features of a flat sample: "
                             f"a batch (B, n)), got {dim!r}")
        self.dim = int(dim)

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 1:
            raise self._error("input", f"{type(self).__name__} runs over the features of a flat sample "
                              f"(a batch (B, n)), got per-sample shape {list(shape)}; flatten first")
        return shape

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        self.check_in_shape(x.shape[1:])
        return self._apply(x)

    def _softmax(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        e = xp.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def _apply(self, x: Array) -> Array:
        raise NotImplementedError

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        batch, size = x.shape[0], x.shape[1]
        block = self._block(self._softmax(x.reshape(batch, size)), be.xp.eye(size, dtype=x.dtype))
        return block.reshape(batch, size * size)

    def _block(self, s: Array, eye: Array) -> Array:
        """Every sample's JT ``[b, j, i]`` from its softmax ``s`` ``(B, n)`` and the identity."""
        raise NotImplementedError

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        (size,) = in_shape
        dtype = choose_index_dtype(size * size, size, index_dtype)
        indptr = be.xp.arange(0, size * size + 1, size, dtype=dtype)
        indices = be.xp.tile(be.xp.arange(size, dtype=dtype), size)
        return Pattern(indptr, indices, (size, size)), {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


class LogSoftmax(_OverFeatures):
    """``x - log Σ exp(x)`` over the features; PyTorch's ``nn.LogSoftmax(dim=1)`` on ``(B, n)``.

    Parameters
    ----------
    dim : {1, -1}
        The feature axis of a ``(B, n)`` batch.

    Examples
    --------
    >>> import numpy as np
    >>> layer = LogSoftmax(dim=1)
    >>> x = np.array([[0.0, np.log(3.0)]])
    >>> np.round(np.exp(layer.forward(x)), 6)
    array([[0.25, 0.75]])
    >>> layer.transposed_jacobian(x).todense()[0]
    array([[ 0.75, -0.25],
           [-0.75,  0.25]])
    """

    def _apply(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        shifted = x - x.max(axis=1, keepdims=True)
        return shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))

    def _block(self, s: Array, eye: Array) -> Array:
        return eye[None] - s[:, :, None]  # [b, j, i] = δ_ij - s_j


class Softmax(_OverFeatures):
    """``exp(x) / Σ exp(x)`` over the features; PyTorch's ``nn.Softmax(dim=1)`` on ``(B, n)``.

    Parameters
    ----------
    dim : {1, -1}
        The feature axis of a ``(B, n)`` batch.

    Examples
    --------
    >>> import numpy as np
    >>> layer = Softmax(dim=-1)
    >>> x = np.array([[0.0, np.log(3.0)]])
    >>> np.round(layer.forward(x), 6)
    array([[0.25, 0.75]])
    >>> np.round(layer.transposed_jacobian(x).todense()[0], 6)
    array([[ 0.1875, -0.1875],
           [-0.1875,  0.1875]])
    """

    def _apply(self, x: Array) -> Array:
        return self._softmax(x)

    def _block(self, s: Array, eye: Array) -> Array:
        return s[:, None, :] * (eye[None] - s[:, :, None])  # [b, j, i] = s_i (δ_ij - s_j)

