"""What a run's gradients tell the cost model: how many of their values are subnormal (issue 38).

On x86 processors a multiply whose operand or result is subnormal (``0 < |v| <`` the dtype's smallest
normal number, 1.2e-38 in float32) takes a microcode assist: tens of cycles instead of one. A deep
chain whose gradient vanishes passes through a band of layers where it is subnormal before it
underflows to zero, and every product from those vectors slows down: measured on 2 cores, the
512-layer ``Linear(64, 64)`` + ``Tanh`` MLP at batch 16, whose gradient holds 59,601 subnormal values
over 88 of its 513 vectors, takes 16.4 ms to back-propagate against 11.2 ms with the upstream gradient
scaled by 1e30 (none subnormal), and hybrid 1, whose SpMVs run scalar compiled loops, 167 ms against
74 ms. That depends on the values, not on the schedule: nothing counted before a backward sees it.

So the host run observes it (:class:`SubnormalWatch`, on :data:`OBSERVE_EVERY`'s schedule), and the
cost model weighs the multiply-adds of the matrix-vector products that read a subnormal value
(:func:`sparse_scan.engine.cost.sparse_features`: ``mv_subnormal`` for the compiled SpMVs,
``gemm_subnormal`` for the GEMMs through a layer's weights and the scalings by a diagonal). Before the
first observation none are counted (a lower bound). Flushing subnormals to zero would remove the
slowdown but change the gradients, which the engine never does. The GPU handles subnormals at full
speed: its cost model weighs them 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .._types import Array
from ._kernels import subnormal_count

__all__ = ["OBSERVE_EVERY", "SubnormalWatch", "Subnormals", "count_subnormals"]

OBSERVE_EVERY = 64
"""A model observes the subnormal values of its first host backward at each batch size, then of every
``OBSERVE_EVERY``-th backward at that size (the schedule does not matter: every schedule computes the
same gradients). Counting costs about 0.7 µs per gradient and 0.3 ns per value (0.37 ms at batch 1
and 0.50 ms at batch 16 over the 513 gradients of a 512-layer MLP of width 64, 3-4 % of its
backward): well under 0.1 % of a backward once amortised."""


@dataclass(frozen=True)
class Subnormals:
    """The subnormal values of one backward's gradients.

    Attributes
    ----------
    batch : int
        The samples of the backward observed.
    values : tuple of int
        ``values[i]``: the subnormal entries of the gradient w.r.t. ``x_i`` over the batch
        (``i = 0..n``, :attr:`~sparse_scan.engine.plan.ScanPlan.outputs`' order).
    sizes : tuple of int
        ``sizes[i]``: the entries per sample of that gradient; a plan weighs the observation only
        where its gradients have these sizes (:meth:`fits`).

    Examples
    --------
    >>> seen = Subnormals(2, (0, 6, 2), (4, 4, 3))
    >>> seen.per_sample(1), seen.total, seen.fits((4, 4, 3)), seen.fits((8, 8, 6))
    (3.0, 8, True, False)
    """

    batch: int
    values: tuple[int, ...]
    sizes: tuple[int, ...]

    @functools.cached_property
    def total(self) -> int:
        """Subnormal entries over every gradient (summed once: :meth:`bucket` is read by every
        ``auto`` plan lookup)."""
        return sum(self.values)

    def per_sample(self, i: int) -> float:
        """The subnormal entries of gradient ``i`` per sample of the backward observed."""
        return self.values[i] / self.batch

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether the observation is of gradients of these sizes per sample (a plan's, in its
        ``outputs`` order): the same layers, the same input shape."""
        return tuple(sizes) == self.sizes

    def bucket(self) -> int:
        """A coarse key of the observation, on which an ``auto`` choice depends: 0 for fewer than one
        subnormal entry per sample, else 1 + the octave of the entries per sample."""
        per_sample = self.total / self.batch
        return 0 if per_sample < 1 else 1 + int(math.log2(per_sample))


_TINY = {np.dtype(t): np.dtype(t).type(np.finfo(t).tiny) for t in (np.float32, np.float64)}
"""The smallest normal number of each dtype counted. float16 gradients are not counted: NumPy
multiplies them in float32, where their subnormal values are normal."""


def count_subnormals(gradients: Sequence[Array]) -> Subnormals:
    """:class:`Subnormals` of host gradients ``(B, ...)`` (NumPy arrays): one compiled pass over each
    float32 or float64 gradient; other dtypes count 0."""
    batch = int(gradients[0].shape[0]) if gradients else 1
    values, sizes = [], []
    for gradient in gradients:
        size = int(np.prod(gradient.shape[1:], dtype=np.int64))
        sizes.append(size)
        tiny = _TINY.get(gradient.dtype)
        if tiny is None or gradient.size == 0:
            values.append(0)
            continue
        flat = gradient if gradient.ndim == 2 else gradient.reshape(gradient.shape[0], size)
        values.append(int(subnormal_count(flat, tiny)))
    return Subnormals(max(batch, 1), tuple(values), tuple(sizes))


class SubnormalWatch:
    """When a model observes its gradients' subnormal values, and the last observation.

    :meth:`observe` is called after every host backward with its gradients; it counts them on
    :data:`OBSERVE_EVERY`'s schedule, per batch size, and keeps the newest count as :attr:`last`.

    Parameters
    ----------
    every : int, optional
        Count every ``every``-th backward of a batch size (its first included); 0 never counts.

    Attributes
    ----------
    every : int
    last : Subnormals or None
        The newest count (None before the first).

    Examples
    --------
    >>> watch = SubnormalWatch(every=2)
    >>> g = [np.full((1, 3), 1e-40, dtype=np.float32), np.ones((1, 3), dtype=np.float32)]
    >>> [watch.observe(g) for _ in range(3)]
    [True, False, True]
    >>> watch.last
    Subnormals(batch=1, values=(3, 0), sizes=(3, 3))
    """

    def __init__(self, every: int = OBSERVE_EVERY) -> None:
        self.every = int(every)
        self.last: Subnormals | None = None
        self._since: dict[int, int] = {}  # per batch size: backwards since its last count

    def observe(self, gradients: Sequence[Array]) -> bool:
        """Count ``gradients`` if it is time to.

        Parameters
        ----------
        gradients : sequence of ndarray
            A host backward's gradients, ``(B, ...)`` each.

        Returns
        -------
        bool
            Whether they were counted: the first backward at this batch size ``B``, or the
            :attr:`every`-th since its last count (never where :attr:`every` is 0).
        """
        if self.every <= 0:
            return False
        batch = int(gradients[0].shape[0]) if gradients else 0
        since = self._since.get(batch)
        if since is not None and since + 1 < self.every:
            self._since[batch] = since + 1
            return False
        self.last, self._since[batch] = count_subnormals(gradients), 0
        return True

    def __call__(self) -> Subnormals | None:
        """The last observation (None before the first)."""
        return self.last
