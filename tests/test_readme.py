"""README.md: its Python examples run against the real API, and its commands are the ones used.

Every fenced ```python block is executed in a fresh namespace, so the documented usage cannot drift
from the library. The set-up commands it gives must be Makefile targets, and CI (.ci/run) must run
the README's test command verbatim.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(language):
    return [body for lang, body in FENCE.findall(README) if lang == language]


def setup_commands():
    """The commands of README's ```bash block(s), comments stripped."""
    commands = []
    for body in blocks("bash"):
        for line in body.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def test_readme_has_python_examples():
    assert blocks("python"), "README.md has no ```python block"


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_example_runs(index, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for optional in ("torch", "sklearn"):  # the PyTorch examples run where PyTorch is installed (CI)
        if re.search(rf"^(import|from) .*\b{optional}\b", blocks("python")[index], re.MULTILINE):
            pytest.importorskip(optional)
    code = compile(blocks("python")[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": "__readme__"})
    assert capsys.readouterr().err == ""


def test_setup_commands_are_make_targets():
    commands = setup_commands()
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    for command in commands:
        assert command.split()[1] in targets
    assert {"install", "test", "test-gpu", "bench", "lint", "wheel-check", "demo"} <= targets


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    test_command = [c for c in setup_commands() if "test" in c]
    assert test_command == ["make test"]
    assert test_command[0] in [line.strip() for line in ci.splitlines()]
    assert ci.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in ci
    assert "torch==2.13.0" in ci
    assert "python tools/check_kernels.py --arch 80 --arch 90" in [line.strip() for line in ci.splitlines()]
    assert "make test-gpu-standin" in [line.strip() for line in ci.splitlines()]
    assert "make wheel-check" in [line.strip() for line in ci.splitlines()]
    assert os.access(REPO / ".ci" / "run", os.X_OK)


def test_readme_states_the_orientation_and_devices():
    assert "grad_in = JT @ grad_out" in README
    for device in ('"cpu"', '"gpu"', '"auto"'):
        assert device in README
    assert "pip install '.[gpu]'" in README


def console_commands(prefix):
    """The ``$ `` commands of README's ```console blocks that start with ``prefix``."""
    return [line[2:] for body in blocks("console") for line in body.splitlines()
            if line.startswith("$ " + prefix)]


def test_the_readme_train_command_reaches_the_stated_accuracy(tmp_path):
    """README's training example, run as written but for 6 epochs (of its 10) and files in tmp_path,
    reaches the test accuracy the README states (at least 90 %)."""
    import json
    import shlex

    from click.testing import CliRunner

    from sparse_scan.cli import app

    pytest.importorskip("sklearn")
    [command] = console_commands("sparse-scan train ")
    assert "at least 90 %" in README or "over 90 % test accuracy" in README
    args = shlex.split(command)[1:]
    for option in ("--out", "--log", "--plot"):
        if option in args:
            index = args.index(option) + 1
            args[index] = str(tmp_path / pathlib.Path(args[index]).name)
    if "--plot" in args:
        pytest.importorskip("matplotlib")
    args = [str(REPO / a) if a.startswith("data/") else a for a in args]
    result = CliRunner().invoke(app.main, args + ["--epochs", "6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["final"]["test_accuracy"] >= 0.90
    assert report["epochs"] == 6 and len(report["per_epoch"]) == 6


def readme_figures():
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_figures", REPO / "tools" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_training_accuracy_the_readme_quotes_has_its_command_in_the_reproduction_script():
    """tools/readme_figures.py runs README's training commands and compares the accuracies README
    quotes (fixed seeds, 1 and 2 threads); this keeps its list and README.md in step: each command
    and figure it checks is README's, and every "N % test accuracy" README states for a command of
    its own is one of them (bench/train_resnet20.py reproduces the figure of its own section)."""
    figures = readme_figures().FIGURES
    prose = " ".join(README.split())
    quoted = set()
    for command, by_epoch in figures.values():
        assert command in prose or command in console_commands("sparse-scan train "), command
        quoted |= {f"{accuracy:.1f}" for accuracy in by_epoch.values()}
        assert all(f"{accuracy:.1f} %" in prose for accuracy in by_epoch.values()), (command, by_epoch)
    stated = set(re.findall(r"(\d+\.\d) % test accuracy", prose))
    assert stated and stated - {"34.7"} <= quoted, stated - quoted


def test_the_readme_example_writes_its_files_where_git_ignores_them():
    """README's training example writes runs/weights.npz, runs/loss.csv and runs/loss.png: runs/ is
    ignored, and the example makes it first."""
    [command] = console_commands("sparse-scan train ")
    outputs = [arg for arg in command.split() if arg.startswith("runs/")]
    assert len(outputs) == 3 and console_commands("mkdir -p runs")
    assert "/runs/" in (REPO / ".gitignore").read_text().splitlines()
