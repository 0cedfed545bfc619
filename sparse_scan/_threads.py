"""The host's cores, and the shared worker threads of the CPU kernels.

NumPy's gathers (``take``) and ufuncs release the GIL, so a large elementwise kernel runs on every core
when its work is cut into pieces handed to threads. One pool serves every such kernel; a kernel never
waits on the pool from inside one of its own tasks, so callers that run on other threads (the scan's
concurrent steps) cannot deadlock it. The scan's concurrent steps have a shared pool of their own
(:func:`step_pool`), since a step waits on kernels. Both live as long as the process (a new pool per
call costs about 0.4 ms), and a forked child makes its own. Where other threads keep the cores busy (a
cut call's threads got part of a core: :func:`note_core_share`), only large calls are cut for a while
(:func:`workers_for`); while a job of our own runs beside the calling thread (:func:`submit_beside`),
calls are cut over one thread fewer.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

from . import _environment

__all__ = ["BUSY_SECONDS", "BUSY_SHARE", "BUSY_THREAD_MIN_VALUES", "THREADS_VARIABLE", "THREAD_MIN_VALUES",
           "cores_busy", "cpu_threads", "even_parts", "kernel_pool", "note_core_share", "run_parts",
           "step_pool", "submit_beside", "thread_count", "worker_pool", "workers_for"]

T = TypeVar("T")

_POOL: ThreadPoolExecutor | None = None
_STEP_POOL: ThreadPoolExecutor | None = None
_BESIDE_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_BESIDE_LOCK = threading.Lock()
_beside_jobs = 0  # submitted beside (submit_beside) and neither run nor cancelled yet


THREADS_VARIABLE = _environment.THREADS.name
"""The environment variable that sets :func:`cpu_threads` (``sparse-scan --threads`` sets it too)."""

THREAD_MIN_VALUES = 2**18
"""Kernel calls with less work (values written, or multiply-adds) run on the calling thread: a hand-off
to the pool costs more (:func:`workers_for`)."""

BUSY_THREAD_MIN_VALUES = 2**22
""":data:`THREAD_MIN_VALUES` while the cores are busy with other threads (:func:`cores_busy`). Beside a
busy thread a piece's thread gets part of a core, so cutting a call pays only for large ones. PyTorch's
OpenMP workers, for one, busy-wait after each of its parallel regions (GNU OpenMP's default: about 8 ms
of CPU after one op, measured). In the bridge's Adam iteration on the pruned VGG-11 (2-core AMD EPYC,
each call site timed split against whole in alternate iterations), right after the optimizer's step
the least-served thread of a split call got 0.43-0.55 of a core (median 0.48; 0.97-1.0 in the engine
alone), and every pruned-product call at 97 % pruned and batch 1 was faster whole (their sum 6.2 ms
against 7.4); at 90 % pruned the large ones still split faster (13.0 against 19.5 ms). ReLU's 1 M
values at batch 16 took 0.27 ms whole against 0.72 split."""

BUSY_SHARE = 0.75
"""A kernel piece whose thread got less than this share of a core (its CPU time over its wall time)
shows the cores busy with other threads (:func:`note_core_share`)."""

BUSY_SECONDS = 0.01
"""How long a busy observation holds (:func:`cores_busy`): about an OpenMP worker's spin after an op.
Calls below :data:`BUSY_THREAD_MIN_VALUES` are not cut meanwhile, so the next cut call after it looks
again."""

_busy_until = 0.0  # time.perf_counter() until which the cores count as busy


def cpu_threads() -> int:
    """The engine's worker threads: ``SPARSE_SCAN_THREADS`` when set (a positive int), else the CPU
    cores this process may run on. Pools already made keep their size."""
    configured = _environment.THREADS.read()
    if configured is not None:
        return configured
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def workers_for(work: int, minimum: int | None = None) -> int:
    """Threads for a kernel call of ``work`` values or multiply-adds: from ``minimum``
    (:data:`THREAD_MIN_VALUES` by default; at least :data:`BUSY_THREAD_MIN_VALUES` while
    :func:`cores_busy`) every one of :func:`cpu_threads` but the one a job beside holds
    (:func:`submit_beside`), else 1, the calling thread."""
    threshold = THREAD_MIN_VALUES if minimum is None else minimum
    if work >= threshold and cores_busy():
        threshold = max(threshold, BUSY_THREAD_MIN_VALUES)
    if work < threshold:
        return 1
    return max(1, cpu_threads() - (1 if _beside_jobs else 0))


def note_core_share(share: float) -> None:
    """Note the least share of a core (CPU time over wall time) that a cut kernel call's threads got:
    under :data:`BUSY_SHARE` the cores count as busy with other threads for :data:`BUSY_SECONDS`."""
    global _busy_until
    if share < BUSY_SHARE:
        _busy_until = time.perf_counter() + BUSY_SECONDS


def cores_busy() -> bool:
    """Whether a cut kernel call found the cores busy with other threads within :data:`BUSY_SECONDS`."""
    return time.perf_counter() < _busy_until


def thread_count(threads: int | None) -> int:
    """An explicit thread count (at least 1), or :func:`cpu_threads` for None."""
    return cpu_threads() if threads is None else max(1, int(threads))


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there, so new pools are made."""
    global _POOL, _STEP_POOL, _BESIDE_POOL, _POOL_LOCK, _BESIDE_LOCK, _beside_jobs
    _POOL, _STEP_POOL, _BESIDE_POOL, _POOL_LOCK = None, None, None, threading.Lock()
    _BESIDE_LOCK, _beside_jobs = threading.Lock(), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def kernel_pool() -> ThreadPoolExecutor | None:
    """The shared pool of the CPU kernels (one thread per core), or None on a single core."""
    global _POOL
    if cpu_threads() < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(cpu_threads(), thread_name_prefix="sparse-scan-kernel")
        return _POOL


