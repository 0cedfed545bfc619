"""Bad command lines and files across `run`, `flops` and `train`: one line on stderr, exit code 2,
nothing the user gave overwritten, and no work started that a bad option would waste."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from sparse_scan import backend
from sparse_scan.cli import app

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "tiny.yaml"


def invoke(*args):
    return CliRunner().invoke(app.main, list(map(str, args)))


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.output.startswith("sparse-scan: error: ") and result.output.count("\n") == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def digits_like(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "data.npz"
    np.savez(path, x_train=rng.random((20, 1, 8, 8)), y_train=rng.integers(0, 10, 20),
             x_test=rng.random((5, 1, 8, 8)), y_test=rng.integers(0, 10, 5))
    return path


@pytest.mark.parametrize("args, fragments", [
    (["run", TINY, "--random", "2", "--method", "foo"], ["--method", "foo"]),
    (["run", TINY, "--random", "0"], ["--random"]),
    (["run", TINY, "--random", "2", "--seed", "-1"], ["--seed", "-1"]),
    (["run", TINY, "--random", "2", "--max-step-flops", "nan"], ["--max-step-flops", "finite"]),
    (["run", TINY, "--random", "2", "--max-step-flops", "inf"], ["--max-step-flops", "finite"]),
    (["run", TINY, "--random", "2", "--max-step-flops", "-5"], ["--max-step-flops", "> 0"]),
    (["flops", TINY, "--max-step-flops", "inf"], ["--max-step-flops", "finite"]),
    (["flops", TINY, "--batch", "0"], ["--batch"]),
    (["no-such-command"], ["No such command"]),
])
def test_option_errors_are_one_line(args, fragments):
    one_line_error(invoke(*args), *fragments)


@pytest.mark.parametrize("option, value, fragment", [
    ("--lr", "nan", "finite"), ("--lr", "inf", "finite"), ("--lr", "0", "> 0"),
    ("--momentum", "nan", "finite"), ("--momentum", "-0.5", ">= 0"), ("--seed", "-1", "-1"),
])
def test_train_option_errors_are_one_line_before_any_work(tmp_path, option, value, fragment):
    result = invoke("train", TINY, "--data", digits_like(tmp_path), option, value,
                    "--out", tmp_path / "w.npz")
    one_line_error(result, option, fragment)
    assert not (tmp_path / "w.npz").exists()


def test_train_on_an_unusable_gpu_is_one_line_before_loading(tmp_path):
    if backend.get("auto").name == "gpu":
        pytest.skip("a GPU is usable here")
    result = invoke("train", TINY, "--data", tmp_path / "never-read.npz", "--device", "gpu")
    one_line_error(result, "--device gpu")


@pytest.mark.parametrize("command", ["flops", "train"])
def test_a_plot_name_without_a_known_suffix_is_refused_and_nothing_is_overwritten(tmp_path, command):
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"mine")
    extra = ["--data", digits_like(tmp_path)] if command == "train" else []
    for name in ("victim", "victim.foo"):
        one_line_error(invoke(command, TINY, *extra, "--plot", tmp_path / name), "--plot", ".png")
    assert victim.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim.png"] + (["data.npz"] if command == "train" else []))


def test_train_refuses_two_outputs_on_one_file(tmp_path):
    data = digits_like(tmp_path)
    one_line_error(invoke("train", TINY, "--data", data, "--out", tmp_path / "w.npz", "--log",
                          tmp_path / "w.npz"), "--log", "the same file as --out")
    assert not (tmp_path / "w.npz").exists()


def test_write_errors_are_one_line(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("sparse_scan.weights.write_npz_atomically", refuse)
    result = invoke("run", TINY, "--random", "2", "--out", tmp_path / "g.npz")
    one_line_error(result, "--out", "cannot write: Permission denied")


def test_run_inputs_that_float32_cannot_hold_or_that_overflow_the_forward(tmp_path):
    shape = (1, 8, 8)
    np.save(tmp_path / "big.npy", np.full((2,) + shape, 1e39))
    one_line_error(invoke("run", TINY, "--input", tmp_path / "big.npy"), "--input", "too large for float32")
    np.save(tmp_path / "empty.npy", np.zeros((0,) + shape))
    one_line_error(invoke("run", TINY, "--input", tmp_path / "empty.npy"), "--input", "no samples")
    np.save(tmp_path / "x.npy", np.ones((2,) + shape))
    np.save(tmp_path / "g.npy", np.full((2, 10), 1e300))
    one_line_error(invoke("run", TINY, "--input", tmp_path / "x.npy", "--grad", tmp_path / "g.npy"),
                   "--grad", "finite")
    # an input that float32 holds, and a forward that overflows it: 4 * 3e38
    np.savez(tmp_path / "w.npz", **{"fc.weight": np.ones((2, 4)), "fc.bias": np.zeros(2)})
    spec = tmp_path / "sum.yaml"
    spec.write_text("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n")
    np.save(tmp_path / "huge.npy", np.full((2, 4), 3e38))
    one_line_error(invoke("run", spec, "--input", tmp_path / "huge.npy"), "layer 'fc'", "float32 overflow",
                   "float64")


@pytest.mark.parametrize("option", ["--input", "--grad", "--labels"])
@pytest.mark.parametrize("content, fragment", [
    ("npz", "an .npz archive; give one array as .npy"),
    ("text", "not a .npy file (no NumPy header"),
    ("empty", "not a .npy file (empty)"),
    ("objects", "holds Python objects"),
])
def test_array_files_that_are_not_one_npy_array(tmp_path, option, content, fragment):
    bad = tmp_path / "bad.npy"
    if content == "npz":
        with bad.open("wb") as stream:
            np.savez(stream, x=np.zeros((2, 1, 8, 8), np.float32))
    elif content == "text":
        bad.write_text("0 1 2 3\n")
    elif content == "empty":
        bad.write_bytes(b"")
    else:
        np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    source = ["--input", bad] if option == "--input" else ["--random", "2", option, bad]
    before = sorted(tmp_path.iterdir())
    one_line_error(invoke("run", TINY, *source, "--out", tmp_path / "g.npz"), option, str(bad), fragment)
    assert sorted(tmp_path.iterdir()) == before


def test_an_npz_named_as_such_is_refused_too(tmp_path):
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 1, 8, 8), np.float32))
    one_line_error(invoke("run", TINY, "--input", tmp_path / "x.npz"), "--input", "an .npz archive")


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("name", ["x.txt", "x", "x.npy"])
def test_out_must_name_an_npz(tmp_path, command, name):
    extra = ["--data", digits_like(tmp_path)] if command == "train" else ["--random", "2"]
    before = sorted(tmp_path.iterdir())
    one_line_error(invoke(command, TINY, *extra, "--out", tmp_path / name), "--out", "ending in .npz")
    assert sorted(tmp_path.iterdir()) == before


OUTPUTS = [("run", "--out", "g.npz"), ("flops", "--plot", "f.png"), ("train", "--out", "w.npz"),
           ("train", "--log", "loss.csv"), ("train", "--plot", "loss.png")]
"""Every output option of every command (``eval`` writes nothing)."""


def no_work(monkeypatch):
    """Make loading a model fail the test: what runs before it is the command's checks alone."""
    import sparse_scan

    def load_model(*args, **kwargs):
        raise AssertionError("the command started its work before refusing an output")

    monkeypatch.setattr(sparse_scan, "load_model", load_model)


