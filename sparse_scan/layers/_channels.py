"""Channels selected or permuted (ShuffleNet): ``Narrow``, a range of channels (``torch.narrow``, a piece of
``x.chunk(2, dim=1)``), and ``ChannelShuffle``, PyTorch's channel shuffle (``x.view(B, g, C // g, H, W)
.transpose(1, 2).view(B, C, H, W)``).

Each output element copies one input element, so the transposed Jacobian holds one entry per column,
valued one: a selection (``Narrow``) or a permutation (``ChannelShuffle``), the same for every sample.

Examples
--------
>>> import numpy as np
>>> x = np.arange(6.0).reshape(1, 6, 1, 1)
>>> ChannelShuffle(2)(x).ravel().tolist(), Narrow(2, 3)(x).ravel().tolist()
([0.0, 3.0, 1.0, 4.0, 2.0, 5.0], [2.0, 3.0, 4.0])
>>> jt = ChannelShuffle(2).transposed_jacobian(x)      # grad_in = JT @ grad_out: a permutation
>>> (jt.todense().T @ x.ravel()).tolist()
[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import integer
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ._base import Layer, Shape

__all__ = ["ChannelShuffle", "Narrow"]


class _Rearrangement(Layer):
    """A layer whose every output element copies one input element (:meth:`_source`)."""

    sample_independent = True

    def _source(self, in_shape: Shape) -> np.ndarray:
        """Per output element (C order), the input element it copies."""
        raise NotImplementedError

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        self.output_shape(shape)
        return shape

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        source = self._source(in_shape)
        rows, columns = math.prod(in_shape), len(source)
        dtype = choose_index_dtype(columns, columns, index_dtype)
        indptr = np.zeros(rows + 1, dtype=dtype)
        np.cumsum(np.bincount(source, minlength=rows), out=indptr[1:])
        indices = np.argsort(source, kind="stable").astype(dtype)  # a row's columns, ascending
        return Pattern(be.asarray(indptr), be.asarray(indices), (rows, columns)), {}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return be.xp.ones(pattern.nnz, dtype=x.dtype)


class Narrow(_Rearrangement):
    """Channels ``start .. start + length - 1`` of each sample: ``torch.narrow(x, 1, start, length)``,
    ``x[:, start:start + length]`` (a piece of ``x.chunk(n, dim=1)`` or ``x.split(size, dim=1)``).

    Parameters
    ----------
    start : int
        The first channel (``>= 0``).
    length : int
        How many (``>= 1``).
    """

    def __init__(self, start: int, length: int) -> None:
        super().__init__()
        self.start = integer(start, f"layer {self.label}: start", minimum=0)
        self.length = integer(length, f"layer {self.label}: length", minimum=1)

    def output_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if not shape or self.start + self.length > shape[0]:
            raise self._error("length", f"channels {self.start} .. {self.start + self.length - 1} of a "
                              f"sample of shape {shape}: it has {shape[0] if shape else 0}")
        return (self.length,) + shape[1:]

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        return x[:, self.start:self.start + self.length].copy()

    def _source(self, in_shape: Shape) -> np.ndarray:
        return np.arange(math.prod(in_shape), dtype=np.int64).reshape(in_shape)[
            self.start:self.start + self.length].ravel()

    def __repr__(self) -> str:
        return f"Narrow(start={self.start}, length={self.length})"


class ChannelShuffle(_Rearrangement):
    """PyTorch's ``nn.ChannelShuffle(groups)``: the channels as ``groups`` groups of ``C // groups``,
    interleaved (``x.view(B, groups, C // groups, H, W).transpose(1, 2).reshape(B, C, H, W)``).

    Parameters
    ----------
    groups : int
        Dividing the channels (``>= 1``).
    """

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = integer(groups, f"layer {self.label}: groups", minimum=1)

    def output_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        if not shape or shape[0] % self.groups:
            raise self._error("groups", f"{self.groups} groups do not divide the {shape[0] if shape else 0} "
                              f"channels of a sample of shape {shape}")
        return shape

    def forward(self, x: Array) -> Array:
        x = self._check_input(x)
        batch, channels = x.shape[:2]
        grouped = x.reshape((batch, self.groups, channels // self.groups) + x.shape[2:])
        return _backend.of(x).xp.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(x.shape)

    def _source(self, in_shape: Shape) -> np.ndarray:
        channels = in_shape[0]
        every = np.arange(math.prod(in_shape), dtype=np.int64).reshape(
            (self.groups, channels // self.groups) + tuple(in_shape[1:]))
        return every.swapaxes(0, 1).ravel()

    def __repr__(self) -> str:
        return f"ChannelShuffle(groups={self.groups})"
