"""The host kernel of scalings by a diagonal: ``out[..., e] = values[..., e] * table[..., index[e]]``.

``A @ D`` scales ``A``'s entries by the diagonal at their columns and ``D @ B`` scales ``B``'s by the
diagonal at their rows: a gather from a small table (the diagonal) times a stream of values. The loop
is compiled (:func:`sparse_scan.engine._kernels.scale_gather`: one pass, no temporary, no index
conversion); batches run one run of samples per core on the kernel pool (one sample per thread
measured faster than cache-blocking the entries across samples), a single sample runs of entries.
Where the entries come in long runs of one table entry and consecutive values (a diagonal scaling
rows, a non-overlapping pool gathering rows of a convolution's JT: :func:`find_runs`), the run
kernel (:func:`sparse_scan.engine._kernels.scale_runs`) scales contiguous copies instead, with no
index read per entry. Results equal NumPy's ``values * table[..., index]`` bit for bit (one IEEE
product per entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._host_kernels import BLOCK_ENTRIES, launch, parts, rows2d
from .._threads import workers_for
from ._kernels import scale_gather, scale_runs

__all__ = ["RUNS_BLOCK_ENTRIES", "RUNS_MIN_LENGTH", "Runs", "find_runs", "scaled_gather"]


RUNS_MIN_LENGTH = 8
"""Scalings whose runs (:func:`find_runs`) hold at least this many entries on average run the run
kernel. Measured on VGG-11-pruned's products (float32, 2 threads, batch 1 / 16, run kernel over the
gather kernel): runs of 96 (relu5·conv6, pool3·conv5) 0.85 -> 0.29 and 1.74 -> 0.39 ms / 13.6 ->
4.8 and 27.4 -> 12.3 ms, of 31.7 (pool1·conv2) 2.23 -> 0.57 / 38.7 -> 16.4 ms (the writes' floor:
4.4, 12.0, 16.1 ms); runs of 1 (the ReLU scalings of columns, pool·ReLU rows) 2.1-2.9x slower."""

RUNS_BLOCK_ENTRIES = 2048
"""Entries per block of the run kernel, run through every sample of a thread's run: at batch 16
(same runs as above) 2048 measured 4.8 / 12.3 / 16.4 ms, 8192 5.6 / 12.9 / 16.9 ms, 32768
6.0 / 13.1 / 16.8 ms; batch 1 within 3 % of each other."""


@dataclass(frozen=True)
class Runs:
    """A scaling's entries as runs: run ``r`` is the entries ``starts[r]:starts[r + 1]``, which read
    the consecutive values from ``values[r]`` on, all scaled by table entry ``table[r]``.

    Attributes
    ----------
    starts : ndarray of int64, shape (runs + 1,)
    values : ndarray of int64, shape (runs,)
    table : ndarray of int64, shape (runs,)
    """

    starts: np.ndarray
    values: np.ndarray
    table: np.ndarray


def find_runs(index: np.ndarray, values_index: np.ndarray | None = None) -> Runs | None:
    """The runs of a scaling (:func:`scaled_gather`'s ``index`` and ``values_index``): maximal ranges
    of entries of one ``index`` whose values are consecutive. None when they are shorter than
    :data:`RUNS_MIN_LENGTH` on average (or there are no entries)."""
    count = index.shape[0]
    table = np.asarray(index, dtype=np.int64)
    values = np.arange(count) if values_index is None else np.asarray(values_index, dtype=np.int64)
    breaks = np.flatnonzero((table[1:] != table[:-1]) | (values[1:] != values[:-1] + 1)) + 1
    if count == 0 or count < RUNS_MIN_LENGTH * (breaks.size + 1):
        return None
    starts = np.concatenate(([0], breaks, [count])).astype(np.int64)
    return Runs(starts, values[starts[:-1]], table[starts[:-1]])


def scaled_gather(values: np.ndarray, table: np.ndarray, index: np.ndarray,
                  values_index: np.ndarray | None = None, out: np.ndarray | None = None,
                  runs: Runs | None = None) -> np.ndarray:
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
    runs : Runs, optional
        ``find_runs(index, values_index)``, when the caller keeps it: the run kernel then runs.

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
    workers = workers_for(out.size)
    if runs is not None:
        pieces = parts(batch, runs.values.shape[0], workers)
        if len(pieces) > 1 and batch < len(pieces):  # cut runs by entries
            cuts = np.searchsorted(runs.starts, np.linspace(0, nnz, len(pieces) + 1)[1:-1])
            bounds = [0, *(int(c) for c in cuts), runs.values.shape[0]]
            pieces = [(0, batch, r0, r1) for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True) if r1 > r0]
        launch(scale_runs, (v, t, runs.starts, runs.values, runs.table, rows),
               [piece + (RUNS_BLOCK_ENTRIES,) for piece in pieces])
        return out
    index = np.ascontiguousarray(index)
    gathered = values_index is not None
    values_index = np.ascontiguousarray(values_index) if gathered else index
    launch(scale_gather, (v, values_index, gathered, t, index, rows),
           [piece + (BLOCK_ENTRIES,) for piece in parts(batch, nnz, workers)])
    return out
