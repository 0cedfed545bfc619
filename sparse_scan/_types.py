"""Type aliases shared by the package (no runtime cost: the aliases are :data:`typing.Any`)."""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array", "RngLike"]

Array: TypeAlias = Any
"""A NumPy or CuPy ``ndarray`` (CuPy is optional, so the alias cannot name its type): annotations say
"an array here", where ``Any`` said nothing."""

RngLike: TypeAlias = Any
"""A source of random numbers an argument may be: a ``numpy.random.Generator``, a seed (int) or None
(fresh entropy); :func:`sparse_scan._checks.as_rng` makes the Generator."""
