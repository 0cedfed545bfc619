"""``sparse-scan run``, ``train`` and ``eval`` on recurrent specs: the bundled LSTM bitstream classifier
(data/lstm-bitstream.yaml), gradients equal to PyTorch autograd's, the same outputs as for CNN specs,
and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from click.testing import CliRunner

from sparse_scan import load_model
from sparse_scan.cli import app

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
BUNDLED = DATA / "lstm-bitstream.yaml"

SMALL = """input_shape: [8, 1]
init: {{seed: 0}}
layers:
  - {{name: rnn, type: {kind}, hidden_size: 6{arguments}}}
  - {{name: head, type: linear, out_features: 3}}
"""


def invoke(*args):
    return CliRunner().invoke(app.main, [*map(str, args)])


def small_spec(tmp_path, kind="gru", arguments="", name="small.yaml"):
    path = tmp_path / name
    path.write_text(SMALL.format(kind=kind, arguments=arguments))
    return path


def test_the_bundled_spec_is_the_papers_lstm_classifier():
    model = load_model(BUNDLED)
    assert model.input_shape == (1000, 1) and model.recurrent.hidden_size == 20 and model.classes == 10
    assert type(model.recurrent).__name__ == "LSTM" and model.recurrent.num_layers == 1


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", "3"),
                                            ("hybrid", "auto"), ("auto", None)])
def test_run_on_the_bundled_spec_every_schedule(tmp_path, method, levels):
    args = ["run", BUNDLED, "--random", "2", "--method", method, "--dtype", "float64", "--json", "--check",
            "--out", tmp_path / "g.npz"] + (["--levels", levels] if levels else [])
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    check = report["check"]  # another schedule: blelloch where linear ran
    assert check["reference"] == ("blelloch" if report["method"] == "linear" else "linear")
    assert check["max_rel_error"] < 1e-10
    if method != "auto" and levels != "auto":
        assert (report["method"], report["levels"]) == (method, None if levels is None else int(levels))
    assert report["schedule"]["requested"] == method and report["schedule"]["critical_steps"] > 0
    assert set(report["timings"]) == {"forward_s", "plan_s", "backward_s"}
    with np.load(tmp_path / "g.npz") as stored:
        shapes = {key: stored[key].shape for key in stored.files}
    assert shapes["input.grad"] == (2, 1000, 1) and shapes["rnn.out.grad"] == (2, 1000, 20)
    assert shapes["fc.out.grad"] == (2, 10) and shapes["rnn.weight_hh_l0.grad"] == (80, 20)
    assert set(shapes) == {"input.grad", "rnn.out.grad", "fc.out.grad"} | {
        f"{key}.grad" for key in load_model(BUNDLED).state_dict()}


@pytest.mark.parametrize("kind, arguments", [("lstm", ", num_layers: 2, bidirectional: true, proj_size: 2"),
                                             ("rnn", ", nonlinearity: relu, batch_first: true"),
                                             ("gru", ", bias: false")])
def test_run_gradients_equal_pytorch_autograd(tmp_path, kind, arguments):
    torch = pytest.importorskip("torch")
    spec = small_spec(tmp_path, kind, arguments)
    model = load_model(spec, dtype=np.float64)
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((4, 8, 1)), rng.integers(0, 3, 4)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", labels)
    result = invoke("run", spec, "--input", tmp_path / "x.npy", "--labels", tmp_path / "y.npy", "--dtype",
                    "float64", "--method", "blelloch", "--json", "--out", tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    recurrent = model.recurrent
    module = getattr(torch.nn, kind.upper())(1, 6, **{
        key: getattr(recurrent, key) for key in ("num_layers", "bias", "batch_first", "bidirectional")},
        **({"nonlinearity": recurrent.nonlinearity} if kind == "rnn" else {}),
        **({"proj_size": recurrent.proj_size} if kind == "lstm" else {})).double()
    head = torch.nn.Linear(model.fc.in_features, 3).double()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(torch.from_numpy(getattr(recurrent, name)))
        head.weight.copy_(torch.from_numpy(model.fc.weight))
        head.bias.copy_(torch.from_numpy(model.fc.bias))
    inputs = torch.from_numpy(x).requires_grad_(True)
    output, _ = module(inputs if recurrent.batch_first else inputs.transpose(0, 1))
    last = output[:, -1] if recurrent.batch_first else output[-1]
    loss = torch.nn.functional.cross_entropy(head(last), torch.from_numpy(labels))
    loss.backward()
    assert json.loads(result.output)["loss"] == pytest.approx(loss.item(), rel=1e-12)
    with np.load(tmp_path / "g.npz") as stored:
        got = dict(stored)
    np.testing.assert_allclose(got["input.grad"], inputs.grad.numpy(), rtol=1e-10, atol=1e-14)
    for name, parameter in list(module.named_parameters(prefix="rnn")) + list(head.named_parameters(
            prefix="head")):
        np.testing.assert_allclose(got[f"{name}.grad"], parameter.grad.numpy(), rtol=1e-10, atol=1e-14,
                                   err_msg=name)


def test_run_prints_the_schedule_and_the_timings():
    result = invoke("run", BUNDLED, "--random", "2", "--method", "hybrid")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{BUNDLED}: hybrid ") and "batch 2, float32" in lines[0]
    assert lines[1].startswith("  schedule: hybrid ") and "depth chosen by --method hybrid" in lines[1]
    for phase in ("forward", "plan", "backward (all grads)"):
        assert any(line.startswith(f"  {phase} ") for line in lines), phase


def test_train_eval_and_run_on_the_bundled_spec_with_the_bitstream_task(tmp_path):
    weights, log = tmp_path / "w.npz", tmp_path / "log.csv"
    result = invoke("train", BUNDLED, "--data", "bitstream:32:16", "--epochs", "1", "--batch-size", "16",
                    "--method", "blelloch", "--compare-bp", "--json", "--out", weights, "--log", log)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["iterations"] == 2 and report["schedule"]["method"] == "blelloch"
    assert report["max_loss_difference_vs_bp"] < 1e-4
    assert report["final"]["test_accuracy"] >= 0 and len(log.read_text().splitlines()) == 3
    with np.load(weights) as stored:
        assert sorted(stored.files) == sorted(load_model(BUNDLED).state_dict())
    result = invoke("eval", BUNDLED, "--data", "bitstream:32:16", "--weights", weights, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["test"]["loss"] == pytest.approx(report["final"]["test_loss"], rel=1e-5)
    result = invoke("run", BUNDLED, "--random", "1", "--weights", weights, "--quiet")
    assert result.exit_code == 0, result.output


def test_train_on_sequences_from_an_npz(tmp_path):
    spec = small_spec(tmp_path, "lstm")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 96)
    x = (rng.random((96, 8, 1)) < 0.2 + 0.3 * labels[:, None, None]).astype(np.float32)
    np.savez(tmp_path / "seq.npz", x_train=x[:64], y_train=labels[:64], x_test=x[64:], y_test=labels[64:])
    result = invoke("train", spec, "--data", tmp_path / "seq.npz", "--epochs", "3", "--batch-size", "16",
                    "--lr", "0.03", "--quiet")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{spec}: test accuracy ") and "12 iterations" in lines[0]


def one_line_exit_2(result, fragment):
    assert result.exit_code == 2, result.output
    assert fragment in result.output and result.output.count("\n") == 1, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case, fragment", [
    ("unknown_field", "field 'hiden_size': unknown argument of gru"),
    ("bad_value", "field 'num_layers': must be an int >= 1"),
    ("weight_shape", "layer 'rnn' (layers[0]), field 'weight_hh_l0': 'rnn.weight_hh_l0' has shape [18, 2], "
     "expected [18, 6]"),
])
def test_bad_specs_are_one_line_exit_2_from_every_command(tmp_path, case, fragment):
    arguments = {"unknown_field": ", hiden_size: 6", "bad_value": ", num_layers: 0", "weight_shape": ""}[case]
    spec = small_spec(tmp_path, "gru", arguments)
    if case == "weight_shape":
        weights = {key: value for key, value in load_model(spec).state_dict().items()}
        weights["rnn.weight_hh_l0"] = np.zeros((18, 2), np.float32)
        np.savez(tmp_path / "w.npz", **weights)
        spec.write_text(spec.read_text().replace("init: {seed: 0}", "weights: w.npz"))
    for command in (["run", spec, "--random", "2"],
                    ["train", spec, "--data", "bitstream:8:4", "--epochs", "1"],
                    ["eval", spec, "--data", "bitstream:8:4"]):
        result = invoke(*command)
        one_line_exit_2(result, fragment)
        assert result.output.startswith(f"sparse-scan: error: {spec}: ")


@pytest.mark.parametrize("command, fragment", [
    (["run", "--random", "2", "--method", "hybrid", "--levels", "9"],
     "hybrid needs levels in 0..4 for 8 time steps"),
    (["run", "--random", "2", "--method", "auto", "--levels", "2"], "levels applies to method='hybrid' only"),
    (["train", "--data", "bitstream:8:x"], "--data bitstream:8:x: expected bitstream, bitstream:TRAIN"),
    (["train", "--data", "digits"], "digits: 1x8x8 images do not fit the model's input [8, 1]"),
    (["eval", "--data", "bitstream", "--weights", "w.npz"], "--weights"),
])
def test_bad_options_on_a_recurrent_spec_are_one_line_exit_2(tmp_path, monkeypatch, command, fragment):
    monkeypatch.chdir(tmp_path)
    spec = small_spec(tmp_path)
    np.savez(tmp_path / "w.npz", **{"rnn.weight_ih_l9": np.zeros(2, np.float32)})
    one_line_exit_2(invoke(command[0], spec, *command[1:]), fragment)


def test_dropout_applies_as_the_spec_sets_the_mode_and_train_refuses_a_model_the_bitstream_does_not_fit(
        tmp_path):
    """A recurrent layer's dropout between its layers follows the spec's ``training`` (false by default,
    as a dropout layer's): ``train`` trains in that mode and scores in eval mode."""
    spec = small_spec(tmp_path, "lstm", ", num_layers: 2, dropout: 0.5")
    assert not load_model(spec).recurrent.training  # eval mode: the dropout is off
    assert load_model(small_spec(tmp_path, "lstm", ", num_layers: 2, dropout: 0.5, training: true",
                                 "training.yaml")).recurrent.training
    for path in (spec, tmp_path / "training.yaml"):
        result = invoke("train", path, "--data", "bitstream:32:16", "--epochs", "1", "--batch-size", "16",
                        "--json")
        assert result.exit_code == 0, result.output
        assert invoke("run", path, "--random", "2").exit_code == 0
    one_line_exit_2(invoke("train", small_spec(tmp_path, "lstm", ", training: 1", "bad.yaml"), "--data",
                           "bitstream"), "field 'training': must be true or false, got 1")
    wide = tmp_path / "wide.yaml"
    wide.write_text(SMALL.format(kind="rnn", arguments="").replace("[8, 1]", "[8, 2]"))
    one_line_exit_2(invoke("train", wide, "--data", "bitstream"), "bitstream sequences are (time steps, 1), "
                    "the model takes [8, 2]")
