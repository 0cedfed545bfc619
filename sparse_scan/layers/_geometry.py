"""Argument parsing and output-size arithmetic shared by convolution and pooling layers."""

from __future__ import annotations

import math
from typing import Any

from .._checks import MAX_SIZE, is_int

IntPair = tuple[int, int]


def pair(value: Any, field: str, label: str, minimum: int) -> IntPair:
    """Parse an int or an (h, w) pair, as PyTorch accepts, and check ``>= minimum``."""
    if is_int(value):
        parsed = (int(value), int(value))
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value):
        parsed = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"layer {label}: {field}: expected an int or an (h, w) pair, got {value!r}")
    if max(parsed) > MAX_SIZE:
        raise ValueError(f"layer {label}: {field}: must be at most {MAX_SIZE}, got {value!r}")
    if min(parsed) < minimum:
        raise ValueError(f"layer {label}: {field}: must be >= {minimum}, got {value!r}")
    return parsed


def window_extent(kernel: int, dilation: int) -> int:
    """Span of a dilated window: ``dilation * (kernel - 1) + 1``."""
    return dilation * (kernel - 1) + 1


def output_size(
    size: int, kernel: int, stride: int, pad_lo: int, pad_hi: int, dilation: int,
    ceil_mode: bool = False,
) -> int:
    """Output length along one axis, PyTorch's formula (``ceil_mode`` for pooling).

    With ``ceil_mode`` the last window must start inside the input or the left padding.
    Returns a value < 1 when the window does not fit (callers turn that into an error).
    """
    span = size + pad_lo + pad_hi - window_extent(kernel, dilation)
    if span < 0:
        return 0
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad_lo:
        out -= 1
    return out
