"""The host kernel of scalings by a diagonal: ``out[..., e] = values[..., e] * table[..., index[e]]``.

``A @ D`` scales ``A``'s entries by the diagonal at their columns and ``D @ B`` scales ``B``'s by the
diagonal at their rows: a gather from a small table (the diagonal) times a stream of values. NumPy's
one-shot expression ``values * table[..., index]`` allocates the gathered table in full, converts the
index array to ``intp`` on every call and runs on one core: up to 4x slower than the cache-blocked,
threaded loop below on a 2-core host (VGG-11's conv·ReLU products, batch 16).

The entries are cut into pieces of :data:`PIECE_ENTRIES`; a piece's index and shared values are read
once from memory and stay in cache while every sample uses them. Each core takes a contiguous run of
pieces.
"""

from __future__ import annotations

import numpy as np

from ._threads import cpu_threads, even_parts, kernel_pool, run_parts

__all__ = ["PIECE_ENTRIES", "THREAD_MIN_VALUES", "scaled_gather"]

PIECE_ENTRIES = 2**16
"""Entries per piece (256-512 KiB of index and values: measured best of 2**14..2**18 on 2 cores)."""

THREAD_MIN_VALUES = 2**18
"""Results with fewer values are computed on the calling thread (a hand-off costs more)."""


def scaled_gather(values: np.ndarray, table: np.ndarray, index: np.ndarray,
                  values_index: np.ndarray | None = None) -> np.ndarray:
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

    Returns
    -------
    ndarray
        ``(B, nnz)`` when either operand is per sample, else ``(nnz,)``; in their result dtype.
    """
    dtype = np.result_type(values, table)
    table = table.astype(dtype, copy=False)  # the gather writes straight into the result
    batched = values.ndim == 2 or table.ndim == 2
    batch = values.shape[0] if values.ndim == 2 else table.shape[0] if table.ndim == 2 else 1
    nnz = index.shape[0]
    out = np.empty((batch, nnz) if batched else (nnz,), dtype=dtype)
    rows = out.reshape(batch, nnz)
    workers = cpu_threads() if out.size >= THREAD_MIN_VALUES else 1

    def run(start: int, stop: int) -> None:
        for lo in range(start, stop, PIECE_ENTRIES):
            hi = min(lo + PIECE_ENTRIES, stop)
            piece = np.asarray(index[lo:hi], dtype=np.intp)
            # mode="clip": the plan's indices are valid by construction, and "raise" buffers ``out``
            shared = None if table.ndim == 2 else np.take(table, piece, mode="clip")
            scales = (values[..., lo:hi] if values_index is None else
                      np.take(values, np.asarray(values_index[lo:hi], dtype=np.intp), axis=-1, mode="clip"))
            for sample in range(batch):
                result = rows[sample, lo:hi]
                scale = scales if scales.ndim == 1 else scales[sample]
                if shared is None:
                    np.take(table[sample], piece, out=result, mode="clip")
                    np.multiply(result, scale, out=result)
                else:
                    np.multiply(scale, shared, out=result)

    run_parts(kernel_pool() if workers > 1 else None, run, even_parts(nnz, workers))
    return out
