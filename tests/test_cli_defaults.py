"""Default options work on every bundled model: `run` and `flops` choose a schedule (``--method
auto``) from estimates before building any product, plan within a bound of symbolic work (seconds, not
minutes), and say what they chose.

The bound is counted, not timed, so that no verdict depends on the machine's speed: the entries of
every pattern built (layers' JTs, residual blocks' JTs, products' results) and the multiply-adds
expanded by scalar symbolic products. The most any bundled spec needs with default options is
ResNet-20's 1.9e8 (its blocks' JTs; 4 s of planning on a quiet 2-core machine, resnet20-pruned 1.7e8
in 8 s); a schedule choice gone wrong costs 10-1000x that (resnet20-pruned's hybrid 2 expands 3.8e9
multiply-adds in 250 s).
"""

from __future__ import annotations

import json
import pathlib

import pytest
from click.testing import CliRunner

from sparse_scan import csr
from sparse_scan.cli import app
from sparse_scan.engine import products

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
SPECS = sorted(path.name for path in DATA.glob("*.yaml"))
SYMBOLIC_BOUND = 2.5e8
"""The most symbolic work (pattern entries plus expanded multiply-adds) default options may cost."""


def invoke(*args):
    return CliRunner().invoke(app.main, list(map(str, args)))


@pytest.fixture
def symbolic_work(monkeypatch):
    """Counts, while a test runs, the entries of every pattern built and the multiply-adds that
    scalar symbolic products expand (``engine.products._expand``): ``symbolic_work[0]``."""
    work = [0]
    expand, make_pattern = products._expand, csr.Pattern.__init__

    def counted_expand(a, b, row_start, row_stop):
        expanded = expand(a, b, row_start, row_stop)
        work[0] += len(expanded[2])
        return expanded

    def counted_pattern(self, *args, **kwargs):
        make_pattern(self, *args, **kwargs)
        work[0] += len(self.indices)

    monkeypatch.setattr(products, "_expand", counted_expand)
    monkeypatch.setattr(csr.Pattern, "__init__", counted_pattern)
    return work


def test_every_bundled_spec_is_covered():
    assert {"tiny.yaml", "lenet5.yaml", "lenet5-digits.yaml", "vgg11.yaml", "vgg11-pruned.yaml"} <= set(SPECS)


@pytest.mark.parametrize("spec", SPECS)
def test_run_with_default_options_succeeds_within_the_symbolic_bound(spec, symbolic_work):
    result = invoke("run", DATA / spec, "--random", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert symbolic_work[0] <= SYMBOLIC_BOUND
    schedule = report["schedule"]
    assert schedule["requested"] == "auto" and (schedule["method"], schedule["levels"]) == (
        report["method"], report["levels"])
    assert schedule["critical_flops"] > 0 and schedule["peak_bytes"] > 0


@pytest.mark.parametrize("spec", SPECS)
def test_flops_with_default_options_succeeds_within_the_symbolic_bound(spec, symbolic_work):
    result = invoke("flops", DATA / spec, "--json")
    assert result.exit_code == 0, result.output
    assert symbolic_work[0] <= SYMBOLIC_BOUND
    report = json.loads(result.output)
    assert report["schedule"]["critical_flops"] == report["totals"]["critical_flops"]
    assert report["totals"]["critical_flops"] <= report["totals"]["bp_flops"]


@pytest.mark.parametrize("command", ["run", "flops"])
def test_a_schedule_that_would_plan_for_hours_is_refused_from_the_estimate(monkeypatch, command,
                                                                         symbolic_work):
    """The Blelloch scan of ResNet-20-pruned needs a 1.1e12-FLOP product (a dense 16384x8192 by
    8192x4096 one): refused from the JTs' sizes, before any product is planned (about 8 s on a quiet
    2-core machine, its blocks' patterns; it used to plan for hours), naming the figure and the option
    to raise it."""
    from sparse_scan import _sequential as _model

    def build_plan(*args, **kwargs):
        raise AssertionError("a product was planned before the refusal")

    monkeypatch.setattr(_model, "build_plan", build_plan)
    extra = ["--random", "2", "--check"] if command == "run" else []
    result = invoke(command, DATA / "resnet20-pruned.yaml", "--method", "blelloch", *extra)
    assert result.exit_code == 2, result.output
    *progress, error = result.output.splitlines()  # progress: a line every 10 s, on a busy machine
    assert error.startswith("sparse-scan: error: ") and "error" not in "".join(progress), result.output
    assert ("the product of layers 'layer2.0'..'layer2.1.relu_out' and layers "
            "'layer2.2'..'layer3.0.relu_out', needs ~1.1e+12 FLOPs (estimated from the JTs' sizes, before "
            "building anything), over the limit of 10000000000 (raise --max-step-flops") in error
    assert symbolic_work[0] <= SYMBOLIC_BOUND
