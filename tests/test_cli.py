"""The ``sparse-scan`` click group: help, version, room for subcommands, and the layout of ``cli/``
(the library's public API only, no import loop, no function-level import of a sibling module)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import click
import pytest
from click.testing import CliRunner

import sparse_scan
from sparse_scan.cli import app


@pytest.fixture
def runner():
    return CliRunner()


def test_version_prints_package_version(runner):
    result = runner.invoke(app.main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"sparse-scan {sparse_scan.__version__}\n"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_flags(runner, flag):
    result = runner.invoke(app.main, [flag])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: ")
    assert "BPPSA" in result.output
    assert "--version" in result.output
    assert "-h, --help" in result.output


def test_bare_invocation_shows_usage(runner):
    result = runner.invoke(app.main, [])
    # click >= 8.2 exits 2 when a group gets no command, older releases 0; both print the help.
    assert result.exit_code in (0, 2)
    assert "Usage: " in result.output


def test_unknown_command_is_a_usage_error(runner):
    result = runner.invoke(app.main, ["no-such-command"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_main_is_an_extensible_group(runner):
    assert isinstance(app.main, click.Group)
    assert "main" in app.__all__
    assert app.main.list_commands(click.Context(app.main)) == ["calibrate", "eval", "flops", "run", "train"]

    @click.command("probe")
    def probe():
        click.echo("probe ran")

    app.main.add_command(probe)
    try:
        result = runner.invoke(app.main, ["probe"])
        assert result.exit_code == 0, result.output
        assert result.output == "probe ran\n"
        assert "probe" in runner.invoke(app.main, ["--help"]).output
    finally:
        app.main.commands.pop("probe")


def test_subcommands_inherit_short_help_flag(runner):
    @click.command("probe")
    def probe():
        """Probe help text."""

    app.main.add_command(probe)
    try:
        result = runner.invoke(app.main, ["probe", "-h"])
        assert result.exit_code == 0, result.output
        assert "Probe help text." in result.output
    finally:
        app.main.commands.pop("probe")


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_nothing_but_click_and_the_standard_library(flag):
    """What makes ``--help`` and ``--version`` start at once (0.14 s against 0.08 s for ``import
    click`` on a quiet 2-core machine), checked by what they import rather than by a clock: nothing
    beyond click, the standard library and sparse_scan's own light modules (no NumPy, SciPy, mpi4py,
    PyYAML or numba)."""
    import json
    import subprocess
    import sys

    probe = ("import json, sys; import click; before = set(sys.modules)\n"
             "from sparse_scan.cli.app import main\n"
             f"try:\n    main([{flag!r}])\nexcept SystemExit:\n    pass\n"
             "print(json.dumps(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    imported = json.loads(done.stdout.splitlines()[-1])
    assert "sparse_scan.cli.app" in imported
    foreign = [name for name in imported if name.split(".")[0] not in sys.stdlib_module_names
               and name.split(".")[0] not in ("sparse_scan", "click")]
    assert foreign == []
    assert not any(name.startswith(("sparse_scan.layers", "sparse_scan._sequential")) for name in imported)


def test_threads_option_sets_the_blas_pool_and_the_engine(monkeypatch):
    import json
    import os
    import pathlib

    from sparse_scan import cpu_threads

    for name in ("SPARSE_SCAN_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "7")  # restored after the test
    tiny = pathlib.Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
    result = CliRunner().invoke(app.main, ["run", str(tiny), "--random", "2", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["threads"] == 1 == cpu_threads()
    blas = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    assert {os.environ[name] for name in blas} == {"1"}
    monkeypatch.setenv("SPARSE_SCAN_THREADS", "3")
    assert cpu_threads() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("SPARSE_SCAN_THREADS", bad)
        result = CliRunner().invoke(app.main, ["flops", str(tiny)])
        assert result.exit_code == 2 and result.output.count("\n") == 1
        assert f"SPARSE_SCAN_THREADS={bad!r}: must be a positive int" in result.output
    monkeypatch.delenv("SPARSE_SCAN_THREADS")
    result = CliRunner().invoke(app.main, ["run", str(tiny), "--random", "2", "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output


def test_the_combine_and_transport_choices_are_the_librarys():
    from sparse_scan.cli import run
    from sparse_scan.distributed import COMBINES, TRANSPORTS

    assert run.COMBINES == COMBINES and run.TRANSPORTS == TRANSPORTS


CLI = pathlib.Path(app.__file__).resolve().parent


def _imports(path):
    """(imported module or name, inside a function?) for every import in the file at ``path``, relative
    imports made absolute (``from . import _common`` is ``sparse_scan.cli._common``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function = {id(node) for function in ast.walk(tree)
                   if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(function)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, id(node) in in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(filter(None, ["sparse_scan.cli" if node.level else None, node.module]))
            yield from ((f"{module}.{alias.name}", id(node) in in_function) for alias in node.names)


def _cli_modules():
    return sorted(CLI.glob("*.py"))


def test_the_cli_uses_the_librarys_public_api_only():
    for path in _cli_modules():
        for name, _ in _imports(path):
            if not name.startswith("sparse_scan.") or name.startswith("sparse_scan.cli."):
                continue
            private = [part for part in name.split(".") if part.startswith("_") and not part.endswith("__")]
            assert not private, (path.name, name)


def test_no_import_loop_and_no_function_level_import_of_a_sibling():
    subcommands = {f"sparse_scan.cli.{module}" for module, _ in app.SUBCOMMANDS.values()}
    for path in _cli_modules():
        siblings = [(name, in_function) for name, in_function in _imports(path)
                    if name.startswith("sparse_scan.cli.")]
        assert not [name for name, in_function in siblings if in_function], path.name
        if path.stem == "app":
            assert not [name for name, _ in siblings if name.rpartition(".")[0] in subcommands
                        or name in subcommands]
        elif path.stem != "__main__":  # `python -m sparse_scan.cli` runs the group
            assert not [name for name, _ in siblings if name.startswith("sparse_scan.cli.app")], path.name


def test_every_command_is_registered_from_its_module():
    for name, (module, attribute) in app.SUBCOMMANDS.items():
        command = app.main.get_command(click.Context(app.main), name)
        assert command.name == name
        assert command is getattr(importlib.import_module(f"sparse_scan.cli.{module}"), attribute)
