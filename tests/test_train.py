"""Training: BPPSA and BP follow the same losses, pruned weights stay zero, the CLI's files and errors."""

from __future__ import annotations

import csv
import pathlib

import numpy as np
import pytest
from click.testing import CliRunner

from sparse_scan import load_model
from sparse_scan.cli import app
from sparse_scan.cli import train as train_cli
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
    result = invoke(spec, "--data", data_path, "--epochs", "2", "--batch-size", "8", "--lr", "0.1",
                    "--momentum", "0.9", "--compare-bp", "--out", tmp_path / "w.npz", "--log",
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
    assert len(rows) == 10 and set(rows[0]) == {"epoch", "iteration", "train_loss", "test_loss",
                                                "bp_train_loss", "bp_test_loss"}


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
    with pytest.raises(DataError, match="do not fit"):
        load_dataset("digits", (3, 8, 8), 10)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("y_test"), "missing array 'y_test'"),
    (lambda d: d.update(x_train=np.zeros((40, 6, 6))), "x_train has shape [40, 6, 6]"),
    (lambda d: d.update(y_train=np.full(40, 4)), "labels outside 0..3"),
    (lambda d: d.update(y_test=np.zeros(12)), "integer labels"),
    (lambda d: d.update(x_test=np.full((12, 1, 6, 6), np.nan)), "NaN or Inf"),
    (lambda d: d.update(x_test=np.full((12, 1, 6, 6), 1e300)), "too large for float32"),
    (lambda d: d.update(x_train=np.zeros((0, 1, 6, 6)), y_train=np.zeros(0, np.int64)),
     "x_train holds no samples"),
])
def test_bad_data_files_are_one_line_exit_2(tmp_path, change, fragment):
    spec, data_path = files(tmp_path)
    arrays = dataset()
    change(arrays)
    np.savez(data_path, **arrays)
    result = invoke(spec, "--data", data_path, "--out", tmp_path / "w.npz")
    assert result.exit_code == 2 and fragment in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "w.npz").exists()


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

    def interrupted(model, data, optimizer, epochs, batch_size, *args):
        on_iteration = args[-1]
        for iteration in range(3):  # one epoch of 40 samples in batches of 16, then Ctrl-C
            on_iteration({"epoch": 0, "iteration": iteration, "train_loss": 1.0, "test_loss": 1.0})
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "train", interrupted)
    result = invoke(spec, "--data", data_path, "--batch-size", "16", "--epochs", "3", "--out",
                    tmp_path / "w.npz")
    assert result.exit_code == 130 and "interrupted" in result.output
    with np.load(tmp_path / "w.npz") as stored:
        assert set(stored.files) == {"conv.weight", "conv.bias", "fc.weight", "fc.bias"}



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
