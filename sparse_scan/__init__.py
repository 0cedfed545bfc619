"""sparse-scan: back-propagation as a parallel scan (BPPSA) over sparse transposed Jacobians.

Public modules: :mod:`sparse_scan.layers` (layers with analytic CSR transposed Jacobians),
:mod:`sparse_scan.csr` (the batched CSR type) and :mod:`sparse_scan.backend` (CPU/GPU selection).
"""

from . import backend, csr, layers
from ._version import __version__
from .csr import BatchedCSR, Pattern

__all__ = ["BatchedCSR", "Pattern", "__version__", "backend", "csr", "layers"]