def command_args(tmp_path, command):
    return {"run": ["--random", "2"], "flops": [], "train": ["--data", digits_like(tmp_path)]}[command]


@pytest.mark.parametrize("command, option, name", OUTPUTS)
@pytest.mark.parametrize("place, fragment", [
    ("under a file", "no such directory"),
    ("a name too long to create", "cannot write there: File name too long"),
])
def test_every_output_is_checked_writable_before_any_work(tmp_path, monkeypatch, command, option, name, place,
                                                          fragment):
    """A path that cannot be written is refused before the work, not after it (as root, a path under
    a regular file or a name over the filesystem's limit is what cannot be written)."""
    extra = command_args(tmp_path, command)
    (tmp_path / "file").write_text("a regular file")
    target = (tmp_path / "file" / name if place == "under a file"
              else tmp_path / ("x" * 250 + pathlib.Path(name).suffix))
    before = sorted(tmp_path.iterdir())
    no_work(monkeypatch)
    one_line_error(invoke(command, TINY, *extra, option, target), option, fragment)
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("command", ["flops", "train"])
def test_plot_without_matplotlib_is_refused_before_any_work(tmp_path, monkeypatch, command):
    extra = command_args(tmp_path, command)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    no_work(monkeypatch)
    before = sorted(tmp_path.iterdir())
    one_line_error(invoke(command, TINY, *extra, "--plot", tmp_path / "f.png", "--log" if command == "train"
                          else "--quiet", *([tmp_path / "loss.csv"] if command == "train" else [])),
                   "--plot needs matplotlib", "pip install 'sparse-scan[plot]'")
    assert sorted(tmp_path.iterdir()) == before
