"""Pruned convolution weights as CSR: the forward's sparse product and the compiled transposed
convolution over the non-zeros, on the host.

A :class:`~sparse_scan.layers.Conv2d` with ``prune_pattern=True`` whose weights are at most
:data:`SPARSE_FORWARD_MAX_DENSITY` dense keeps them as CSR matrices (per group for the forward, and
``W^T`` of every group for the transposed convolution: :func:`weights_as_csr`,
:func:`transposed_weights_csr`), refilled from the weights once per version. The forward multiplies
the columns by them (SciPy, :func:`grouped_product`); ``JT @ g`` runs compiled over their non-zeros
(:func:`pruned_transposed_convolution`: :func:`~sparse_scan.layers._kernels.transposed_conv` and
:func:`~sparse_scan.layers._kernels.transposed_conv_taps`), without JT's values or a dense GEMM.
On the GPU the dense weights multiply (:func:`host_sparse_weights` is the dispatch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import backend as _backend
from .._host_kernels import launch
from .._threads import workers_for
from ..csr import choose_index_dtype
from ._geometry import ConvGeometry
from ._kernels import transposed_conv, transposed_conv_taps

if TYPE_CHECKING:  # SciPy loads on first use (0.14 s of import): planning needs none
    import scipy.sparse

__all__ = ["CSR_PATH_MAX_PADDED_SHARE", "DIRECT_MIN_WIDTH", "SPARSE_FORWARD_MAX_DENSITY", "grouped_product",
           "host_sparse_weights", "pruned_transposed_convolution", "transposed_weights_csr",
           "weights_as_csr"]

CSR_PATH_MAX_PADDED_SHARE = 2.0
"""The compiled sparse transposed convolution runs every tap of every non-zero weight over whole output
planes, padded ones included; JT's SpMV only the taps inside (JT's stored entries). Through the CSR
weights while their taps are at most this many times JT's entries, else the SpMV of JT's (cached,
shared) values. Measured on the pruned VGG-11 (2 cores, float32, batch 1 / 4 / 16): 4x4 planes (1.44x
the entries) 192 / 431 / 1149 us against the SpMV's 292 / 1141 / 2047; 2x2 planes (2.25x) 260 / 557 /
996 us against 115 / 392 / 914."""

SPARSE_FORWARD_MAX_DENSITY = 0.05
"""Pruned weights with at most this fraction of non-zeros multiply the forward's columns as a CSR
matrix on the CPU. Measured on 2 cores against NumPy's GEMM on VGG-11's layers (batch 16): 2-4x
faster at 3%, slower from about 6-10% (SciPy's product runs on one core). ``JT @ g`` through such
weights runs compiled (:func:`pruned_transposed_convolution`)."""

# SciPy's CSR weights multiply on the host; the GPU multiplies the dense weights
host_sparse_weights = _backend.twin(cpu=lambda be, conv, transposed: conv._sparse_weights(transposed),
                                    gpu=lambda be, conv, transposed: None)


def weights_as_csr(weights: np.ndarray, offset: int, row_stride: int, column_stride: int,
                    dtype: Any) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """A CSR matrix of ``dtype`` over the non-zeros of ``weights`` (a 2-D view of a layer's weights, or
    of its pattern mask; the values are refilled at every use) and the flat weight position of each
    stored value: ``offset + row * row_stride + column * column_stride``."""
    import scipy.sparse  # noqa: PLC0415 - on first use: planning needs none

    matrix = scipy.sparse.csr_matrix(weights != 0, dtype=dtype)
    rows = np.repeat(np.arange(weights.shape[0]), np.diff(matrix.indptr))
    positions = (offset + rows * row_stride + matrix.indices * column_stride).astype(np.intp)
    return matrix, positions


def transposed_weights_csr(groups: np.ndarray, dtype: Any) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """``W^T`` of every group as one CSR matrix, rows ``(ci, kh, kw)`` (global input channel), columns
    ``co`` (global output channel; block-diagonal over the groups), with the weights' flat position of
    each stored value (:func:`weights_as_csr`). ``groups``: the weights as ``(groups, cout / groups,
    taps)``."""
    count, cout, taps = groups.shape
    parts = [weights_as_csr(group.T, index * group.size, 1, taps, dtype)
             for index, group in enumerate(groups)]
    nnz = np.cumsum([0] + [matrix.nnz for matrix, _ in parts])
    indptr = np.concatenate([[0]] + [matrix.indptr[1:] + offset
                                     for (matrix, _), offset in zip(parts, nnz[:-1], strict=True)])
    indices = np.concatenate([matrix.indices + index * cout for index, (matrix, _) in enumerate(parts)])
    data = np.concatenate([matrix.data for matrix, _ in parts])
    dtype = choose_index_dtype(int(nnz[-1]), count * cout, None)
    import scipy.sparse  # noqa: PLC0415 - on first use: planning needs none

    matrix = scipy.sparse.csr_matrix((data, indices.astype(dtype), indptr.astype(dtype)),
                                     shape=(count * taps, count * cout), copy=False)
    return matrix, np.concatenate([positions for _, positions in parts])


DIRECT_MIN_WIDTH = 32
"""Output rows at least this wide take :func:`sparse_scan.layers._kernels.transposed_conv` (per output row),
narrower ones :func:`~sparse_scan.layers._kernels.transposed_conv_taps` (per whole plane). Measured on the
pruned VGG-11 at batch 16: conv1 (32 wide) 0.42 ms against 0.75, conv2 (16 wide) 5.2 against 1.7."""


def pruned_transposed_convolution(g: ConvGeometry, weights: scipy.sparse.csr_matrix,
                                   grad_out: np.ndarray) -> np.ndarray:
    """``JT @ grad_out`` (``(B, out size) -> (B, in size)``) through pruned weights ``W^T``
    (:func:`transposed_weights_csr`): :mod:`sparse_scan.layers._kernels`' transposed convolutions,
    runs of input channels of about equal non-zeros on the kernel pool's threads."""
    batch = grad_out.shape[0]
    dtype = np.result_type(weights.dtype, grad_out.dtype)
    data = weights.data.astype(dtype, copy=False)
    grad = np.ascontiguousarray(grad_out, dtype=dtype).reshape(batch, -1)
    out_plane = g.out_height * g.out_width
    taps = g.out_width < DIRECT_MIN_WIDTH
    if taps and batch > 1:  # channel-major: each output plane of every sample one run
        grad = np.ascontiguousarray(grad.reshape(batch, g.out_channels, out_plane).transpose(1, 0, 2))
    out = np.empty((batch, g.in_channels, g.height * g.width), dtype=dtype)
    geometry = (g.in_channels, g.height, g.width, g.out_channels, g.out_height, g.out_width, *g.kernel,
                *g.stride, g.pad_top, g.pad_left, *g.dilation, batch)
    work = weights.nnz * out_plane * batch
    workers = workers_for(work)
    per_channel = weights.indptr[::g.kernel[0] * g.kernel[1]]
    cuts = np.searchsorted(per_channel, np.arange(1, workers) * (weights.nnz / workers))
    bounds = [0, *(int(c) for c in cuts), g.in_channels]
    pieces = [(first, last) for first, last in zip(bounds[:-1], bounds[1:], strict=True) if last > first]
    common = (weights.indptr, weights.indices, data, grad.reshape(-1), geometry)
    launch(transposed_conv_taps if taps else transposed_conv, (*common, out), pieces)
    return out.reshape(batch, -1)


def grouped_product(matrices: list[scipy.sparse.csr_matrix], blocks: np.ndarray) -> np.ndarray:
    """``matrices[g] @ blocks[g]`` stacked over the groups (one group: no stacking copy)."""
    if len(matrices) == 1:
        return np.asarray(matrices[0] @ blocks[0])[None]
    return np.stack([matrix @ block for matrix, block in zip(matrices, blocks, strict=True)])
