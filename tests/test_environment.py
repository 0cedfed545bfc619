"""Every environment variable the package reads goes through one parser, sparse_scan/_environment.py,
and a value it does not understand is an error naming the variable, the value and what it accepts:
never "no limit" or "unset" without a word; on the command line, one line and exit code 2 (issue 47)."""

from __future__ import annotations

import pathlib
import re

import pytest
from click.testing import CliRunner

from sparse_scan import _environment, cpu_threads
from sparse_scan._environment import EnvironmentVariableError
from sparse_scan._sequential import default_memory_budget
from sparse_scan.cli import app
from sparse_scan.engine import cost

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "data" / "tiny.yaml"

READERS = {
    "SPARSE_SCAN_THREADS": (cpu_threads, [("8", 8), (" 2 ", 2)], ["0", "-1", "two", "2.5", "1e3"]),
    "SPARSE_SCAN_MAX_PLAN_SECONDS": (cost.max_plan_seconds, [("90", 90.0), ("1e3", 1e3), ("0.5", 0.5)],
                                     ["inf", "1e400", "-inf", "nan", "0", "-5", "soon"]),
    "SPARSE_SCAN_MEMORY_BUDGET": (default_memory_budget,
                                  [("4096", 4096), ("512M", 2**29), ("1.5GiB", 3 * 2**29), ("2tb", 2**41)],
                                  ["lots", "-1G", "0", "0.1", "1e9", "9" * 400 + "T"]),
}
"""Variable -> (what reads it, (value, what it gives) accepted, values refused)."""


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_reader_takes_its_values_and_refuses_the_rest(monkeypatch, name):
    reader, accepted, refused = READERS[name]
    for value, expected in accepted:
        monkeypatch.setenv(name, value)
        assert reader() == expected
    for value in refused:
        monkeypatch.setenv(name, value)
        with pytest.raises(EnvironmentVariableError, match=re.escape(f"{name}={value!r}: must be ")):
            reader()


def test_an_infinite_planning_limit_is_refused_not_taken_as_none(monkeypatch):
    for value in ("inf", "1e400", "Infinity"):
        monkeypatch.setenv(cost.PLAN_SECONDS_VARIABLE, value)
        with pytest.raises(ValueError, match="must be a finite number of seconds > 0"):
            cost.max_plan_seconds()
    monkeypatch.setenv(cost.PLAN_SECONDS_VARIABLE, "  ")  # blank: unset
    assert cost.max_plan_seconds() == cost.MAX_PLAN_SECONDS


def test_the_cuda_aware_flag_takes_its_documented_spellings_and_refuses_the_rest(monkeypatch):
    from sparse_scan.distributed import _transport

    for value in ("1", "true", "Yes", "ON"):
        monkeypatch.setenv(_transport.CUDA_AWARE_VARIABLE, value)
        assert _transport._cuda_aware_mpi() is True
    for value in ("0", "False", "no", "off"):
        monkeypatch.setenv(_transport.CUDA_AWARE_VARIABLE, value)
        assert _transport._cuda_aware_mpi() is False
    for value in ("abc", "2", "y"):
        monkeypatch.setenv(_transport.CUDA_AWARE_VARIABLE, value)
        with pytest.raises(EnvironmentVariableError,
                           match=f"SPARSE_SCAN_CUDA_AWARE_MPI='{value}': must be 1, true, yes or on"):
            _transport._cuda_aware_mpi()


def test_the_cost_model_variable_takes_defaults_or_a_file(monkeypatch, tmp_path):
    variable = cost.COST_MODEL_VARIABLE
    monkeypatch.setenv(variable, "defaults")
    assert _environment.COST_MODEL.read() == "defaults"
    (tmp_path / "c.json").write_text("{}")
    monkeypatch.setenv(variable, str(tmp_path / "c.json"))
    assert _environment.COST_MODEL.read() == tmp_path / "c.json"
    for value, why in ((tmp_path, "it is a directory"), (tmp_path / "none.json", "no such file")):
        monkeypatch.setenv(variable, str(value))
        with pytest.raises(EnvironmentVariableError, match=re.escape(f"{variable}={str(value)!r}: must be "
                                                                     f"'defaults' or a calibration file")
                           + f".*: {why}$"):
            _environment.COST_MODEL.read()


def test_the_cache_home_is_an_absolute_xdg_cache_home_or_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _environment.cache_home() == tmp_path
    assert cost.cache_path("cpu").parent == tmp_path / "sparse-scan"
    for ignored in ("", "relative/cache"):  # the XDG specification: a relative path is ignored
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert _environment.cache_home() == pathlib.Path.home() / ".cache"


@pytest.mark.parametrize("name, value", [
    ("SPARSE_SCAN_MAX_PLAN_SECONDS", "inf"), ("SPARSE_SCAN_MAX_PLAN_SECONDS", "1e400"),
    ("SPARSE_SCAN_CUDA_AWARE_MPI", "abc"), ("SPARSE_SCAN_THREADS", "two"),
    ("SPARSE_SCAN_MEMORY_BUDGET", "lots"), ("SPARSE_SCAN_COST_MODEL", "/no/such/calibration.json")])
def test_the_command_line_refuses_a_value_it_does_not_understand_in_one_line(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    accepts = next(variable.accepts for variable in _environment.VARIABLES if variable.name == name)
    why = ": no such file" if name == "SPARSE_SCAN_COST_MODEL" else ""
    for command in (["flops", str(TINY), "--quiet"], ["calibrate", "--show"]):
        result = CliRunner().invoke(app.main, command)
        assert result.exit_code == 2, result.output
        assert result.output == f"sparse-scan: error: {name}={value!r}: must be {accepts}{why}\n"


def _sources() -> list[pathlib.Path]:
    """The package's sources, cli/ included."""
    return [*REPO.joinpath("sparse_scan").rglob("*.py"), *REPO.joinpath("cli").glob("*.py")]


def test_every_variable_the_package_names_is_read_by_the_one_parser():
    named = set()
    for path in _sources():
        named |= set(re.findall(r"\bSPARSE_SCAN_[A-Z_]+\b", path.read_text(encoding="utf-8")))
    assert named == {variable.name for variable in _environment.VARIABLES}


READS_THE_ENVIRONMENT = {
    "sparse_scan/_environment.py": "the one parser",
    "sparse_scan/_host_kernels.py": "numba's own NUMBA_CACHE_DIR, and where numba caches (XDG_CACHE_HOME)",
    "sparse_scan/distributed/_mpi.py": "whether an MPI launcher started this process (its variables are set)",
    "cli/_options.py": "--threads writes SPARSE_SCAN_THREADS and the BLAS pool's variables",
}
"""The only sources that touch ``os.environ`` or ``os.getenv``, and why."""


def test_no_other_module_reads_the_environment():
    touching = sorted(path.relative_to(REPO).as_posix() for path in _sources()
                      if re.search(r"\bos\.(environ|getenv)\b|\bgetenv\(", path.read_text(encoding="utf-8")))
    assert touching == sorted(READS_THE_ENVIRONMENT)
