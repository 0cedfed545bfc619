"""The cost model (issue 38): features counted from plans, constants from a fit or a cache, ``auto`` by
predicted time, explicit schedules refused from their estimates.

Every decision asserted here uses fixed constants (the defaults, or a model built in the test), never a
live calibration: no verdict depends on this machine or its load.
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import pytest
from click.testing import CliRunner

from sparse_scan import Sequential, load_model
from sparse_scan import calibration as calibration_module
from sparse_scan.calibration import Measurement, fit
from sparse_scan.cli import app
from sparse_scan.engine import cost
from sparse_scan.engine.cost import DEFAULTS, FEATURES, CostModel, current, load, save
from sparse_scan.engine.dense_plan import auto_levels, build_dense_plan
from sparse_scan.engine.plan import ScanCostError, ScanMemoryError
from sparse_scan.engine.schedule import depth
from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU, Tanh
from sparse_scan.recurrent import GRU, LSTM, RNN, Horizon, RecurrentClassifier

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def test_a_prediction_is_the_features_weighed_by_their_seconds():
    model = CostModel("cpu", 2, (("call", 1e-4), ("mv_step", 2e-6), ("mv_gemm", 1e-10)))
    assert model.predict({"call": 1, "mv_step": 10, "mv_gemm": 1e6}) == pytest.approx(1e-4 + 2e-5 + 1e-4)
    assert model.seconds["mm_general"] == 0.0 and set(model.seconds) == set(FEATURES)
    with pytest.raises(ValueError, match="unknown features"):
        CostModel("cpu", 1, (("warp_drive", 1.0),))
    with pytest.raises(ValueError, match=">= 0"):
        CostModel("cpu", 1, (("call", -1.0),))


def test_back_propagations_features_are_counted_from_the_layers():
    # Linear(3, 4) -> Tanh -> Linear(4, 2): JTs of 12, 4 and 8 entries; BP is three mvs in three levels
    model = Sequential(Linear(3, 4, rng=0), Tanh(), Linear(4, 2, rng=1))
    plan = model.plan((3,), "linear")
    features = plan.features(batch=5, threads=2)
    assert features["call"] == 1 and features["layer"] == 3 and features["level"] == 3
    assert features["mv_step"] == 3 and "mm_step" not in features
    assert features["mv_gemm"] == 5 * 2 * (12 + 8)  # the linear layers' mvs run as GEMMs, 2 per entry
    assert features["mv_scale"] == 5 * 2 * 4  # tanh's diagonal
    assert features.get("fill", 0) == 0  # nothing read as values: GEMMs and a scaling from the input


def test_a_gemm_through_the_weights_counts_the_dense_layers_work_and_its_weights_once():
    # an 80%-pruned Linear(64, 64): its JT holds ~820 entries, the GEMM over its weights (still the
    # faster path at that density) does 64·64 multiply-adds per sample and reads the 4096 weights once
    dense, pruned = Linear(64, 64, rng=0), Linear(64, 64, rng=0, prune_pattern=True)
    weight = np.array(pruned.weight)
    weight[np.random.default_rng(0).random(weight.shape) < 0.8] = 0
    pruned.weight = weight
    for layer in (dense, pruned):
        plan = Sequential(layer, Tanh(), input_shape=(64,)).plan((64,), "linear")
        [gemm] = [step for step in plan.steps if step.method == "gemm"]
        features = plan.features(batch=3, threads=1)
        assert features["mv_gemm"] == 3 * 2 * 64 * 64 and features["mv_weights"] == 64 * 64
        assert features["mv_call"] == 1
    assert gemm.flops < 2 * 64 * 64 * 0.3  # the pruned JT's own count is far lower


def test_a_transposed_convolution_counts_the_taps_it_adds_into_place():
    # Conv2d(3, 8, 3, padding=1) on 3x6x6, back-propagated through its weights: its GEMM gives 3·9
    # taps per input channel and output pixel, added into place per sample; a linear layer adds none
    model = Sequential(Conv2d(3, 8, 3, padding=1, rng=0), ReLU(), Flatten(), Linear(8 * 6 * 6, 4, rng=1),
                       input_shape=(3, 6, 6))
    plan = model.plan((3, 6, 6), "linear")
    assert sum(step.method == "gemm" for step in plan.steps) == 2
    assert plan.features(batch=5, threads=1)["mv_taps"] == 5 * 3 * 9 * 6 * 6
    # in a residual block, its convolutions' taps add up
    block = load_model(DATA / "resnet20.yaml").layers[3]  # conv, bn, relu, conv, bn on 16x32x32
    assert block.weights_path((16, 32, 32)).taps == 2 * 16 * 9 * 32 * 32


def test_filled_jts_are_counted_per_call_and_an_spmvs_work_per_sample():
    # blelloch over Tanh-Linear pairs: its products are per sample (a diagonal per sample), and so are
    # the mvs by them; every JT whose values a product reads is one fill
    model = Sequential(*[layer for i in range(4) for layer in (Linear(6, 6, rng=i), Tanh())])
    plan = model.plan((6,), "blelloch")
    assert any(step.kind == "mv" and step.method == "spmv" and plan.element_bytes[step.right][1] > 0
               for step in plan.steps)
    one, five = plan.features(1, 1), plan.features(5, 1)
    assert five["mv_spmv"] == pytest.approx(5 * one["mv_spmv"]) and one["mv_spmv"] > 0
    filled = {element.lo for step in plan.steps if step.kind == "mm"
              for element in (step.left, step.right) if element.lo == element.hi}
    assert one["fill_call"] == five["fill_call"] == len(filled)


def test_a_residual_blocks_mv_counts_one_call_per_inner_operator():
    from sparse_scan.spec import model_from_spec
    conv = {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1, "bias": False}
    model = model_from_spec({"input_shape": [4, 6, 6], "init": {"seed": 0}, "layers": [
        {"type": "residual", "layers": [conv, {"type": "batchnorm2d"}, {"type": "relu"}, conv]},
        {"type": "flatten"}, {"type": "linear", "out_features": 3}]})
    plan = model.plan((4, 6, 6), "linear")
    features = plan.features(2, 1)
    # the block: its four layers and the sum; the linear head: one; weights: two convolutions' and
    # the head's; work: the convolutions' GEMMs, the diagonals' entries and the head's GEMM, 2 per sample
    assert features["mv_call"] == 5 + 1
    assert features["mv_weights"] == 2 * 4 * 4 * 9 + 4 * 36 * 3
    assert features["mv_gemm"] == 2 * 2 * (2 * 4 * 4 * 9 * 36 + 2 * 4 * 36 + 4 * 36 * 3)


def test_a_product_of_shared_jts_runs_once_per_batch_and_a_levels_steps_share_the_threads():
    model = Sequential(*[Linear(4, 4, rng=i) for i in range(4)])  # four sample-independent JTs
    plan = model.plan((4,), "blelloch")
    products = [step for step in plan.steps if step.kind == "mm"]
    assert products and all(plan.element_bytes[step.out][1] == 0 for step in products)  # shared
    one, sixteen = plan.features(1, 1), plan.features(16, 1)
    assert one["mm_sample"] == sixteen["mm_sample"] == len(products)
    assert one["mm_general"] + one.get("mm_block", 0) == sixteen["mm_general"] + sixteen.get("mm_block", 0)
    # on 2 threads a step of a level of several counts half
    shares = [1 / min(2, len(level)) for level in plan.levels_of_steps for i in level
              if plan.steps[i].kind == "mm"]
    assert sum(shares) < len(products)  # some products run side by side
    assert plan.features(1, 2)["mm_sample"] == pytest.approx(sum(shares))
    # a level of several steps is handed to the pool (on more than one thread) and waited for
    pooled = sum(len(level) > 1 for level in plan.levels_of_steps)
    assert pooled and plan.features(1, 2)["pool_level"] == pooled and "pool_level" not in plan.features(1, 1)


def test_the_recurrent_plans_prediction_weighs_its_scans_features():
    model = RecurrentClassifier(RNN(1, 4, rng=0), 3, rng=1, input_shape=(20, 1))
    costs = CostModel("cpu", 2, (("factored_step", 1e-6), ("factored_sample", 1e-7), ("dense_level", 1e-5),
                                 ("dense_flops", 1e-9), ("block_fill", 1e-4), ("block_fill_values", 1e-9)))
    linear, blelloch = model.plan(method="linear"), model.plan(method="blelloch")
    # every schedule passes over the T x B x S state gradients; the cell's kernel runs BP's chain and
    # the gate gradient, the input's and both weights' (2·rows·(2·columns + out) + 4·rows per step)
    cell = 2 * 4 * (2 * 1 + 4) + 4 * 4
    assert linear.features(8) == {"call": 1, "factored_flops": 8 * linear.work_flops + 20 * 8 * cell,
                                  "factored_step": 20, "factored_sample": 160, "step_values": 20 * 8 * 4}
    # on 3 threads BP's samples run 3, 3 and 2 to a thread: the longest run's count
    threaded = linear.features(8, 3)
    assert (threaded["factored_sample"], threaded["factored_flops"]) == (20 * 3, 3 * (linear.work_flops
                                                                                       + 20 * cell))
    assert threaded["step_values"] == 20 * 8 * 4
    features = blelloch.features(8)
    assert features["block_fill_values"] == 20 * 8 * 16 and features["block_fill"] == 1
    assert features["cell_flops"] == 20 * 8 * cell  # after a scan
    assert features["step_values"] == 20 * 8 * 4
    assert features["dense_level"] + features["dense_chain_step"] == blelloch.critical_steps
    assert blelloch.predicted_seconds(8, costs) == pytest.approx(costs.predict(features))
    auto = model.plan(method="auto", batch=8)
    assert "predicted_s" in auto.explain(8)
    chosen = [c for c in auto.choice.candidates if c.verdict == "chosen"]
    assert chosen[0].predicted_s == min(c.predicted_s for c in auto.choice.candidates)


def _reached(totals):
    """Per sample, the steps back from the end whose total gradients are not all zero (B, T, S):
    what a back-propagation that stops where its gradient vanished ran."""
    nonzero = np.abs(totals).sum(axis=2) != 0
    return [totals.shape[1] - int(np.argmax(row)) if row.any() else 0 for row in nonzero]


@pytest.mark.parametrize("kind, module, row_values", [
    # the saved rows its kernel checks (x, h_prev and the cell's own) and the rows it zeroes (S, x)
    ("rnn", lambda: RNN(1, 8, rng=0), 8 + 1 + 8 + 8 + 1),
    ("gru", lambda: GRU(1, 8, rng=0), 4 * 8 + 1 + 8 + 8 + 1),
    ("lstm", lambda: LSTM(1, 8, proj_size=4, rng=0), 6 * 8 + 8 + 1 + 4 + (4 + 8) + 1)])
def test_a_last_state_back_propagation_is_predicted_as_far_as_its_gradient_last_reached(kind, module,
                                                                                       row_values):
    steps, batch = 1000, 3
    model = RecurrentClassifier(module(), 3, rng=1, input_shape=(steps, 1))
    linear, blelloch = model.plan(method="linear"), model.plan(method="blelloch")
    full, scan = linear.features(batch), blelloch.features(batch)
    assert full["factored_step"] == steps and "exit_values" not in full and model.recurrent.horizon is None
    x = np.random.default_rng(0).standard_normal((batch, steps, 1)).astype(np.float32)
    logits = model.forward(x)
    totals = model.backward(np.ones_like(logits), "linear")[1]
    horizon = model.recurrent.horizon  # float32: the gradient underflows long before 1,000 steps
    reached = _reached(totals)  # the totals' h part: the LSTM's c part may reach a few steps further
    if kind == "lstm":
        assert np.mean(reached) <= horizon.steps <= np.mean(reached) + 16 and max(reached) < steps
    else:
        assert horizon.steps == pytest.approx(np.mean(reached)) and max(reached) < steps
    assert (horizon.time_steps, horizon.row_values) == (steps, row_values)
    features = linear.features(batch)  # the cached plan reads the horizon now
    share = horizon.steps / steps
    assert features["factored_step"] == pytest.approx(steps * share)
    assert features["factored_sample"] == pytest.approx(steps * batch * share)
    assert features["factored_flops"] == pytest.approx(full["factored_flops"] * share)
    assert features["exit_values"] == pytest.approx((steps - horizon.steps) * row_values * batch)
    assert features["step_values"] == full["step_values"]
    assert blelloch.features(batch) == scan  # a scan runs every step whatever the gradient
    defaults = CostModel("cpu", 2, DEFAULTS["cpu"])
    assert linear.predicted_seconds(batch, defaults) == pytest.approx(
        defaults.predict(linear.features(batch, defaults.threads)))
    threaded = linear.features(batch, 3)  # 3 samples on 3 threads: one each
    for name in ("factored_sample", "factored_flops", "exit_values"):
        assert threaded[name] == pytest.approx(features[name] / 3)
    assert defaults.predict(features) < defaults.predict(full)
    model.backward(np.ones_like(logits), "blelloch")
    assert model.recurrent.horizon is horizon  # a scan keeps the last one seen


def test_the_horizon_predicts_every_step_until_one_vanished():
    assert Horizon(1000.0, 1000, 62).steps_over(5000) == 5000  # none vanished: no bound seen
    assert Horizon(140.0, 1000, 62).steps_over(5000) == 140
    assert Horizon(140.0, 1000, 62).steps_over(100) == 100


def test_auto_chooses_again_once_back_propagation_is_seen_to_stop_early():
    model = RecurrentClassifier(RNN(1, 8, rng=0), 3, rng=1, input_shape=(1000, 1))
    pooled = RecurrentClassifier(RNN(1, 8, rng=0), 3, rng=1, input_shape=(1000, 1), reduction="mean")
    x = np.random.default_rng(0).standard_normal((2, 1000, 1)).astype(np.float32)
    for classifier in (model, pooled):
        first = classifier.plan(method="auto", batch=2)
        logits = classifier.forward(x)
        classifier.backward(np.ones_like(logits), "linear")
        again = classifier.plan(method="auto", batch=2)
        if classifier is pooled:  # every state has a direct gradient: nothing stops early
            assert classifier.recurrent.horizon is None and again is first
            continue
        assert again is not first and classifier.plan_builds == 2
        assert classifier.plan(method="auto", batch=2) is again  # the same horizon: the cached choice
        bp = [c for c in again.choice.candidates if c.method == "linear"][0]
        before = [c for c in first.choice.candidates if c.method == "linear"][0]
        assert bp.predicted_s < before.predicted_s


def test_auto_levels_follows_the_cost_model_it_is_given():
    launches = CostModel("gpu", 64, (("dense_level", 1e-3), ("dense_chain_step", 1e-3),
                                     ("dense_flops", 1e-15)))
    flops = CostModel("gpu", 64, (("dense_level", 1e-9), ("dense_chain_step", 1e-9), ("dense_flops", 1e-9)))
    levels = [build_dense_plan(1000, "hybrid", k).critical_steps for k in range(depth(1000) + 1)]
    chosen = auto_levels(1000, 4, 8, "gpu", model=launches)
    assert chosen > 0 and levels[chosen] == min(levels)  # the fewest levels
    assert auto_levels(1000, 4, 8, "gpu", model=flops) == 0  # the least work


def test_auto_picks_back_propagation_for_the_issues_deep_narrow_mlp():
    # 256 x (Linear(8, 8), Tanh): the fewest critical-path FLOPs are a deep hybrid's, 5.7-6.9x slower
    # than BP on a 2-core CPU (issue 38); by predicted time, with the CPU's default constants, BP
    layers = [layer for i in range(256) for layer in (Linear(8, 8, rng=i), Tanh())]
    model = Sequential(*layers)
    for batch in (1, 16):
        auto = model.plan((8,), "auto", batch=batch)
        assert (auto.method, auto.levels) == ("linear", None)
        assert auto.choice.chosen.predicted_s == min(c.predicted_s for c in auto.choice.candidates)
        assert min(c.critical_flops for c in auto.choice.candidates) < auto.critical_flops
    assert "least predicted time for batch 16 on the cpu (cost model: defaults)" in auto.choice.criterion


def test_the_plan_explains_its_predicted_time():
    model = Sequential(Linear(3, 4, rng=0), Tanh(), Linear(4, 2, rng=1))
    plan = model.plan((3,), "blelloch")
    explained = plan.explain(batch=4)
    model_now = current("cpu")
    assert explained["predicted_s"] == pytest.approx(model_now.predict(plan.features(4, model_now.threads)))


def test_an_explicit_schedule_over_the_planning_limit_is_refused_from_its_estimate():
    # eight 512-wide dense layers: blelloch's products enumerate ~1e9 multiply-adds; with a 1 s limit
    # it is refused at once, naming the product, the figure and how to raise the limit
    model = Sequential(*[Linear(512, 512, rng=i) for i in range(8)], max_plan_seconds=1.0)
    start = time.perf_counter()
    refused = (r"planning blelloch would take ~\d+ s .*the costliest, scan step "
               r".*over the planning limit of 1 s \(raise it with max_plan_seconds=")
    with pytest.raises(ScanCostError, match=refused):
        model.plan((512,), "blelloch")
    assert time.perf_counter() - start < 5 and model.plan_builds == 0
    assert model.plan((512,), "linear").method == "linear"  # back-propagation plans no product


def test_the_planning_limit_comes_from_the_model_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(cost.PLAN_SECONDS_VARIABLE, raising=False)
    assert cost.max_plan_seconds() == cost.MAX_PLAN_SECONDS and cost.max_plan_seconds(3) == 3
    monkeypatch.setenv(cost.PLAN_SECONDS_VARIABLE, "7.5")
    assert cost.max_plan_seconds() == 7.5
    monkeypatch.setenv(cost.PLAN_SECONDS_VARIABLE, "soon")
    with pytest.raises(ValueError, match="SPARSE_SCAN_MAX_PLAN_SECONDS='soon': must be a finite number"):
        cost.max_plan_seconds()


def test_auto_builds_nothing_whose_planning_is_predicted_over_its_budget():
    model = Sequential(Conv2d(3, 16, 3, padding=1, rng=0), ReLU(), Conv2d(16, 16, 3, padding=1, rng=1),
                       ReLU(), Flatten(), Linear(16 * 24 * 24, 10, rng=2))
    auto = model.plan((3, 24, 24), "auto")
    assert model.plan_builds == 1 and auto.method == "linear"
    assert all(c.estimated and c.verdict.startswith("not built") for c in auto.choice.candidates[1:])


def test_the_cache_file_round_trips_and_is_what_runs_use(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cost.COST_MODEL_VARIABLE)
    assert current("cpu").source == "defaults"  # nothing cached yet
    mine = CostModel("cpu", 3, (("call", 1e-3), ("mv_gemm", 2e-10)), "calibrated in a test")
    path = save(mine)
    assert path.parent == tmp_path / "sparse-scan" and current("cpu") == load(path)
    # what the file lists, and the defaults of what it does not (a calibration of an older version)
    assert load(path).seconds == dict(DEFAULTS["cpu"]) | dict(mine.constants)
    assert (load(path).threads, load(path).source) == (3, "calibrated in a test")
    monkeypatch.setenv(cost.COST_MODEL_VARIABLE, "defaults")  # what the tests set: the cache ignored
    assert current("cpu") == CostModel("cpu", current("cpu").threads, DEFAULTS["cpu"])
    other = save(CostModel("cpu", 1, (("call", 5e-3),), "elsewhere"), tmp_path / "other.json")
    monkeypatch.setenv(cost.COST_MODEL_VARIABLE, str(other))
    assert current("cpu").source == "elsewhere"
    monkeypatch.delenv(cost.COST_MODEL_VARIABLE)
    path.write_text("{not json", encoding="utf-8")
    with pytest.warns(RuntimeWarning, match=f"{path.name}.*sparse-scan calibrate"):
        assert current("cpu").source == "defaults"  # a damaged cache: the defaults, said
    with pytest.raises(ValueError, match="not a sparse-scan calibration file"):
        load(path)


def test_the_fit_recovers_the_constants_that_made_the_times():
    truth = {"call": 5e-5, "level": 1e-5, "mv_step": 3e-6, "mm_step": 8e-5, "mv_gemm": 2e-10,
             "mm_general": 1.5e-9, "fill": 4e-9}
    rng = np.random.default_rng(0)
    measurements = []
    for _ in range(40):
        features = {name: float(rng.integers(1, 1000)) * (1e4 if name in ("mv_gemm", "mm_general", "fill")
                                                            else 1) for name in truth}
        seconds = sum(truth[name] * count for name, count in features.items())
        measurements.append(Measurement("synthetic", "linear", None, 1, features, seconds))
    fitted = fit(measurements, prior_weight=0.0).seconds
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=0.05), name
    assert fitted["dense_flops"] == dict(DEFAULTS["cpu"])["dense_flops"]  # never seen: its default


def test_calibrate_command_writes_and_shows_the_constants(tmp_path, monkeypatch):
    fake = CostModel("cpu", 2, DEFAULTS["cpu"], "calibrated (fake)")
    timed = [Measurement("tiny", "linear", None, 1, {"call": 1}, 1e-4)]
    monkeypatch.setattr(calibration_module, "calibrate", lambda device, repeats, progress: (fake, timed))
    runner = CliRunner()
    out = tmp_path / "cost.json"
    result = runner.invoke(app.main, ["calibrate", "--output", str(out), "--json", "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["cache"] == str(out) and load(out) == fake
    assert report["measurements"][0]["predicted_s"] == pytest.approx(fake.predict({"call": 1}))
    shown = runner.invoke(app.main, ["calibrate", "--show"])
    assert shown.exit_code == 0 and "(defaults;" in shown.output and "mm_general" in shown.output
    bad = runner.invoke(app.main, ["calibrate", "--output", str(tmp_path / "missing" / "dir" / "x.json"),
                                   "--quiet"], catch_exceptions=False)
    assert bad.exit_code == 0  # folders are made
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    unwritable = runner.invoke(app.main, ["calibrate", "--output", str(tmp_path / "a-file" / "x.json"),
                                          "--quiet"])
    assert unwritable.exit_code == 2 and "cannot write the calibration" in unwritable.output


@pytest.mark.parametrize("variable, value, spec, levels, says, limit", [
    # VGG-11's hybrid 1 enumerates ~2.3e8 pattern entries and multiply-adds: ~70 s by the defaults
    (cost.PLAN_SECONDS_VARIABLE, "10", "vgg11.yaml", "1", "vgg11.yaml: planning hybrid 1 would take ~",
     "over the planning limit of 10 s (raise it with max_plan_seconds= or SPARSE_SCAN_MAX_PLAN_SECONDS)"),
    # 64 MiB holds the spec's weights and a sample's activations (checked at loading), not the product
    ("SPARSE_SCAN_MEMORY_BUDGET", "64M", "vgg11-pruned.yaml", "2",
     "vgg11-pruned.yaml: planning hybrid 2: scan step",
     "over the memory budget of 64.0 MiB (raise it with memory_budget= or SPARSE_SCAN_MEMORY_BUDGET")],
    ids=["planning-limit", "memory-budget"])
def test_the_command_line_refuses_a_schedule_over_a_limit_in_one_line(monkeypatch, variable, value, spec,
                                                                        levels, says, limit):
    monkeypatch.setenv(variable, value)
    start = time.perf_counter()
    result = CliRunner().invoke(app.main, ["flops", str(DATA / spec), "--method", "hybrid",
                                           "--levels", levels, "--quiet"])
    assert result.exit_code == 2 and time.perf_counter() - start < 30
    line = result.output.strip()
    assert "\n" not in line and says in line
    assert limit in line
    assert "--max-step-flops" not in line  # not the limit that refused it


def test_an_explicit_schedule_over_the_memory_budget_is_refused_from_its_estimate():
    # four 256-wide dense layers: blelloch's first products hold 256 x 256 entries, 512 KiB each at
    # 8 bytes an entry; with a 64 KiB budget it is refused before any pattern is built
    model = Sequential(*[Linear(256, 256, rng=i) for i in range(4)], memory_budget=64 * 2**10)
    start = time.perf_counter()
    refused = (r"planning blelloch: scan step .* has a result of ~6.55e\+04 entries, ~512.0 KiB "
               r"\(estimated .*\), over the memory budget of 64.0 KiB \(raise it with memory_budget= or "
               r"SPARSE_SCAN_MEMORY_BUDGET")
    with pytest.raises(ScanMemoryError, match=refused):
        model.plan((256,), "blelloch")
    assert time.perf_counter() - start < 5 and model.plan_builds == 0
    model.memory_budget = 2**20  # within twice the budget: built, the lean method if need be
    assert model.plan((256,), "blelloch").method == "blelloch"


def test_the_memory_budget_comes_from_the_model_the_environment_or_the_machine(monkeypatch):
    from sparse_scan._sequential import default_memory_budget

    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "512M")
    assert default_memory_budget() == 512 * 2**20
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "1.5GiB")
    assert default_memory_budget() == 3 * 2**29
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "4096")
    assert default_memory_budget() == 4096
    for bad in ("lots", "-1G", "0"):
        monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", bad)
        with pytest.raises(ValueError, match=f"SPARSE_SCAN_MEMORY_BUDGET='{bad}': must be a number of bytes"):
            default_memory_budget()
    monkeypatch.delenv("SPARSE_SCAN_MEMORY_BUDGET")
    assert default_memory_budget() > 0


