"""Training that diverges stops at the iteration that went non-finite, names it and what went so, keeps
the weights of the last finite iteration, and shows no NumPy warning (the suite turns warnings into
errors) nor a layer's error further on; on the command line, one line and exit code 2 (issue 47, item 11)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from click.testing import CliRunner

from sparse_scan import Sequential, load_model
from sparse_scan.cli import app
from sparse_scan.layers import Flatten, Linear, MaxPool2d, ReLU
from sparse_scan.optim import SGD
from sparse_scan.train import Dataset, DivergenceError, train, train_iterations

TINY = pathlib.Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def _model() -> Sequential:
    """A little CNN with a max-pool (whose backward refuses NaN inputs, the error seen before)."""
    return Sequential(ReLU(), MaxPool2d(2), Flatten(), Linear(4, 3, rng=0))


def _data(nan_train: int | None = None, nan_test: int | None = None) -> Dataset:
    """12 training samples (the batches of 4 shuffled by the seed), 4 test ones; a NaN in the samples
    given."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, 12)
    x_train, x_test = x.copy(), x[:4].copy()
    for array, sample in ((x_train, nan_train), (x_test, nan_test)):
        if sample is not None:
            array[sample, 0, 1, 1] = np.nan
    return Dataset(x_train, y, x_test, y[:4])


def _weights(model: Sequential) -> dict[str, np.ndarray]:
    return {key: value.copy() for key, value in model.state_dict().items()}


def _train_recording(model: Sequential, data: Dataset,
                     optimizer: SGD) -> tuple[DivergenceError, list[dict[str, np.ndarray]]]:
    """Train until it diverges; the error and the weights after each recorded iteration (the first:
    before any)."""
    weights = [_weights(model)]
    with pytest.raises(DivergenceError) as diverged:
        train(model, data, optimizer, epochs=3, batch_size=4, method="linear",
              on_iteration=lambda record: weights.append(_weights(model)))
    return diverged.value, weights


def _same(model: Sequential, weights: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(value, weights[key]) for key, value in model.state_dict().items())


def test_a_weight_overflowing_in_the_step_is_undone_and_named():
    model = _model()
    error, weights = _train_recording(model, _data(), SGD(model, lr=1e39))  # lr is inf in float32
    assert error.iteration == 0 and error.records == [] and error.copy == ""
    assert error.what.startswith("'3.weight' holds NaN or Inf after the optimizer's step (undone)")
    assert str(error).startswith("training diverged at iteration 0: '3.weight' holds NaN or Inf")
    assert _same(model, weights[0])


def test_outputs_gone_non_finite_are_named_at_their_iteration_and_the_last_finite_weights_kept():
    """A NaN in one sample: before, the max-pool's backward refused it with a traceback."""
    model = _model()
    error, weights = _train_recording(model, _data(nan_train=1), SGD(model, lr=0.1))
    assert error.iteration == 2 and error.what == "the model's outputs holds NaN or Inf (3 of 12 entries)"
    assert [record["iteration"] for record in error.records] == [0, 1] and len(weights) == 3
    assert _same(model, weights[-1]) and not _same(model, weights[0])


def test_a_non_finite_gradient_is_named(monkeypatch):
    model = _model()
    real = model.parameter_gradients
    monkeypatch.setattr(model, "parameter_gradients",
                        lambda grads: real(grads) | {"3.bias": np.array([0.0, np.nan, np.inf], np.float32)})
    error, weights = _train_recording(model, _data(), SGD(model, lr=0.1))
    assert (error.iteration, error.what) == (0, "the gradient of '3.bias' holds NaN or Inf (2 of 3 entries)")
    assert _same(model, weights[0])


def test_a_non_finite_test_loss_undoes_the_step_that_made_it():
    model = _model()
    error, weights = _train_recording(model, _data(nan_test=0), SGD(model, lr=0.1))
    assert error.iteration == 0 and error.what.startswith("the test loss is ")
    assert _same(model, weights[0])


def test_the_baselines_divergence_undoes_both_steps():
    model, copy = _model(), _model()
    weights = _weights(model)
    with pytest.raises(DivergenceError, match="the back-propagation baseline's '3.weight' holds NaN") as err:
        train(model, _data(), SGD(model, lr=0.1), epochs=1, batch_size=4, method="linear",
              baseline=(copy, SGD(copy, lr=1e39)))
    assert err.value.copy == "bp_" and _same(model, weights) and _same(copy, weights)


def test_train_iterations_stops_the_same_way():
    class Task:
        def __len__(self) -> int:
            return 8

        def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return np.full((len(indices), 1, 4, 4), np.nan, np.float32), np.zeros(len(indices), np.int64)

    model = _model()
    weights = _weights(model)
    with pytest.raises(DivergenceError, match="training diverged at iteration 0: the ") as error:
        train_iterations(model, Task(), SGD(model, lr=0.1), iterations=3, batch_size=4)
    assert error.value.records == [] and _same(model, weights)


def test_the_command_line_says_where_it_diverged_in_one_line_and_keeps_the_weights(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    np.savez(tmp_path / "data.npz", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    out, log = tmp_path / "w.npz", tmp_path / "log.csv"
    result = CliRunner().invoke(app.main, [
        "train", str(TINY), "--data", str(tmp_path / "data.npz"), "--optimizer", "sgd", "--lr", "1e39",
        "--epochs", "2", "--batch-size", "8", "--out", str(out), "--log", str(log), "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"sparse-scan: error: {TINY}: training diverged at iteration 0 (epoch 1, batch "
                             "1/2): 'conv1.weight' holds NaN or Inf after the optimizer's step (undone); "
                             f"the last finite weights in {out}, log in {log} (lower --lr?)\n")
    with np.load(out) as saved:  # the weights it started from: the step of iteration 0 undone
        assert all(np.array_equal(saved[key], value) for key, value in load_model(TINY).state_dict().items())
