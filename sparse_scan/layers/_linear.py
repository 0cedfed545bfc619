"""Linear (fully connected) layer: ``y = x W^T + b``; its transposed Jacobian is ``W^T``. Pruned, its
forward and weight gradient are the pruned 1x1 convolution's (:mod:`~sparse_scan.layers._conv_pruned`),
costing in proportion to the kept weights."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._checks import flag, integer
from .._types import Array, RngLike
from ..csr import Pattern, choose_index_dtype
from ..engine.plan import WeightsPath
from ._base import Shape
from ._conv_pruned import LINEAR_DIRECT_MAX_DENSITY, direct_forward, linear_geometry
from ._weighted import WeightedLayer

__all__ = ["Linear"]


class Linear(WeightedLayer):
    """PyTorch's ``nn.Linear`` on a batch of vectors ``(B, in_features)``.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
    dtype : numpy dtype, optional
        float32 (default) or float64.
    rng : numpy.random.Generator or int, optional
        Source of the PyTorch-style uniform initialisation.
    prune_pattern : bool
        Drop exactly-zero weights from the Jacobian's pattern.

    Attributes
    ----------
    weight : ndarray, shape (out_features, in_features)
    bias : ndarray, shape (out_features,), or None
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: Any = None,
        rng: RngLike = None,
        prune_pattern: bool = False,
    ) -> None:
        self.in_features = integer(in_features, "layer Linear: in_features", 1)
        self.out_features = integer(out_features, "layer Linear: out_features", 1)
        super().__init__(
            (self.out_features, self.in_features), flag(bias, "layer Linear: bias"), self.in_features,
            dtype, rng, prune_pattern
        )

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if shape != (self.in_features,):
            raise self._error(
                "input",
                f"expected per-sample shape ({self.in_features},), got {shape}"
                + ("; add a Flatten layer before it" if len(shape) > 1 else ""),
            )
        return shape

    def output_shape(self, in_shape: Shape) -> Shape:
        self.check_in_shape(in_shape)
        return (self.out_features,)

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        self._check_input_dtype(x)
        be = _backend.of(x)
        pruned = self._direct_pruned()
        if pruned is not None:
            y = direct_forward(be, linear_geometry(self.in_features, self.out_features), pruned,
                               self._kept_values(be, pruned), x.reshape(x.shape[0], -1, 1, 1), self.bias)
            if y is not None:
                return y.reshape(x.shape[0], -1)
        y = x @ be.asarray(self.weight).T
        return y if self.bias is None else y + be.asarray(self.bias)

    def _direct_max_density(self) -> float:
        return LINEAR_DIRECT_MAX_DENSITY

    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """``weight`` and ``bias`` gradients (paper Eq. 2), summed over the batch like PyTorch; pruned
        weights: the kept weights' alone, a sampled product (:attr:`sampled_gradient`)."""
        x = self._check_input(x)
        be = _backend.of(x)
        grad = be.asarray(grad_out)  # on x's device, wherever the backward ran
        batch = x.shape[0]
        grads = {"weight": self._weight_gradient(
            be, linear_geometry(self.in_features, self.out_features), x.reshape(batch, -1, 1, 1),
            grad.reshape(batch, -1, 1, 1), lambda: grad.T @ x)}
        if self.bias is not None:
            grads["bias"] = grad.sum(axis=0)
        return grads

    def pattern_nnz(self, in_shape: Shape) -> int:
        self.check_in_shape(in_shape)
        if self.prune_pattern:
            self._structure_key()  # a non-finite weight cannot define a pruned pattern
            return int(np.count_nonzero(self._support()))
        return self.in_features * self.out_features

    def weights_path(self, in_shape: Shape) -> WeightsPath:
        """The GEMM ``g W``: ``in_features · out_features`` multiply-adds per sample."""
        self.check_in_shape(in_shape)
        return WeightsPath(self.in_features * self.out_features, weights=self.in_features * self.out_features)

    def weights_matvec(self, in_shape: Shape, device: str = "cpu") -> Callable[[Array], Array]:
        """``JT @ g = g W`` for a batch ``g`` of ``(B, out_features)``: one GEMM."""
        self.check_in_shape(in_shape)
        weight = _backend.get(device).asarray(self.weight)
        return lambda grad_out: grad_out @ weight

    def _structural_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, Array]:
        n_in, n_out = self.in_features, self.out_features
        dtype = choose_index_dtype(n_in * n_out, n_out, index_dtype)
        xp = be.xp
        indptr = xp.arange(n_in + 1, dtype=dtype) * dtype.type(n_out)
        indices = xp.tile(xp.arange(n_out, dtype=dtype), n_in)
        # entry (i, o) holds weight[o, i], flat index o * n_in + i
        widx = (xp.arange(n_out, dtype=dtype)[None, :] * dtype.type(n_in)
                + xp.arange(n_in, dtype=dtype)[:, None]).ravel()
        return Pattern(indptr, indices, (n_in, n_out)), widx

    def _structured_values(self, be: _backend.Backend, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return be.asarray(self.weight).T.ravel()

    def __repr__(self) -> str:
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None})")
