"""Subnormal gradient values (issue 38): counted exactly, observed on their schedule by the host run,
and weighed by the cost model on the multiply-adds that read them.

The oracles: NumPy's own comparisons for the count; the schedules' mvs written out by hand for the
features (which gradient each mv reads and how many multiply-adds per value it does). Every cost
asserted uses constants built in the test, never a calibration.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparse_scan import Sequential, backend
from sparse_scan.engine.cost import DEFAULTS, CostModel, load
from sparse_scan.engine.subnormals import OBSERVE_EVERY, Subnormals, SubnormalWatch, count_subnormals
from sparse_scan.layers import Linear, Tanh


def _oracle(values: np.ndarray) -> int:
    return int(np.count_nonzero((np.abs(values) < np.finfo(values.dtype).tiny) & (values != 0)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_subnormal_values_are_counted_exactly(dtype):
    info = np.finfo(dtype)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 300)).astype(dtype)
    specials = np.array([0.0, -0.0, info.tiny, -info.tiny, info.smallest_subnormal, -info.smallest_subnormal,
                         info.tiny / 2, -info.tiny * 0.999, np.inf, -np.inf, np.nan], dtype=dtype)
    values.reshape(-1)[rng.choice(values.size, 200, replace=False)] = np.resize(specials, 200)
    strided = values[:, ::3]  # not contiguous
    integers = np.arange(12).reshape(3, 4)
    seen = count_subnormals([values, strided, values.reshape(4, 2, 150), integers])
    assert seen.batch == 4
    assert seen.values == (_oracle(values), _oracle(strided), _oracle(values), 0)
    assert 0 < seen.values[1] < seen.values[0]
    assert seen.total == sum(seen.values)


def test_the_watch_counts_the_first_backward_of_each_batch_size_and_every_nth():
    watch = SubnormalWatch(every=3)
    assert watch() is None and SubnormalWatch().every == OBSERVE_EVERY
    two = [np.full((2, 5), 1e-40, dtype=np.float32)]
    three = [np.zeros((3, 5), dtype=np.float32)]
    counted = [watch.observe(g) for g in (two, three) * 4]  # alternating batch sizes: each its own count
    assert counted == [True, True, False, False, False, False, True, True]
    assert watch() == Subnormals(3, (0,), (5,)) and watch().bucket() == 0
    watch.observe(two)
    assert watch() is not None and watch().batch == 3  # not yet the 3rd of batch 2: the newest count stays
    assert SubnormalWatch(every=0).observe(two) is False  # 0: never counts
    assert Subnormals(1, (1,), (1,)).bucket() == 1 and Subnormals(2, (6, 0), (3, 3)).bucket() == 2
    assert Subnormals(4, (1, 2), (3, 3)).bucket() == 0  # under one per sample


def _chain_with_subnormal_gradients(batch: int = 3):
    # Linear(6, 5) -> Tanh -> Linear(5, 4) -> Tanh, the upstream gradient in float32's subnormal range:
    # gradient i is the one w.r.t. x_i (x_4 the output)
    model = Sequential(Linear(6, 5, rng=0), Tanh(), Linear(5, 4, rng=1), Tanh(), input_shape=(6,))
    rng = np.random.default_rng(1)
    model.forward(rng.standard_normal((batch, 6)).astype(np.float32))
    grad_out = (rng.standard_normal((batch, 4)) * 1e-39).astype(np.float32)
    return model, grad_out


def test_a_host_backward_observes_its_gradients_and_the_features_weigh_what_the_mvs_read():
    model, grad_out = _chain_with_subnormal_gradients(batch=3)
    plan = model.plan((6,), "linear")
    assert model.subnormals() is None
    assert "gemm_subnormal" not in plan.features(3, 1)  # nothing seen yet: none counted
    grads = model.backward(grad_out, "linear")
    seen = model.subnormals()
    assert seen.batch == 3 and seen.values == tuple(_oracle(g) for g in grads)
    assert seen.values[4] > 0 and seen.values[2] > 0
    # back-propagation: tanh's diagonal reads gradient 4 and gradient 2 (1 multiply-add per value),
    # Linear(5, 4)'s GEMM gradient 3 (5 per value), Linear(6, 5)'s gradient 1 (6 per value)
    per_sample = [v / 3 for v in seen.values]
    features = plan.features(batch=6, threads=1)
    want = 6 * (per_sample[4] * 1 + per_sample[3] * 5 + per_sample[2] * 1 + per_sample[1] * 6)
    assert features["gemm_subnormal"] == pytest.approx(want)
    assert "mv_subnormal" not in features
    # hybrid 1 pairs the scan's elements [g, tanh, Linear(5, 4), tanh, Linear(6, 5)] as (g, tanh),
    # (Linear(5, 4), tanh), Linear(6, 5): the first pair is an mv by tanh's diagonal (reads gradient
    # 4); the product of the second (5x4 per sample) is an SpMV that reads gradient 3 (5 per value);
    # the down-sweep's GEMMs by Linear(5, 4) and Linear(6, 5) read gradients 3 and 1
    hybrid = model.plan((6,), "hybrid", 1).features(batch=6, threads=1)
    assert hybrid["mv_subnormal"] == pytest.approx(6 * per_sample[3] * 5)
    want = 6 * (per_sample[4] + per_sample[3] * 5 + per_sample[1] * 6)
    assert hybrid["gemm_subnormal"] == pytest.approx(want)


def test_the_prediction_adds_the_observed_subnormals_cost_and_auto_chooses_again():
    model, grad_out = _chain_with_subnormal_gradients()
    cost = CostModel("cpu", 1, (("call", 1e-5), ("mv_subnormal", 1e-6), ("gemm_subnormal", 1e-7)))
    before = model.plan((6,), "hybrid", 1).predicted_seconds(3, cost)
    chosen = model.plan((6,), "auto", batch=3)
    model.backward(grad_out, "linear")
    features = model.plan((6,), "hybrid", 1).features(3, 1)
    after = model.plan((6,), "hybrid", 1).predicted_seconds(3, cost)
    added = 1e-6 * features["mv_subnormal"] + 1e-7 * features["gemm_subnormal"]
    assert after - before == pytest.approx(added)
    again = model.plan((6,), "auto", batch=3)
    assert again is not chosen and again is model.plan((6,), "auto", batch=3)
    assert [c.predicted_s for c in again.choice.candidates][0] > chosen.choice.candidates[0].predicted_s


def test_the_observation_changes_no_gradient_and_runs_on_its_schedule_inside_the_model():
    model, grad_out = _chain_with_subnormal_gradients()
    model.subnormals.every = 2
    first = model.backward(grad_out, "linear")  # counted
    counted = model.subnormals()
    second = model.backward(grad_out, "linear")  # not counted
    assert model.subnormals() is counted
    third = model.backward(grad_out, "linear")  # counted: the 2nd since
    assert model.subnormals() is not counted and model.subnormals() == counted
    for a, b, c in zip(first, second, third, strict=True):  # counting writes nothing
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    with pytest.raises(AttributeError):
        model.subnormals = SubnormalWatch()  # the one watch its plans read


def test_an_observation_of_other_gradients_is_not_weighed():
    # shape-agnostic layers: an observation at input (4,) says nothing of the plans for (6,)
    model = Sequential(Tanh(), Tanh(), Tanh())
    model.forward(np.full((2, 4), 3.0, dtype=np.float32))
    model.backward(np.full((2, 4), 1e-40, dtype=np.float32), "linear")
    assert model.subnormals().total == 2 * 4 * 4 and model.subnormals().sizes == (4, 4, 4, 4)
    assert "gemm_subnormal" in model.plan((4,), "linear").features(2, 1)
    plans = (model.plan((6,), "linear"), model.plan((6,), "auto", batch=2), model.estimate((6,), "blelloch"))
    for plan in plans:
        assert not {"gemm_subnormal", "mv_subnormal"} & set(plan.features(2, 1))


def test_estimates_weigh_the_observation_as_built_plans_do():
    model, grad_out = _chain_with_subnormal_gradients()
    model.backward(grad_out, "linear")
    built = model.plan((6,), "hybrid", 1).features(3, 1)
    estimated = model.estimate((6,), "hybrid", 1).features(3, 1)
    assert estimated["mv_subnormal"] == built["mv_subnormal"] > 0
    assert estimated["gemm_subnormal"] == built["gemm_subnormal"] > 0


def test_a_calibration_file_without_the_subnormal_features_takes_their_defaults(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"device": "cpu", "threads": 2, "seconds": {"call": 1e-4}}), encoding="utf-8")
    model = load(path)
    assert model.seconds["call"] == 1e-4
    assert model.seconds["mv_subnormal"] == dict(DEFAULTS["cpu"])["mv_subnormal"] > 0


@pytest.mark.gpu
def test_a_gpu_backward_observes_nothing():
    gpu = backend.get("gpu")
    model, grad_out = _chain_with_subnormal_gradients()
    model.forward(gpu.asarray(np.ones((3, 6), dtype=np.float32)))
    model.backward(gpu.asarray(grad_out), "linear")
    assert model.subnormals() is None
