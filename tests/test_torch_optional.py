"""The tests that import every module leave out only what needs PyTorch in sparse_scan/torch/ where it
is missing (tests/torch_optional.py): torch imported anywhere else still fails them (issue 47)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch_optional


@pytest.fixture
def no_torch(monkeypatch, tmp_path):
    """``import torch`` fails as it does where PyTorch is not installed; tmp_path is importable, its
    ``front/`` standing for sparse_scan/torch/."""
    monkeypatch.setitem(sys.modules, "torch", None)  # ModuleNotFoundError: import of torch halted
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch_optional, "FRONT_DOOR", tmp_path / "front")
    for package in ("front", "engine"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "uses_torch.py").write_text("import os\nimport torch\n")
    return tmp_path


def test_a_front_door_module_that_needs_the_missing_torch_is_left_out(no_torch):
    assert torch_optional.import_module("front.uses_torch") is None


def test_torch_imported_anywhere_else_fails(no_torch):
    with pytest.raises(ModuleNotFoundError, match="torch"):
        torch_optional.import_module("engine.uses_torch")
    with pytest.raises(ModuleNotFoundError, match="nonexistent"):
        torch_optional.import_module("front.nonexistent")


def test_the_bridge_is_left_out_without_torch_and_its_names_are_missing(monkeypatch, no_torch):
    import sparse_scan.torch as front

    monkeypatch.setattr(torch_optional, "FRONT_DOOR", pathlib.Path(front.__file__).resolve().parent)
    monkeypatch.delitem(sys.modules, "sparse_scan.torch._bridge", raising=False)
    for name in ("_bridge", "bppsa"):  # not getattr: that would load them
        monkeypatch.delitem(vars(front), name, raising=False)
    assert torch_optional.import_module("sparse_scan.torch._bridge") is None
    assert torch_optional.resolve(front, "bppsa") is torch_optional.MISSING
    assert torch_optional.resolve(front, "nope", None) is None


def test_ci_runs_the_torch_free_part_before_it_installs_torch():
    """So that the suite's verdict without PyTorch (README: optional) cannot go wrong unseen again."""
    ci = pathlib.Path(__file__).parents[1] / ".ci" / "run"
    lines = [line.strip() for line in ci.read_text().splitlines()]
    install = lines.index("python -m pip install --quiet torch==2.13.0")
    before = "\n".join(lines[:install])
    assert "make install" in lines[:install] and "python -m pytest --collect-only -q" in before
    for test in ("test_docstrings", "test_layout", "test_namespace", "test_imports", "test_torch_optional"):
        assert f"tests/{test}.py" in before
    assert "grep -lE 'sparse_scan\\.torch|export_torch|bppsa' tests/test_*.py" in before
