"""Training: BPPSA and BP follow the same losses, pruned weights stay zero, the CLI's files and errors."""

from __future__ import annotations

import collections
import csv
import json
import pathlib

import numpy as np
import pytest
from click.testing import CliRunner

import sparse_scan.train as training
from sparse_scan import load_model
from sparse_scan.cli import app
from sparse_scan.loss import softmax_cross_entropy
from sparse_scan.optim import SGD, Adam
from sparse_scan.train import DataError, Dataset, load_dataset, train

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"

SPEC = """input_shape: [1, 6, 6]
init: {{seed: 0}}
{prune}layers:
  - {{name: conv, type: conv2d, out_channels: 3, kernel_size: 3, padding: 1}}
  - {{name: act, type: tanh}}
  - {{name: pool, type: maxpool2d, kernel_size: 2}}
  - {{name: flat, type: flatten}}
  - {{name: fc, type: linear, out_features: 4}}
"""


def dataset(n_train=40, n_test=12, seed=0):
    rng = np.random.default_rng(seed)
    return {"x_train": rng.standard_normal((n_train, 1, 6, 6)).astype(np.float32),
            "y_train": rng.integers(0, 4, n_train), "x_test": rng.standard_normal((n_test, 1, 6, 6)),
            "y_test": rng.integers(0, 4, n_test)}


def files(tmp_path, prune=""):
    spec = tmp_path / "model.yaml"
    spec.write_text(SPEC.format(prune=prune))
    np.savez(tmp_path / "data.npz", **dataset())
    return spec, tmp_path / "data.npz"


@pytest.mark.parametrize("method, levels, optimizer", [("blelloch", None, "sgd"), ("hybrid", 1, "adam")])
def test_bppsa_and_bp_training_follow_the_same_losses(tmp_path, method, levels, optimizer):
    spec, data_path = files(tmp_path)
    model, bp = load_model(spec), load_model(spec)
    data = load_dataset(data_path, model.input_shape, 4)
    make = (lambda m: SGD(m, lr=0.1, momentum=0.9)) if optimizer == "sgd" else (lambda m: Adam(m, lr=0.01))
    records = train(model, data, make(model), epochs=3, batch_size=16, method=method, levels=levels,
                    baseline=(bp, make(bp)))
    assert len(records) == 9
    for record in records:
        assert record["train_loss"] == pytest.approx(record["bp_train_loss"], rel=1e-5)
        assert record["test_loss"] == pytest.approx(record["bp_test_loss"], rel=1e-5)
    assert records[-1]["train_loss"] != records[0]["train_loss"]  # it trained
    for a, b in zip(model.layers, bp.layers, strict=True):
        if hasattr(a, "weight"):
            np.testing.assert_allclose(a.weight, b.weight, rtol=1e-4, atol=1e-6)


def invoke(*args):
    return CliRunner().invoke(app.main, ["train", *map(str, args)])


