"""The planned scan: every schedule gives back-propagation's gradients; plans are symbolic and reused."""

from __future__ import annotations

import pathlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import scipy.sparse as sp
from oracles import torch_modules

from sparse_scan import Sequential
from sparse_scan.csr import Pattern
from sparse_scan.engine import _cpu as host
from sparse_scan.engine import products as product_planning
from sparse_scan.engine.plan import ScanCostError
from sparse_scan.engine.products import plan_product
from sparse_scan.engine.run import multiply
from sparse_scan.engine.schedule import depth, live_schedule, schedule_at_depth
from sparse_scan.layers import (
    AvgPool2d,
    Conv2d,
    Flatten,
    LeakyReLU,
    Linear,
    MaxPool2d,
    ReLU,
    Sigmoid,
    Tanh,
)
from sparse_scan.optim import SGD

POINTWISE = (ReLU, lambda: LeakyReLU(0.1), Tanh, Sigmoid)


def random_chain(n: int, seed: int, dtype) -> tuple[Sequential, tuple[int, ...]]:
    """A chain of ``n`` layers mixing every layer type, with compatible shapes.

    Spatial layers come first (conv with random kernel/stride/padding/dilation/groups, pools,
    activations), then Flatten, then linear layers and activations.
    """
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 4)), int(rng.integers(5, 8)), int(rng.integers(5, 8)))
    in_shape, layers, flat = shape, [], False
    spatial = n // 2 if n > 2 else n - 1
    for position in range(n):
        if not flat and position == spatial:
            layers.append(Flatten())
            flat = True
            shape = (int(np.prod(shape)),)
            continue
        choice = rng.integers(0, 4)
        if choice == 0:
            layers.append(POINTWISE[rng.integers(0, len(POINTWISE))]())
            continue
        if flat:
            out = int(rng.integers(2, 9))
            layers.append(Linear(shape[0], out, dtype=dtype, rng=seed + position))
            shape = (out,)
            continue
        c, h, w = shape
        if choice == 1 and min(h, w) >= 2:
            pool = MaxPool2d(2, stride=int(rng.integers(1, 3))) if rng.random() < 0.5 else \
                AvgPool2d(2, stride=1, padding=1, count_include_pad=bool(rng.random() < 0.5))
            layers.append(pool)
        else:
            groups = c if c > 1 and rng.random() < 0.3 else 1
            out_c = groups * int(rng.integers(1, 3))
            kernel = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
            conv = Conv2d(c, out_c, kernel, stride=int(rng.integers(1, 3)),
                          padding=(int(rng.integers(0, 2)), int(rng.integers(0, 2))),
                          groups=groups, dtype=dtype, rng=seed + position)
            try:
                conv.output_shape(shape)
            except ValueError:  # the kernel does not fit what is left of the input
                conv = Tanh()
            layers.append(conv)
        shape = layers[-1].output_shape(shape)
    return Sequential(*layers), in_shape


def dense_backprop(model: Sequential, grad_out: np.ndarray) -> list[np.ndarray]:
    """Reference BP: ``g_{i-1} = dense(JT_i) @ g_i``, one sample at a time, float64."""
    batch = grad_out.shape[0]
    grads = [grad_out.reshape(batch, -1).astype(np.float64)]
    for jt in reversed(model.transposed_jacobians()):
        dense = jt.todense().astype(np.float64)
        if jt.shared:
            grads.append(grads[-1] @ dense.T)
        else:
            grads.append(np.einsum("bij,bj->bi", dense, grads[-1]))
    return grads[::-1]


def schedules(n: int):
    yield "linear", None
    yield "blelloch", None
    for levels in range(depth(n) + 1):
        yield "hybrid", levels
    yield "hybrid", "auto"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 21])
@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_every_schedule_equals_dense_backprop(n, batch, dtype, rtol, block_products):
    model, in_shape = random_chain(n, seed=100 * n + batch, dtype=dtype)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((batch,) + in_shape).astype(dtype)
    y = model.forward(x)
    grad_out = rng.standard_normal(y.shape).astype(dtype)
    reference = dense_backprop(model, grad_out)
    for method, levels in schedules(n):
        grads = model.backward(grad_out, method=method, levels=levels)
        assert len(grads) == n + 1
        for i, (got, want) in enumerate(zip(grads, reference, strict=True)):
            assert got.shape == (batch,) + model.shapes(in_shape)[i]
            scale = max(np.abs(want).max(), 1e-30)
            error = np.abs(got.reshape(batch, -1) - want).max() / scale
            assert error <= rtol, f"{method} levels={levels}: grad x_{i} off by {error:.2e}"
    if block_products == "all" and n == 21:
        methods = {step.method for step in model.plan(in_shape, "blelloch").steps}
        assert "block" in methods, methods


@pytest.mark.parametrize("n", [1, 2, 5, 8, 21])
def test_without_the_input_gradient_every_other_gradient_is_the_same_and_less_runs(n, monkeypatch):
    model, in_shape = random_chain(n, seed=31 * n, dtype=np.float64)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3,) + in_shape)
    grad_out = rng.standard_normal(model.forward(x).shape)
    computed = []  # the steps each run computes (the products' and mv steps' outputs)
    run_plan = host.run_plan

    def counted(plan, *args, outputs=None, **kwargs):
        live = range(len(plan.steps)) if outputs is None else plan.needed_steps(outputs)[0]
        computed.append({plan.steps[index].out for index in live})
        return run_plan(plan, *args, outputs=outputs, **kwargs)

    monkeypatch.setattr(host, "run_plan", counted)
    for method, levels in schedules(n):
        every = model.backward(grad_out, method=method, levels=levels)
        wanted = model.backward(grad_out, method=method, levels=levels, input_gradient=False)
        assert wanted[0] is None
        for i in range(1, n + 1):  # the same steps' values, bit for bit
            np.testing.assert_array_equal(wanted[i], every[i], err_msg=f"{method} {levels}: x_{i}")
        assert computed[-1] < computed[-2], f"{method} {levels}: nothing skipped"
        first = model.plan(in_shape, method, levels).outputs[0]
        assert first in computed[-2] and first not in computed[-1]
        ours = model.parameter_gradients(wanted)
        for key, value in model.parameter_gradients(every).items():
            np.testing.assert_array_equal(ours[key], value, err_msg=key)


