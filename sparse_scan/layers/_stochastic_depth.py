"""Stochastic depth: torchvision's ``StochasticDepth`` (``torchvision.ops.stochastic_depth``) and timm's
``DropPath``, which drop whole samples (``mode="row"``) or the whole batch (``mode="batch"``).

In training mode a forward keeps each row (or the batch) with probability ``1 - p`` and multiplies it
by ``1 / (1 - p)`` (torchvision's ``noise.div_(survival_rate)``: the mask in the input's dtype divided by
``1 - p``; ``DropPath(scale_by_keep=False)`` leaves the kept rows as they are), zeros where ``p == 1``.
The identity in eval mode and wherever ``p == 0`` (PyTorch draws no mask then). The layer keeps the
last forward's mask, and its transposed Jacobian is the diagonal holding it (``jacobian_kind =
"diagonal"``): per sample for ``row`` (values ``(B, n)``), the same for every sample for ``batch``
(``sample_independent``: values ``(n,)``).

The masks come from the engine's own generator, as :class:`~sparse_scan.layers.Dropout`'s: each forward
takes one 64-bit seed from the layer's ``rng`` and draws SplitMix64 uniforms where the input lives
(:func:`~sparse_scan.layers._dropout.uniform_counter`; one per row, or one for the batch), a row kept
where its uniform is at least ``p``: the same seed gives the same masks on the CPU and the GPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import as_rng, flag, number
from .._types import Array, RngLike
from ..csr import Pattern
from ._base import Layer, Shape, diagonal_pattern
from ._dropout import scaled_mask, uniform_counter

__all__ = ["DropPath", "StochasticDepth"]

STOCHASTIC_DEPTH_MODES = ("row", "batch")


class _DropSamples(Layer):
    """What StochasticDepth and DropPath share: masks of whole rows or of the batch, their diagonal JT."""

    jacobian_kind = "diagonal"

    def __init__(self, p: float, mode: str, scale: bool, training: bool, rng: RngLike, field: str) -> None:
        super().__init__()
        self._p = number(p, f"layer {self.label}: {field}", 0.0)
        if self._p > 1:
            raise self._error(field, f"drop probability has to be between 0 and 1, but got {p!r}")
        if mode not in STOCHASTIC_DEPTH_MODES:
            raise self._error("mode", f"must be one of {', '.join(STOCHASTIC_DEPTH_MODES)}, got {mode!r}")
        self._mode = mode
        self._scale = scale
        self._rng = as_rng(rng)
        self.training = training  # (and no mask yet)

    @property
    def sample_independent(self) -> bool:  # type: ignore[override]
        """``batch`` mode: one mask for every sample of the batch."""
        return self._mode == "batch"

    def _mode_set(self) -> None:
        self._mask = None  # a mask belongs to the mode that drew it

    def _identity(self) -> bool:
        """Eval mode or ``p == 0``: no mask drawn, nothing multiplied."""
        return not self.training or self._p == 0

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        if self._identity():
            return x
        xp = _backend.of(x).xp
        rows = x.shape[0] if self._mode == "row" else 1
        seed = self._rng.integers(0, 2**64, dtype=np.uint64)
        keep = uniform_counter(xp, seed, rows) >= self._p
        self._mask = scaled_mask(xp, keep, self._p, x.dtype) if self._scale else keep.astype(x.dtype)
        return x * self._mask.reshape((rows,) + (1,) * (x.ndim - 1))

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        return diagonal_pattern(be, math.prod(in_shape), index_dtype), {}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        size = pattern.shape[0]
        shape = (size,) if self.sample_independent else (x.shape[0], size)
        if self._identity():
            return be.xp.ones(shape, dtype=x.dtype)
        if self._mask is None:
            raise self._error("input", "no mask: in training mode the Jacobian is that of the last forward's "
                              "mask; call forward(x) first (or eval() for the identity)")
        mask = be.asarray(self._mask).astype(x.dtype, copy=False)
        if self.sample_independent:
            return be.xp.repeat(mask[:1], size)
        if mask.shape[0] != x.shape[0]:
            raise self._error("input", f"batch of {x.shape[0]} samples, the last forward's had "
                              f"{mask.shape[0]}: the Jacobian holds that forward's mask")
        return be.xp.repeat(mask[:, None], size, axis=1)


class StochasticDepth(_DropSamples):
    """torchvision's ``StochasticDepth(p, mode)``: in training mode each row (``mode="row"``) or the
    whole batch (``"batch"``) is zeroed with probability ``p``, the rest scaled by ``1 / (1 - p)``.

    Parameters
    ----------
    p : float
        The probability of dropping, in ``[0, 1]``.
    mode : {"row", "batch"}
        Whether each sample draws its own mask or the batch one.
    training : bool
        PyTorch's mode (a module starts in training mode): masks in training mode, the identity in eval
        mode.
    rng : numpy.random.Generator or int, optional
        The source of the masks' seeds: one per forward in training mode.

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import StochasticDepth
    >>> drop = StochasticDepth(0.5, "row", rng=0)
    >>> x = np.ones((4, 2, 3))
    >>> y = drop(x)
    >>> y[:, 0, 0], bool(all((y[b] == y[b, 0, 0]).all() for b in range(4)))   # whole rows
    (array([2., 2., 2., 0.]), True)
    >>> drop.transposed_jacobian(x).data[:, 0]
    array([2., 2., 2., 0.])
    >>> bool((drop.eval()(x) == x).all())
    True
    >>> whole = StochasticDepth(0.5, "batch", rng=1)
    >>> _ = whole(x)
    >>> whole.transposed_jacobian(x).data.shape                  # one mask for the batch: shared
    (6,)
    """

    def __init__(self, p: float, mode: str, *, training: bool = True, rng: RngLike = None) -> None:
        super().__init__(p, mode, True, training, rng, "p")

    @property
    def p(self) -> float:
        """The probability of dropping."""
        return self._p

    @property
    def mode(self) -> str:
        """``row`` or ``batch`` (read only: the plan's sharing of JT values depends on it)."""
        return self._mode

    def __repr__(self) -> str:
        return f"StochasticDepth(p={self._p}, mode={self._mode})"


class DropPath(_DropSamples):
    """timm's ``DropPath(drop_prob=0.0, scale_by_keep=True)``: each row is zeroed with probability
    ``drop_prob`` in training mode, the rest scaled by ``1 / (1 - drop_prob)`` (``scale_by_keep``).

    Parameters
    ----------
    drop_prob : float
        The probability of dropping a row, in ``[0, 1]``.
    scale_by_keep : bool
        Whether kept rows are divided by ``1 - drop_prob``.
    training : bool
        PyTorch's mode (a module starts in training mode).
    rng : numpy.random.Generator or int, optional
        The source of the masks' seeds: one per forward in training mode.

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import DropPath
    >>> drop = DropPath(0.5, scale_by_keep=False, rng=0)
    >>> drop(np.ones((4, 3)))[:, 0]
    array([1., 1., 1., 0.])
    >>> DropPath(0.1)
    DropPath(drop_prob=0.100)
    """

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True, *, training: bool = True,
                 rng: RngLike = None) -> None:
        keep = flag(scale_by_keep, "layer DropPath: scale_by_keep")
        super().__init__(drop_prob, "row", keep, training, rng, "drop_prob")

    @property
    def drop_prob(self) -> float:
        """The probability of dropping a row."""
        return self._p

    @property
    def scale_by_keep(self) -> bool:
        """Whether kept rows are divided by ``1 - drop_prob``."""
        return self._scale

    def __repr__(self) -> str:
        return f"DropPath(drop_prob={round(self._p, 3):0.3f})"
