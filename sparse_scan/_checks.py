"""Argument checks shared by the public entry points (layers, recurrent modules, specs, schedules):
exact types, no silent coercion.

A bool is not an int here, a string is not a number, and ``"false"`` is not a truth value; each
failure is a ValueError that starts with the argument's name (for layers, ``layer <label>: <field>``,
which the spec loader turns into the file, layer and field). NumPy is imported by the checks that need
it, not by this module: the schedules' checks run before NumPy loads.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ._types import RngLike

__all__ = ["MAX_SIZE", "as_float_dtype", "as_rng", "flag", "integer", "is_int", "number"]

MAX_SIZE = 2**31 - 1
"""The largest size, count or offset an argument may hold (larger ones overflow index arithmetic)."""


def is_int(value: Any) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(value: Any, name: str, minimum: int | None = None, maximum: int | None = None,
            note: str = "") -> int:
    """``value`` as an int within ``[minimum, maximum]`` (either may be None) and ``±MAX_SIZE``;
    ``note`` explains the maximum in the message."""
    if (not is_int(value) or abs(value) > MAX_SIZE or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bounds = [f">= {minimum}"] if minimum is not None else []
        bounds += [f"<= {maximum}{note}"] if maximum is not None else []
        size = f" of at most {MAX_SIZE} in size" if is_int(value) and abs(value) > MAX_SIZE else ""
        raise ValueError(f"{name}: must be an int{size}{' ' if bounds else ''}{' and '.join(bounds)}, "
                         f"got {value!r}")
    return int(value)


def number(value: Any, name: str, minimum: float = -math.inf, below: float = math.inf,
           inclusive: bool = True) -> float:
    """``value`` as a float: a finite real number in ``[minimum, below)`` (``(minimum, below)`` when
    not ``inclusive``)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive) or value >= below:
        low = f"{'>=' if inclusive else '>'} {minimum:g}"
        raise ValueError(f"{name}: must be {low}{'' if below == math.inf else f' and < {below:g}'}, "
                         f"got {value!r}")
    return float(value)


def flag(value: Any, name: str) -> bool:
    """``value`` if it is a bool (NumPy's too): ``"false"`` or ``0`` are errors, not truth values."""
    import numpy as np  # noqa: PLC0415 - not at import: the schedules' checks run before NumPy loads

    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: must be true or false, got {value!r}")
    return bool(value)


def as_float_dtype(dtype: Any, label: str) -> Any:
    """``dtype`` as a NumPy dtype, float32 (None, the default) or float64; a ValueError naming
    ``layer <label>`` otherwise."""
    import numpy as np  # noqa: PLC0415 - not at import: the schedules' checks run before NumPy loads

    try:
        resolved = np.dtype(np.float32 if dtype is None else dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in (np.dtype(np.float32), np.dtype(np.float64)):  # (None: float32)
        raise ValueError(f"layer {label}: dtype: must be float32 or float64, got {dtype!r}")
    return resolved


def as_rng(rng: RngLike) -> Any:
    """A NumPy ``Generator`` from a Generator (itself), a seed or None (fresh entropy)."""
    import numpy as np  # noqa: PLC0415 - not at import: the schedules' checks run before NumPy loads

    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