def test_without_the_input_gradient_the_first_layers_jt_is_neither_filled_nor_applied(monkeypatch):
    model = Sequential(Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0), ReLU(), Flatten(),
                       Linear(48, 4, dtype=np.float64, rng=1))
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 4))
    grad_out = np.ones((2, 4))
    first = model.layers[0]
    used = []
    monkeypatch.setattr(first, "transposed_jacobian", lambda *a: used.append("values") or
                        type(first).transposed_jacobian(first, *a))
    monkeypatch.setattr(first, "weights_matvec", lambda *a: (lambda g: used.append("applied") or
                                                             type(first).weights_matvec(first, *a)(g)))
    model.forward(x)
    for method in ("linear", "blelloch"):
        used.clear()
        model.backward(grad_out, method=method)
        assert used, "the spies see the first layer's JT when the input's gradient is wanted"
        used.clear()
        assert model.backward(grad_out, method=method, input_gradient=False)[0] is None
        assert used == [], method


@pytest.mark.parametrize("n", [3, 8, 21])
def test_blelloch_equals_torch_autograd(n):
    torch = pytest.importorskip("torch")
    model, in_shape = random_chain(n, seed=7 * n, dtype=np.float64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4,) + in_shape)
    grad_out = rng.standard_normal(model.forward(x).shape)
    activations = [torch.from_numpy(x).requires_grad_(True)]
    for module in torch_modules(model):
        activations.append(module(activations[-1]))
        activations[-1].retain_grad()
    activations[-1].backward(torch.from_numpy(grad_out))
    for method, levels in (("blelloch", None), ("hybrid", 1)):
        grads = model.backward(grad_out, method=method, levels=levels)
        for got, tensor in zip(grads[:-1], activations[:-1], strict=True):
            np.testing.assert_allclose(got, tensor.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_numeric_pattern_is_the_symbolic_one_with_exact_cancellation():
    # A = [[1, 1], [0, 2]], B = [[1], [-1]]: C[0, 0] = 1 - 1 = 0 exactly, C[1, 0] = -2
    a = Pattern(np.array([0, 2, 3], np.int32), np.array([0, 1, 1], np.int32), (2, 2))
    b = Pattern(np.array([0, 1, 2], np.int32), np.array([0, 0], np.int32), (2, 1))
    plan = plan_product(a, b, "general", "general")
    values = multiply(plan, np.array([1.0, 1.0, 2.0]), np.array([1.0, -1.0]))
    assert plan.out.nnz == 2 and values.tolist() == [0.0, -2.0]  # the zero stays explicit
    scipy_c = sp.csr_matrix(([1.0, 1.0, 2.0], [0, 1, 1], [0, 2, 3]), (2, 2)) @ \
        sp.csr_matrix(([1.0, -1.0], [0, 0], [0, 1, 2]), (2, 1))
    assert scipy_c.nnz == 1  # what SciPy would have done to the pattern


@pytest.mark.parametrize("seed", range(5))
def test_symbolic_pattern_is_the_boolean_product(seed):
    rng = np.random.default_rng(seed)
    a = sp.random(13, 9, density=0.3, format="csr", random_state=seed)
    b = sp.random(9, 11, density=0.3, format="csr", random_state=seed + 50)
    plan = plan_product(Pattern(a.indptr, a.indices, a.shape), Pattern(b.indptr, b.indices, b.shape),
                        "general", "general")
    structure = (a.toarray() != 0).astype(int) @ (b.toarray() != 0).astype(int) > 0
    out = sp.csr_matrix((np.ones(plan.out.nnz), plan.out.indices, plan.out.indptr), plan.out.shape)
    np.testing.assert_array_equal(out.toarray() != 0, structure)
    assert plan.flops == 2 * int(((a != 0).sum(axis=0).A1 * (b != 0).sum(axis=1).A1).sum())
    batched_a = rng.standard_normal((3, a.nnz))
    values = multiply(plan, batched_a, b.data)
    for k in range(3):
        dense = sp.csr_matrix((values[k], plan.out.indices, plan.out.indptr), plan.out.shape)
        expected = sp.csr_matrix((batched_a[k], a.indices, a.indptr), a.shape) @ b
        np.testing.assert_allclose(dense.toarray(), expected.toarray(), rtol=1e-12)


def test_plan_is_built_once_and_reused_across_batches_and_batch_sizes():
    model, in_shape = random_chain(8, seed=3, dtype=np.float64)
    rng = np.random.default_rng(1)
    for batch in (2, 2, 5):
        y = model.forward(rng.standard_normal((batch,) + in_shape))
        model.backward(rng.standard_normal(y.shape), method="blelloch")
    assert model.plan_builds == 1
    model.backward(rng.standard_normal(y.shape), method="hybrid", levels=1)
    assert model.plan_builds == 2
    first = model.plan(in_shape, "hybrid", 1)
    assert model.plan(in_shape, "hybrid", 1) is first and model.plan_builds == 2


def test_plan_report_figures():
    model, in_shape = random_chain(8, seed=5, dtype=np.float32)
    linear = model.plan(in_shape, "linear")
    blelloch = model.plan(in_shape, "blelloch")
    assert all(step.kind == "mv" for step in linear.steps) and linear.critical_steps == 8
    assert linear.critical_flops == linear.work_flops
    assert blelloch.critical_steps < linear.critical_steps
    assert any(step.kind == "mm" for step in blelloch.steps)
    assert all(step.kind == "mv" for step in blelloch.steps if step.phase == "down")
    report = blelloch.report(batch=4, itemsize=4)
    assert set(report["totals"]) == {"critical_flops", "work_flops", "critical_steps", "plan_bytes",
                                     "peak_bytes"}
    for step in report["steps"]:
        assert step["flops_live"] <= step["flops"] and step["phase"] in ("up", "down", "final")
    assert report["totals"]["peak_bytes"] > 0
    auto = model.plan(in_shape, "hybrid", "auto")  # the least predicted time (the cost model's defaults)
    assert auto.predicted_seconds(1) == min(model.plan(in_shape, "hybrid", k).predicted_seconds(1)
                                            for k in range(depth(8) + 1))


@pytest.mark.parametrize("method, levels", [("blelloch", None), ("hybrid", 2)])
def test_steps_of_a_level_run_concurrently_with_the_same_results(method, levels):
    model, in_shape = random_chain(21, seed=11, dtype=np.float64)
    rng = np.random.default_rng(0)
    y = model.forward(rng.standard_normal((3,) + in_shape))
    grad = rng.standard_normal(y.shape).reshape(3, -1)
    plan = model.plan(in_shape, method, levels)
    assert max(len(level) for level in plan.levels_of_steps) > 1
    jts = model.transposed_jacobians()[::-1]
    serial = host.run_plan(plan, grad, jts, threads=1)
    for got, want in zip(host.run_plan(plan, grad, jts, threads=4), serial, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("method, levels", [("blelloch", None), ("hybrid", 2)])
def test_products_write_into_the_arrays_of_the_last_run_and_never_into_a_result(method, levels):
    """A run keeps its product arrays for the plan's next run (the same arrays come back), a result
    handed out is never written again, and two runs at once share nothing."""
    model, in_shape = random_chain(21, seed=11, dtype=np.float64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3,) + in_shape)
    y = model.forward(x)
    plan = model.plan(in_shape, method, levels)
    jts = model.transposed_jacobians()[::-1]
    grads = [rng.standard_normal(y.shape).reshape(3, -1) for _ in range(3)]
    first = host.run_plan(plan, grads[0], jts)
    copies = [g.copy() for g in first]
    kept = host._KEPT[id(plan)]
    arrays = {id(array) for same in kept.values() for array in same}
    assert arrays
    second = host.run_plan(plan, grads[1], jts)
    assert {id(array) for same in host._KEPT[id(plan)].values() for array in same} == arrays
    for got, want in zip(first, copies, strict=True):
        np.testing.assert_array_equal(got, want)  # the first run's results were not written again
    fresh = Sequential(*model.layers).plan(in_shape, method, levels)  # a plan of its own: new arrays
    assert fresh is not plan
    for got, want in zip(second, host.run_plan(fresh, grads[1], jts), strict=True):
        np.testing.assert_array_equal(got, want)
    with ThreadPoolExecutor(2) as pool:  # concurrent runs of one plan
        both = list(pool.map(lambda g: host.run_plan(plan, g, jts, threads=1), grads[1:]))
    for got, want in zip(both[0], second, strict=True):
        np.testing.assert_array_equal(got, want)
    model.forward(x[:2])  # another batch size: only that run's arrays are kept
    host.run_plan(plan, grads[2][:2], model.transposed_jacobians()[::-1])
    shapes = {shape for shape, _ in host._KEPT[id(plan)]}
    assert shapes and all(len(shape) == 1 or shape[0] == 2 for shape in shapes)


def test_plan_build_reports_progress_once_per_size_pattern_and_step():
    model, in_shape = random_chain(8, seed=2, dtype=np.float32)
    calls = []
    plan = model.plan(in_shape, "blelloch", progress=lambda *call: calls.append(call))
    patterns = [c for c in calls if c[0] == "patterns"]
    steps = [c for c in calls if c[0] == "steps"]
    assert [c for c in calls if c[0] == "sizes"] == [("sizes", j, 8) for j in range(1, 9)]
    # only the layers that are operands of a product need their pattern
    operands = {e.lo for s in plan.steps if s.kind == "mm" for e in (s.left, s.right) if e.lo == e.hi}
    assert 0 < len(operands) < 8
    assert patterns == [("patterns", j, len(operands)) for j in range(1, len(operands) + 1)]
    assert steps == [("steps", k, len(plan.steps)) for k in range(len(plan.steps) + 1)]
    calls.clear()
    model.plan(in_shape, "blelloch", progress=lambda *call: calls.append(call))
    assert calls == []  # cached: nothing to build


@pytest.mark.parametrize("seed", range(3))
def test_the_reference_backward_runs_no_scan_and_agrees_with_every_schedule(seed, monkeypatch):
    """``Sequential.reference_backward`` (what ``run --check`` compares the linear scan with):
    back-propagation through each layer's JT values by SciPy, a residual block's included, equal to
    every schedule's gradients, and computed without the engine's plans or executors."""
    from sparse_scan import _sequential as _model
    from sparse_scan.layers import Residual

    model, in_shape = random_chain(8, seed=seed, dtype=np.float64)
    channels = model.shapes(in_shape)[1][0]
    block = Residual(Conv2d(channels, channels, 3, padding=1, dtype=np.float64, rng=seed), ReLU(),
                     Conv2d(channels, channels, 3, padding=1, dtype=np.float64, rng=seed + 1))
    model = Sequential(model.layers[0], block, *model.layers[1:])
    rng = np.random.default_rng(seed)
    out = model.forward(rng.standard_normal((3,) + in_shape))
    grad = rng.standard_normal(out.shape)
    schedules = [model.backward(grad, method) for method in ("linear", "blelloch")]
    monkeypatch.setattr(_model, "run_plan", None)  # the reference runs no scan
    reference = model.reference_backward(grad)
    assert [r.shape for r in reference] == [g.shape for g in schedules[0]]
    for gradients in schedules:
        for got, want in zip(gradients, reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_max_step_flops_gives_up_before_building_a_costlier_product():
    model, in_shape = random_chain(8, seed=5, dtype=np.float32)
    full = model.plan(in_shape, "blelloch")
    costliest = max(step.flops for step in full.steps
                    if step.kind == "mm" and not step.method.startswith("scale"))
    fresh, _ = random_chain(8, seed=5, dtype=np.float32)
    with pytest.raises(ScanCostError, match=f"needs {costliest} FLOPs, over the limit of {costliest - 1}"):
        fresh.plan(in_shape, "blelloch", max_step_flops=costliest - 1)
    assert fresh.plan(in_shape, "blelloch", max_step_flops=costliest).work_flops == full.work_flops


@pytest.mark.parametrize("seed", range(6))
def test_auto_stops_deepening_without_missing_the_best_depth(seed):
    model, in_shape = random_chain(13, seed=seed, dtype=np.float32)
    for batch, device in ((1, "cpu"), (16, "cpu"), (4, "gpu")):
        auto = model.plan(in_shape, "hybrid", "auto", batch=batch, device=device)
        builds = model.plan_builds
        every = [model.plan(in_shape, "hybrid", k) for k in range(depth(13) + 1)]
        assert auto.predicted_seconds(batch, device) == min(p.predicted_seconds(batch, device) for p in every)
        assert builds <= len(every)


def test_auto_skips_depths_whose_products_cost_more_than_the_best_plan():
    # 3 -> 1000 -> 3 -> ...: a level-0 product (1000x3 by 3x1000, dense 1000x1000) alone takes more
    # than twice the whole linear scan's predicted time: its estimate says so, so depth 1 is not even
    # built, nor any deeper one
    model = Sequential(*[Linear(1000 if i % 2 else 3, 3 if i % 2 else 1000, dtype=np.float64, rng=i)
                         for i in range(6)])
    auto = model.plan((3,), "hybrid", "auto")
    assert model.plan_builds == 1  # depth 0 only
    verdicts = [c.verdict for c in auto.choice.candidates]
    assert verdicts[0] == "chosen" and verdicts[1].startswith("not built: a product of")
    assert all(v == "not built: deeper than hybrid 1" for v in verdicts[2:])
    assert model.plan((3,), "hybrid", "auto") is auto and model.plan_builds == 1  # choice cached
    every = [model.plan((3,), "hybrid", k) for k in range(depth(6) + 1)]
    assert auto.critical_flops == min(p.critical_flops for p in every)
    assert auto.levels == 0


@pytest.mark.parametrize("n", range(1, 34))
def test_blelloch_schedule_for_every_chain_length(n):
    # tiny Linear chains: any n, not only powers of two; critical path ~ 2 log2(n)
    rng = np.random.default_rng(n)
    sizes = rng.integers(1, 4, size=n + 1)
    model = Sequential(*[Linear(int(sizes[i]), int(sizes[i + 1]), dtype=np.float64, rng=i)
                         for i in range(n)])
    x = rng.standard_normal((2, int(sizes[0])))
    grad_out = rng.standard_normal(model.forward(x).shape)
    reference = model.backward(grad_out, method="linear")
    for method, levels in schedules(n):
        for got, want in zip(model.backward(grad_out, method=method, levels=levels), reference,
                             strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert model.plan((int(sizes[0]),), "blelloch").critical_steps <= 2 * depth(n) + 1


def test_bad_calls_are_clear():
    model = Sequential(Linear(3, 2, dtype=np.float64))
    with pytest.raises(RuntimeError, match="forward"):
        model.backward(np.ones((1, 2)))
    model.forward(np.ones((1, 3)))
    with pytest.raises(ValueError, match="method"):
        model.backward(np.ones((1, 2)), method="bogus")
    with pytest.raises(ValueError, match="levels"):
        model.backward(np.ones((1, 2)), method="hybrid", levels=5)
    with pytest.raises(ValueError, match="levels"):
        model.backward(np.ones((1, 2)), method="blelloch", levels=1)
    with pytest.raises(ValueError, match="grad_out"):
        model.backward(np.ones((1, 3)))
    with pytest.raises(TypeError, match="Layer"):
        Sequential(Linear(3, 2), "relu")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_sample", ["neither", "a", "both"])
def test_lean_and_chunked_products_equal_the_stored_plan(seed, per_sample):
    rng = np.random.default_rng(seed)
    a = sp.random(40, 30, density=0.2, format="csr", random_state=seed)
    b = sp.random(30, 50, density=0.2, format="csr", random_state=seed + 9)
    pa, pb = Pattern(a.indptr, a.indices, a.shape), Pattern(b.indptr, b.indices, b.shape)
    a_data = a.data if per_sample == "neither" else rng.standard_normal((3, a.nnz))
    b_data = rng.standard_normal((3, b.nnz)) if per_sample == "both" else b.data
    stored = plan_product(pa, pb, "general", "general")
    chunked = plan_product(pa, pb, "general", "general", chunk_products=7)
    lean = plan_product(pa, pb, "general", "general", budget_bytes=stored.multiply_adds * 11)
    assert (stored.method, chunked.method, lean.method) == ("general", "general", "rowwise")
    assert lean.nbytes < stored.nbytes
    samples = [(np.broadcast_to(a_data, (3, a.nnz))[s], np.broadcast_to(b_data, (3, b.nnz))[s])
               for s in range(3)]
    oracle = [(sp.csr_matrix((x, a.indices, a.indptr), a.shape)
               @ sp.csr_matrix((y, b.indices, b.indptr), b.shape)).toarray() for x, y in samples]
    expected = multiply(stored, a_data, b_data)
    for s, want in enumerate(oracle):
        got = expected if expected.ndim == 1 else expected[s]
        rows = np.repeat(np.arange(40), np.diff(stored.out.indptr))
        np.testing.assert_allclose(got, want[rows, stored.out.indices], rtol=1e-12, atol=1e-15)
    for plan in (chunked, lean):
        assert plan.out.same_as(stored.out)
        np.testing.assert_allclose(host.multiply(plan, a_data, b_data), expected, rtol=1e-12)


@pytest.mark.parametrize("budget", [None, 1])
def test_a_scalar_product_reports_its_rows_as_it_expands_them(budget):
    """A product of minutes shows that it moves: ``progress(rows_done, rows)`` after every chunk, for
    the stored and the lean (row-wise) plan alike, which equal the plan built without it."""
    a = sp.random(40, 30, density=0.2, format="csr", random_state=3)
    b = sp.random(30, 50, density=0.2, format="csr", random_state=4)
    pa, pb = Pattern(a.indptr, a.indices, a.shape), Pattern(b.indptr, b.indices, b.shape)
    budget_bytes = None if budget is None else plan_product(pa, pb, "general", "general").multiply_adds * 11
    calls = []
    plan = plan_product(pa, pb, "general", "general", budget_bytes=budget_bytes, chunk_products=20,
                        progress=lambda done, rows: calls.append((done, rows)))
    assert plan.method == ("general" if budget is None else "rowwise")
    done = [d for d, _ in calls]
    assert len(calls) > 5 and done == sorted(done) and calls[-1] == (40, 40) and {r for _, r in calls} == {40}
    assert plan.out.same_as(plan_product(pa, pb, "general", "general", budget_bytes=budget_bytes).out)


def test_the_symbolic_products_order_is_the_stable_sorts():
    """Packing keys with their positions into one sort gives the stable order (the order in which a
    C entry's multiply-adds are summed), and large keys fall back to the stable argsort."""
    rng = np.random.default_rng(0)
    for keys in (np.zeros(0, np.int64), rng.integers(0, 7, 1000), rng.integers(0, 2**40, 5000),
                 rng.integers(0, 2**62, 100)):
        order, ordered = product_planning._stable_order(keys)
        np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
        np.testing.assert_array_equal(ordered, np.sort(keys))


@pytest.mark.parametrize("per_sample", ["neither", "a", "both"])
def test_stored_products_cut_over_threads_equal_one_piece(monkeypatch, per_sample):
    rng = np.random.default_rng(7)
    a = sp.random(60, 45, density=0.2, format="csr", random_state=1)
    b = sp.random(45, 70, density=0.2, format="csr", random_state=2)
    pa, pb = Pattern(a.indptr, a.indices, a.shape), Pattern(b.indptr, b.indices, b.shape)
    a_data = a.data if per_sample == "neither" else rng.standard_normal((4, a.nnz))
    b_data = rng.standard_normal((4, b.nnz)) if per_sample == "both" else b.data
    plan = plan_product(pa, pb, "general", "general")
    whole = multiply(plan, a_data, b_data)
    monkeypatch.setattr(host, "workers_for", lambda work, minimum=None: 3)
    np.testing.assert_array_equal(multiply(plan, a_data, b_data), whole)
    np.testing.assert_array_equal(host.multiply(plan, a_data, b_data), whole)


def test_products_with_one_multiply_add_per_entry_skip_the_sums():
    pool = MaxPool2d(2)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4))
    conv = Conv2d(3, 2, 3, padding=1, dtype=np.float64, rng=0)
    selection, weights = pool.transposed_jacobian(x), conv.transposed_jacobian(pool.forward(x))
    plan = plan_product(selection.pattern, weights.pattern, "selection", "general")
    assert plan.starts is None and plan.out.nnz == plan.multiply_adds
    values = multiply(plan, selection.data, weights.data)
    for b in range(2):
        dense = sp.csr_matrix((values[b], plan.out.indices, plan.out.indptr), plan.out.shape)
        np.testing.assert_allclose(dense.toarray(), selection.todense()[b] @ weights.todense())


def test_memory_budget_selects_the_lean_method_and_names_the_step_when_nothing_fits(monkeypatch):
    monkeypatch.setattr(product_planning, "BLOCK_MIN_INNER", 10**9)  # scalar products only
    model, in_shape = random_chain(8, seed=11, dtype=np.float64)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3,) + in_shape)
    grad_out = rng.standard_normal(model.forward(x).shape)
    reference = model.backward(grad_out, method="linear")
    general = [s for s in model.plan(in_shape, "blelloch").steps if s.method == "general"]
    assert general, "the chain should have at least one general product"
    model.memory_budget = min(s.product.multiply_adds for s in general) * 12 - 1
    lean_plan = model.plan(in_shape, "blelloch")
    assert "rowwise" in {step.method for step in lean_plan.steps}
    for got, want in zip(model.backward(grad_out, method="blelloch"), reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10)
    # a result just over the budget: the estimate lets it through (within twice), building refuses it
    model.memory_budget = max(s.out_nnz for s in general) * 8 - 1
    with pytest.raises(MemoryError, match=r"layers? '.*needs more than \d+ bytes.*budget of \d+ bytes"):
        model.plan(in_shape, "blelloch")
    model.memory_budget = 16  # far over: refused from the estimate, before anything is built
    with pytest.raises(MemoryError, match=r"layers? '.*has a result of .*over the memory budget of 16 B\b"):
        model.plan(in_shape, "blelloch")


