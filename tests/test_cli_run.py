"""``sparse-scan run``: gradients on bundled models (PyTorch autograd as oracle), outputs, bad input."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from click.testing import CliRunner
from oracles import torch_modules

from sparse_scan import load_model
from sparse_scan.cli import app

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def invoke(*args):
    return CliRunner().invoke(app.main, ["run", *map(str, args)])


@pytest.mark.parametrize("spec, method, levels", [("tiny.yaml", "blelloch", None),
                                                  ("tiny.yaml", "hybrid", "1"),
                                                  ("lenet5.yaml", "blelloch", None),
                                                  ("vgg11-pruned.yaml", "hybrid", "1"),
                                                  ("vgg11.yaml", "linear", None)])
def test_gradients_equal_torch_autograd(tmp_path, spec, method, levels):
    model = load_model(DATA / spec, dtype=np.float64)
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(*torch_modules(model))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3,) + model.input_shape)
    labels = None if spec.startswith("vgg11") else rng.integers(0, 10, 3)
    np.save(tmp_path / "x.npy", x)
    args = [DATA / spec, "--input", tmp_path / "x.npy", "--method", method, "--dtype", "float64",
            "--out", tmp_path / "g.npz", "--json", "--check"]
    if levels is not None:
        args += ["--levels", levels]
    if labels is not None:
        np.save(tmp_path / "y.npy", labels)
        args += ["--labels", tmp_path / "y.npy"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    check = report["check"]  # another computation: back-propagation outside the engine for linear
    assert check["reference"] == ("layerwise" if method == "linear" else "linear")
    assert check["computed"] == method + ("" if levels is None else f" {levels}")
    assert check["max_rel_error"] < 1e-10
    with np.load(tmp_path / "g.npz") as stored:
        got = dict(stored)
    inputs = torch.from_numpy(x).requires_grad_(True)
    outputs = [inputs]
    for module in net:
        outputs.append(module(outputs[-1]))
        outputs[-1].retain_grad()
    if labels is not None:
        loss = torch.nn.functional.cross_entropy(outputs[-1], torch.from_numpy(labels))
        assert report["loss"] == pytest.approx(loss.item(), rel=1e-12)
    else:
        loss = outputs[-1].sum()
    loss.backward()
    np.testing.assert_allclose(got["input.grad"], inputs.grad.numpy(), rtol=1e-9, atol=1e-12)
    for layer, tensor in zip(model.layers, outputs[1:], strict=True):
        np.testing.assert_allclose(got[f"{layer.name}.out.grad"], tensor.grad.numpy(), rtol=1e-9, atol=1e-12)
    for layer, module in zip(model.layers, net, strict=True):
        if hasattr(layer, "weight"):
            # a pruned layer's gradient is its kept weights' (autograd's times the mask)
            kept = (layer.weight != 0) if getattr(layer, "prune_pattern", False) else 1
            np.testing.assert_allclose(got[f"{layer.name}.weight.grad"], module.weight.grad.numpy() * kept,
                                       rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(got[f"{layer.name}.bias.grad"], module.bias.grad.numpy(),
                                       rtol=1e-9, atol=1e-12)


def test_timing_breakdown_is_printed():
    result = invoke(DATA / "tiny.yaml", "--random", "2", "--method", "linear")
    assert result.exit_code == 0, result.output
    for phase in ("forward", "plan (built)", "JT values", "scan", "parameter grads"):
        assert phase in result.output


def test_output_keys_and_upstream_gradient(tmp_path):
    model = load_model(DATA / "tiny.yaml")
    grad = np.random.default_rng(1).standard_normal((2, 10)).astype(np.float32)
    np.save(tmp_path / "g.npy", grad)
    result = invoke(DATA / "tiny.yaml", "--random", "2", "--grad", tmp_path / "g.npy", "--out",
                    tmp_path / "out.npz")
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "out.npz") as stored:
        got = dict(stored)
    parameters = {f"{n}.{p}.grad" for n in ("conv1", "conv2", "fc") for p in ("weight", "bias")}
    assert set(got) == {"input.grad"} | {f"{layer.name}.out.grad" for layer in model.layers} | parameters
    np.testing.assert_array_equal(got["fc.out.grad"], grad)  # the upstream gradient itself
    assert [f for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temporary left


def write_npy(tmp_path, name, array):
    np.save(tmp_path / name, array)
    return tmp_path / name


@pytest.mark.parametrize("case, fragment", [
    ("input_shape", "the model takes (N, 1, 8, 8)"),
    ("input_nan", "NaN or Inf"),
    ("input_dtype", "expected numbers"),
    ("input_missing", "no such file"),
    ("grad_shape", "the output has [2, 10]"),
    ("labels_range", "labels must lie in 0..9"),
    ("levels", "levels in 0..3"),
    ("levels_word", "--levels must be"),
    ("gpu", "--device gpu"),
    ("both_inputs", "exactly one of --input"),
    ("spec", "unknown layer type"),
    ("costly_step", "raise --max-step-flops, or use --method linear"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, case, fragment):
    from sparse_scan import backend
    if case == "gpu" and backend.gpu_usable():
        pytest.skip("a GPU is usable here")
    x = np.zeros((2, 1, 8, 8), np.float32)
    spec = DATA / "tiny.yaml"
    args = {"input_shape": lambda: ["--input", write_npy(tmp_path, "x.npy", np.zeros((2, 8, 8)))],
            "input_nan": lambda: ["--input", write_npy(tmp_path, "x.npy", np.full_like(x, np.nan))],
            "input_dtype": lambda: ["--input", write_npy(tmp_path, "x.npy", x.astype("U1"))],
            "input_missing": lambda: ["--input", tmp_path / "nope.npy"],
            "grad_shape": lambda: ["--random", "2", "--grad", write_npy(tmp_path, "g.npy", np.ones((2, 9)))],
            "labels_range": lambda: ["--random", "2", "--labels",
                                     write_npy(tmp_path, "y.npy", np.array([0, 10]))],
            "levels": lambda: ["--random", "2", "--method", "hybrid", "--levels", "7"],
            "levels_word": lambda: ["--random", "2", "--method", "hybrid", "--levels", "deep"],
            "gpu": lambda: ["--random", "2", "--device", "gpu"],
            "both_inputs": lambda: ["--random", "2", "--input", write_npy(tmp_path, "x.npy", x)],
            "spec": lambda: ["--random", "2"],
            "costly_step": lambda: ["--random", "2", "--method", "blelloch",
                                    "--max-step-flops", "100"]}[case]()
    if case == "spec":
        spec = tmp_path / "bad.yaml"
        spec.write_text("input_shape: [1, 8, 8]\nlayers: [{name: c, type: conv9}]\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(spec, *args, "--out", tmp_path / "out.npz")
    assert result.exit_code == 2, result.output
    assert fragment in result.output and result.output.count("\n") == 1
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_existing_output_is_never_overwritten_without_force(tmp_path):
    target = tmp_path / "out.npz"
    target.write_bytes(b"user data")
    result = invoke(DATA / "tiny.yaml", "--random", "2", "--out", target)
    assert result.exit_code == 2 and "exists" in result.output
    assert target.read_bytes() == b"user data"
    assert invoke(DATA / "tiny.yaml", "--random", "2", "--out", target, "--force").exit_code == 0
    with np.load(target) as stored:
        assert "input.grad" in stored.files
