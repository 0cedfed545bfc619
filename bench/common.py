"""Shared by the benchmark scripts: timing and the record of where a figure was measured."""

from __future__ import annotations

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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(be: backend.Backend) -> dict[str, Any]:
    import scipy

    info = {"platform": platform.platform(), "processor": _cpu_model(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
            "backend": be.name, "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if be.name == "gpu":
        info["cupy"] = be.xp.__version__
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