def test_cli_trains_writes_weights_log_and_keeps_pruned_weights_zero(tmp_path):
    spec, data_path = files(tmp_path, prune="prune: {amount: 0.5}\n")
    zeros = load_model(spec).layers[0].weight == 0
    result = invoke(spec, "--data", data_path, "--epochs", "2", "--batch-size", "8", "--optimizer", "sgd",
                    "--lr", "0.1", "--momentum", "0.9", "--compare-bp", "--out", tmp_path / "w.npz", "--log",
                    tmp_path / "log.csv")
    assert result.exit_code == 0, result.output
    assert "max loss difference" in result.output
    with np.load(tmp_path / "w.npz") as stored:
        weight = stored["conv.weight"]
    plain = tmp_path / "plain"
    plain.touch()
    assert (tmp_path / "w.npz").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert zeros.any() and np.all(weight[zeros] == 0) and np.all(weight[~zeros] != 0)
    with (tmp_path / "log.csv").open() as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 10 and list(rows[0]) == [
        "epoch", "iteration", "samples", "train_loss", "train_accuracy", "test_loss", "test_accuracy",
        "elapsed_s", "bp_train_loss", "bp_train_accuracy", "bp_test_loss", "bp_test_accuracy"]


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    spec, data_path = files(tmp_path)
    result = invoke(spec, "--data", data_path, "--batch-size", "16", "--compare-bp", "--plot",
                    tmp_path / "loss.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_digits_dataset_fits_the_bundled_lenet():
    pytest.importorskip("sklearn")
    model = load_model(DATA / "lenet5-digits.yaml")
    data = load_dataset("digits", model.input_shape, 10)
    assert data.x_train.shape == (1437, 1, 8, 8) and data.x_test.shape == (360, 1, 8, 8)
    assert 0 <= data.x_train.min() and data.x_train.max() <= 1 and set(data.y_train) == set(range(10))
    padded = load_dataset("digits", (1, 12, 12), 10)
    np.testing.assert_array_equal(padded.x_train[:, :, 2:10, 2:10], data.x_train)
    rgb = load_dataset("digits", (3, 32, 32), 10)  # ResNet-20's input: the grey level in each channel
    for channel in range(3):
        np.testing.assert_array_equal(rgb.x_train[:, channel:channel + 1, 12:20, 12:20], data.x_train)
    assert not rgb.x_train[:, :, :12].any() and not rgb.x_train[:, :, 20:].any()
    for shape in [(2, 8, 8), (1, 7, 8), (3, 8)]:
        with pytest.raises(DataError, match="do not fit"):
            load_dataset("digits", shape, 10)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("y_test"), "missing array 'y_test'"),
    (lambda d: d.update(x_train=np.zeros((40, 6, 6))), "x_train has shape [40, 6, 6]"),
    (lambda d: d.update(y_train=np.full(40, 4)), "labels outside 0..3"),
    (lambda d: d.update(y_test=np.zeros(12)), "integer labels"),
    (lambda d: d.update(x_test=np.full((12, 1, 6, 6), np.nan)), "NaN or Inf"),
    (lambda d: d.update(x_test=np.full((12, 1, 6, 6), 1e300)), "too large for float32"),
    (lambda d: d.update(x_train=np.zeros((0, 1, 6, 6)), y_train=np.zeros(0, np.int64)),
     "x_train holds no samples"),
    (lambda d: d.update(x_train=np.full((40, 1, 6, 6), 2**24 + 1, np.int64)),
     "x_train: holds integers float32 does not hold exactly (16777217 would be 16777216"),
])
def test_bad_data_files_are_one_line_exit_2(tmp_path, change, fragment):
    spec, data_path = files(tmp_path)
    arrays = dataset()
    change(arrays)
    np.savez(data_path, **arrays)
    result = invoke(spec, "--data", data_path, "--out", tmp_path / "w.npz")
    assert result.exit_code == 2 and fragment in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "w.npz").exists()


def test_data_over_the_memory_budget_is_refused_before_it_is_read(tmp_path, monkeypatch):
    _, data_path = files(tmp_path)
    arrays = dataset()
    np.savez(data_path, **arrays)
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "8K")  # the arrays hold about 15 KiB
    with pytest.raises(DataError, match=f"{data_path}.*over the memory budget of 8.0 KiB.*"
                                        "SPARSE_SCAN_MEMORY_BUDGET"):
        load_dataset(data_path, (1, 6, 6), 4)
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "64K")
    assert load_dataset(data_path, (1, 6, 6), 4).x_train.shape == (40, 1, 6, 6)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", "npy"])
def test_data_files_that_are_no_npz_are_one_line_exit_2(tmp_path, content):
    spec, data_path = files(tmp_path)
    if content == "npy":
        data_path = tmp_path / "data.npy"
        np.save(data_path, np.ones(3))
    else:
        data_path.write_bytes(content)
    result = invoke(spec, "--data", data_path)
    assert result.exit_code == 2 and "not a readable .npz" in result.output, result.output
    assert result.output.count("\n") == 1


def test_existing_outputs_are_kept(tmp_path):
    spec, data_path = files(tmp_path)
    (tmp_path / "w.npz").write_bytes(b"mine")
    result = invoke(spec, "--data", data_path, "--out", tmp_path / "w.npz")
    assert result.exit_code == 2 and "exists" in result.output
    assert (tmp_path / "w.npz").read_bytes() == b"mine"


