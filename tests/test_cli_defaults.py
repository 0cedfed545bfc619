"""Default options work on every bundled model: `run` and `flops` choose a schedule (``--method
auto``) from estimates before building any product, plan in seconds, and say what they chose."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
from click.testing import CliRunner

from sparse_scan.cli import app

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
SPECS = sorted(path.name for path in DATA.glob("*.yaml"))
PLAN_SECONDS = 10.0


def invoke(*args):
    return CliRunner().invoke(app.main, list(map(str, args)))


def test_every_bundled_spec_is_covered():
    assert {"tiny.yaml", "lenet5.yaml", "lenet5-digits.yaml", "vgg11.yaml", "vgg11-pruned.yaml"} <= set(SPECS)


@pytest.mark.parametrize("spec", SPECS)
def test_run_with_default_options_succeeds_and_plans_in_seconds(spec):
    result = invoke("run", DATA / spec, "--random", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["timings"]["plan_s"] < PLAN_SECONDS
    schedule = report["schedule"]
    assert schedule["requested"] == "auto" and (schedule["method"], schedule["levels"]) == (
        report["method"], report["levels"])
    assert schedule["critical_flops"] > 0 and schedule["peak_bytes"] > 0


@pytest.mark.parametrize("spec", SPECS)
def test_flops_with_default_options_succeeds_in_seconds(spec):
    start = time.perf_counter()
    result = invoke("flops", DATA / spec, "--json")
    assert time.perf_counter() - start < PLAN_SECONDS
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["schedule"]["critical_flops"] == report["totals"]["critical_flops"]
    assert report["totals"]["critical_flops"] <= report["totals"]["bp_flops"]