def test_dense_steps_equal_spmvs_and_need_no_jt_values(monkeypatch):
    """mv steps by an unpruned conv/linear JT run as GEMMs over the weights: same gradients as the
    CSR SpMV path, and on the linear schedule those layers' JT values are never computed."""
    model, in_shape = random_chain(8, seed=3, dtype=np.float64)
    weighted = {index for index, layer in enumerate(model.layers) if isinstance(layer, (Conv2d, Linear))}
    assert weighted, "the chain needs a conv or linear layer"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5,) + in_shape)
    grad_out = rng.standard_normal(model.forward(x).shape)
    jts = model.transposed_jacobians()[::-1]
    n = len(model)
    for method, levels in schedules(n):
        plan = model.plan(in_shape, method, levels)
        dense = {step.right.lo for step in plan.steps if step.method == "gemm"}
        assert dense <= {n - index for index in weighted}
        if method == "linear":
            assert dense == plan.weights.gemm_only == {n - index for index in weighted}
        spmv = host.run_plan(plan, grad_out.reshape(5, -1), jts)  # no dense matvecs: SpMVs
        for got, want in zip(model.backward(grad_out, method=method, levels=levels), spmv, strict=True):
            np.testing.assert_allclose(got.reshape(5, -1), want, rtol=1e-12, atol=1e-12)

    calls = []
    for layer in model.layers:
        original = layer.transposed_jacobian
        monkeypatch.setattr(layer, "transposed_jacobian",
                            lambda x, *a, _layer=layer, _original=original: calls.append(_layer)
                            or _original(x, *a))
    model.backward(grad_out, method="linear")
    assert not {id(model.layers[index]) for index in weighted} & {id(layer) for layer in calls}
    # ReLUs and 2x2 max-pools apply their JTs from their inputs (tests/test_input_operators.py)
    activations = model._require_forward()
    filled = [layer for index, layer in enumerate(model.layers) if index not in weighted
              and layer.input_matvec(activations[index]) is None]
    assert [id(layer) for layer in calls] == [id(layer) for layer in filled]


