"""Scan schedules over a chain of ``n`` elements: pure bookkeeping, no arrays.

Back-propagation through ``n`` layers is the exclusive scan of ``[g_n, JT_n, ..., JT_1]`` under
``A ◇ B = B·A`` (paper §3.1): element 0 is the output gradient, element ``j`` the transposed Jacobian of
layer ``n - j + 1``. An :class:`Element` names the product of a run of consecutive elements; a schedule
lists which products are computed, at which level (steps of one level are independent). Three
schedules compute the scan:

``linear``
    ``g_{i-1} = JT_i g_i`` one matrix-vector product after another (back-propagation).
``blelloch``
    Algorithm 1 of the paper for any ``n``: up-sweep, root set to the identity, down-sweep with
    reversed operands.
``hybrid``
    ``levels`` up-sweep levels, a linear scan over the segment products the down-sweep needs, then
    the matching down-sweep levels (paper §5.3). ``levels=0`` is ``linear``; the full depth is
    ``blelloch``.

Both element kinds of the engine run these schedules: sparse JTs (:mod:`sparse_scan.engine.plan`) and
dense blocks (:mod:`sparse_scan.engine.dense_plan`). This module imports neither NumPy nor any other
part of the engine: the command line reads :data:`SCHEDULES` before NumPy loads.

Examples
--------
>>> [(level, phase) for level, phase, _, _ in live_schedule(3, "blelloch", None)]
[(0, 'up'), (1, 'down'), (2, 'final')]
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .._checks import is_int

__all__ = ["IDENTITY", "METHODS", "SCHEDULES", "Element", "checked_levels", "depth", "live_schedule",
           "live_segments", "scan_outputs", "schedule", "schedule_at_depth"]

METHODS = ("linear", "blelloch", "hybrid")
"""The schedules a plan is built for."""

SCHEDULES = ("auto",) + METHODS
"""What a caller may ask for: ``auto`` chooses one of :data:`METHODS` (``Sequential.plan``)."""

Segment = tuple[int, int]  # elements lo..hi (inclusive) combined: hi's JT applied last


@dataclass(frozen=True)
class Element:
    """Symbolic contents of one scan value: a product of consecutive elements ``lo..hi``.

    ``lo == 0`` means the product includes the output gradient, so the value is a vector; an empty
    segment (``lo > hi``) is the identity.
    """

    lo: int
    hi: int

    @property
    def is_identity(self) -> bool:
        return self.lo > self.hi

    @property
    def is_vector(self) -> bool:
        return self.lo == 0 and not self.is_identity


IDENTITY = Element(1, 0)


def depth(n: int) -> int:
    """``ceil(log2(n + 1))``: up-sweep levels of a full Blelloch scan over ``n + 1`` elements."""
    return math.ceil(math.log2(n + 1)) if n > 0 else 0


def schedule_at_depth(requested: str, k: int, full: int) -> tuple[str, int | None]:
    """Hybrid depth ``k`` of a chain of full depth ``full`` (:func:`depth`) as ``(method, levels)``, named
    as a request for ``requested`` names it: ``hybrid`` (a depth chosen for a hybrid) names every depth
    ``hybrid k``; ``auto`` names depth 0 ``linear`` and depths ``full - 1`` and ``full`` ``blelloch``
    (their schedules are the Blelloch scan's: the top level's products are all moves), the others
    ``hybrid k``. The one mapping both model kinds' automatic choices use.

    Examples
    --------
    >>> [schedule_at_depth("auto", k, 4) for k in range(5)]
    [('linear', None), ('hybrid', 1), ('hybrid', 2), ('blelloch', None), ('blelloch', None)]
    >>> schedule_at_depth("hybrid", 3, 4)
    ('hybrid', 3)
    """
    if requested == "hybrid":
        return "hybrid", k
    return ("linear", None) if k == 0 else ("blelloch", None) if k >= full - 1 else ("hybrid", k)


def schedule(n: int, method: str, levels: int | None) -> list[tuple[int, str, Element, Element, int]]:
    """The raw schedule: ``(level, phase, left, right, slot)`` per product, ``slot`` receiving it.

    ``left ◇ right = right · left``. Combines with the identity are moves: they update the slots and
    emit nothing. Products whose result nothing uses are still listed
    (:func:`~sparse_scan.engine.plan.build_plan` drops them).
    """
    return [(level, phase, Element(*left), Element(*right), slot)
            for level, phase, left, right, slot in _segment_schedule(n, method, levels)]


_IDENTITY_SEGMENT = (1, 0)


def _segment_schedule(n: int, method: str,
                      levels: int | None) -> list[tuple[int, str, Segment, Segment, int]]:
    """:func:`schedule` over plain ``(lo, hi)`` segments (cheap to hash: the planners' hot path)."""
    slots: list[Segment] = [(j, j) for j in range(n + 1)]
    ops: list[tuple[int, str, Segment, Segment, int]] = []
    level = 0

    def combine(left: Segment, right: Segment) -> Segment:
        if left[0] > left[1]:
            return right
        if right[0] > right[1]:
            return left
        return left[0], right[1]

    def record(phase: str, left: Segment, right: Segment, slot: int) -> None:
        result = combine(left, right)
        if not (left[0] > left[1] or right[0] > right[1]):
            ops.append((level, phase, left, right, slot))
        slots[slot] = result

    if method == "linear":
        up = 0
    elif method == "blelloch":
        up = max(depth(n) - 1, 0)
    else:
        up = levels if levels is not None else 0
    # up-sweep: a[r] <- a[l] ◇ a[r]
    for d in range(up):
        for i in range(0, n - 2**d + 1, 2 ** (d + 1)):
            left, right = i + 2**d - 1, min(i + 2 ** (d + 1) - 1, n)
            record("up", slots[left], slots[right], right)
        level += 1
    if method == "blelloch":
        slots[n] = _IDENTITY_SEGMENT
        top = depth(n) - 1
    else:
        # linear scan over the segment roots: P_0 = I, P_{j+1} = P_j ◇ root_j; root_j <- P_j
        width = 2**up
        roots = [min(j * width + width - 1, n) for j in range((n + width) // width)]
        prefix = _IDENTITY_SEGMENT
        for root in roots:
            segment = slots[root]
            slots[root] = prefix
            if prefix[0] <= prefix[1]:
                ops.append((level, "linear", prefix, segment, -1))
                level += 1
            prefix = combine(prefix, segment)
        top = up - 1
    # down-sweep: T = a[l]; a[l] = a[r]; a[r] = T ◇' a[r] with reversed operands: a[r] ◇ T = T·a[r]
    for d in range(top, -1, -1):
        for i in range(0, n - 2**d + 1, 2 ** (d + 1)):
            left, right = i + 2**d - 1, min(i + 2 ** (d + 1) - 1, n)
            subtree = slots[left]
            slots[left] = slots[right]
            record("down", slots[right], subtree, right)
        level += 1
    ops.append((level, "final", slots[n], (n, n), -1))  # g_0 = JT_1 · g_1
    return ops


def checked_levels(n: int, method: str, levels: int | None, unit: str = "layers") -> int | None:
    """Validate ``method`` and, for ``hybrid``, ``levels`` (an int in 0 .. ``depth(n)``, not a float
    or a bool; other methods take none); return the levels. ``unit`` names what ``n`` counts."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if method != "hybrid":
        if levels is not None:
            raise ValueError(f"levels applies to method='hybrid' only; got levels={levels!r} "
                             f"with method={method!r}")
        return None
    if not is_int(levels) or not 0 <= levels <= depth(n):
        raise ValueError(f"hybrid needs levels in 0..{depth(n)} for {n} {unit}; got {levels!r}")
    return int(levels)


def scan_outputs(n: int) -> list[Element]:
    """Where the results live: the gradient w.r.t. ``x_i`` is the prefix ``0..n-i`` (``i = 0..n``)."""
    return [Element(0, n - i) for i in range(n + 1)]


def live_schedule(n: int, method: str, levels: int | None) -> list[tuple[int, str, Element, Element]]:
    """:func:`schedule` without the products nothing uses: ``(level, phase, left, right)`` per step.

    Levels are renumbered densely (dropped steps may leave empty levels); steps of one level are
    independent. Both element kinds of the engine run this schedule: sparse JTs
    (:func:`~sparse_scan.engine.plan.build_plan`) and dense blocks (:mod:`sparse_scan.engine.dense_plan`).

    Examples
    --------
    >>> [(level, phase) for level, phase, _, _ in live_schedule(3, "blelloch", None)]
    [(0, 'up'), (1, 'down'), (2, 'final')]
    """
    return [(level, phase, Element(*left), Element(*right))
            for level, phase, left, right in live_segments(n, method, levels)]


@functools.lru_cache(maxsize=64)
def live_segments(n: int, method: str, levels: int | None) -> tuple[tuple[int, str, Segment, Segment], ...]:
    """:func:`live_schedule` with plain ``(lo, hi)`` segments for operands (cached): what a planner that
    only counts steps reads (:func:`~sparse_scan.engine.dense_plan.dense_shape`)."""
    levels = checked_levels(n, method, levels)
    needed = {(0, n - i) for i in range(n + 1)}  # scan_outputs
    kept = []
    for level, phase, left, right, _ in reversed(_segment_schedule(n, method, levels)):
        out = (left[0], right[1])
        if out in needed:  # the last producer of a value suffices: earlier duplicates drop out
            kept.append((level, phase, left, right))
            needed.discard(out)
            needed.update((left, right))
    kept.reverse()
    level_ids = {level: rank for rank, level in enumerate(sorted({op[0] for op in kept}))}
    return tuple((level_ids[level], phase, left, right) for level, phase, left, right in kept)
