"""What every scan plan reports, under one set of names and units: the plan protocol.

Two plan kinds run the engine's schedules: :class:`~sparse_scan.engine.plan.ScanPlan` over sparse
JTs, and :class:`~sparse_scan.engine.dense_plan.SizedDenseScanPlan` over dense blocks of one size (a
:class:`~sparse_scan.engine.dense_plan.DenseScanPlan` with its block size,
:meth:`~sparse_scan.engine.dense_plan.DenseScanPlan.sized`). Both are a :class:`ScanPlanLike`:

======================  =====================================================================
``method``              ``linear``, ``blelloch`` or ``hybrid``
``levels``              up-sweep levels of a ``hybrid`` plan (None for the others)
``n``                   elements (layers, or time steps) of the chain
``steps``               every step (:class:`StepFigures`: ``level``, ``phase``, ``kind``,
                        ``flops``)
``critical_flops``      the flops of the :func:`critical_path`: each level's costliest step
``work_flops``          the flops of every step
``critical_steps``      levels: the steps that run one after another
``plan_bytes``          index structure the numeric phase holds (sparse products; a dense
                        block needs none)
``peak_bytes(b, i)``    most bytes of scan values live at once, ``b`` samples of ``i`` bytes
``report(b, i)``        ``method``, ``levels``, ``n``, ``steps`` (a dict per step: ``level,
                        phase, kind, method, left, right, mnk, flops, flops_live, out_nnz,
                        plan_bytes``) and ``totals`` (:data:`TOTALS`, by :func:`totals`)
======================  =====================================================================

Units are the same for both: FLOPs for one sample, counted as in docs/design.md (a multiply-add is
two; a dense ``size×size`` block counts every entry); bytes for the whole batch. This module is pure
bookkeeping: it imports no part of the engine, and plan modules import it.

Examples
--------
>>> from sparse_scan.engine.dense_plan import build_dense_plan
>>> plan = build_dense_plan(6, "blelloch").sized(2, affine=False)       # six 2x2 blocks
>>> isinstance(plan, ScanPlanLike)
True
>>> path = critical_path(plan.steps)
>>> [plan.steps[index].level for index in path] == list(range(plan.critical_steps))
True
>>> plan.critical_flops == sum(plan.steps[index].flops for index in path) < plan.work_flops
True
>>> sorted(totals(plan, batch=4, itemsize=8))
['critical_flops', 'critical_steps', 'peak_bytes', 'plan_bytes', 'work_flops']
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

__all__ = ["TOTALS", "ScanPlanLike", "StepFigures", "critical_path", "size_text", "totals"]

TOTALS = ("critical_flops", "work_flops", "critical_steps", "plan_bytes", "peak_bytes")
"""The keys of a plan report's ``totals``, in order."""


@runtime_checkable
class StepFigures(Protocol):
    """What the protocol reads of one step of a plan."""

    @property
    def level(self) -> int:
        """Position on the critical path: steps of one level are independent."""

    @property
    def phase(self) -> str:
        """``up``, ``linear``, ``down`` or ``final``."""

    @property
    def kind(self) -> str:
        """``mm`` (matrix-matrix) or ``mv`` (matrix-vector)."""

    @property
    def flops(self) -> int:
        """FLOPs of the step for one sample."""


@runtime_checkable
class ScanPlanLike(Protocol):
    """A planned scan's figures, the same names and units for every plan kind (module docstring)."""

    @property
    def method(self) -> str:
        """The schedule: ``linear``, ``blelloch`` or ``hybrid``."""

    @property
    def levels(self) -> int | None:
        """Up-sweep levels of a ``hybrid`` plan, else None."""

    @property
    def n(self) -> int:
        """Elements of the chain (layers, or time steps)."""

    @property
    def steps(self) -> Sequence[StepFigures]:
        """Every step, in an order where a step's operands come from earlier levels."""

    @property
    def critical_flops(self) -> int:
        """FLOPs on the critical path (one sample): the costliest step of every level."""

    @property
    def work_flops(self) -> int:
        """FLOPs of every step (one sample)."""

    @property
    def critical_steps(self) -> int:
        """Levels: the steps that run one after another."""

    @property
    def plan_bytes(self) -> int:
        """Index structure the numeric phase holds."""

    def peak_bytes(self, batch: int, itemsize: int) -> int:
        """Most bytes of scan values live at once, for ``batch`` samples of ``itemsize``-byte values."""

    def report(self, batch: int, itemsize: int) -> dict[str, Any]:
        """Per-step figures and :func:`totals` (JSON-friendly)."""


def critical_path(steps: Sequence[StepFigures]) -> list[int]:
    """The critical path: the index of every level's costliest step (the first of equals), in level
    order. A plan's ``critical_flops`` is the sum of these steps' ``flops``.

    Examples
    --------
    >>> from types import SimpleNamespace as Step
    >>> critical_path([Step(level=0, flops=4), Step(level=0, flops=6), Step(level=1, flops=2),
    ...                Step(level=1, flops=2)])
    [1, 2]
    """
    costliest: dict[int, int] = {}
    for index, step in enumerate(steps):
        if step.level not in costliest or step.flops > steps[costliest[step.level]].flops:
            costliest[step.level] = index
    return [costliest[level] for level in sorted(costliest)]


def totals(plan: ScanPlanLike, batch: int, itemsize: int) -> dict[str, int]:
    """The ``totals`` of ``plan``'s report (:data:`TOTALS`), ``peak_bytes`` for ``batch`` samples of
    ``itemsize``-byte values."""
    return {"critical_flops": plan.critical_flops, "work_flops": plan.work_flops,
            "critical_steps": plan.critical_steps, "plan_bytes": plan.plan_bytes,
            "peak_bytes": plan.peak_bytes(batch, itemsize)}


def size_text(nbytes: float) -> str:
    """Bytes in B, KiB, MiB or GiB (the command line's figures and the planner's messages)."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:,.1f} GiB"
