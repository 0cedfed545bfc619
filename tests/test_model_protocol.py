"""One model protocol (issue 35): both model kinds implement :class:`sparse_scan.model.Model` with the
same signatures, and the command line, :mod:`sparse_scan.flops` and training take a model, not a type.

Every command runs here on a model that answers the protocol's members only (:class:`ProtocolOnly`,
wrapping a loaded spec of each kind): a call of anything else, or a branch on the model's class (a
wrapper is neither class), fails the command. The sources of ``cli/``, ``sparse_scan/flops/`` and
``sparse_scan/train.py`` name neither model class.
"""

from __future__ import annotations

import ast
import inspect
import json
import pathlib
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import sparse_scan
from sparse_scan import Sequential, load_model
from sparse_scan.cli import app
from sparse_scan.model import Model, ModelPlan
from sparse_scan.recurrent import RecurrentClassifier

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / "data"
RECURRENT = """input_shape: [8, 1]
init: {seed: 0}
layers:
  - {name: rnn, type: gru, hidden_size: 6}
  - {name: head, type: linear, out_features: 3}
"""

MEMBERS = sorted({name for name in vars(Model) if not name.startswith("_")} | set(Model.__annotations__)
                 | {"__call__"})
"""The protocol's members: its methods and its attributes."""


class ProtocolOnly:
    """``model`` seen through the protocol alone: any other attribute raises AttributeError."""

    def __init__(self, model: Any) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "used", set())

    def __getattr__(self, name: str) -> Any:
        if name not in MEMBERS:
            raise AttributeError(f"{name!r} is not in the Model protocol")
        self.used.add(name)
        return getattr(self._model, name)

    def __call__(self, x: Any) -> Any:
        return self._model(x)


@pytest.fixture(params=["sequential", "recurrent"])
def kind(request, tmp_path):
    """``(kind, spec path, --data)`` of each model kind."""
    if request.param == "sequential":
        pytest.importorskip("sklearn")
        return request.param, DATA / "lenet5-digits.yaml", "digits"
    path = tmp_path / "gru.yaml"
    path.write_text(RECURRENT)
    return request.param, path, "bitstream:32:16"


def test_both_kinds_implement_the_protocol_with_the_same_signatures():
    for cls in (Sequential, RecurrentClassifier):
        for name in MEMBERS:
            member = getattr(Model, name, None)
            if not callable(member):
                continue
            want = inspect.signature(member).parameters
            got = inspect.signature(getattr(cls, name)).parameters
            assert [(p.name, p.kind, p.default) for p in got.values()] == [
                (p.name, p.kind, p.default) for p in want.values()], (cls.__name__, name)
    sequential, recurrent = load_model(DATA / "tiny.yaml"), load_model(DATA / "lstm-bitstream.yaml")
    for model in (sequential, recurrent):
        assert isinstance(model, Model) and isinstance(model.plan(batch=2), ModelPlan)
    assert sparse_scan.Model is Model


@pytest.mark.parametrize("command", ["run", "run-check", "flops", "train", "eval"])
def test_every_command_runs_a_model_through_the_protocol_alone(monkeypatch, tmp_path, kind, command):
    name, spec, data = kind
    seen: list[ProtocolOnly] = []
    real = sparse_scan.load_model

    def protocol_only(*args: Any, **kwargs: Any) -> ProtocolOnly:
        seen.append(ProtocolOnly(real(*args, **kwargs)))
        return seen[-1]

    monkeypatch.setattr(sparse_scan, "load_model", protocol_only)
    args = {"run": ["run", spec, "--random", "2", "--out", tmp_path / "g.npz"],
            "run-check": ["run", spec, "--random", "2", "--method", "blelloch", "--check"],
            "flops": ["flops", spec, "--method", "blelloch"],
            "train": ["train", spec, "--data", data, "--epochs", "1", "--compare-bp", "--out",
                      tmp_path / "w.npz"],
            "eval": ["eval", spec, "--data", data]}[command]
    result = CliRunner().invoke(app.main, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert seen and all(isinstance(model, ProtocolOnly) for model in seen)
    used = set().union(*(model.used for model in seen))
    assert used <= set(MEMBERS)
    if command == "run-check":
        reference = "layerwise" if report["method"] == "linear" else "linear"
        assert report["check"]["reference"] == (reference if name == "sequential" else "linear")
        assert report["check"]["max_rel_error"] < 1e-4 and {"check_reference", "check_backward"} <= used
    if command == "flops":
        assert report["totals"]["bp_flops"] == sum(2 * row["nnz"] * row.get("blocks", 1)
                                                   for row in report["layers"])
    if command == "train":
        assert report["iterations"] >= 1 and (tmp_path / "w.npz").exists()


def test_live_counts_refuse_a_recurrent_model_through_the_protocol(monkeypatch, tmp_path):
    path = tmp_path / "gru.yaml"
    path.write_text(RECURRENT)
    monkeypatch.setattr(sparse_scan, "load_model", lambda *a, **k: ProtocolOnly(load_model(*a, **k)))
    result = CliRunner().invoke(app.main, ["flops", str(path), "--random", "2"])
    assert result.exit_code == 2 and "recurrent model's blocks are dense" in result.output


def test_the_training_loop_trains_both_kinds_alike():
    """:func:`sparse_scan.train.train_iterations` on a sampled task and :func:`~sparse_scan.train.train`
    on its split: one loop, any model."""
    from sparse_scan.optim import Adam
    from sparse_scan.recurrent import GRU, Bitstream
    from sparse_scan.train import train, train_iterations

    data = Bitstream(steps=8, samples=48, seed=0)
    models = [Sequential(sparse_scan.layers.Flatten(), sparse_scan.layers.Linear(8, 10, rng=0),
                         input_shape=(8, 1)),
              RecurrentClassifier(GRU(1, 4, rng=0), classes=10, rng=1, input_shape=(8, 1))]
    for model in models:
        records = train_iterations(model, data, Adam(model, lr=1e-2), iterations=3, batch_size=16)
        assert [r["iteration"] for r in records] == [0, 1, 2]
        assert np.isfinite([r["loss"] for r in records]).all()
        records = train(model, data.split(16), Adam(model, lr=1e-2), epochs=1, batch_size=16)
        assert len(records) == 2 and 0 <= records[-1]["test_accuracy"] <= 1


def _named(path: pathlib.Path) -> set[str]:
    """The names and attributes a module's code (not its docstrings or comments) mentions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name.rpartition(".")[2] for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    return names


def test_the_cli_flops_and_training_name_no_model_class():
    sources = [*sorted((REPO / "cli").glob("*.py")), *sorted((REPO / "sparse_scan" / "flops").glob("*.py")),
               REPO / "sparse_scan" / "train.py"]
    found = {path.relative_to(REPO).as_posix(): sorted(_named(path) & {"Sequential", "RecurrentClassifier"})
             for path in sources}
    assert not {path: names for path, names in found.items() if names}
