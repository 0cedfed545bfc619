"""The ``sparse-scan`` click group.

Each subcommand lives in its own module (``run``, ``flops``, ``train``, ``evaluate``, ``calibrate``),
which only reads its input, calls :mod:`sparse_scan` and prints the result. The group loads a
subcommand's module the first time the command is asked for (to run it, or for its own ``--help``;
``sparse-scan --help`` lists the commands by their :data:`SUMMARIES` lines, loading none of them) and
registers it with ``main.add_command``; the modules import click, :mod:`._common` and
:mod:`._options` only (and :data:`sparse_scan.SCHEDULES`, which needs no NumPy), the library inside
the command functions, so ``sparse-scan --help`` and ``--version`` import neither NumPy nor SciPy.
Nothing here imports a subcommand at import time, and no subcommand imports this module.

Errors are one line on stderr and exit code 2 (:func:`._common.fail`), never a traceback; Ctrl-C, at
any point, is ``sparse-scan: interrupted`` and exit code 130 (:data:`._common.INTERRUPTED`; ``train``
saves its weights and plot first).

Examples
--------
>>> from click.testing import CliRunner
>>> from sparse_scan import __version__
>>> result = CliRunner().invoke(main, ["--version"])
>>> result.output == f"sparse-scan {__version__}\\n"
True
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import IO, Any, NoReturn

import click

from sparse_scan import __version__

from ._common import INTERRUPTED, fail
from ._progress import end_line

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS = {"run": ("run", "run"), "flops": ("flops", "flops"), "train": ("train", "train_command"),
               "eval": ("evaluate", "eval_command"), "calibrate": ("calibrate", "calibrate_command")}
"""Command name -> (module of :mod:`sparse_scan.cli`, attribute): loaded on first use."""

SUMMARIES = {"run": "Gradients of MODEL's loss w.r.t. input, layers, parameters.",
             "flops": "FLOP analysis of MODEL's backward pass, static or live.",
             "train": "Train MODEL with BPPSA gradients on a dataset.",
             "eval": "Loss and accuracy of MODEL on a dataset's splits.",
             "calibrate": "Measure this machine's cost-model constants."}
"""Command name -> its line in ``sparse-scan --help`` (its short help), so that listing the commands
imports none of their modules."""

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _LazyGroup(click.Group):
    """A click group that imports a subcommand's module when the command is first asked for, and
    whose usage errors (a bad option value, an unknown command) are one line on stderr and exit code 2,
    like every other error of the command; help and a bare invocation print the usage as usual."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(SUBCOMMANDS))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """``--help``'s list of commands: each of :data:`SUBCOMMANDS` by its :data:`SUMMARIES` line (its
        module not imported), a command added otherwise by its own short help."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))  # click's own
        rows = []
        for name in names:
            command = None if name in SUMMARIES else self.get_command(ctx, name)
            if command is None or not command.hidden:
                rows.append((name, SUMMARIES[name] if command is None else command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and name in SUBCOMMANDS:
            module, attribute = SUBCOMMANDS[name]
            command = getattr(importlib.import_module(f".{module}", __package__), attribute)
            self.add_command(command, name)
        return command

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            if not standalone_mode:
                return super().main(*args, standalone_mode=False, **kwargs)
            self._standalone(*args, **kwargs)

    def _standalone(self, *args: Any, **kwargs: Any) -> NoReturn:
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as error:
            error.show()
            sys.exit(error.exit_code)
        except click.ClickException as error:
            fail(error.format_message().replace("\n", " "))
        except (click.Abort, KeyboardInterrupt):  # Ctrl-C: click turns it into Abort while it runs a command
            end_line()
            click.echo("sparse-scan: interrupted", err=True)
            sys.exit(INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: IO[str] | None = None, line: str | None = None) -> None:
    """How a command shows a warning (``warnings.showwarning``): ``sparse-scan: warning: message``,
    one line on stderr, without the source line Python's own format adds."""
    end_line()
    click.echo(f"sparse-scan: warning: {message}", file=file, err=file is None)


@click.group(cls=_LazyGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(
    __version__, "--version", prog_name="sparse-scan", message="%(prog)s %(version)s"
)
def main() -> None:
    """Back-propagation as a parallel scan (BPPSA) over sparse transposed Jacobians.

    Models are YAML specs (see README): `sparse-scan run MODEL.yaml` computes the gradients of a
    batch by a scan, `sparse-scan flops MODEL.yaml` analyses the backward pass statically,
    `sparse-scan train` and `eval` train and evaluate a classifier, `sparse-scan calibrate` measures
    the cost model that `--method auto` chooses by. Threads: --threads N on run,
    train and eval, or the SPARSE_SCAN_THREADS environment variable.
    """
    from sparse_scan import check_environment  # noqa: PLC0415 - not at import: --help comes first

    try:
        check_environment()
    except ValueError as error:  # a SPARSE_SCAN_... variable's value not understood, named
        fail(str(error))


if __name__ == "__main__":  # pragma: no cover - `python -m sparse_scan.cli.app`
    main()
