"""The names of the scan schedules, importable without NumPy (the command line's choices)."""

from __future__ import annotations

__all__ = ["METHODS", "SCHEDULES"]

METHODS = ("linear", "blelloch", "hybrid")
"""The schedules a plan is built for (:mod:`sparse_scan.scan`)."""

SCHEDULES = ("auto",) + METHODS
"""What a caller may ask for: ``auto`` chooses one of :data:`METHODS` (``Sequential.plan``)."""