def test_pruned_layers_keep_the_spmv():
    conv = Conv2d(4, 8, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True)
    weight = conv.weight.copy()
    weight.ravel()[np.random.default_rng(0).permutation(weight.size)[: int(0.97 * weight.size)]] = 0
    conv.weight = weight
    model = Sequential(conv, ReLU(), Conv2d(8, 2, 3, dtype=np.float64, rng=1))
    plan = model.plan((4, 9, 9), "linear")
    assert [step.method for step in plan.steps] == ["gemm", "scale", "spmv"]
    assert plan.weights.gemm_only == {1}


def test_peak_memory_counts_no_values_for_weights_only_jts_on_the_cpu():
    model = Sequential(Conv2d(2, 4, 3, padding=1, dtype=np.float64, rng=0), ReLU(),
                       Conv2d(4, 3, 3, dtype=np.float64, rng=1))
    plan = model.plan((2, 6, 6), "linear")
    assert plan.weights.gemm_only == {1, 3}
    # per sample: g_3 (48) and ReLU's diagonal (144) from the start, + grad x_2 (144), + grad x_1
    # (144) at the peak; the convolutions' JTs hold no values on the CPU
    assert plan.peak_bytes(5, 8, "cpu") == (48 + 144 + 144 + 144) * 5 * 8
    # the GPU holds both convolutions' values from the start; its peak is after the first level
    conv_bytes = 8 * (model.layers[0].pattern((2, 6, 6)).nnz + model.layers[2].pattern((4, 6, 6)).nnz)
    assert plan.peak_bytes(5, 8, "gpu") == (48 + 144 + 144) * 5 * 8 + conv_bytes
    assert plan.report(5, 8)["totals"]["peak_bytes"] == plan.peak_bytes(5, 8, "cpu")


