"""sparse-scan: back-propagation as a parallel scan (BPPSA) over sparse transposed Jacobians.

Public modules: :mod:`sparse_scan.layers` (layers with analytic CSR transposed Jacobians),
:mod:`sparse_scan.csr` (the batched CSR type), :mod:`sparse_scan.backend` (CPU/GPU selection),
:class:`Sequential` (a chain whose backward pass is a planned scan, :mod:`sparse_scan.scan`) and
:func:`load_model` (a ``Sequential`` from a YAML model spec, :mod:`sparse_scan.spec`),
:mod:`sparse_scan.recurrent` (RNN and GRU whose backward is a scan over dense blocks,
:mod:`sparse_scan.dense_scan`).
"""

from . import backend, csr, distributed, layers, recurrent
from ._version import __version__
from .csr import BatchedCSR, Pattern
from .export import export_torch
from .model import Sequential
from .scan import ScanPlan
from .spec import SpecError, load_model

__all__ = ["BatchedCSR", "Pattern", "ScanPlan", "Sequential", "SpecError", "__version__", "backend", "csr",
           "distributed", "export_torch", "layers", "load_model", "recurrent"]
