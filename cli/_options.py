"""The click options shared by the ``sparse-scan`` commands, one definition each.

An option that several commands take is defined here once; where the commands differ only in its
default or its help line, it is a function of those. Importing this module costs click and
:data:`sparse_scan.SCHEDULES` (which imports no NumPy), so that ``sparse-scan --help`` starts at once
and ``--threads`` takes effect before NumPy loads its BLAS.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Callable

import click

from sparse_scan import SCHEDULES

__all__ = ["FILE", "FiniteFloat", "batch_size_option", "data_option", "device_option", "dtype_option",
           "file_option", "force_option", "json_option", "levels_option", "max_step_flops_option",
           "method_option", "model_argument", "quiet_option", "seed_option", "set_threads",
           "threads_option"]

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
"""What ``click.option`` returns: a decorator of a command function."""

FILE = click.Path(dir_okay=False, path_type=pathlib.Path)
"""The type of every file argument and option: a :class:`pathlib.Path`, not a directory."""


class FiniteFloat(click.ParamType):
    """A finite float (click's ``FloatRange`` lets NaN through), above ``minimum`` (or at it, when
    ``inclusive``)."""

    name = "float"

    def __init__(self, minimum: float, inclusive: bool = False) -> None:
        self.minimum, self.inclusive = minimum, inclusive

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if number < self.minimum or (number == self.minimum and not self.inclusive):
            self.fail(f"{value!r} must be {'>=' if self.inclusive else '>'} {self.minimum:g}", param, ctx)
        return number


model_argument = click.argument("model", type=FILE)
"""``MODEL``, the YAML spec every command reads."""

method_option = click.option(
    "--method", type=click.Choice(SCHEDULES), default="auto", show_default=True,
    help="scan schedule; auto chooses linear, hybrid or blelloch from cost estimates (hybrid without "
    "--levels chooses its depth)")
"""``--method`` of every command that plans a scan (run, train, flops)."""

levels_option = click.option(
    "--levels", default=None, help="up-sweep levels of hybrid: an int or 'auto' (the default)")
"""``--levels`` of every command that plans a scan, read by :func:`._common.parse_levels`."""

max_step_flops_option = click.option(
    "--max-step-flops", type=FiniteFloat(0), default=1e10, show_default=True,
    help="give up before planning a costlier product (deep scans of big networks need billions)")
"""``--max-step-flops`` of every command that plans a scan."""

dtype_option = click.option(
    "--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
"""``--dtype`` of the commands that take a value type (run, flops)."""

data_option = click.option(
    "--data", required=True, help="'digits' (scikit-learn's), 'bitstream[:TRAIN[:TEST]]' (the paper's "
    "sequences, 2048 and 512 by default) or a .npz with x_train, y_train, x_test, y_test")
"""``--data`` of the commands that read a dataset (train, eval)."""


def device_option(default: str) -> Decorator:
    """``--device`` (cpu, gpu or auto) with the command's ``default``."""
    return click.option("--device", type=click.Choice(["cpu", "gpu", "auto"]), default=default,
                        show_default=True)


def file_option(*names: str, help: str) -> Decorator:
    """An option naming a file (``--weights``, ``--out``, ``--plot``, ...): ``names`` as for
    ``click.option`` (the flag, then the parameter's name where it differs)."""
    return click.option(*names, type=FILE, help=help)


def seed_option(help: str) -> Decorator:
    """``--seed``, a non-negative int, 0 by default; ``help`` says what it seeds."""
    return click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help=help)


def batch_size_option(default: int, help: str | None = None) -> Decorator:
    """``--batch-size``, a positive int, with the command's ``default``."""
    return click.option("--batch-size", type=click.IntRange(min=1), default=default, show_default=True,
                        help=help)


def force_option(help: str) -> Decorator:
    """``--force``: overwrite the existing output files that ``help`` names."""
    return click.option("--force", is_flag=True, help=help)


def json_option(help: str = "print JSON only") -> Decorator:
    """``--json``, passed to the command as ``as_json``."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def quiet_option(help: str = "no progress line while the plan is built") -> Decorator:
    """``--quiet``; ``help`` says what it silences."""
    return click.option("--quiet", is_flag=True, help=help)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""What sizes the BLAS thread pool when NumPy loads (OpenBLAS, MKL or OpenMP builds)."""


def set_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """``--threads N``: ``SPARSE_SCAN_THREADS`` (the engine's worker threads, read by
    :func:`sparse_scan.cpu_threads`) and the BLAS pool's variables, set as the option is parsed: before
    the command imports NumPy, which reads them once, when it loads."""
    if value is not None:
        for name in ("SPARSE_SCAN_THREADS",) + THREAD_VARIABLES:
            os.environ[name] = str(value)
    return value


threads_option = click.option(
    "--threads", type=click.IntRange(min=1), default=None, callback=set_threads, expose_value=False,
    is_eager=True, help="CPU threads: the BLAS pool and the scan's workers (default: "
    "SPARSE_SCAN_THREADS, else every core this process may use)")
"""``--threads`` of every command that computes (run, train, eval)."""
