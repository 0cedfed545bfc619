"""``sparse-scan flops``: static analysis through the CLI, its JSON contract and its errors."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from sparse_scan import load_model
from sparse_scan.cli import app

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def invoke(*args):
    return CliRunner().invoke(app.main, ["flops", *map(str, args)])


def test_json_contract_on_the_tiny_model():
    result = invoke(DATA / "tiny.yaml", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [layer["name"] for layer in report["layers"]] == [
        "conv1", "relu1", "pool1", "conv2", "tanh2", "flat", "fc"]
    for layer in report["layers"]:
        assert set(layer) == {"name", "type", "shape", "nnz", "sparsity", "csr_bytes", "dense_bytes"}
    assert {"level", "phase", "kind", "mnk", "flops", "critical"} <= set(report["steps"][0])
    assert set(report["totals"]) >= {"bp_flops", "critical_flops", "work_flops", "peak_bytes"}
    # every level has exactly one critical step, the costliest; critical FLOPs are their sum
    levels = {step["level"] for step in report["steps"]}
    critical = [step for step in report["steps"] if step["critical"]]
    assert sorted(step["level"] for step in critical) == sorted(levels)
    for step in critical:
        assert step["flops"] == max(s["flops"] for s in report["steps"] if s["level"] == step["level"])
    assert sum(step["flops"] for step in critical) == report["totals"]["critical_flops"]
    assert report["totals"]["work_flops"] == sum(step["flops"] for step in report["steps"])
    # BP: one SpMV per layer, 2 FLOPs per JT non-zero; the linear scan is exactly that
    linear = json.loads(invoke(DATA / "tiny.yaml", "--json", "--method", "linear").output)
    assert linear["totals"]["critical_flops"] == linear["totals"]["bp_flops"] == sum(
        2 * layer["nnz"] for layer in report["layers"])


def test_vgg11_shows_the_papers_table_1():
    result = invoke(DATA / "vgg11.yaml", "--method", "linear", "--json")
    assert result.exit_code == 0, result.output
    layers = {layer["name"]: layer for layer in json.loads(result.output)["layers"]}
    assert round(layers["conv1"]["sparsity"], 5) == 0.99157 and layers["conv1"]["nnz"] == 1_696_512
    assert round(layers["relu1"]["sparsity"], 5) == 0.99998
    assert round(layers["pool1"]["sparsity"], 5) == 0.99994
    assert layers["conv1"]["dense_bytes"] == 768 * 2**20
    table = invoke(DATA / "vgg11.yaml", "--method", "linear").output
    assert "conv1" in table and "0.99157" in table and "BP FLOPs" in table


@pytest.mark.parametrize("levels", [["--levels", "auto"], []])
def test_hybrid_auto_reports_the_chosen_depth(levels):
    # hybrid without --levels chooses its depth, like --levels auto
    result = invoke(DATA / "lenet5.yaml", "--method", "hybrid", *levels, "--json")
    report = json.loads(result.output)
    model = load_model(DATA / "lenet5.yaml")
    assert report["levels"] == model.plan(model.input_shape, "hybrid", "auto").levels
    schedule = report["schedule"]
    assert schedule["requested"] == "hybrid" and schedule["method"] == "hybrid"
    # every depth once: LeNet-5's 12 layers have depth 4, and hybrid 3 is already blelloch's schedule
    assert [c["levels"] for c in schedule["candidates"]] == [0, 1, 2, 3]
    assert [c["verdict"] for c in schedule["candidates"]].count("chosen") == 1
    text = invoke(DATA / "lenet5.yaml", "--method", "hybrid", *levels).output
    assert f"schedule: hybrid {report['levels']} (depth chosen by --method hybrid" in text


def test_default_method_chooses_a_schedule_and_says_why():
    report = json.loads(invoke(DATA / "lenet5.yaml", "--json").output)
    schedule = report["schedule"]
    assert (report["method"], report["levels"]) == (schedule["method"], schedule["levels"])
    assert schedule["requested"] == "auto" and "least predicted time" in schedule["reason"]
    assert schedule["critical_flops"] == report["totals"]["critical_flops"]
    assert {"peak_bytes", "plan_bytes", "work_flops"} <= set(schedule)
    labels = [(c["method"], c["levels"]) for c in schedule["candidates"]]
    assert labels == [("linear", None), ("hybrid", 1), ("hybrid", 2), ("blelloch", None)]
    chosen = [c for c in schedule["candidates"] if c["verdict"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["critical_flops"] == schedule["critical_flops"]
    built = [c for c in schedule["candidates"] if not c["estimated"]]
    assert chosen[0]["predicted_s"] == min(c["predicted_s"] for c in built) == schedule["predicted_s"]
    for candidate in schedule["candidates"]:
        assert candidate["verdict"] in ("chosen", "built") or candidate["verdict"].startswith("not built")
    text = invoke(DATA / "lenet5.yaml").output
    assert "schedule: linear (chosen by --method auto: the least predicted time for batch 1 on the cpu" \
        in text
    assert "blelloch   critical path ~" in text and ", predicted ~" in text


def test_an_explicit_method_says_so():
    report = json.loads(invoke(DATA / "tiny.yaml", "--method", "blelloch", "--json").output)
    assert report["method"] == "blelloch" and report["schedule"]["reason"] == "as requested"
    assert "candidates" not in report["schedule"]


@pytest.mark.parametrize("args, fragment", [
    (["nope.yaml"], "nope.yaml: no such file"),
    ([DATA / "tiny.yaml", "--method", "hybrid", "--levels", "9"], "levels in 0..3"),
    ([DATA / "tiny.yaml", "--method", "hybrid", "--levels", "many"], "--levels must be"),
    ([DATA / "tiny.yaml", "--levels", "1"], "levels applies to method='hybrid' only"),
    ([DATA / "vgg11-pruned.yaml", "--method", "blelloch", "--max-step-flops", "1e6"],
     "over the limit of 1000000"),
    ([DATA / "tiny.yaml", "--method", "auto", "--levels", "1"], "levels applies to method='hybrid' only"),
])
def test_errors_are_one_line_with_exit_2(args, fragment):
    result = invoke(*args)
    assert result.exit_code == 2
    assert fragment in result.output and result.output.count("\n") == 1
    assert "Traceback" not in result.output


def test_plot_never_overwrites_without_force(tmp_path):
    target = tmp_path / "fig.png"
    target.write_bytes(b"keep me")
    result = invoke(DATA / "tiny.yaml", "--plot", target)
    assert result.exit_code == 2 and "exists" in result.output
    assert target.read_bytes() == b"keep me"


def test_plot_draws_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "fig.png"
    result = invoke(DATA / "tiny.yaml", "--plot", target)
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_installed_command_runs_as_a_subprocess():
    command = shutil.which("sparse-scan")
    if command is None:
        pytest.skip("the sparse-scan entry point is not on PATH")
    done = subprocess.run([command, "flops", str(DATA / "tiny.yaml"), "--json"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["totals"]["bp_flops"] > 0


def test_live_options_only_add_to_the_static_output():
    # without --input/--random the output is the static analysis alone; with them, the same then more
    static_text = invoke(DATA / "tiny.yaml", "--method", "blelloch").output
    static_json = json.loads(invoke(DATA / "tiny.yaml", "--method", "blelloch", "--json").output)
    assert "live" not in static_json and "live FLOPs on" not in static_text
    text = invoke(DATA / "tiny.yaml", "--method", "blelloch", "--random", "3")
    assert text.exit_code == 0, text.output
    assert text.output.startswith(static_text.rstrip("\n") + "\n\nlive FLOPs on 3 samples, convention ours")
    assert "BPPSA critical FLOPs   static" in text.output
    report = json.loads(invoke(DATA / "tiny.yaml", "--method", "blelloch", "--random", "3", "--json").output)
    live = report.pop("live")
    assert report == static_json
    assert live["convention"] == "ours" and live["samples"] == 3
    assert [step["static"] for step in live["steps"]] == [step["flops"] for step in static_json["steps"]]
    assert live["totals"]["critical_flops"]["static"] == static_json["totals"]["critical_flops"]
    for step in live["steps"]:
        assert len(step["live"]["samples"]) == 3 and step["live"]["max"] <= step["static"]


def test_input_file_equals_the_same_random_batch(tmp_path):
    import numpy as np

    shape = load_model(DATA / "tiny.yaml").input_shape
    x = np.random.default_rng(5).standard_normal((2,) + shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    args = (DATA / "tiny.yaml", "--method", "hybrid", "--levels", "1", "--convention", "paper", "--json")
    from_file = json.loads(invoke(*args, "--input", tmp_path / "x.npy").output)["live"]
    from_seed = json.loads(invoke(*args, "--random", "2", "--seed", "5").output)["live"]
    assert from_file == from_seed and from_file["convention"] == "paper"
    assert all(step["phase"] != "final" for step in from_file["steps"])


def test_conventions_match_the_library():
    from sparse_scan.cli.flops import CONVENTIONS
    from sparse_scan.flops import CONVENTIONS as LIBRARY

    assert CONVENTIONS == LIBRARY


def test_live_plot_draws_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "fig.png"
    result = invoke(DATA / "tiny.yaml", "--random", "2", "--plot", target)
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_live_input_errors_are_one_line_with_exit_2(tmp_path):
    import numpy as np

    np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 4), np.float32))
    np.save(tmp_path / "nan.npy", np.full((1,) + load_model(DATA / "tiny.yaml").input_shape, np.nan))
    (tmp_path / "text.npy").write_text("1 2 3")
    cases = [
        (["--random", "2", "--input", tmp_path / "wrong.npy"],
         "give at most one of --input X.npy and --random N"),
        (["--convention", "paper"],
         "--convention applies to the live figures: give --input X.npy or --random N"),
        (["--input", tmp_path / "wrong.npy"], "wrong.npy: shape [2, 3, 4], the model takes (N, "),
        (["--input", tmp_path / "nan.npy"], "nan.npy: holds NaN or Inf"),
        (["--input", tmp_path / "text.npy"], "text.npy: not a .npy file"),
        (["--input", tmp_path / "missing.npy"], f"--input {tmp_path / 'missing.npy'}: no such file"),
        (["--random", "0"], "--random"),
        (["--random", "1", "--convention", "artifact"], "--convention"),
    ]
    for args, fragment in cases:
        result = invoke(DATA / "tiny.yaml", *args)
        assert result.exit_code == 2, (args, result.output)
        assert fragment in result.output and result.output.count("\n") == 1, (args, result.output)
        assert "Traceback" not in result.output


def test_a_recurrent_spec_reports_its_plan_and_refuses_live_counts():
    result = invoke(DATA / "lstm-bitstream.yaml", "--method", "blelloch", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    plan = load_model(DATA / "lstm-bitstream.yaml").plan((1000, 1), "blelloch", batch=1)
    assert report["method"] == "blelloch" and report["layers"][0]["blocks"] == 1000
    assert report["totals"] == {key: value for key, value in plan.report(1, 4)["totals"].items()
                                if key != "plan_bytes"} | {"bp_flops": 2 * 1000 * 40**2}
    refused = invoke(DATA / "lstm-bitstream.yaml", "--random", "2")
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1
    assert "recurrent model's blocks are dense" in refused.output
