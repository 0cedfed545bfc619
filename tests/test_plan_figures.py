"""Both plan kinds under one protocol: the same names, and the same figures for the same chain."""

from __future__ import annotations

from collections import Counter

import pytest

from sparse_scan import Sequential
from sparse_scan.engine.dense_plan import build_dense_plan
from sparse_scan.engine.figures import TOTALS, ScanPlanLike, critical_path, totals
from sparse_scan.engine.schedule import depth
from sparse_scan.flops import analyse
from sparse_scan.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU

SAME = ("level", "phase", "kind", "left", "right", "mnk", "flops", "flops_live", "out_nnz")
"""Step fields a sparse chain of dense ``H×H`` JTs and the dense scan of ``H×H`` blocks share
(``method`` and ``plan_bytes`` say how each runs it)."""


def schedules(n: int) -> list[tuple[str, int | None]]:
    return [("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(depth(n) + 1)]


def step_rows(plan: ScanPlanLike) -> Counter:
    """The report's steps as a multiset (a level's steps may come in another order)."""
    return Counter(tuple(tuple(row[key]) if isinstance(row[key], list) else row[key] for key in SAME)
                   for row in plan.report(1, 4)["steps"])


def dense_chain(n: int, size: int) -> Sequential:
    """``n`` linear layers of ``size×size``: every JT a dense block, like a recurrent chain's."""
    return Sequential(*[Linear(size, size, rng=j) for j in range(n)], input_shape=(size,))


def test_both_plan_kinds_satisfy_the_protocol_with_the_same_report_keys():
    sparse = dense_chain(5, 2).plan((2,), "blelloch")
    dense = build_dense_plan(5, "blelloch").sized(2)
    assert isinstance(sparse, ScanPlanLike) and isinstance(dense, ScanPlanLike)
    reports = [plan.report(batch=3, itemsize=8) for plan in (sparse, dense)]
    assert [set(report) for report in reports] == [{"method", "levels", "n", "steps", "totals"}] * 2
    assert [tuple(report["totals"]) for report in reports] == [TOTALS] * 2
    assert set(reports[0]["steps"][0]) == set(reports[1]["steps"][0])
    for plan, report in zip((sparse, dense), reports, strict=True):
        assert report["totals"] == totals(plan, 3, 8)
        assert report["totals"]["peak_bytes"] == plan.peak_bytes(3, 8)


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 5, 13])
def test_a_sparse_chain_of_dense_blocks_has_the_dense_plans_figures(n, size):
    """The same chain planned twice, as sparse JTs and as a dense-block scan (a gradient w.r.t. the
    last state alone: plain block products), gives the same steps and totals in the same units."""
    model = dense_chain(n, size)
    for method, levels in schedules(n):
        sparse = model.plan((size,), method, levels)
        dense = build_dense_plan(n, method, levels).sized(size, affine=False)
        label = f"{method} {levels}"
        assert step_rows(sparse) == step_rows(dense), label
        assert (sparse.critical_flops, sparse.work_flops, sparse.critical_steps) == (
            dense.critical_flops, dense.work_flops, dense.critical_steps), label


def test_the_critical_path_is_the_plans_critical_flops_and_what_flops_marks():
    model = Sequential(Conv2d(1, 4, 3, padding=1, rng=0), ReLU(), MaxPool2d(2), Conv2d(4, 4, 3, rng=1),
                       ReLU(), Flatten(), Linear(16, 5, rng=2), input_shape=(1, 8, 8))
    for method, levels in schedules(len(model.layers)):
        plan = model.plan(model.input_shape, method, levels)
        path = critical_path(plan.steps)
        assert [plan.steps[index].level for index in path] == sorted({step.level for step in plan.steps})
        assert sum(plan.steps[index].flops for index in path) == plan.critical_flops
        report = analyse(model, method, levels)
        assert [index for index, step in enumerate(report["steps"]) if step["critical"]] == path
        assert {key: report["totals"][key] for key in TOTALS if key != "plan_bytes"} == {
            key: value for key, value in totals(plan, 1, 4).items() if key != "plan_bytes"}