def test_ctrl_c_keeps_the_weights_written_so_far(tmp_path, monkeypatch):
    spec, data_path = files(tmp_path)

    real = training.train

    def interrupted(model, data, optimizer, epochs, batch_size, *args):
        on_iteration = args[-1]

        def stop_in_epoch_two(record):
            on_iteration(record)
            if record["iteration"] == 4:  # one epoch of 40 samples in batches of 16, two batches more
                raise KeyboardInterrupt

        return real(model, data, optimizer, epochs, batch_size, *args[:-1], stop_in_epoch_two)

    monkeypatch.setattr(training, "train", interrupted)
    result = invoke(spec, "--data", data_path, "--batch-size", "16", "--epochs", "3", "--out",
                    tmp_path / "w.npz", "--log", tmp_path / "log.csv")
    assert result.exit_code == 130 and "interrupted" in result.output
    assert result.output.count("epoch 1/3") == 1 and "epoch 2/3" not in result.output
    with np.load(tmp_path / "w.npz") as stored:
        assert set(stored.files) == {"conv.weight", "conv.bias", "fc.weight", "fc.bias"}
    with (tmp_path / "log.csv").open() as stream:  # appended as it went: every iteration run
        assert [row["iteration"] for row in csv.DictReader(stream)] == ["0", "1", "2", "3", "4"]


def test_epoch_lines_on_any_stream_accuracy_in_the_summary_and_json(tmp_path):
    spec, data_path = files(tmp_path)
    result = invoke(spec, "--data", data_path, "--batch-size", "16", "--epochs", "3")  # not a TTY
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split()[1] for line in epochs] == ["1/3", "2/3", "3/3"]
    for line in epochs:
        assert "train loss" in line and "test loss" in line and " acc " in line and line.endswith(" s")
    assert "  schedule: " in result.output and "(chosen by --method auto" in result.output
    assert lines[-1].startswith(f"{spec}: test accuracy ") and "after 3 epochs, 9 iterations" in lines[-1]
    quiet = invoke(spec, "--data", data_path, "--batch-size", "16", "--epochs", "3", "--quiet")
    assert quiet.output.splitlines() == [lines[-1].split(" in ")[0] + " in " + quiet.output.split(" in ")[1]
                                         .rstrip("\n")] and quiet.output.count("\n") == 1
    report = json.loads(invoke(spec, "--data", data_path, "--batch-size", "16", "--epochs", "3",
                               "--json").stdout)
    assert report["iterations"] == 9 and len(report["per_epoch"]) == 3
    one = invoke(spec, "--data", data_path, "--batch-size", "40", "--epochs", "1").output.splitlines()
    assert "1 epoch of 1 batch of 40" in one[0] and "after 1 epoch, 1 iteration in " in one[-1]  # 1, not 1s
    assert "3 epochs of 3 batches of 16" in lines[0]
    assert 0 <= report["final"]["test_accuracy"] <= 1 and report["final"] == report["per_epoch"][-1]
    assert report["schedule"]["method"] in ("linear", "hybrid", "blelloch")
    assert report["schedule"]["requested"] == "auto"


