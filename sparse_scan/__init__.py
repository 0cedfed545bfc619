"""sparse-scan: back-propagation as a parallel scan (BPPSA) over sparse transposed Jacobians.

Public modules: :mod:`sparse_scan.layers` (layers with analytic CSR transposed Jacobians),
:mod:`sparse_scan.csr` (the batched CSR type), :mod:`sparse_scan.backend` (CPU/GPU selection),
:class:`Sequential` (a chain whose backward pass is a planned scan, :mod:`sparse_scan.scan`) and
:func:`load_model` (a ``Sequential`` from a YAML model spec, :mod:`sparse_scan.spec`),
:mod:`sparse_scan.recurrent` (RNN and GRU whose backward is a scan over dense blocks,
:mod:`sparse_scan.dense_scan`).

The names load on first use (PEP 562): ``import sparse_scan`` imports neither NumPy nor SciPy, so the
command line's ``--help`` and ``--version`` start at once, and ``--threads`` can size the BLAS pool
before NumPy loads it.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

__all__ = ["BatchedCSR", "Pattern", "ScanPlan", "Sequential", "SpecError", "__version__", "backend", "csr",
           "distributed", "export_torch", "layers", "load_model", "recurrent"]

_MODULES = ("backend", "csr", "distributed", "layers", "recurrent")
_NAMES = {"BatchedCSR": "csr", "Pattern": "csr", "export_torch": "export", "Sequential": "model",
          "ScanPlan": "scan", "SpecError": "spec", "load_model": "spec"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
