"""Bad command lines and files across `run`, `flops` and `train`: one line on stderr, exit code 2,
nothing the user gave overwritten, and no work started that a bad option would waste."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner
from limits import fails_rather_than_hangs

from sparse_scan import backend
from sparse_scan.cli import app

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / "data"
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
    ("under a file", "cannot write there: {tmp}/file is a regular file, not a folder"),
    ("in a missing folder", "no such directory {tmp}/missing"),
    ("a name too long to create", "cannot write there: File name too long"),
    ("a name too long to exist", "cannot write there: File name too long"),
    ("a symlink loop", "cannot write there: a symlink loop"),
])
def test_every_output_is_checked_writable_before_any_work(tmp_path, monkeypatch, command, option, name, place,
                                                          fragment):
    """A path that cannot be written is refused before the work, not after it, naming the true cause
    (as root, a path under a regular file or a name over the filesystem's limit is what cannot be
    written; a name of 300 characters was a traceback, issue 47)."""
    extra = command_args(tmp_path, command)
    (tmp_path / "file").write_text("a regular file")
    suffix = pathlib.Path(name).suffix
    (tmp_path / f"loop{suffix}").symlink_to(tmp_path / f"pool{suffix}")
    (tmp_path / f"pool{suffix}").symlink_to(tmp_path / f"loop{suffix}")
    target = {"under a file": tmp_path / "file" / name, "in a missing folder": tmp_path / "missing" / name,
              "a name too long to create": tmp_path / ("x" * 250 + suffix),
              "a name too long to exist": tmp_path / ("x" * 300 + suffix),
              "a symlink loop": tmp_path / f"loop{suffix}"}[place]
    fragment = fragment.format(tmp=tmp_path)
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


# --- issue 47 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "flops"])
def test_integer_inputs_the_dtype_does_not_hold_exactly_are_refused_not_rounded(tmp_path, command):
    x = np.zeros((2, 1, 8, 8), np.int64)
    x[1, 0, 2, 3] = 2**24 + 1  # float32 would make it 2**24
    np.save(tmp_path / "x.npy", x)
    one_line_error(invoke(command, TINY, "--input", tmp_path / "x.npy"),
                   f"--input {tmp_path / 'x.npy'}: holds integers float32 does not hold exactly (16777217 "
                   "would be 16777216 at index [1, 0, 2, 3]): give floats, or use float64")
    result = invoke(command, TINY, "--input", tmp_path / "x.npy", "--dtype", "float64", "--quiet")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command, option, name", OUTPUTS + [("calibrate", "--output", "c.json")])
def test_an_output_name_ending_in_a_slash_is_refused(tmp_path, monkeypatch, command, option, name):
    """``d.npz/`` names a folder: pathlib drops the slash, and a file d.npz was written (issue 47)."""
    extra = command_args(tmp_path, command) if command != "calibrate" else []
    no_work(monkeypatch)
    before = sorted(tmp_path.iterdir())
    one_line_error(invoke(command, *([TINY] if command != "calibrate" else []), *extra, option,
                          f"{tmp_path / name}/"), option, "ends in '/', a folder's name: give a file name")
    assert sorted(tmp_path.iterdir()) == before


@pytest.fixture
def small_budget(monkeypatch):
    """A memory budget of 1 MiB: every refusal is estimated, and what a regression would allocate is
    tens of megabytes at most."""
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "1M")


def test_a_batch_over_the_memory_budget_is_refused_before_it_is_allocated(tmp_path, small_budget):
    budget = "over the memory budget of 1.0 MiB (raise it with SPARSE_SCAN_MEMORY_BUDGET)"
    one_line_error(invoke("run", TINY, "--random", "100000"), "--random 100000: a batch of 100000 samples "
                   "(8.2 KiB each, the inputs, activations and gradients) with the model's parameters would "
                   "take ~798.8 MiB (estimated before allocating it)", budget)
    one_line_error(invoke("flops", TINY, "--random", "100000"), "--random 100000: a batch", budget)
    np.save(tmp_path / "x.npy", np.zeros((1000, 1, 8, 8), np.float32))
    one_line_error(invoke("run", TINY, "--input", tmp_path / "x.npy"),
                   f"--input {tmp_path / 'x.npy'}: a batch of 1000 samples", budget)
    for command in ("train", "eval"):
        one_line_error(invoke(command, TINY, "--data", digits_like(tmp_path), "--batch-size", "1000"),
                       "--batch-size 1000: a batch of 1000 samples", budget)
    assert invoke("run", TINY, "--random", "10", "--quiet").exit_code == 0  # what fits runs


def test_a_spec_over_the_memory_budget_is_one_line_naming_the_layer_and_the_field(tmp_path, small_budget):
    spec = tmp_path / "wide.yaml"
    spec.write_text("input_shape: [1, 8, 8]\ninit: {seed: 0}\nlayers:\n  - {type: flatten}\n"
                    "  - {name: fc, type: linear, out_features: 40000}\n")
    for command in ("run", "flops"):
        one_line_error(invoke(command, spec, *(["--random", "2"] if command == "run" else [])),
                       f"{spec}: layer 'fc' (layers[1]), field 'out_features': the model up to its 2,560,000 "
                       "parameters would take ~29.3 MiB", "SPARSE_SCAN_MEMORY_BUDGET")


@pytest.mark.parametrize("option", ["MODEL", "--input", "--grad", "--labels", "--weights", "--data"])
def test_a_named_pipe_is_refused_without_blocking(tmp_path, option):
    """Nobody writes to the pipe: reading it would block forever (issue 47); refused as weights: are."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    args = {"MODEL": ["run", pipe, "--random", "2"], "--input": ["run", TINY, "--input", pipe],
            "--grad": ["run", TINY, "--random", "2", "--grad", pipe],
            "--labels": ["run", TINY, "--random", "2", "--labels", pipe],
            "--weights": ["run", TINY, "--random", "2", "--weights", pipe],
            "--data": ["train", TINY, "--data", pipe]}[option]
    with fails_rather_than_hangs():
        result = invoke(*args)
    one_line_error(result, str(pipe), "not a regular file (a named pipe)")


