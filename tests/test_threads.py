"""The shared worker pools: reused across calls, separate for steps and kernels, none where unused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sparse_scan import Sequential, _threads
from sparse_scan._threads import cpu_threads, kernel_pool, step_pool, worker_pool
from sparse_scan.engine import _cpu as host
from sparse_scan.engine import _dense_cpu as dense_host
from sparse_scan.engine.run import dense_scan
from sparse_scan.layers import Conv2d, MaxPool2d, ReLU


def test_step_pool_is_shared_at_the_core_count_and_owned_otherwise():
    with step_pool(cpu_threads()) as first, step_pool(cpu_threads()) as second:
        assert first is second
    assert first.submit(int, 3).result() == 3  # still open: it lives as long as the process
    with step_pool(cpu_threads() + 1) as own:
        assert own is not first and own.submit(int, 4).result() == 4
    with pytest.raises(RuntimeError):
        own.submit(int, 5)  # closed on exit
    if kernel_pool() is not None:
        assert kernel_pool() is not first  # steps wait on kernels: never the same threads


def test_only_schedules_with_concurrent_steps_take_step_threads(monkeypatch):
    calls = []
    real = host.step_pool
    monkeypatch.setattr(host, "step_pool", lambda workers: (calls.append(workers), real(workers))[1])
    model = Sequential(Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0), ReLU(), MaxPool2d(2),
                       Conv2d(3, 2, 3, padding=1, dtype=np.float64, rng=1), ReLU(), input_shape=(2, 6, 6))
    x = np.random.default_rng(0).standard_normal((2, 2, 6, 6))
    grad = np.random.default_rng(1).standard_normal(model.forward(x).shape)
    linear = model.backward(grad, "linear", device="cpu")
    assert calls == []  # one step per level: no pool
    blelloch = model.backward(grad, "blelloch", device="cpu")
    assert calls == ([] if cpu_threads() < 2 else [cpu_threads()])
    for got, want in zip(blelloch, linear, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_forked_children_forget_both_pools(monkeypatch):
    monkeypatch.setattr(_threads, "_POOL", object())
    monkeypatch.setattr(_threads, "_STEP_POOL", object())
    _threads._forget_pool()
    assert _threads._POOL is None and _threads._STEP_POOL is None


def test_worker_pool_honours_an_explicit_thread_count_on_one_core(monkeypatch):
    with worker_pool(1) as none:
        assert none is None
    monkeypatch.setattr(_threads, "cpu_threads", lambda: 1)  # no shared kernel pool on one core
    assert kernel_pool() is None
    with worker_pool(3) as own:
        assert own is not None and own.submit(int, 7).result() == 7
    with pytest.raises(RuntimeError):
        own.submit(int, 8)  # closed on exit
    rng = np.random.default_rng(0)
    blocks, direct = rng.standard_normal((9, 2, 3, 3)) / 2, rng.standard_normal((9, 2, 3))
    serial = dense_scan(blocks, direct, method="blelloch", threads=1)
    monkeypatch.setattr(dense_host, "SPLIT_MIN_VALUES", 1)  # split even these small products
    cuts = []
    real = dense_host.run_parts
    monkeypatch.setattr(dense_host, "run_parts",
                        lambda pool, run, parts: (cuts.append((pool, len(parts))), real(pool, run, parts))[1])
    np.testing.assert_allclose(dense_scan(blocks, direct, method="blelloch", threads=3), serial, rtol=1e-12)
    assert cuts and all(pool is not None and count > 1 for pool, count in cuts)


def test_a_structure_key_is_derived_once_per_weight_version_on_any_thread():
    conv = Conv2d(2, 2, 3, dtype=np.float64, rng=0, prune_pattern=True)
    before = conv._structure_key()
    weight = conv.weight.copy()
    weight[0, 0] = 0.0  # a new zero set, assigned: another thread derives its key, this one reuses it
    conv.weight = weight
    seen = []
    worker = threading.Thread(target=lambda: seen.append(conv._structure_key()))
    worker.start()
    worker.join()
    assert seen[0] != before
    assert conv._zero_set == (conv._zero_set_version, seen[0]) and conv._structure_key() == seen[0]


def test_workers_for_cuts_large_calls_over_every_core_and_thread_count_takes_an_explicit_one(monkeypatch):
    """The one rule of the kernel calls: every core from THREAD_MIN_VALUES (or a caller's own minimum)
    of work, else the calling thread."""
    monkeypatch.setattr(_threads, "cpu_threads", lambda: 3)
    monkeypatch.setattr(_threads, "cores_busy", lambda: False)
    assert [_threads.workers_for(work) for work in (0, _threads.THREAD_MIN_VALUES - 1,
                                                     _threads.THREAD_MIN_VALUES)] == [1, 1, 3]
    assert [_threads.workers_for(work, minimum=10) for work in (9, 10)] == [1, 3]
    assert [_threads.thread_count(threads) for threads in (None, 0, 1, 5)] == [3, 1, 1, 5]


def test_a_job_beside_holds_a_core_from_its_submission_until_it_has_run_or_is_cancelled(monkeypatch):
    """While work submitted beside (``submit_beside``) is queued or running, large kernel calls are cut
    over one thread fewer (the calling thread alone on two cores); a job that raised, one cancelled
    before it started and one that ran all give their core back."""
    monkeypatch.setattr(_threads, "cpu_threads", lambda: 3)
    monkeypatch.setattr(_threads, "cores_busy", lambda: False)
    large = _threads.THREAD_MIN_VALUES
    assert _threads.workers_for(large) == 3
    release, started = threading.Event(), threading.Event()
    running = _threads.submit_beside(lambda: (started.set(), release.wait(60)))
    queued = _threads.submit_beside(int, 7)  # behind the running one on the beside thread
    failing = _threads.submit_beside(lambda: 1 / 0)
    assert started.wait(60)
    assert [_threads.workers_for(work) for work in (large - 1, large)] == [1, 2]  # small calls: as ever
    monkeypatch.setattr(_threads, "cpu_threads", lambda: 2)
    assert _threads.workers_for(large) == 1
    assert queued.cancel() and _threads.workers_for(large) == 1  # the running and the failing ones
    release.set()
    assert running.result(60) == (None, True)
    with pytest.raises(ZeroDivisionError):
        failing.result(60)
    deadline = time.monotonic() + 60  # a future's callbacks run just after its waiters wake
    while _threads.workers_for(large) != 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _threads.workers_for(large) == 2


def test_a_cut_call_whose_thread_got_part_of_a_core_keeps_the_next_small_calls_whole(monkeypatch):
    """Beside other busy threads a piece's thread gets part of a core: a share under BUSY_SHARE marks
    the cores busy for BUSY_SECONDS, calls below BUSY_THREAD_MIN_VALUES then stay on the calling
    thread (a caller's larger minimum stands), and afterwards the usual rule is back."""
    now = [100.0]
    monkeypatch.setattr(_threads.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(_threads, "_busy_until", 0.0)
    monkeypatch.setattr(_threads, "cpu_threads", lambda: 2)
    busy = _threads.BUSY_THREAD_MIN_VALUES
    assert busy > _threads.THREAD_MIN_VALUES
    works = (_threads.THREAD_MIN_VALUES, busy - 1, busy)
    _threads.note_core_share(_threads.BUSY_SHARE)  # a full enough share: not busy
    assert not _threads.cores_busy() and [_threads.workers_for(work) for work in works] == [2, 2, 2]
    _threads.note_core_share(_threads.BUSY_SHARE - 0.01)
    assert _threads.cores_busy() and [_threads.workers_for(work) for work in works] == [1, 1, 2]
    larger = 4 * busy
    assert [_threads.workers_for(work, minimum=larger) for work in (larger // 2, larger)] == [1, 2]
    now[0] += _threads.BUSY_SECONDS
    assert not _threads.cores_busy() and [_threads.workers_for(work) for work in works] == [2, 2, 2]


def test_launch_notes_the_least_share_of_a_core_its_pieces_threads_got(monkeypatch):
    """Each piece's share is its thread's CPU time over its wall time; pieces too short to tell count
    as a whole core."""
    from sparse_scan import _host_kernels  # noqa: PLC0415

    if kernel_pool() is None:
        pytest.skip("one core: no pool, nothing cut")
    noted = []
    monkeypatch.setattr(_host_kernels, "note_core_share", noted.append)
    monkeypatch.setattr(_host_kernels, "_THREAD_CLOCK", True)
    seconds = 4 * _host_kernels.SHARE_MIN_SECONDS

    def kernel(sleeping, first, last):
        if sleeping == first:  # this piece's thread waits: no CPU time
            time.sleep(seconds)
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

    _host_kernels.launch(kernel, (0,), [(0, 1), (1, 2)])  # the pool's piece sleeps
    _host_kernels.launch(kernel, (1,), [(0, 1), (1, 2)])  # the calling thread's piece sleeps
    assert len(noted) == 2 and max(noted) < 0.5  # a sleeping thread's share is about 0, loaded or not
    monkeypatch.setattr(_host_kernels, "_THREAD_CLOCK", False)
    _host_kernels.launch(kernel, (0,), [(0, 1), (1, 2)])
    assert noted[2] == 1.0
