"""The host scaling kernel (compiled) against NumPy's one-shot expression, on every operand layout:
bit for bit."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from sparse_scan.engine import _scaled_gather
from sparse_scan.engine._scaled_gather import find_runs, scaled_gather


@pytest.fixture(params=["inline", "pieces on threads"])
def pieces(request, monkeypatch):
    """Run small inputs through blocks and the thread pool too (as large ones would): runs of samples
    for a batch, runs of entries for one sample."""
    if request.param == "pieces on threads":
        monkeypatch.setattr(_scaled_gather, "BLOCK_ENTRIES", 7)
        monkeypatch.setattr(_scaled_gather, "RUNS_BLOCK_ENTRIES", 7)
        monkeypatch.setattr(_scaled_gather, "workers_for", lambda work, minimum=None: 3)
    return request.param


@pytest.mark.parametrize("values_batched", [False, True])
@pytest.mark.parametrize("table_batched", [False, True])
@pytest.mark.parametrize("gathered_values", [False, True])
@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (np.float32, np.float64),
                                    (np.float64, np.float32)])
def test_equals_the_numpy_expression(pieces, values_batched, table_batched, gathered_values, dtypes):
    rng = np.random.default_rng(0)
    batch, nnz, n, m = 4, 61, 9, 23
    values = rng.standard_normal((batch, m if gathered_values else nnz) if values_batched else
                                 (m if gathered_values else nnz,)).astype(dtypes[0])
    table = rng.standard_normal((batch, n) if table_batched else (n,)).astype(dtypes[1])
    index = rng.integers(0, n, nnz).astype(np.int32)
    values_index = rng.integers(0, m, nnz).astype(np.int64) if gathered_values else None
    got = scaled_gather(values, table, index, values_index=values_index)
    read = values if values_index is None else values[..., values_index]
    want = read * table[..., index]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("values_batched", [False, True])
@pytest.mark.parametrize("table_batched", [False, True])
@pytest.mark.parametrize("gathered_values", [False, True])
@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (np.float64, np.float32)])
def test_runs_equal_the_numpy_expression(pieces, values_batched, table_batched, gathered_values, dtypes):
    rng = np.random.default_rng(1)
    batch, n, m = 4, 9, 200
    lengths = rng.integers(1, 30, 12)
    nnz = int(lengths.sum())
    index = np.repeat(rng.integers(0, n, lengths.size), lengths).astype(np.int32)
    values_index = (np.concatenate([np.arange(start, start + length) for start, length in
                                    zip(rng.integers(0, m - 30, lengths.size), lengths, strict=True)])
                    if gathered_values else None)
    width = m if gathered_values else nnz
    values = rng.standard_normal((batch, width) if values_batched else (width,)).astype(dtypes[0])
    table = rng.standard_normal((batch, n) if table_batched else (n,)).astype(dtypes[1])
    runs = find_runs(index, values_index)
    assert runs is not None and runs.values.size <= lengths.size and runs.starts[-1] == nnz
    got = scaled_gather(values, table, index, values_index=values_index, runs=runs)
    read = values if values_index is None else values[..., values_index]
    want = read * table[..., index]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_runs_break_where_the_table_entry_changes_or_the_values_jump():
    index = np.array([3, 3, 3, 3, 5, 5, 5, 5, 5, 5, 5, 5])
    values_index = np.array([0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14])
    runs = find_runs(index, values_index)
    assert runs is None  # 12 entries in 3 runs: 4 on average, under RUNS_MIN_LENGTH
    runs = find_runs(np.repeat(index, 4), np.arange(48))
    np.testing.assert_array_equal(runs.starts, [0, 16, 48])
    np.testing.assert_array_equal(runs.values, [0, 16])
    np.testing.assert_array_equal(runs.table, [3, 5])
    assert find_runs(np.arange(40)) is None and find_runs(np.zeros(0, np.int32)) is None


def test_no_entries(pieces):
    got = scaled_gather(np.zeros(0, np.float32), np.ones((3, 5), np.float32), np.zeros(0, np.int64))
    assert got.shape == (3, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_pool():
    values, table = np.arange(2**19, dtype=np.float64), np.ones((2, 3))
    index = np.zeros(values.size, dtype=np.int64)
    want = np.broadcast_to(values, (2, values.size))
    assert np.array_equal(scaled_gather(values, table, index), want)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: with the parent's pool, whose threads it lacks, this would hang
        os._exit(0 if np.array_equal(scaled_gather(values, table, index), want) else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the kernel pool")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
