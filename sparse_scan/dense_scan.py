"""Deprecated: dense-block scans moved to :mod:`sparse_scan.engine` (removed in the next release).

``dense_plan`` is :func:`sparse_scan.engine.dense_plan.build_dense_plan` (renamed: the function shared
its name with its module).

``sparse_scan.dense_scan`` re-exports :func:`sparse_scan.engine.run.dense_scan` and the plans of
:mod:`sparse_scan.engine.dense_plan`.
"""

from __future__ import annotations

import warnings

from .engine.dense_plan import DenseScanPlan, Location, auto_levels, build_dense_plan
from .engine.run import dense_scan

dense_plan = build_dense_plan  # its name before the engine's modules took that name

__all__ = ["DenseScanPlan", "Location", "auto_levels", "dense_plan", "dense_scan"]

warnings.warn("sparse_scan.dense_scan is deprecated: import from sparse_scan.engine (sparse_scan.engine.run, "
              "sparse_scan.engine.dense_plan)", DeprecationWarning, stacklevel=2)
