"""``sparse-scan --help`` lists the commands without importing their modules (issue 47, item 16: it took
1.89x a bare ``import click``; bench/startup.py measures it). Checked by what it imports, never by a
clock."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from sparse_scan.cli import app

COMMAND_MODULES = {f"sparse_scan.cli.{module}" for module, _ in app.SUBCOMMANDS.values()}


def _imported_by(arguments: list[str]) -> set[str]:
    """The modules ``main(arguments)`` imports in a fresh interpreter, beyond click's own."""
    probe = ("import json, sys; import click; before = set(sys.modules)\n"
             "from sparse_scan.cli.app import main\n"
             f"try:\n    main({arguments!r})\nexcept SystemExit:\n    pass\n"
             "print(json.dumps(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_help_imports_no_command_module():
    imported = _imported_by(["--help"])
    assert "sparse_scan.cli.app" in imported
    assert not imported & (COMMAND_MODULES | {"sparse_scan.cli._options", "sparse_scan.cli._distributed",
                                              "sparse_scan._checks", "json.decoder", "csv", "dataclasses"})


def test_a_commands_own_help_imports_its_module_only():
    assert _imported_by(["flops", "--help"]) & COMMAND_MODULES == {"sparse_scan.cli.flops"}


def test_help_lists_every_command_by_its_summary_on_one_line():
    assert set(app.SUMMARIES) == set(app.SUBCOMMANDS)
    result = CliRunner().invoke(app.main, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    listed = result.output.split("Commands:\n", 1)[1].splitlines()
    assert listed == [f"  {name:9}  {app.SUMMARIES[name]}" for name in sorted(app.SUMMARIES)]
