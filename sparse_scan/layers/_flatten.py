"""Flatten: a reshape whose transposed Jacobian is the identity."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import integer
from .._types import Array
from ..csr import Pattern
from ._base import Layer, Shape, diagonal_pattern

__all__ = ["Flatten"]


class Flatten(Layer):
    """Flatten dimensions ``start_dim..end_dim`` (counted with the batch axis, like PyTorch).

    Parameters
    ----------
    start_dim, end_dim : int
        PyTorch's defaults (1, -1) flatten every per-sample axis.
    """

    jacobian_kind = "diagonal"
    sample_independent = True

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim = integer(start_dim, f"layer {self.label}: start_dim")
        self.end_dim = integer(end_dim, f"layer {self.label}: end_dim")

    def _axes(self, ndim: int) -> tuple[int, int]:
        start = self.start_dim + ndim if self.start_dim < 0 else self.start_dim
        end = self.end_dim + ndim if self.end_dim < 0 else self.end_dim
        if not 1 <= start <= end < ndim:
            raise self._error(
                "start_dim/end_dim",
                f"({self.start_dim}, {self.end_dim}) do not select per-sample axes of a "
                f"{ndim}-d batch",
            )
        return start, end

    def output_shape(self, in_shape: Shape) -> Shape:
        full = (1,) + tuple(in_shape)
        start, end = self._axes(len(full))
        merged = int(np.prod(full[start : end + 1]))
        return full[1:start] + (merged,) + full[end + 1 :]

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        self._axes(len(shape) + 1)
        return shape

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        return x.reshape((x.shape[0],) + self.output_shape(x.shape[1:]))

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        return diagonal_pattern(be, int(np.prod(in_shape)), index_dtype), {}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return be.xp.ones(pattern.nnz, dtype=x.dtype)

    def __repr__(self) -> str:
        return f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim})"
