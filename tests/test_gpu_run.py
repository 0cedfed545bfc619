"""``tools/gpu_run.sh`` fits the GPU time we get, and the GPU code of its benchmarks runs.

A lent GPU comes for calls of at most 10 minutes with at most 8 files back, so each part of the script
must plan its steps within ``TOTAL_S`` and write at most 8 files (``--dry-run`` lists both). Its
benchmarks have never run on a GPU: their GPU paths are run here through the CuPy stand-in at small
sizes, so that the first GPU call measures instead of crashing.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import STANDIN

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_run.sh"
MAX_FILES = 8


def dry_run(part: str) -> str:
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", part], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    return result.stdout


@pytest.mark.parametrize("part", ["one", "sanitizer"])
def test_each_part_fits_one_call_and_brings_back_at_most_eight_files(part):
    out = dry_run(part)
    planned, total = map(int, re.search(r"limits adding up to (\d+) s of TOTAL_S=(\d+) s", out).groups())
    assert planned <= total <= 480, out  # 2 minutes of margin in a 600 s call
    files = re.search(r"files \((\d+)\): (.*)", out)
    names = files.group(2).split()
    assert int(files.group(1)) == len(names) <= MAX_FILES
    written = set(re.findall(r"\$OUT/([\w$.-]+)", out))
    assert written <= set(names), written - set(names)
    assert all(re.fullmatch(r"[\w$.-]+", name) for name in names)  # names the device tool brings back


def test_part_one_runs_every_gpu_test_and_the_headline_benchmarks():
    out = dry_run("one")
    assert "pytest -m gpu" in out and " -k " not in out.split("tests ")[1].split("\n")[0]
    assert "bench/rnn.py --device gpu --steps 1000 --batches --gru" in out  # T = 1000, B = 16
    assert "bench/spgemm.py --device gpu" in out and "bench/scan.py --device gpu" in out


def test_an_unknown_part_is_a_usage_error():
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "everything"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


def run_on_standin(script: str, *args: str, cwd: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    result = subprocess.run([sys.executable, "-m", "cupy_standin", str(ROOT / "bench" / script), "--device",
                             "gpu", *args, "--json"], capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["machine"]["backend"] == "gpu" and report["machine"]["gpu"] == "CuPy stand-in (CPU)"
    return report


@pytest.mark.skipif(not STANDIN, reason="runs the benchmark through the CuPy stand-in")
def test_the_rnn_benchmark_runs_its_gpu_path(tmp_path):
    report = run_on_standin("rnn.py", "--steps", "12", "--batches", "--gru", "--no-jax", cwd=tmp_path)
    (row,) = report["rows"]
    assert (row["T"], row["B"]) == (12, 16) and row["linear"]["backward_s"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not STANDIN, reason="runs the benchmark through the CuPy stand-in")
def test_the_scan_benchmark_runs_its_gpu_path(tmp_path):
    """The pruned VGG-11 backward on the device for the schedules whose products stay small (about 12 s
    here; bench/spgemm.py's GPU path was run the same way, in 4 minutes: too long for CI)."""
    report = run_on_standin("scan.py", "--repeats", "1", "--no-dense", "--batch", "1", "--max-step-flops",
                            "1e7", cwd=tmp_path)
    ran = {(row["method"], row["levels"]) for row in report["rows"] if "backward_s" in row}
    assert {("linear", None), ("hybrid", 1)} <= ran
    assert all(row["max_rel_error_vs_linear"] < 1e-4 for row in report["rows"] if "backward_s" in row)
