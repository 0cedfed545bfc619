"""The host's cores, and the shared worker threads of the CPU kernels.

NumPy's gathers (``take``) and ufuncs release the GIL, so a large elementwise kernel runs on every core
when its work is cut into pieces handed to threads. One pool serves every such kernel; a kernel never
waits on the pool from inside one of its own tasks, so callers that run on other threads (the scan's
concurrent steps) cannot deadlock it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["cpu_threads", "kernel_pool"]

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def cpu_threads() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there, so a new pool is made."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


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
