"""The dense-block scan against a dense reference chain, for every schedule and levels value."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sparse_scan.engine import _dense_cpu as dense_host
from sparse_scan.engine.dense_plan import Location, auto_levels, build_dense_plan, dense_shape
from sparse_scan.engine.figures import critical_path
from sparse_scan.engine.run import dense_scan
from sparse_scan.engine.schedule import depth

SCHEDULES = [("linear", None), ("blelloch", None)]


def reference(blocks: np.ndarray, direct: np.ndarray) -> np.ndarray:
    """``G_T = d_T``, ``G_t = d_t + A_{t+1} G_{t+1}``, ``G_0 = A_1 G_1``, one step after another."""
    steps = len(blocks)
    if direct.ndim == 2:
        last, direct = direct, np.zeros(blocks.shape[:3])
        direct[-1] = last
    totals = np.zeros((steps + 1,) + direct.shape[1:])
    totals[steps] = direct[steps - 1]
    for t in range(steps - 1, -1, -1):
        totals[t] = (direct[t - 1] if t > 0 else 0) + np.einsum("bij,bj->bi", blocks[t], totals[t + 1])
    return totals


def every_schedule(n: int) -> list[tuple[str, int | None]]:
    return SCHEDULES + [("hybrid", k) for k in range(depth(n) + 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 21, 64])
@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("affine", [True, False], ids=["every-step", "last-only"])
def test_every_schedule_equals_the_sequential_chain(n, batch, affine):
    rng = np.random.default_rng(n * 10 + batch)
    size = 4
    blocks = rng.standard_normal((n, batch, size, size)) / 2.5
    direct = rng.standard_normal((n, batch, size) if affine else (batch, size))
    expected = reference(blocks, direct)
    scale = np.abs(expected).max()
    for method, levels in every_schedule(n):
        got = dense_scan(blocks, direct, method, levels)
        label = f"{method} {levels}"
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10 * scale, err_msg=label)
        single = dense_scan(blocks.astype(np.float32), direct.astype(np.float32), method, levels, threads=1)
        assert single.dtype == np.float32
        np.testing.assert_allclose(single, expected, rtol=1e-4, atol=1e-4 * scale, err_msg=label)


def _chains_of_groups(plan):
    """Runs of four or more levels of one mv each, every one reading the previous one's result, from
    the built plan's groups (the executor's view)."""
    runs, start = {}, None
    for index, groups in enumerate(plan.levels_of_groups + [[]]):
        single = len(groups) == 1 and groups[0].kind == "mv" and len(groups[0].ops) == 1
        follows = single and start is not None and groups[0].ops[0].left == Location(
            plan.levels_of_groups[index - 1][0].buffer, 0)
        if start is not None and not follows:
            if index - start >= 4:
                runs[start] = index
            start = None
        if single and start is None:
            start = index
    return runs


def test_the_counted_shape_is_the_built_plans():
    # dense_shape counts levels, products and chains from the schedule's segments alone (the cost
    # model's and auto's figures): every n to 130 and every schedule, against the built plan
    for n in range(1, 131):
        hybrids = [("hybrid", k) for k in range(depth(n) + 1)]
        for method, levels in [("linear", None), ("blelloch", None)] + hybrids:
            plan, shape = build_dense_plan(n, method, levels), dense_shape(n, method, levels)
            assert shape.counts == tuple((sum(len(g.ops) for g in groups if g.kind == "mm"),
                                          sum(len(g.ops) for g in groups if g.kind == "mv"))
                                         for groups in plan.levels_of_groups)
            assert shape.chains == _chains_of_groups(plan)
            for size, affine in ((3, True), (5, False)):
                sized = plan.sized(size, affine)
                steps = sized.steps
                assert shape.critical_flops(size, affine) == sum(steps[i].flops for i in critical_path(steps))
                assert sum(shape.level_flops(size, affine)) == sum(step.flops for step in steps)


def test_threads_split_large_levels_without_changing_results(monkeypatch):
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((300, 16, 6, 6)) / 4
    direct = rng.standard_normal((300, 16, 6))
    one = dense_scan(blocks, direct, "blelloch", threads=1)
    np.testing.assert_allclose(dense_scan(blocks, direct, "blelloch", threads=3), one, rtol=1e-12, atol=1e-14)
    splits = []
    original = ThreadPoolExecutor.map
    monkeypatch.setattr(ThreadPoolExecutor, "map", lambda pool, *a: splits.append(1) or original(pool, *a))
    monkeypatch.setattr(dense_host, "SPLIT_MIN_VALUES", 64)  # split even these small levels
    np.testing.assert_allclose(dense_scan(blocks, direct, "blelloch", threads=3), one, rtol=1e-12, atol=1e-14)
    assert splits
    np.testing.assert_allclose(one, reference(blocks, direct), rtol=1e-10, atol=1e-12)


def test_auto_levels_is_a_valid_hybrid_and_deeper_on_a_gpu_model():
    rng = np.random.default_rng(1)
    blocks = rng.standard_normal((40, 2, 3, 3)) / 2
    direct = rng.standard_normal((40, 2, 3))
    expected = reference(blocks, direct)
    np.testing.assert_allclose(dense_scan(blocks, direct, levels="auto"), expected, rtol=1e-10)
    cpu, gpu = auto_levels(1000, 16, 20, "cpu"), auto_levels(1000, 16, 20, "gpu")
    assert 0 <= cpu <= gpu <= depth(1000)
    assert gpu > cpu  # on a GPU the shorter critical path pays for the extra products


def test_plans_are_cached_and_report_the_scan_figures():
    plan = build_dense_plan(1000, "blelloch")
    assert build_dense_plan(1000, "blelloch") is plan
    size = 20
    linear = build_dense_plan(1000, "linear").sized(size)
    assert linear.critical_steps == 1000
    assert linear.work_flops == linear.critical_flops == 1000 * 2 * size**2
    assert plan.critical_steps <= 2 * depth(1000) + 1
    # Blelloch: about n block products in all, one per level on the critical path
    figures = plan.sized(size)
    mm = sum(1 for step in figures.steps if step.kind == "mm")
    assert 900 < mm < 1000
    assert figures.work_flops == sum(step.flops for step in figures.steps) == sum(figures.level_flops)
    report = figures.report(batch=16, itemsize=4)
    assert report["totals"]["work_flops"] == figures.work_flops  # FLOPs per sample, as a sparse plan's
    assert report["totals"]["peak_bytes"] > 1000 * 16 * size * size * 4  # the input blocks at least
    assert len(report["steps"]) == len(figures.steps)


def test_a_scan_without_direct_gradients_counts_no_vector_parts():
    plan, size = build_dense_plan(64, "blelloch"), 5
    affine, last_only = plan.sized(size), plan.sized(size, affine=False)
    block_products = sum(1 for step in affine.steps if step.kind == "mm")
    assert affine.work_flops - last_only.work_flops == block_products * 2 * size**2
    assert last_only.peak_bytes(3, 8) < affine.peak_bytes(3, 8)
    assert {step.flops for step in last_only.steps if step.kind == "mm"} == {2 * size**3}


@pytest.mark.parametrize("blocks_shape, direct_shape", [((3, 2, 4, 4), (3, 2, 5)), ((3, 2, 4, 5), (3, 2, 4)),
                                                        ((3, 2, 4, 4), (2, 2, 4)), ((3, 2, 4, 4), (3, 4))])
def test_shape_mismatches_are_named(blocks_shape, direct_shape):
    with pytest.raises(ValueError, match="blocks must be"):
        dense_scan(np.zeros(blocks_shape), np.zeros(direct_shape))


def test_bad_methods_and_levels_are_errors():
    with pytest.raises(ValueError, match="method must be one of"):
        build_dense_plan(4, "tree")
    with pytest.raises(ValueError, match="hybrid needs levels"):
        build_dense_plan(4, "hybrid", 7)
    with pytest.raises(ValueError, match="at least one step"):
        build_dense_plan(0)
