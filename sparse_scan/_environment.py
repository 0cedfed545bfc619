"""The environment variables the package reads: one reader each, one error for a value not understood.

Every variable is a :class:`Variable` of :data:`VARIABLES`: its name, what it accepts and its parser
(:func:`positive_int`, :func:`positive_number`, :func:`byte_size`, :func:`flag`,
:func:`defaults_or_file`). :meth:`Variable.read` gives None where the variable is unset or blank, else
its value, or raises :class:`EnvironmentVariableError` naming the variable, its value and what it
accepts; nothing is taken as unset, or as no limit, without a word. :func:`check_environment`
(:func:`sparse_scan.check_environment`) reads them all: the command line does, before anything else,
and turns the error into one line and exit code 2.

:func:`cache_home` is where the package caches files: ``XDG_CACHE_HOME`` where it is an absolute path,
else ``~/.cache`` (the XDG specification says to ignore a relative one).

Imports no NumPy: the command line reads the variables before NumPy loads.

Examples
--------
>>> import os
>>> os.environ["SPARSE_SCAN_MAX_PLAN_SECONDS"] = "1e400"
>>> MAX_PLAN_SECONDS.read()
Traceback (most recent call last):
...
sparse_scan._environment.EnvironmentVariableError: SPARSE_SCAN_MAX_PLAN_SECONDS='1e400': must be a finite ...
>>> os.environ["SPARSE_SCAN_MAX_PLAN_SECONDS"] = " 90 "
>>> MAX_PLAN_SECONDS.read()
90.0
>>> del os.environ["SPARSE_SCAN_MAX_PLAN_SECONDS"]
>>> MAX_PLAN_SECONDS.read() is None
True
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

__all__ = ["COST_MODEL", "CUDA_AWARE_MPI", "FLAG_SPELLINGS", "MAX_PLAN_SECONDS", "MEMORY_BUDGET", "THREADS",
           "VARIABLES", "EnvironmentVariableError", "Variable", "byte_size", "cache_home",
           "check_environment", "defaults_or_file", "flag", "positive_int", "positive_number"]

T = TypeVar("T")


class EnvironmentVariableError(ValueError):
    """An environment variable's value that its reader does not understand: the message names the
    variable, the value and what it accepts."""


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable the package reads.

    Attributes
    ----------
    name : str
    accepts : str
        What it accepts, as the error says it (``a positive int (the CPU threads to use)``).
    parse : callable
        Its value, stripped and not empty, -> what it means; a ``ValueError`` for a value it does not
        understand (its message, if any, says why, at the error's end).
    """

    name: str
    accepts: str
    parse: Callable[[str], T]

    def read(self) -> T | None:
        """The variable's value: None where it is unset or blank, else :attr:`parse` of it.

        Raises
        ------
        EnvironmentVariableError
            The value is not one :attr:`parse` understands.
        """
        raw = os.environ.get(self.name, "")
        text = raw.strip()
        if not text:
            return None
        try:
            return self.parse(text)
        except ValueError as error:
            why = f": {error}" if str(error) else ""
            raise EnvironmentVariableError(f"{self.name}={raw!r}: must be {self.accepts}{why}") from None


def positive_int(text: str) -> int:
    """An int >= 1 written in decimal digits (``8``; not ``0``, ``-1``, ``2.5``, ``1e3``)."""
    if not text.isdecimal() or int(text) < 1:
        raise ValueError
    return int(text)


def positive_number(text: str) -> float:
    """A finite number > 0 (``0.5``, ``90``, ``1e3``; not ``inf``, ``1e400``, ``nan``, ``0``)."""
    value = float(text)  # a ValueError where it is no number
    if not (math.isfinite(value) and value > 0):
        raise ValueError
    return value


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_BYTES = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?")


def byte_size(text: str) -> int:
    """A number of bytes > 0, optionally with a binary unit, any case: ``4096``, ``512M``, ``1.5GiB``,
    ``2tb`` (k, M, G, T: powers of 1024)."""
    match = _BYTES.fullmatch(text.lower())
    if match is None:
        raise ValueError
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not (math.isfinite(value) and value >= 1):
        raise ValueError
    return int(value)


FLAG_SPELLINGS = {"1": True, "true": True, "yes": True, "on": True,
                  "0": False, "false": False, "no": False, "off": False}
"""What :func:`flag` understands, any case."""


def flag(text: str) -> bool:
    """A yes or no: one of :data:`FLAG_SPELLINGS`, any case."""
    try:
        return FLAG_SPELLINGS[text.lower()]
    except KeyError:
        raise ValueError from None


def defaults_or_file(text: str) -> str | pathlib.Path:
    """``defaults``, or the path of a file that exists (a ``ValueError`` saying what it is else)."""
    if text == "defaults":
        return text
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        raise ValueError("it is a directory")
    if not path.is_file():
        raise ValueError("no such file" if not path.exists() else "it is not a regular file")
    return path


THREADS = Variable("SPARSE_SCAN_THREADS", "a positive int (the CPU threads to use)", positive_int)
"""The engine's worker threads (:func:`sparse_scan.cpu_threads`; ``sparse-scan --threads`` sets it)."""

COST_MODEL = Variable("SPARSE_SCAN_COST_MODEL", "'defaults' or a calibration file, as `sparse-scan "
                      "calibrate --output FILE` writes", defaults_or_file)
"""The cost model's constants (:func:`sparse_scan.engine.cost.current`)."""

MAX_PLAN_SECONDS = Variable("SPARSE_SCAN_MAX_PLAN_SECONDS", "a finite number of seconds > 0 (the planning "
                            "limit)", positive_number)
"""The planning limit (:func:`sparse_scan.engine.cost.max_plan_seconds`)."""

MEMORY_BUDGET = Variable("SPARSE_SCAN_MEMORY_BUDGET", "a number of bytes > 0, optionally with a unit "
                         "(512M, 12GiB)", byte_size)
"""The memory budget where a model sets none (``sparse_scan._sequential.default_memory_budget``)."""

CUDA_AWARE_MPI = Variable("SPARSE_SCAN_CUDA_AWARE_MPI", "1, true, yes or on (the MPI library takes device "
                          "buffers), or 0, false, no or off (it does not)", flag)
"""Whether the MPI library is CUDA-aware (``sparse_scan.distributed._transport``), asked of it where unset."""

VARIABLES = (THREADS, COST_MODEL, MAX_PLAN_SECONDS, MEMORY_BUDGET, CUDA_AWARE_MPI)
"""Every ``SPARSE_SCAN_...`` variable the package reads."""


def check_environment() -> None:
    """Read every ``SPARSE_SCAN_...`` environment variable the package reads (:data:`VARIABLES`).

    Raises
    ------
    EnvironmentVariableError
        A ``ValueError`` naming the first variable whose value is not understood, the value and what
        the variable accepts.
    """
    for variable in VARIABLES:
        variable.read()


def cache_home() -> pathlib.Path:
    """The folder of per-user caches: ``XDG_CACHE_HOME`` where it is an absolute path, else
    ``~/.cache`` (a relative one is ignored, as the XDG Base Directory specification says)."""
    setting = os.environ.get("XDG_CACHE_HOME", "")
    return pathlib.Path(setting) if os.path.isabs(setting) else pathlib.Path.home() / ".cache"
