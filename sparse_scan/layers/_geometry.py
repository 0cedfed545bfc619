"""The window geometries of convolution and pooling: argument parsing, output sizes, and per input
shape everything a layer's pattern, values and kernels depend on (:class:`ConvGeometry`,
:class:`PoolGeometry`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

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


@dataclass(frozen=True)
class ConvGeometry:
    """Everything the pattern depends on, for one input shape."""

    in_channels: int
    height: int
    width: int
    out_channels: int
    out_height: int
    out_width: int
    kernel: IntPair
    stride: IntPair
    pad_top: int
    pad_left: int
    dilation: IntPair
    groups: int

    @property
    def cin_per_group(self) -> int:
        return self.in_channels // self.groups

    @property
    def cout_per_group(self) -> int:
        return self.out_channels // self.groups

    @property
    def shape(self) -> tuple[int, int]:
        return (self.in_channels * self.height * self.width,
                self.out_channels * self.out_height * self.out_width)

    def kernel_args(self) -> tuple[np.int64, ...]:
        """The scalar arguments every conv kernel takes, in ``conv.cu``'s order."""
        return tuple(np.int64(v) for v in (
            self.in_channels, self.height, self.width, self.out_channels, self.out_height,
            self.out_width, self.kernel[0], self.kernel[1], self.stride[0], self.stride[1],
            self.pad_top, self.pad_left, self.dilation[0], self.dilation[1], self.groups))


@dataclass(frozen=True)
class PoolGeometry:
    """Everything the pattern and values of one pooling layer depend on, for one input shape.

    Attributes
    ----------
    channels, height, width : int
        Per-sample input shape ``(C, H, W)``.
    out_height, out_width : int
        Output spatial size ``(Ho, Wo)``.
    kernel, stride, padding, dilation : (int, int)
        Window geometry along (height, width).
    """

    channels: int
    height: int
    width: int
    out_height: int
    out_width: int
    kernel: IntPair
    stride: IntPair
    padding: IntPair
    dilation: IntPair

    @property
    def inputs(self) -> int:
        """Input elements per sample (JT's rows)."""
        return self.channels * self.height * self.width

    @property
    def outputs(self) -> int:
        """Output elements per sample (JT's columns)."""
        return self.channels * self.out_height * self.out_width

    @property
    def offsets(self) -> int:
        """Window offsets ``kh * kw`` (the slot table's rows)."""
        return self.kernel[0] * self.kernel[1]

    def axis(self, axis: int) -> tuple[int, int, int, int, int, int]:
        """``(size, out, kernel, stride, pad, dilation)`` along axis 0 (height) or 1 (width)."""
        sizes = ((self.height, self.out_height), (self.width, self.out_width))[axis]
        return sizes + (self.kernel[axis], self.stride[axis], self.padding[axis],
                        self.dilation[axis])

    @property
    def nnz(self) -> int:
        """Entries of JT: per channel, every (height tap, width tap) pair."""
        return self.channels * axis_tap_count(*self.axis(0)) * axis_tap_count(*self.axis(1))

    def as_array(self) -> np.ndarray:
        """The 13 int64 the kernels read: C, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw."""
        return np.array(
            (self.channels, self.height, self.width, self.out_height, self.out_width,
             *self.kernel, *self.stride, *self.padding, *self.dilation),
            dtype=np.int64,
        )


def axis_grid(
    size: int, out: int, kernel: int, stride: int, pad: int, dilation: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Input position of every (window offset, output) pair, shape ``(kernel, out)``, and validity."""
    offset = np.arange(kernel, dtype=np.int64)[:, None]
    outputs = np.arange(out, dtype=np.int64)[None, :]
    position = outputs * stride - pad + offset * dilation
    valid = (position >= 0) & (position < size)
    shape = position.shape
    return position, np.broadcast_to(outputs, shape), np.broadcast_to(offset, shape), valid


def axis_tap_count(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """Number of (output, window offset) pairs along one axis that land on an input position."""
    return int(axis_grid(size, out, kernel, stride, pad, dilation)[3].sum())
