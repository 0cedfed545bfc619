"""Shared by the benchmark scripts: timing, the record of where a figure was measured, and the rows
file that keeps every measured row of a run that is killed half-way."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from sparse_scan import backend


def no_sync() -> None:
    """Nothing to wait for (CPU work is synchronous)."""


def median_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = no_sync) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(be: backend.Backend, with_torch: bool = True) -> dict[str, Any]:
    """Where a figure was measured. ``with_torch=False`` leaves PyTorch out (importing it starts
    OpenMP threads that slow NumPy work measured afterwards in the same process)."""
    import scipy

    info = {"platform": platform.platform(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
            "backend": be.name, "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if be.name == "gpu":
        info["cupy"] = be.xp.__version__
    if with_torch:
        try:
            import torch

            info["torch"] = torch.__version__
            info["torch_threads"] = torch.get_num_threads()
        except ImportError:
            info["torch"] = None
    if be.name == "gpu":
        props = be.xp.cuda.runtime.getDeviceProperties(be.xp.cuda.Device().id)
        info["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return info


def cpu_pressure() -> str | None:
    """The first line of ``/proc/pressure/cpu`` (how long tasks waited for a core lately: on a shared
    machine, whether a timing can be believed), or None where the kernel has no such file."""
    try:
        return pathlib.Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


class Rows:
    """The rows file of one run (``--rows PATH``): JSON lines appended and flushed as the run goes, so
    that a run killed half-way (a time limit on a lent GPU) keeps every row it finished.

    The first line says what runs where, ``{"benchmark": NAME, "machine": {...}}`` plus the script's
    ``extra`` fields; then one line ``{"benchmark": NAME, "row": {...}}`` per measured row, the row as
    the script's final JSON holds it; last ``{"benchmark": NAME, "finished": true, "seconds": S}`` when
    the run got to its end. Several runs may append to one file (each starts with its own first line).
    ``path`` None writes nothing. :func:`read_rows` reads a file back.
    """

    def __init__(self, path: pathlib.Path | None, benchmark: str, info: dict[str, Any], **extra: Any) -> None:
        self.path, self.benchmark = path, benchmark
        self._start = time.perf_counter()
        self._write({"machine": info, **extra})

    def add(self, row: dict[str, Any]) -> None:
        self._write({"row": row})

    def finish(self) -> None:
        self._write({"finished": True, "seconds": round(time.perf_counter() - self._start, 3)})

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({"benchmark": self.benchmark, **record}) + "\n"  # serialised before opening
        with open(self.path, "a", encoding="utf-8") as file:  # one write per line, flushed on close
            file.write(line)


def read_rows(path: pathlib.Path) -> dict[str, Any]:
    """A rows file (:class:`Rows`) as the script's JSON report: ``machine`` (and the other fields of
    the first run's first line), ``rows`` (every run's, in order) and ``finished`` (whether the last run
    got to its end)."""
    report: dict[str, Any] = {"machine": None, "rows": [], "finished": False}
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the run was killed while writing its last line
                break
            raise
        if "machine" in record:
            if report["machine"] is None:
                report.update({key: value for key, value in record.items() if key not in report})
                report["machine"] = record["machine"]
            report["finished"] = False
        elif "row" in record:
            report["rows"].append(record["row"])
        elif record.get("finished"):
            report["finished"] = True
    return report