def test_train_and_run_start_from_weights_and_eval_reports_them(tmp_path):
    spec, data_path = files(tmp_path)
    result = invoke(spec, "--data", data_path, "--batch-size", "8", "--epochs", "2", "--out",
                    tmp_path / "w.npz", "--json")
    trained = json.loads(result.stdout)["final"]
    evaluated = json.loads(CliRunner().invoke(app.main, ["eval", str(spec), "--data", str(data_path),
                                                         "--weights", str(tmp_path / "w.npz"),
                                                         "--json"]).output)
    assert evaluated["test"]["accuracy"] == pytest.approx(trained["test_accuracy"])
    assert evaluated["test"]["loss"] == pytest.approx(trained["test_loss"], rel=1e-6)
    assert evaluated["test"]["samples"] == 12 and evaluated["train"]["samples"] == 40
    text = CliRunner().invoke(app.main, ["eval", str(spec), "--data", str(data_path)]).output
    assert "test  loss" in text and "accuracy" in text and "its spec's weights" in text
    # train again from the saved weights: the first epoch starts where the last one ended
    again = json.loads(invoke(spec, "--data", data_path, "--batch-size", "8", "--epochs", "1", "--weights",
                              tmp_path / "w.npz", "--json").stdout)
    fresh = json.loads(invoke(spec, "--data", data_path, "--batch-size", "8", "--epochs", "1",
                              "--json").stdout)
    assert again["per_epoch"][0]["train_loss"] < fresh["per_epoch"][0]["train_loss"]
    # run with them: the gradients are those of the trained model
    np.save(tmp_path / "x.npy", np.ones((2, 1, 6, 6), np.float32))
    grads = {}
    for name, extra in (("spec", []), ("trained", ["--weights", tmp_path / "w.npz"])):
        out = tmp_path / f"{name}.npz"
        done = CliRunner().invoke(app.main, ["run", str(spec), "--input", str(tmp_path / "x.npy"), "--out",
                                             str(out), *map(str, extra)])
        assert done.exit_code == 0, done.output
        with np.load(out) as stored:
            grads[name] = stored["input.grad"]
    model = load_model(spec)
    with np.load(tmp_path / "w.npz") as stored:
        model.load_state_dict(dict(stored))
    model.forward(np.ones((2, 1, 6, 6), np.float32))
    np.testing.assert_allclose(grads["trained"], model.backward(np.ones((2, 4), np.float32))[0], rtol=1e-5)
    assert not np.allclose(grads["trained"], grads["spec"])


@pytest.mark.parametrize("command", ["train", "run", "eval"])
@pytest.mark.parametrize("case, fragment", [
    ("missing", "no such file"),
    ("npy", "not a readable .npz"),
    ("unknown_key", "'nope.weight' matches no parameter"),
    ("missing_key", "no 'fc.bias' (strict"),
    ("shape", "'fc.weight' has shape [2, 3], the model's is [4, 27]"),
    ("nan", "'fc.bias' holds NaN or Inf"),
])
def test_bad_weights_files_are_one_line_exit_2(tmp_path, command, case, fragment):
    spec, data_path = files(tmp_path)
    good = load_model(spec).state_dict()
    weights = tmp_path / "w.npz"
    if case == "npy":
        np.save(tmp_path / "w.npy", np.ones(3))
        (tmp_path / "w.npy").rename(weights)
    elif case != "missing":
        arrays = dict(good)
        if case == "unknown_key":
            arrays["nope.weight"] = np.ones(2)
        elif case == "missing_key":
            arrays.pop("fc.bias")
        elif case == "shape":
            arrays["fc.weight"] = np.ones((2, 3), np.float32)
        else:
            arrays["fc.bias"] = np.full(4, np.nan, np.float32)
        np.savez(weights, **arrays)
    extra = {"train": ["--data", data_path, "--out", tmp_path / "o.npz"], "eval": ["--data", data_path],
             "run": ["--random", "2", "--out", tmp_path / "o.npz"]}[command]
    result = CliRunner().invoke(app.main, [command, str(spec), "--weights", str(weights), *map(str, extra)])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and f"--weights {weights}: " in result.output
    assert fragment in result.output, result.output
    assert not (tmp_path / "o.npz").exists()


def test_state_dict_is_named_like_pytorchs_and_loads_strictly():
    torch = pytest.importorskip("torch")
    from oracles import torch_modules

    model = load_model(DATA / "lenet5-digits.yaml")
    net = torch.nn.Sequential(collections.OrderedDict(
        (layer.name, module) for layer, module in zip(model.layers, torch_modules(model), strict=True)))
    state = model.state_dict()
    assert list(state) == list(net.state_dict())
    assert all(state[k].shape == tuple(v.shape) for k, v in net.state_dict().items())
    fresh = load_model(DATA / "lenet5-digits.yaml")
    fresh.layers[0].weight = fresh.layers[0].weight * 0
    fresh.load_state_dict({k: v.detach().numpy() for k, v in net.state_dict().items()})  # float64: cast
    assert fresh.layers[0].weight.dtype == np.float32
    np.testing.assert_array_equal(fresh.layers[0].weight, model.layers[0].weight)
    with pytest.raises(ValueError, match="no 'fc3.bias'"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "fc3.bias"})
    fresh.load_state_dict({"fc3.bias": np.zeros(10)}, strict=False)
    assert not fresh.layers[-1].bias.any()


