"""Deprecated: the scan's plans moved to :mod:`sparse_scan.engine` (removed in the next release).

``sparse_scan.scan`` re-exports what it held: schedules from :mod:`sparse_scan.engine.schedule`, plans
from :mod:`sparse_scan.engine.plan`, and ``run_plan`` (the host executor; the engine's dispatch is
:func:`sparse_scan.engine.run.run_plan`, which takes the backend first).
"""

from __future__ import annotations

import warnings

from .engine._cpu import run_plan
from .engine.plan import (
    Candidate,
    ElementInfo,
    ScanCostError,
    ScanMemoryError,
    ScanPlan,
    ScheduleChoice,
    Step,
    build_plan,
    estimate_plan,
)
from .engine.schedule import (
    METHODS,
    SCHEDULES,
    Element,
    checked_levels,
    depth,
    live_schedule,
    scan_outputs,
    schedule,
)

__all__ = ["METHODS", "SCHEDULES", "Candidate", "Element", "ElementInfo", "ScanCostError", "ScanMemoryError",
           "ScanPlan", "ScheduleChoice", "Step", "build_plan", "checked_levels", "depth", "estimate_plan",
           "live_schedule", "run_plan", "scan_outputs", "schedule"]

warnings.warn("sparse_scan.scan is deprecated: import from sparse_scan.engine (sparse_scan.engine.plan, "
              "sparse_scan.engine.schedule, sparse_scan.engine.run)", DeprecationWarning, stacklevel=2)