def beside_pool() -> ThreadPoolExecutor:
    """One thread for work that runs beside the calling thread's (a backward's parameter gradients
    beside its scan): its own, not the kernel pool's, since that work launches kernels on the kernel
    pool and waits for them. Work goes to it through :func:`submit_beside`."""
    global _BESIDE_POOL
    with _POOL_LOCK:
        if _BESIDE_POOL is None:
            _BESIDE_POOL = ThreadPoolExecutor(1, thread_name_prefix="sparse-scan-beside")
        return _BESIDE_POOL


def submit_beside(function: Callable[..., T], *args: Any) -> Future[T]:
    """``function(*args)`` on :func:`beside_pool`'s thread. From now until it has run or is cancelled,
    kernel calls are cut over one thread fewer (:func:`workers_for`; one, the calling thread, on two
    cores): that thread holds a core, and a piece handed to a pool thread would share one. In the
    bridge's Adam iteration on the pruned VGG-11, its sampled weight gradients beside the scan (2-core
    AMD EPYC, fused Adam, in-process split timing, medians of 40 iterations, processes alternating with
    the tree before), the backward took at 97 % pruned 14.1-15.1 against 17.3-18.5 ms at batch 16 (at
    batch 1 within noise: 5.1-5.3 against 5.1-6.8), at 90 % pruned 23.5-24.2 against 26.9-28.9 ms at
    batch 16 and 7.0-7.3 against 8.8-9.3 at batch 1."""
    global _beside_jobs
    with _BESIDE_LOCK:
        _beside_jobs += 1
    try:
        future = beside_pool().submit(function, *args)
    except BaseException:
        _beside_done(None)
        raise
    future.add_done_callback(_beside_done)
    return future


def _beside_done(_: Future | None) -> None:
    """One job beside less in flight (:func:`submit_beside`)."""
    global _beside_jobs
    with _BESIDE_LOCK:
        _beside_jobs -= 1


@contextlib.contextmanager
def step_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """Threads for ``workers`` concurrent scan steps: the shared step pool (one thread per core) when
    ``workers`` is the core count, else a pool of ``workers`` threads closed on exit."""
    global _STEP_POOL
    if workers != cpu_threads():
        with ThreadPoolExecutor(workers) as own:
            yield own
        return
    with _POOL_LOCK:
        if _STEP_POOL is None:
            _STEP_POOL = ThreadPoolExecutor(workers, thread_name_prefix="sparse-scan-step")
        pool = _STEP_POOL
    yield pool


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[ThreadPoolExecutor | None]:
    """Threads for work cut into ``workers`` parts by its caller: None for one part, else the shared
    kernel pool (the parts then run at most one per core), or, on a single core where there is no
    shared pool, a pool of ``workers`` threads closed on exit (an explicit count above 1 still runs
    its parts concurrently)."""
    if workers <= 1:
        yield None
        return
    shared = kernel_pool()
    if shared is not None:
        yield shared
        return
    with ThreadPoolExecutor(workers) as own:
        yield own


def even_parts(count: int, parts: int) -> list[tuple[int, int]]:
    """``[0, count)`` cut into at most ``parts`` runs ``(first, last)`` of about equal length (no empty
    runs)."""
    bounds = [count * k // max(1, parts) for k in range(max(1, parts) + 1)]
    return [(first, last) for first, last in zip(bounds[:-1], bounds[1:], strict=True) if last > first]


def run_parts(pool: ThreadPoolExecutor | None, run: Callable[[int, int], object],
              parts: list[tuple[int, int]]) -> None:
    """``run(first, last)`` for every part: on ``pool``'s threads when there is more than one part,
    else on the calling thread."""
    if pool is None or len(parts) < 2:
        for first, last in parts:
            run(first, last)
    else:
        list(pool.map(lambda part: run(*part), parts))