def test_a_chain_of_dense_mvs_plans_without_building_their_patterns():
    model, in_shape = random_chain(8, seed=3, dtype=np.float64)
    plan = model.plan(in_shape, "linear")
    assert plan.weights.gemm_only
    for index, layer in enumerate(model.layers):
        if len(model) - index in plan.weights.gemm_only:
            assert not layer._patterns, layer  # the plan counted its entries, built nothing
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3,) + in_shape)
    grad_out = rng.standard_normal(model.forward(x).shape)
    model.backward(grad_out, "linear")
    assert all(not model.layers[len(model) - j]._patterns for j in plan.weights.gemm_only)


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("dtypes", [("float64", "float64"), ("float32", "float32"), ("float32", "float64"),
                                    ("float64", "float32")])
def test_host_matvec_equals_scipy_bit_for_bit_inline_and_cut_over_threads(monkeypatch, threaded, shared,
                                                                          dtypes):
    """Rows cut at about equal non-zeros (empty rows included) or samples cut over the threads; every
    value SciPy's (summed from zero in the row's order in the result dtype), explicit zeros kept (an
    explicit zero times an infinity is NaN)."""
    if threaded:
        monkeypatch.setattr(host, "MATVEC_THREAD_MIN", 1)
        monkeypatch.setattr(host, "cpu_threads", lambda: 3)
    rng = np.random.default_rng(8)
    matrix = sp.random(40, 30, density=0.2, format="lil", random_state=rng)
    matrix[5:9] = 0  # empty rows
    matrix = matrix.tocsr()
    matrix.eliminate_zeros()
    matrix.sort_indices()
    pattern = Pattern(matrix.indptr, matrix.indices, matrix.shape)
    vectors = rng.standard_normal((5, 30)).astype(dtypes[1])
    data = (matrix.data if shared else rng.standard_normal((5, matrix.nnz))).astype(dtypes[0])
    data[..., 0] = 0  # an explicit zero, whose column holds an infinity in one sample
    vectors[2, matrix.indices[0]] = np.inf
    got = host.matvec(pattern, data, vectors)
    assert got.dtype == np.result_type(data, vectors)
    for sample in range(5):
        values = data if shared else data[sample]
        want = sp.csr_matrix((values, matrix.indices, matrix.indptr), shape=matrix.shape) @ vectors[sample]
        np.testing.assert_array_equal(got[sample], want)
    assert np.isnan(got[2, 0])


