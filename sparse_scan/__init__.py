"""sparse-scan: back-propagation as a parallel scan (BPPSA) over sparse transposed Jacobians.

Public modules: :mod:`sparse_scan.layers` (layers with analytic CSR transposed Jacobians),
:mod:`sparse_scan.csr` (the batched CSR type), :mod:`sparse_scan.backend` (CPU/GPU selection),
:class:`Sequential` (a chain whose backward pass is a planned scan; :func:`default_memory_budget`, the
memory budget where a model sets none) and :func:`load_model` (a
model from a YAML model spec, :mod:`sparse_scan.spec`), :mod:`sparse_scan.model` (:class:`Model`, the
protocol both model kinds implement and the command line, flops and training take),
:mod:`sparse_scan.recurrent` (RNN, GRU and LSTM whose backward is a scan over dense blocks, and their
classifier), :mod:`sparse_scan.engine` (the scan engine
itself: schedules, plans and their executors), :mod:`sparse_scan.optim`, :mod:`sparse_scan.train`,
:mod:`sparse_scan.weights`, :mod:`sparse_scan.loss`, :mod:`sparse_scan.flops`,
:mod:`sparse_scan.distributed`, :mod:`sparse_scan.calibration` (the cost model's constants measured
on this machine) and :mod:`sparse_scan.torch` (PyTorch models in: :func:`export_torch`,
imported only when used). Every other
module is private by name (``_...``).

The names load on first use (PEP 562): ``import sparse_scan`` imports neither NumPy nor SciPy, so the
command line's ``--help`` and ``--version`` start at once, and ``--threads`` can size the BLAS pool
before NumPy loads it (:data:`SCHEDULES`, :func:`cpu_threads` and :func:`check_environment`, which reads
every ``SPARSE_SCAN_...`` environment variable and refuses a value it does not understand, import no
NumPy either).
"""

from __future__ import annotations

from ._lazy import lazy_attributes
from ._version import __version__

__all__ = ["SCHEDULES", "BatchedCSR", "GPUUnavailableError", "Model", "Pattern", "ScanCostError",
           "ScanMemoryError", "ScanPlan", "Sequential", "SpecError", "__version__", "backend", "calibration",
           "check_environment", "cpu_threads", "csr", "default_memory_budget", "distributed", "engine",
           "export_torch", "flops", "layers", "load_model", "loss", "model", "optim", "recurrent", "torch",
           "train", "weights"]

_MODULES = ("backend", "calibration", "csr", "distributed", "engine", "flops", "layers", "loss", "model",
            "optim", "recurrent", "torch", "train", "weights")
_NAMES = {"BatchedCSR": "csr", "Pattern": "csr", "export_torch": "torch._export", "Sequential": "_sequential",
          "default_memory_budget": "_sequential",
          "Model": "model",
          "ScanPlan": "engine.plan", "ScanCostError": "engine.plan", "ScanMemoryError": "engine.plan",
          "SCHEDULES": "engine.schedule", "GPUUnavailableError": "backend", "SpecError": "spec",
          "load_model": "spec", "cpu_threads": "_threads", "check_environment": "_environment"}


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _NAMES, _MODULES)
