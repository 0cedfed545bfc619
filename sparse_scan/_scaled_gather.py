"""The host kernel of scalings by a diagonal: ``out[..., e] = values[..., e] * table[..., index[e]]``.

``A @ D`` scales ``A``'s entries by the diagonal at their columns and ``D @ B`` scales ``B``'s by the
diagonal at their rows: a gather from a small table (the diagonal) times a stream of values. The loop
is compiled (:func:`sparse_scan._numba_kernels.scale_gather`: one pass, no temporary, no index
conversion); batches run one run of samples per core on the kernel pool (one sample per thread
measured faster than cache-blocking the entries across samples), a single sample runs of entries.
Results equal NumPy's ``values * table[..., index]`` bit for bit (one IEEE product per entry).
"""

from __future__ import annotations

import numpy as np

from ._host_kernels import BLOCK_ENTRIES, kernels, launch, parts, rows2d
from ._threads import cpu_threads

__all__ = ["THREAD_MIN_VALUES", "scaled_gather"]

THREAD_MIN_VALUES = 2**18
"""Results with fewer values are computed on the calling thread (a hand-off costs more)."""


def scaled_gather(values: np.ndarray, table: np.ndarray, index: np.ndarray,
                  values_index: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``values[..., e] * table[..., index[e]]`` on the host.

    Parameters
    ----------
    values : ndarray, shape (nnz,) or (B, nnz)
        The scaled operand's values (shared by the batch, or per sample).
    table : ndarray, shape (n,) or (B, n)
        The diagonal.
    index : ndarray of int, shape (nnz,)
        The diagonal entry of every value.
    values_index : ndarray of int, shape (nnz,), optional
        Read ``values[..., values_index[e]]`` instead (``values`` then has any length): the products
        of two gathered operands, one multiply-add per result entry.
    out : ndarray, optional
        Where to write the result (C-contiguous, of the result's shape and dtype, below).

    Returns
    -------
    ndarray
        ``(B, nnz)`` when either operand is per sample, else ``(nnz,)``; in their result dtype.
    """
    dtype = np.result_type(values, table)
    batched = values.ndim == 2 or table.ndim == 2
    batch = values.shape[0] if values.ndim == 2 else table.shape[0] if table.ndim == 2 else 1
    nnz = index.shape[0]
    if out is None:
        out = np.empty((batch, nnz) if batched else (nnz,), dtype=dtype)
    if out.size == 0:
        return out
    rows = out.reshape(batch, nnz)
    v, t = rows2d(values, dtype), rows2d(table, dtype)
    index = np.ascontiguousarray(index)
    gathered = values_index is not None
    values_index = np.ascontiguousarray(values_index) if gathered else index
    launch(kernels().scale_gather, (v, values_index, gathered, t, index, rows),
           [piece + (BLOCK_ENTRIES,) for piece in
            parts(batch, nnz, cpu_threads() if out.size >= THREAD_MIN_VALUES else 1)])
    return out
