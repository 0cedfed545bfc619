"""A strict, test-only stand-in for CuPy: the GPU path's Python glue and CUDA sources run on the CPU.

:func:`install` puts modules named ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.cuda.nccl``,
``cupyx``, ``cupyx.scipy``, ``cupyx.scipy.sparse`` and ``cupyx.scipy.special`` into ``sys.modules``.
The code under test then imports them as it imports CuPy on a GPU machine: its arrays are
:class:`~._array.ndarray` (NumPy underneath, recognised as CuPy arrays), its
``RawModule``/``RawKernel`` build the ``rawkernels/*.cu`` sources with g++ and launch them with CuPy's
calling convention (:mod:`._raw`), and ``cupy.cuda`` has one device (more, and an NCCL, on request:
:mod:`._cuda`).

It is at least as strict as CuPy where a test could otherwise pass here and fail on a GPU: host arrays
in device calls, functions, methods and keywords the installed CuPy lacks (its API is read from the
real package, :mod:`._reference`), kernel scalars of the wrong width, launch sizes beyond CUDA's
limits, names missing from ``name_expressions``, barriers not reached by every thread of a block, and
reads of memory nobody wrote (``empty`` is NaN-filled). Launches and host synchronisations are counted
in :data:`STATS`.

What it cannot show, and only a GPU can: races between blocks and between streams (blocks run one
after another, work runs at launch), the GPU's rounding (FMA contraction, flush-to-zero of denormals),
real memory limits, out-of-bounds accesses (compute-sanitizer on the device) and speed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import scipy.special as scipy_special

from . import _array, _cuda, _raw, _reference
from ._array import STATS, ndarray
from ._cuda import AVAILABLE
from ._reference import ReferenceUnavailable

__all__ = ["AVAILABLE", "STATS", "ReferenceUnavailable", "available", "install", "ndarray"]

_MODULE_NAMES = ("cupy", "cupy.cuda", "cupy.cuda.runtime", "cupy.cuda.nccl", "cupyx", "cupyx.scipy",
                 "cupyx.scipy.sparse", "cupyx.scipy.special")


def _memoize(for_each_device: bool = False) -> Any:
    """``cupy.memoize``: a cache per argument tuple (one device here)."""

    def decorator(function: Any) -> Any:
        cache: dict[Any, Any] = {}

        def call(*args: Any) -> Any:
            if args not in cache:
                cache[args] = function(*args)
            return cache[args]

        return call

    return decorator


def _get_array_module(*arrays: Any) -> types.ModuleType:
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in arrays) else np


def _cupy_module(cuda: types.ModuleType) -> types.ModuleType:
    cupy = types.ModuleType("cupy", "CuPy stand-in (tests/cupy_standin): NumPy on the CPU, CuPy's rules")
    cupy.__file__ = __file__
    cupy.__version__ = _array.reference().version + "+standin"
    cupy.cuda = cuda
    cupy.ndarray = ndarray
    cupy.RawModule = _raw.RawModule
    cupy.RawKernel = _raw.RawKernel
    cupy.memoize = _memoize
    cupy.get_array_module = _get_array_module
    cupy.get_default_memory_pool = lambda: _cuda.MemoryPool()
    cupy.get_default_pinned_memory_pool = lambda: _cuda.MemoryPool()
    cupy.ufunc = _array.ufunc
    cupy.from_dlpack = _array.from_dlpack

    def missing(name: str) -> Any:
        entry = _array.reference().cupy.get(name)
        if entry is None:
            raise AttributeError(f"module 'cupy' has no attribute '{name}' (CuPy "
                                 f"{_array.reference().version})")
        if entry["kind"] in ("type", "dtype", "float", "int", "bool", "_DTypeMeta") or name in (
                "newaxis", "inf", "nan", "pi", "e", "euler_gamma"):
            return getattr(np, name)  # CuPy re-exports NumPy's scalar types, dtypes and constants
        if entry["kind"] in ("function", "ufunc", "_GUFunc", "builtin_function_or_method",
                             "cython_function_or_method", "fused_cython_function", "_wrapped_function"):
            return _array.function(name)
        raise AttributeError(f"the CuPy stand-in does not provide cupy.{name} ({entry['kind']})")

    cupy.__getattr__ = missing
    return cupy


def _sparse_module() -> types.ModuleType:
    from ._sparse import csr_matrix, issparse

    sparse = types.ModuleType("cupyx.scipy.sparse")
    sparse.csr_matrix = csr_matrix
    sparse.issparse = issparse
    return sparse


def _cupyx_module() -> tuple[types.ModuleType, ...]:
    cupyx = types.ModuleType("cupyx")
    scipy = types.ModuleType("cupyx.scipy")
    sparse = _sparse_module()
    scipy.sparse = sparse
    cupyx.scipy = scipy

    def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
        return _array.pin(np.empty(shape, dtype=dtype, order=order))

    def zeros_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
        return _array.pin(np.zeros(shape, dtype=dtype, order=order))

    cupyx.empty_pinned, cupyx.zeros_pinned = empty_pinned, zeros_pinned
    special = types.ModuleType("cupyx.scipy.special")
    special.erf = _array.host_ufunc("erf", scipy_special.erf)
    scipy.special = special
    return cupyx, scipy, sparse, special


def available() -> str | None:
    """Why the stand-in cannot run here (``None`` when it can): it needs g++ and the real CuPy's API."""
    import shutil

    if shutil.which("g++") is None:
        return "g++ is not on PATH (the stand-in builds the CUDA sources with it)"
    try:
        _reference.load()
    except ReferenceUnavailable as error:
        return str(error)
    return None


def install() -> None:
    """Put the stand-in into ``sys.modules`` as ``cupy`` and ``cupyx`` (the real ones must not be
    imported in this process)."""
    if "cupy" in sys.modules and not getattr(sys.modules["cupy"], "__file__", "").startswith(
            __file__.rsplit("/", 1)[0]):
        raise RuntimeError("the real CuPy is already imported in this process: install the stand-in first")
    _array.REFERENCE = _reference.load()
    cuda = _cuda.module()
    cupy = _cupy_module(cuda)
    modules = dict(zip(_MODULE_NAMES, (cupy, cuda, cuda.runtime, cuda.nccl, *_cupyx_module()), strict=True))
    sys.modules.update(modules)