def pruned_pair(rng_offset=0):
    return [Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=rng_offset, prune_pattern=True),
            Conv2d(3, 2, 3, padding=1, dtype=np.float64, rng=rng_offset + 1, prune_pattern=True)]


def dense_reference(convs, x, grad):
    """BP through unpruned copies of the pruned convolutions."""
    reference = Sequential(ReLU(), Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0), ReLU(),
                           Conv2d(3, 2, 3, padding=1, dtype=np.float64, rng=1), ReLU(), input_shape=(2, 5, 5))
    for layer, conv in zip(reference.layers[1::2], convs, strict=True):
        layer.weight, layer.bias = conv.weight.copy(), conv.bias.copy()
    reference.forward(x)
    return reference.backward(grad, "linear")


@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_a_backward_on_a_plan_hit_hashes_no_zero_set_and_assigned_zero_sets_re_plan(monkeypatch, method):
    """The pruned layers' structure keys follow their weights' version: a backward over unchanged
    weights derives none (on the scan's step threads neither: two threads forced for blelloch);
    weights assigned with the same zero set keep the plan, a new zero set is planned for."""
    from sparse_scan.layers import _weighted

    monkeypatch.setattr(host, "cpu_threads", lambda: 2)
    calls = []
    real = _weighted.WeightedLayer._zero_set_key
    monkeypatch.setattr(_weighted.WeightedLayer, "_zero_set_key",
                        lambda layer: (calls.append(layer.name), real(layer))[1])
    convs = pruned_pair()
    model = Sequential(ReLU(), convs[0], ReLU(), convs[1], ReLU(), input_shape=(2, 5, 5))
    x = np.random.default_rng(0).standard_normal((2, 2, 5, 5))
    grad = np.random.default_rng(1).standard_normal((2, 2, 5, 5))
    model.forward(x)
    first = model.backward(grad, method)
    builds, calls[:] = model.plan_builds, []
    model.forward(x)
    model.backward(grad, method)
    assert calls == [] and model.plan_builds == builds  # a hit: no hash, no plan
    convs[1].weight = convs[1].weight * 2  # a new version, the same zero set: hashed once, same plan
    model.forward(x)
    model.backward(grad, method)
    assert calls == [convs[1].name] and model.plan_builds == builds
    weight = convs[0].weight.copy()
    weight[0] = 0.0  # a new zero set: a new pattern and plan
    model.load_state_dict({f"{convs[0].name}.weight": weight}, strict=False)
    model.forward(x)
    second = model.backward(grad, method)
    assert model.plan_builds == builds + 1
    for got, want in zip(second, dense_reference(convs, x, grad), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(first[0], second[0])


@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_weights_zeroed_after_the_optimizer_was_built_are_pruned(method):
    """A pruned layer's gradient is its kept weights' (its zero set's): weights loaded as zeros after
    the optimizer was built are pruned from then on, with a zero gradient, so plain SGD leaves them
    zero and the plan stands; the scan's gradients stay the dense reference's."""
    convs = pruned_pair()
    model = Sequential(ReLU(), convs[0], ReLU(), convs[1], ReLU(), input_shape=(2, 5, 5))
    optimizer = SGD(model, lr=0.1)
    weight = convs[0].weight.copy()
    weight[0, 0] = 0.0
    convs[0].weight = weight
    x = np.random.default_rng(0).standard_normal((2, 2, 5, 5))
    grad = np.random.default_rng(1).standard_normal((2, 2, 5, 5))
    model.forward(x)
    gradients = model.parameter_gradients(model.backward(grad, method))
    assert not gradients[f"{convs[0].name}.weight"][0, 0].any()
    optimizer.step(gradients)
    builds = model.plan_builds
    assert np.count_nonzero(convs[0].weight[0, 0]) == 0  # pruned: not revived
    model.forward(x)
    for got, want in zip(model.backward(grad, method), dense_reference(convs, x, grad), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert model.plan_builds == builds
@pytest.mark.parametrize("batch", [1, 3, 8, 9])
def test_heavily_pruned_convolutions_apply_through_their_weights(monkeypatch, batch):
    """At every batch the mv steps by a heavily pruned conv JT (BP's schedule) use its CSR weights
    and fill no JT values; every schedule gives the dense reference's gradients."""
    rng = np.random.default_rng(batch)
    convs = [Conv2d(3, 8, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True),
             Conv2d(8, 4, 3, stride=2, dtype=np.float64, rng=1, prune_pattern=True)]
    for conv in convs:
        weight = conv.weight.copy()
        weight.ravel()[rng.permutation(weight.size)[weight.size // 25:]] = 0  # 4% non-zeros
        conv.weight = weight
    model = Sequential(convs[0], ReLU(), convs[1], Tanh(), input_shape=(3, 8, 8))
    dense = Sequential(*[Conv2d(3, 8, 3, padding=1, dtype=np.float64), ReLU(),
                         Conv2d(8, 4, 3, stride=2, dtype=np.float64), Tanh()], input_shape=(3, 8, 8))
    for target, source in ((dense.layers[0], convs[0]), (dense.layers[2], convs[1])):
        target.weight, target.bias = source.weight.copy(), source.bias.copy()
    x = rng.standard_normal((batch, 3, 8, 8))
    grad = rng.standard_normal(model.forward(x).shape)
    dense.forward(x)
    want = dense.backward(grad, "linear")
    filled = []
    real = Conv2d.transposed_jacobian
    monkeypatch.setattr(Conv2d, "transposed_jacobian", lambda layer, *args, **kwargs: (
        filled.append(layer), real(layer, *args, **kwargs))[1])
    for method, levels in (("linear", None), ("hybrid", 1), ("blelloch", None)):
        filled.clear()
        for got, expected in zip(model.backward(grad, method, levels), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
        if method == "linear":
            assert filled == []  # BP reads each JT by mv steps only


@pytest.mark.parametrize("method, levels", [("linear", None), ("hybrid", 1), ("hybrid", 2),
                                            ("blelloch", None)])
def test_estimates_are_the_built_figures_for_dense_and_diagonal_chains(method, levels):
    # dense JTs (linear layers) and diagonals (activations): entries spread evenly, products exact
    model = Sequential(*[layer for i in range(4) for layer in (Linear(3 + i, 4 + i, rng=i), Tanh())])
    built = model.plan((3,), method, levels)
    estimate = model.estimate((3,), method, levels)
    assert estimate.estimated and not built.estimated
    assert (estimate.critical_flops, estimate.work_flops, estimate.critical_steps) == (
        built.critical_flops, built.work_flops, built.critical_steps)
    for device in ("cpu", "gpu"):  # the same JTs held: the estimate knows which go through the weights
        assert estimate.peak_bytes(4, 8, device) == built.peak_bytes(4, 8, device)
    assert estimate.features(4, 2) == built.features(4, 2)  # the cost model's figures too
    with pytest.raises(ValueError, match="estimated plan"):
        host.run_plan(estimate, np.ones((1, 7)), [])


def test_auto_chooses_a_deeper_schedule_where_its_predicted_time_is_less():
    # on the GPU's cost model a level's launch costs more than a scaling's work: the deeper, the faster
    model = Sequential(*[Tanh() for _ in range(16)])
    auto = model.plan((64,), "auto", device="gpu")
    every = [model.plan((64,), "hybrid", k) for k in range(depth(16) + 1)]
    predicted = [p.predicted_seconds(1, "gpu") for p in every]
    assert auto.predicted_seconds(1, "gpu") == min(predicted) < predicted[0]
    assert auto.method != "linear"
    labels = [c.label for c in auto.choice.candidates]
    assert labels == ["linear", "hybrid 1", "hybrid 2", "hybrid 3", "blelloch"]
    assert auto.choice.requested == "auto" and "least predicted time" in auto.choice.criterion
    assert [c.predicted_s for c in auto.choice.candidates] == pytest.approx(predicted[:5])
    assert model.plan((64,), "auto").method == "linear"  # the CPU's: fixed costs per product dominate
    x = np.random.default_rng(0).standard_normal((3, 64))
    model.forward(x)
    for got, want in zip(model.backward(np.ones((3, 64))), model.backward(np.ones((3, 64)), "linear"),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_auto_never_fails_and_builds_nothing_costly_on_vgg11():
    from sparse_scan import load_model

    model = load_model(pathlib.Path(__file__).resolve().parents[1] / "data" / "vgg11.yaml")
    auto = model.plan(model.input_shape, "auto", max_step_flops=1e10)
    assert auto.method == "linear" and model.plan_builds == 1
    deeper = auto.choice.candidates[1:]
    assert all(c.estimated for c in deeper) and deeper[0].verdict.startswith("not built: ")
    assert model.plan(model.input_shape, "hybrid").levels == 0  # hybrid without levels: auto depth


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 100, 1000])
def test_the_depth_mapping_names_a_depth_by_the_schedule_it_runs(n):
    """``schedule_at_depth`` (both model kinds' automatic choices) names depth 0 linear and depths
    depth(n) - 1 and depth(n) blelloch, the schedules they run, and every other depth a hybrid that is
    neither."""
    full = depth(n)
    linear, blelloch = live_schedule(n, "linear", None), live_schedule(n, "blelloch", None)
    for k in range(full + 1):
        method, levels = schedule_at_depth("auto", k, full)
        assert live_schedule(n, method, levels) == live_schedule(n, "hybrid", k)
        if method == "hybrid":
            assert live_schedule(n, "hybrid", k) not in (linear, blelloch)
        assert schedule_at_depth("hybrid", k, full) == ("hybrid", k)
