"""The ``sparse-scan`` click group: help, version, and room for subcommands."""

from __future__ import annotations

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
    assert "main" in app.__all__ and "flops" in app.main.commands

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
