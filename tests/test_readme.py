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
    assert "nvcc --ptx" in ci
    assert "make wheel-check" in [line.strip() for line in ci.splitlines()]
    assert os.access(REPO / ".ci" / "run", os.X_OK)


def test_readme_states_the_orientation_and_devices():
    assert "grad_in = JT @ grad_out" in README
    for device in ('"cpu"', '"gpu"', '"auto"'):
        assert device in README
    assert "pip install '.[gpu]'" in README