def test_weights_round_trip_through_an_atomic_npz(tmp_path):
    from sparse_scan.weights import load_state_dict, state_dict, write_npz_atomically

    spec, _ = files(tmp_path)
    trained, fresh = load_model(spec), load_model(spec)
    trained.layers[0].weight = trained.layers[0].weight * 2
    write_npz_atomically(tmp_path / "w.npz", state_dict(trained))
    with np.load(tmp_path / "w.npz") as stored:
        load_state_dict(fresh, dict(stored))
    for key, value in state_dict(trained).items():
        np.testing.assert_array_equal(state_dict(fresh)[key], value)


def test_a_scan_over_the_flop_limit_is_one_line_exit_2(tmp_path):
    rng = np.random.default_rng(0)
    data_path = tmp_path / "data.npz"
    np.savez(data_path, x_train=rng.standard_normal((8, 1, 8, 8)), y_train=rng.integers(0, 10, 8),
             x_test=rng.standard_normal((4, 1, 8, 8)), y_test=rng.integers(0, 10, 4))
    spec = pathlib.Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
    result = invoke(spec, "--data", data_path, "--method", "blelloch", "--max-step-flops", "100",
                    "--out", tmp_path / "w.npz")
    assert result.exit_code == 2 and "raise --max-step-flops" in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "w.npz").exists()


def test_train_refuses_bad_arguments_before_any_step(tmp_path):
    spec, data_path = files(tmp_path)
    model, other = load_model(spec), load_model(spec)
    data = load_dataset(data_path, model.input_shape, 4)
    before = model.layers[0].weight.copy()
    for kwargs, message in [
        ({"batch_size": 0}, "batch_size: must be an int >= 1"),
        ({"epochs": -1}, "epochs: must be an int >= 0"),
        ({"batch_size": 2.5}, "batch_size: must be an int"),
    ]:
        with pytest.raises(ValueError, match=message):
            train(model, data, SGD(model, lr=0.1), **{"epochs": 1, "batch_size": 8, **kwargs})
    with pytest.raises(ValueError, match="optimizer: built on another model"):
        train(model, data, SGD(other, lr=0.1), epochs=1, batch_size=8)
    with pytest.raises(ValueError, match="x_train has 40 samples and y_train 39 labels"):
        train(model, Dataset(data.x_train, data.y_train[:-1], data.x_test, data.y_test), SGD(model, lr=0.1),
              epochs=1, batch_size=8)
    np.testing.assert_array_equal(model.layers[0].weight, before)


@pytest.mark.parametrize("labels, message", [
    ([0, -1], r"labels: must lie in 0\.\.3"), ([0, 4], r"labels: must lie in 0\.\.3"),
    ([0.0, 1.0], "integer labels"), ([0], "expected 2 integer labels"),
])
def test_the_loss_refuses_labels_it_would_misread(labels, message):
    with pytest.raises(ValueError, match=message):
        softmax_cross_entropy(np.zeros((2, 4), np.float32), np.array(labels))


def test_layers_with_parameters_need_unique_names():
    from sparse_scan import Sequential
    from sparse_scan.layers import Linear, ReLU

    first, second = Linear(3, 3, rng=0), Linear(3, 3, rng=1)
    first.name = second.name = "fc"
    with pytest.raises(ValueError, match="unique names: 'fc' names 2"):
        Sequential(first, ReLU(), second)
    relu = ReLU()
    Sequential(Linear(3, 3, rng=0), relu, Linear(3, 3, rng=1), relu)  # a parameterless layer may repeat


def test_evaluate_runs_dropout_in_eval_mode_and_gives_the_mode_back():
    from sparse_scan import Sequential
    from sparse_scan.layers import Dropout, Flatten, Linear

    dropout = Dropout(0.5, rng=0)
    model = Sequential(Flatten(), dropout, Linear(16, 3, dtype=np.float64, rng=1))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20, 1, 4, 4)), rng.integers(0, 3, 20)
    scores = training.evaluate(model, x, y)
    assert dropout.training
    dropout.eval()
    assert scores == training.evaluate(model, x, y)  # as without dropout, not a random mask
    dropout.train()
    assert training.evaluate(model, x, y) == scores
