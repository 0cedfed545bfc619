"""Type aliases shared by the package (no runtime cost: the aliases are :data:`typing.Any`)."""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array"]

Array: TypeAlias = Any
"""A NumPy or CuPy ``ndarray`` (CuPy is optional, so the alias cannot name its type): annotations say
"an array here", where ``Any`` said nothing."""