@pytest.mark.parametrize("option", ["MODEL", "weights:", "--weights", "--input"])
def test_a_symlink_loop_is_called_one(tmp_path, option):
    loop = tmp_path / "loop.npz"
    loop.symlink_to(tmp_path / "back.npz")
    (tmp_path / "back.npz").symlink_to(loop)
    spec = tmp_path / "m.yaml"
    spec.write_text("input_shape: [1, 8, 8]\nweights: loop.npz\nlayers: [{type: relu}]\n")
    args = {"MODEL": [loop, "--random", "2"], "weights:": [spec, "--random", "2"],
            "--weights": [TINY, "--random", "2", "--weights", loop],
            "--input": [TINY, "--input", loop]}[option]
    one_line_error(invoke("run", *args), "a symlink loop")


@pytest.mark.parametrize("option", ["weights:", "--weights", "--data"])
def test_an_npz_member_that_is_no_array_is_one_line_naming_the_file_and_the_member(tmp_path, option):
    """A member without .npy came back as bytes: ``'bytes' object has no attribute 'dtype'`` (issue 47)."""
    path = tmp_path / "w.npz"
    np.savez(path, **{"conv1.bias": np.zeros(4, np.float32)})
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("fc.weight", b"not an array")
    spec = tmp_path / "m.yaml"
    spec.write_text("input_shape: [1, 8, 8]\nweights: w.npz\nlayers: [{type: relu}]\n")
    args = {"weights:": ["run", spec, "--random", "2"],
            "--weights": ["run", TINY, "--random", "2", "--weights", path],
            "--data": ["train", TINY, "--data", path]}[option]
    one_line_error(invoke(*args), str(path), "member 'fc.weight' is not an array (.npy)")


def fake_calibration(monkeypatch):
    """``calibrate`` without measuring: a fixed cost model (the refusals below come before it)."""
    from sparse_scan import calibration
    from sparse_scan.engine.cost import DEFAULTS, CostModel

    model = CostModel("cpu", 2, DEFAULTS["cpu"], "calibrated (fake)")
    monkeypatch.setattr(calibration, "calibrate", lambda device, repeats, progress: (model, []))


def test_calibrate_checks_its_output_before_measuring(tmp_path, monkeypatch):
    from sparse_scan import calibration

    def measure(*args, **kwargs):
        raise AssertionError("measured before the output was checked")

    monkeypatch.setattr(calibration, "calibrate", measure)
    (tmp_path / "file").write_text("a regular file")
    one_line_error(invoke("calibrate", "--output", tmp_path / "file" / "c.json"),
                   f"--output {tmp_path / 'file' / 'c.json'}: cannot write the calibration: "
                   f"{tmp_path / 'file'} is a regular file, not a folder")
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    one_line_error(invoke("calibrate", "--output", notes),
                   f"--output {notes}: exists and is not a calibration (use --force to overwrite)")
    assert notes.read_text() == '{"mine": true}'


def test_calibrate_rewrites_a_calibration_and_overwrites_another_file_with_force(tmp_path, monkeypatch):
    from sparse_scan.engine.cost import load

    fake_calibration(monkeypatch)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    assert invoke("calibrate", "--output", notes, "--force", "--quiet").exit_code == 0
    assert load(notes).source == "calibrated (fake)"
    assert invoke("calibrate", "--output", notes, "--quiet").exit_code == 0  # a calibration: rewritten


def _sweep():
    """tools/bad_input_sweep.py, the reviewer's sweep of issue 47's cases (loaded as test_readme loads
    tools/readme_figures.py)."""
    spec = importlib.util.spec_from_file_location("bad_input_sweep", REPO / "tools" / "bad_input_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SWEEP = _sweep()


@pytest.mark.parametrize("case", [case for case in SWEEP.CASES if case.isolated], ids=lambda case: case.name)
def test_what_blocked_or_took_gigabytes_is_one_line_in_a_bounded_process(tmp_path, case):
    """The issue's own cases that a regression would let block (a named pipe) or take gigabytes (a
    40000x40000 linear, a 1x30000x30000 input, --random 10000000, an alias bomb, /dev/zero): each in a
    process of its own with a timeout and an address-space limit (the sweep's), so that a regression
    fails here instead of taking the machine."""
    outcome = SWEEP.run_case(case, tmp_path)
    assert outcome.matched, outcome


def test_the_sweep_covers_every_command_line_item_of_the_issue():
    assert {case.item for case in SWEEP.CASES} >= {"3", "4", "7", "8", "9", "10", "12", "14", "15"}
