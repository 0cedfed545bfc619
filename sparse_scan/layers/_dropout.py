"""Dropout: PyTorch's ``nn.Dropout``, a per-sample diagonal mask drawn anew by every forward.

In training mode each forward zeroes every element with probability ``p`` and scales the others by
``1 / (1 - p)`` (PyTorch's rule: ``mask / (1 - p)`` in the input's dtype); the layer keeps that scaled
mask, and its transposed Jacobian is the diagonal holding it (``jacobian_kind = "diagonal"``, one
mask per sample). In eval mode it is the identity.

The mask is drawn where the input lives, from a counter-based generator: each forward takes one
64-bit seed from the layer's NumPy ``Generator`` (``rng=``), and element ``i`` of the flattened batch
keeps its value when ``u_i >= p``, with ``u_i`` the top 53 bits of SplitMix64's ``i``-th output for
that seed (``mix(seed + (i + 1) * 0x9E3779B97F4A7C15)``) as a float in ``[0, 1)``. Integer arithmetic
wraps modulo 2**64 alike in NumPy and CuPy, so a seed gives the same masks on the CPU and the GPU,
nothing is uploaded, and the same ``rng`` seed reproduces the same sequence of masks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import as_rng, number
from .._types import Array, RngLike
from ..csr import Pattern
from ._base import Layer, Shape, diagonal_pattern

__all__ = ["Dropout"]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def uniform_counter(xp: Any, seed: np.uint64, count: int) -> Array:
    """``count`` floats in ``[0, 1)``: SplitMix64's first ``count`` outputs for ``seed``, top 53 bits.

    The same values on NumPy and CuPy (``xp``): integer products and sums wrap modulo 2**64 in both.

    Examples
    --------
    >>> import numpy as np
    >>> u = uniform_counter(np, np.uint64(1234567), 100_000)
    >>> bool(u.min() >= 0 and u.max() < 1), round(float(u.mean()), 2)
    (True, 0.5)
    """
    z = xp.arange(1, count + 1, dtype=xp.uint64) * _GAMMA + seed
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(xp.float64) * (2.0 ** -53)


def scaled_mask(xp: Any, keep: Array, p: float, dtype: Any) -> Array:
    """PyTorch's dropout factor: ``keep / (1 - p)`` in ``dtype`` (zeros when ``p == 1``)."""
    dtype = np.dtype(dtype)
    if p == 1:
        return xp.zeros(keep.shape, dtype=dtype)
    return keep.astype(dtype) / dtype.type(1 - p)


class Dropout(Layer):
    """PyTorch's ``nn.Dropout`` on a batch of any per-sample shape.

    Parameters
    ----------
    p : float
        The probability of zeroing an element, in ``[0, 1]`` (PyTorch's default 0.5).
    training : bool
        PyTorch's mode (a module starts in training mode): masks in training mode, the identity in
        eval mode (:meth:`eval`).
    rng : numpy.random.Generator or int, optional
        The source of the masks' seeds: one per forward in training mode.

    Notes
    -----
    In training mode :meth:`transposed_jacobian` gives the diagonal of the mask that the last
    :meth:`forward` drew (its input must have that forward's batch shape), so run the forward first,
    as :class:`~sparse_scan.Sequential` does. Changing the mode forgets the mask.

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import Dropout
    >>> drop = Dropout(0.25, rng=0)
    >>> x = np.ones((2, 3, 4))
    >>> y = drop(x)
    >>> sorted(np.unique(y).tolist())
    [0.0, 1.3333333333333333]
    >>> jt = drop.transposed_jacobian(x)
    >>> jt.shape, jt.data.shape, bool((jt.data == y.reshape(2, -1)).all())
    ((12, 12), (2, 12), True)
    >>> bool((Dropout(0.25, rng=0)(x) == y).all())      # the same seed, the same masks
    True
    >>> bool((drop.eval()(x) == x).all())
    True
    """

    jacobian_kind = "diagonal"
    sample_independent = False

    def __init__(self, p: float = 0.5, *, training: bool = True, rng: RngLike = None) -> None:
        super().__init__()
        self.p = number(p, f"layer {self.label}: p", 0.0)
        if self.p > 1:
            raise self._error("p", f"dropout probability has to be between 0 and 1, got {p!r}")
        self._rng = as_rng(rng)
        self.training = training  # (and no mask yet)

    def _mode_set(self) -> None:
        self._mask = None  # a mask belongs to the mode that drew it

    # --- the protocol ----------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        if not self.training:
            return x
        xp = _backend.of(x).xp
        batch, size = x.shape[0], math.prod(x.shape[1:])
        seed = self._rng.integers(0, 2**64, dtype=np.uint64)
        keep = uniform_counter(xp, seed, batch * size).reshape(batch, size) >= self.p
        self._mask = scaled_mask(xp, keep, self.p, x.dtype)
        return x * self._mask.reshape(x.shape)

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        return diagonal_pattern(be, math.prod(in_shape), index_dtype), {}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        shape = (x.shape[0], pattern.shape[0])
        if not self.training:
            return be.xp.ones(shape, dtype=x.dtype)
        if self._mask is None:
            raise self._error("input", "no mask: in training mode the Jacobian is that of the last "
                              "forward's mask; call forward(x) first (or eval() for the identity)")
        if tuple(self._mask.shape) != shape:
            raise self._error("input", f"batch shape {tuple(x.shape)} differs from the last forward's "
                              f"({self._mask.shape[0]} samples of {self._mask.shape[1]} elements), whose "
                              "mask the Jacobian holds")
        return be.asarray(self._mask).astype(x.dtype, copy=False)

    def __repr__(self) -> str:
        return f"Dropout(p={self.p}, inplace=False)"
