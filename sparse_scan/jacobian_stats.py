"""Per-layer figures of a chain's transposed Jacobians: shape, non-zeros, sparsity, bytes.

The static half of paper Table 1: computed from each layer's count of its pattern's entries
(``Layer.pattern_nnz``) and the shapes alone, so it builds no pattern where a layer can count its
entries without one (a convolution can; VGG-11's patterns would take seconds).

Examples
--------
>>> from sparse_scan.layers import Conv2d, MaxPool2d, ReLU
>>> rows = chain_stats([Conv2d(3, 64, 3, padding=1, rng=0), ReLU(), MaxPool2d(2)], (3, 32, 32))
>>> [(r["type"], r["nnz"], round(r["sparsity"], 5)) for r in rows]
[('Conv2d', 1696512, 0.99157), ('ReLU', 65536, 0.99998), ('MaxPool2d', 65536, 0.99994)]
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .csr import choose_index_dtype
from .layers import Layer

__all__ = ["chain_stats", "layer_stats"]


def layer_stats(layer: Layer, in_shape: Sequence[int], dtype: Any = np.float32,
                name: str | None = None) -> dict[str, Any]:
    """Figures of one layer's transposed Jacobian for one sample of ``in_shape``.

    Parameters
    ----------
    layer : Layer
    in_shape : sequence of int
        Per-sample input shape (no batch axis).
    dtype : numpy dtype
        Value dtype assumed for the byte counts.
    name : str, optional
        Name to report (defaults to ``layer.name`` or the class name).

    Returns
    -------
    dict
        ``name, type, in_shape, out_shape, shape, nnz, sparsity, csr_bytes, dense_bytes,
        sample_independent, kind``. ``csr_bytes`` counts ``indptr + indices + data`` of one
        sample; ``dense_bytes`` is the same matrix stored dense.
    """
    in_shape = tuple(int(s) for s in in_shape)
    out_shape = tuple(layer.output_shape(in_shape))
    nnz = layer.pattern_nnz(in_shape)
    itemsize = np.dtype(dtype).itemsize
    rows, cols = math.prod(in_shape), math.prod(out_shape)
    index_bytes = choose_index_dtype(nnz, cols).itemsize * (rows + 1 + nnz)  # indptr + indices
    return {
        "name": name or layer.name or type(layer).__name__,
        "type": type(layer).__name__,
        "in_shape": list(in_shape),
        "out_shape": list(out_shape),
        "shape": [rows, cols],
        "nnz": nnz,
        "sparsity": 1.0 - nnz / (rows * cols),
        "csr_bytes": index_bytes + nnz * itemsize,
        "dense_bytes": rows * cols * itemsize,
        "sample_independent": layer.sample_independent,
        "kind": layer.jacobian_kind,
    }


def chain_stats(layers: Sequence[Layer], in_shape: Sequence[int],
                dtype: Any = np.float32) -> list[dict[str, Any]]:
    """:func:`layer_stats` for every layer of a chain, threading the shapes through."""
    rows, shape = [], tuple(in_shape)
    for layer in layers:
        rows.append(layer_stats(layer, shape, dtype))
        shape = layer.output_shape(shape)
    return rows
