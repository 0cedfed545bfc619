"""Progress of long work on stderr, for every command: what is being done, and for how long.

A :class:`Progress` shows a status (``planning: steps 14/40, product rows 35 %``, ``epoch 1/2: batch
12/45``) set by the command as it works. On a terminal it is one line, rewritten in place at most
:data:`TTY_REFRESH_S` apart and every second with the seconds so far, and wiped when the work ends or
a line of output or an error is printed. Elsewhere (a pipe, a file, a test runner) it is a plain line
``sparse-scan: STATUS (N s)`` at most every :data:`PLAIN_INTERVAL_S` seconds: work shorter than that
prints nothing, longer work a line every interval, even while one step takes minutes (a thread
prints it). ``--quiet`` turns it off.

Only one is active at a time; :func:`end_line` wipes its line, so that an error never lands on the
end of a status line (``_common.echo_error`` calls it).

Importing this module costs the standard library only.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

__all__ = ["PHASES", "PLAIN_INTERVAL_S", "TTY_REFRESH_S", "Progress", "end_line", "plan_status"]

PLAIN_INTERVAL_S = 10.0
"""Seconds between two plain progress lines (and before the first) where stderr is no terminal."""

TTY_REFRESH_S = 0.2
"""Least seconds between two redraws of the terminal's status line."""

_ACTIVE: list[Progress] = []


def end_line() -> None:
    """Wipe the active progress' status line on a terminal (before an error is printed)."""
    for progress in _ACTIVE:
        progress.wipe()


class Progress:
    """The status of the command's work on ``stream`` (stderr by default), as a context manager.

    Parameters
    ----------
    quiet : bool
        Show nothing (``--quiet``).
    stream : file, optional
        Where to show it; a terminal (``isatty()``) gets the rewritten line.
    interval : float, optional
        Seconds between plain lines (default :data:`PLAIN_INTERVAL_S`).

    Examples
    --------
    >>> import io
    >>> stream = io.StringIO()
    >>> with Progress(quiet=False, stream=stream, interval=0) as progress:
    ...     progress.show("planning: steps 1/2")
    >>> print(stream.getvalue(), end="")
    sparse-scan: planning: steps 1/2 (... s)
    """

    def __init__(self, quiet: bool, stream: IO[str] | None = None, interval: float | None = None) -> None:
        self.quiet = quiet
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = PLAIN_INTERVAL_S if interval is None else interval
        self.text = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = self._plain = time.monotonic()
        self._drawn = -float("inf")  # the first status is drawn at once
        self._line = ""
        self._open = False  # a terminal line is drawn: self._line

    def __enter__(self) -> Progress:
        if not self.quiet:
            self._start = self._plain = time.monotonic()
            _ACTIVE.append(self)
            self._thread = threading.Thread(target=self._tick, name="sparse-scan progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        _ACTIVE.remove(self)
        self.wipe()

    def show(self, text: str) -> None:
        """Make ``text`` the status (shown now on a terminal, unless drawn under
        :data:`TTY_REFRESH_S` ago; elsewhere once :attr:`interval` has passed since the last line)."""
        self.text = text
        if self._thread is not None:
            with self._lock:
                self._draw(time.monotonic())

    def echo(self, text: str, stream: IO[str] | None = None) -> None:
        """Print a line of output (on ``stream``, stdout by default) without gluing it to the status
        line; the status comes back at the next draw."""
        with self._lock:
            self._wipe()
            print(text, file=sys.stdout if stream is None else stream, flush=True)

    def wipe(self) -> None:
        """Remove the status line from a terminal (nothing elsewhere)."""
        with self._lock:
            self._wipe()

    def _wipe(self) -> None:
        if self._open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._open = False

    def _tick(self) -> None:
        while not self._stop.wait(TTY_REFRESH_S if self.tty else min(1.0, self.interval or 1.0)):
            with self._lock:
                self._draw(time.monotonic(), tick=True)

    def _draw(self, now: float, tick: bool = False) -> None:
        """Draw the status if it is due (the lock held). On a terminal: when the line (status and
        seconds) changed, at once or, under :data:`TTY_REFRESH_S` after the last draw, at the
        thread's next ``tick``."""
        if not self.text:
            return
        seconds = int(now - self._start)
        if self.tty:
            line = f"{self.text} ({seconds} s)"
            if (self._open and line == self._line) or (not tick and now - self._drawn < TTY_REFRESH_S):
                return
            self.stream.write(f"\r\x1b[K{line}")
            self._open, self._drawn, self._line = True, now, line
        elif now - self._plain >= self.interval:
            self.stream.write(f"sparse-scan: {self.text} ({seconds} s)\n")
            self._plain = now
        else:
            return
        self.stream.flush()


PHASES = {"sizes": "JT sizes", "patterns": "JT patterns", "steps": "steps", "live": "samples"}
"""How :func:`plan_status` names the phases a plan's build (and a live FLOP count) reports."""


def plan_status(progress: Progress, what: str = "planning") -> Any:
    """A ``progress(phase, done, total)`` callback for :meth:`sparse_scan.Sequential.plan` and
    :func:`sparse_scan.flops.live` that shows ``what: phase done/total`` on ``progress``, and within a
    step the share of its product's rows expanded so far (a product can take minutes)."""
    steps = [""]

    def show(phase: str, done: int, total: int) -> None:
        if phase == "product rows":
            progress.show(f"{what}: {steps[0]}, product rows {100 * done // max(total, 1)} %")
            return
        text = f"{PHASES.get(phase, phase)} {done}/{total}"
        if phase == "steps":
            steps[0] = f"{text} done"
        progress.show(f"{what}: {text}")

    return show
