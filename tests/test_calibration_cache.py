"""The cached calibration: one that cannot be used (damaged, non-finite constants, another device's, a
directory) is named once, in one line, and the run uses the defaults, saying so; the same file named
by SPARSE_SCAN_COST_MODEL is refused (issue 47, items 6 and 13)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sparse_scan.cli import app
from sparse_scan.engine import cost
from sparse_scan.engine.cost import DEFAULTS, CostModel, cache_path, current, load, save

TINY = pathlib.Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The calibration cache of the CPU, in tmp_path, read by the runs (not the tests' defaults)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cost.COST_MODEL_VARIABLE)
    path = cache_path("cpu")
    path.parent.mkdir(parents=True)
    return path


def _calibration(**changes: object) -> str:
    """A calibration file's text, with ``changes`` to its fields (``call=...``: a constant)."""
    fields = CostModel("cpu", 2, DEFAULTS["cpu"], "a test").as_dict()
    for name, value in changes.items():
        (fields["seconds"] if name in fields["seconds"] else fields)[name] = value
    return json.dumps(fields)


BROKEN = {  # file text -> what the message says is wrong
    "not-json": ("{not json", "Expecting property name"),
    "infinity": (_calibration(call=float("inf")), "seconds.call: Infinity, not a finite number >= 0"),
    "nan": (_calibration(level=float("nan")), "seconds.level: NaN, not a finite number >= 0"),
    "overflow": (_calibration().replace('"call": ', '"call": 1e999, "x": ', 1), "seconds.call: Infinity"),
    "negative": (_calibration(mv_spmv=-1e-9), "seconds.mv_spmv: -1e-09, not a finite number >= 0"),
    "a-string": (_calibration(fill="fast"), 'seconds.fill: "fast", not a finite number'),
    "threads": (_calibration(threads=0), "threads: 0, not an int >= 1"),
    "device": (_calibration(device="tpu"), 'device: "tpu", not one of cpu, gpu'),
    "unknown": (_calibration().replace('"call": ', '"warp_speed": 1.0, "call": ', 1),
                "unknown features ['warp_speed']"),
    "array": ("[1, 2]", "not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.filterwarnings("always")  # once is the cache's own doing, not the warning filter's
def test_a_broken_cache_is_named_once_and_the_defaults_used(cache, case):
    text, says = BROKEN[case]
    cache.write_text(text, encoding="utf-8")
    with pytest.warns(RuntimeWarning) as caught:
        assert current("cpu").source == "defaults"
        assert current("cpu").source == "defaults"  # the same problem again: not said again
    assert len(caught) == 1
    assert str(cache) in str(caught[0].message) and says in str(caught[0].message)
    assert "until `sparse-scan calibrate` rewrites it" in str(caught[0].message)


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_the_same_file_chosen_by_the_variable_is_refused(monkeypatch, tmp_path, case):
    text, says = BROKEN[case]
    (tmp_path / "c.json").write_text(text, encoding="utf-8")
    monkeypatch.setenv(cost.COST_MODEL_VARIABLE, str(tmp_path / "c.json"))
    with pytest.raises(ValueError, match="not a sparse-scan calibration file") as refused:
        current("cpu")
    assert says in str(refused.value)


@pytest.mark.filterwarnings("always")
def test_a_cache_of_another_device_is_not_used(cache, monkeypatch, tmp_path):
    save(CostModel("gpu", 64, DEFAULTS["gpu"], "a gpu's"), cache)
    with pytest.warns(RuntimeWarning, match="a calibration of the gpu, not of the cpu"):
        model = current("cpu")
    assert (model.device, model.source) == ("cpu", "defaults")
    monkeypatch.setenv(cost.COST_MODEL_VARIABLE, str(cache))
    with pytest.raises(ValueError, match="SPARSE_SCAN_COST_MODEL='.*': a calibration of the gpu; this run "
                                         "is on the cpu"):
        current("cpu")
    assert current("gpu").source == "a gpu's"


@pytest.mark.filterwarnings("always")
def test_a_directory_where_the_cache_should_be_is_named(cache):
    cache.mkdir()
    with pytest.warns(RuntimeWarning, match="a directory, not a sparse-scan calibration file; auto uses the "
                                            "default cost model until it is removed"):
        assert current("cpu").source == "defaults"
    with pytest.raises(ValueError, match="a directory"):
        load(cache)


def test_a_good_cache_is_used_and_said(cache):
    save(CostModel("cpu", 3, (("call", 1e-3),), "calibrated in a test"), cache)
    assert current("cpu").source == "calibrated in a test"
    result = CliRunner().invoke(app.main, ["flops", str(TINY), "--quiet"])
    assert result.exit_code == 0 and "cost model: calibrated in a test" in result.output


@pytest.mark.filterwarnings("always")
def test_the_command_line_says_which_cost_model_it_used(cache):
    save(CostModel("gpu", 64, DEFAULTS["gpu"], "a gpu's"), cache)
    result = CliRunner().invoke(app.main, ["run", str(TINY), "--random", "2", "--method", "auto"])
    assert result.exit_code == 0, result.output
    assert "on the cpu (cost model: defaults)" in result.stdout and "gpu" not in result.stdout
    assert result.stderr == (f"sparse-scan: warning: {cache}: a calibration of the gpu, not of the cpu; auto "
                             "uses the default cost model until `sparse-scan calibrate` rewrites it\n")


def test_a_damaged_cache_is_one_line_once_in_a_real_run(cache):
    """Python's own warning format, with its source lines, in a process of its own (issue 47, item 13:
    three RuntimeWarnings, each with its source line, before)."""
    cache.write_text("{damaged", encoding="utf-8")
    env = {name: value for name, value in os.environ.items() if name != cost.COST_MODEL_VARIABLE}
    done = subprocess.run([sys.executable, "-m", "sparse_scan.cli", "run", str(TINY), "--random", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"sparse-scan: warning: {cache}: not a sparse-scan calibration file "
                                        "(Expecting property name enclosed in double quotes: line 1 column 2 "
                                        "(char 1)); auto uses the default cost model until `sparse-scan "
                                        "calibrate` rewrites it"]
