"""Bounds for tests of what once blocked or ran without end (issue 47): a regression fails the test
rather than hanging it."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


@contextlib.contextmanager
def fails_rather_than_hangs(seconds: float = 10) -> Iterator[None]:
    """Raise TimeoutError in the block after ``seconds`` (SIGALRM: a read blocked on a named pipe is
    interrupted by it), so that a block that would never end fails instead."""
    def expire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
