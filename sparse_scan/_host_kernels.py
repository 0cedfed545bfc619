"""Compiled host kernels: the one lazy loader of numba, and the launcher that runs kernels on the pool.

The hot loops of the host engine and of the layers and cells (products' scalings, gathers and sums,
im2col, max-pool values, the recurrent backward) are compiled by numba. Each lives beside the code it
serves (``engine/_kernels.py``, ``layers/_kernels.py``, ``recurrent/_kernels.py``), written as a plain
Python function under :func:`compiled`, and is imported and called by name: ``from ._kernels import
im2col``. This module is the only one that imports numba:

* numba is imported by the first call of a compiled kernel, never by ``import sparse_scan`` or the
  CLI's ``--help`` (``import numba`` costs about 0.3 s). That first call compiles every kernel of the
  kernel's module (and of the modules whose kernels they call) into numba dispatchers, which then
  take the kernels' places in their modules, so that kernels calling kernels compile as numba
  functions.
* Kernels are compiled with ``cache=True``: the first process compiles each argument signature it meets
  (float32/float64 values, int32/int64 indices: about 0.3-1 s each) and writes it to disk; later
  processes load it (milliseconds). The cache sits in the package's ``__pycache__``; when that folder
  is not writable (a read-only site-packages) and ``NUMBA_CACHE_DIR`` is unset, it is set to a
  writable folder of the user's (:func:`cache_directory`).
* The kernels release the GIL (``nogil=True``), check no bounds and keep NumPy's floating-point
  semantics (``error_model="numpy"``, no fastmath). They take a range of samples and of entries:
  callers cut their work with :func:`parts` and run the pieces on the project's kernel pool with
  :func:`launch` (:mod:`sparse_scan._threads`: one thread per core of
  :func:`~sparse_scan._threads.cpu_threads`, the one thread setting). numba's own thread pool
  (``parallel=True``) is not used: the scan runs concurrent steps on threads of its own, which
  numba's default threading layer refuses, and one run of samples per pool thread serves batches.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from ._threads import even_parts, kernel_pool, note_core_share

__all__ = ["BLOCK_ENTRIES", "OPTIONS", "SHARE_MIN_SECONDS", "CompiledKernel", "cache_directory", "compiled",
           "launch", "parts", "rows2d", "u"]

PACKAGE = pathlib.Path(__file__).resolve().parent

OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}
"""numba's options for every kernel (:func:`compiled` adds a kernel's own, such as ``inline``)."""

u = np.uintp
"""Indices read through ``u(...)`` in the kernels: unsigned, so numba adds no negative-index
wrap-around to every read (1.4x on the scaling kernel: the loop unrolls)."""

BLOCK_ENTRIES = 8192
"""Entries per block of the streaming kernels: a block's indices (and shared values) are read once
and stay in L1/L2 while every sample of the thread's run uses them. Measured on VGG-11's pool1·conv2
gather at batch 16 (2 threads): 35 ms one sample after the other, 23 ms with blocks of 4-16 Ki."""


def _writable(folder: pathlib.Path) -> bool:
    """Whether numba could write its cache files in ``folder`` (creating it if need be)."""
    while not folder.exists():
        folder = folder.parent
    return os.access(folder, os.W_OK | os.X_OK)


def cache_directory(environ: dict[str, str] | None = None, package: pathlib.Path = PACKAGE) -> str | None:
    """The ``NUMBA_CACHE_DIR`` to set before numba is imported, or None to keep numba's choice.

    numba caches a package's kernels in its ``__pycache__`` and, where that is read-only, in its own
    user cache (``$XDG_CACHE_HOME/numba``, ``~/.cache/numba`` by default). None when
    ``NUMBA_CACHE_DIR`` is set already or either of those is writable; else
    ``<tempdir>/sparse-scan-numba-<uid>`` (without it, ``cache=True`` would fail to compile at all).
    """
    environ = os.environ if environ is None else environ
    user_cache = pathlib.Path(environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "numba"
    if environ.get("NUMBA_CACHE_DIR") or _writable(package / "__pycache__") or _writable(user_cache):
        return None
    return str(pathlib.Path(tempfile.gettempdir()) / f"sparse-scan-numba-{os.getuid()}")


@functools.lru_cache(maxsize=None)
def _use_cache_directory() -> None:
    """Point numba at :func:`cache_directory` when it names one (before a kernels module loads)."""
    folder = cache_directory()
    if folder is not None:
        os.environ["NUMBA_CACHE_DIR"] = folder
        import numba.core.config  # noqa: PLC0415 - numba may have been imported by the user already

        numba.core.config.reload_config()


class CompiledKernel:
    """A host kernel: a Python function that numba compiles (:data:`OPTIONS`) at its first call.

    Calling it calls the numba dispatcher (:meth:`dispatcher`); ``py_func`` is the function itself
    (numba's name), ``__name__`` and ``__doc__`` its own.
    """

    def __init__(self, function: Callable[..., Any], options: dict[str, Any]) -> None:
        functools.update_wrapper(self, function)
        self.py_func = function
        self.options = options
        self._dispatcher: Any = None

    def __call__(self, *args: Any) -> Any:
        return (self._dispatcher or self.dispatcher())(*args)

    def dispatcher(self) -> Any:
        """The numba dispatcher (numba imported and the kernel's module bound on the first call)."""
        if self._dispatcher is None:
            with _BINDING:
                _bind(sys.modules[self.py_func.__module__], set())
        return self._dispatcher

    def __repr__(self) -> str:
        return f"<compiled kernel {self.py_func.__module__}.{self.__name__}>"


def compiled(function: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: ``function`` as a :class:`CompiledKernel` (``@compiled`` or, with numba options of
    its own, ``@compiled(inline="always")``), compiled by numba on its first call."""
    def wrap(function: Callable[..., Any]) -> CompiledKernel:
        return CompiledKernel(function, {**OPTIONS, **options})

    return wrap if function is None else wrap(function)


_BINDING = threading.RLock()
"""Held while kernels' modules are bound: the first calls may come from several pool threads."""


def _bind(module: Any, bound: set[str]) -> None:
    """Give every kernel named in ``module`` its numba dispatcher and put the dispatchers in the
    module's namespace, where numba looks up the kernels a kernel calls (a kernel imported from
    another module binds that module too)."""
    if module.__name__ in bound:
        return
    bound.add(module.__name__)
    _use_cache_directory()
    import numba  # noqa: PLC0415 - lazy by design: numba costs 0.3 s to import

    kernels = {name: value for name, value in vars(module).items() if isinstance(value, CompiledKernel)}
    for kernel in kernels.values():
        if kernel._dispatcher is None:
            kernel._dispatcher = numba.njit(**kernel.options)(kernel.py_func)
        _bind(sys.modules[kernel.py_func.__module__], bound)
    for name, kernel in kernels.items():
        setattr(module, name, kernel._dispatcher)


def parts(batch: int, count: int, workers: int) -> list[tuple[int, int, int, int]]:
    """Pieces ``(first sample, last sample, first item, last item)`` of a kernel call over ``batch``
    samples of ``count`` items each, for ``workers`` threads: one run of samples per thread when there
    are at least as many samples (one sample per thread beats cache blocking), else runs of items."""
    if workers <= 1 or batch * count == 0:
        return [(0, batch, 0, count)]
    if batch >= workers:
        return [(s0, s1, 0, count) for s0, s1 in even_parts(batch, workers)]
    return [(0, batch, e0, e1) for e0, e1 in even_parts(count, workers)]


def launch(kernel: Callable[..., None], args: tuple, pieces: list[tuple[int, ...]]) -> None:
    """``kernel(*args, *piece)`` for every piece: all but the last on the kernel pool's threads when
    there are several (the kernels release the GIL), the last on the calling thread, which then
    waits for the others (one hand-off fewer: 15 µs instead of 28-63 µs for two pieces on this
    2-core machine). The least share of a core that a piece's thread got is noted
    (:func:`~sparse_scan._threads.note_core_share`): where other threads keep the cores busy, the next
    calls are cut only where that pays."""
    pool = kernel_pool() if len(pieces) > 1 else None
    if pool is None:
        for piece in pieces:
            kernel(*args, *piece)
        return
    others = [pool.submit(_core_share, kernel, args, piece) for piece in pieces[:-1]]
    share = _core_share(kernel, args, pieces[-1])
    note_core_share(min([share] + [future.result() for future in others]))


SHARE_MIN_SECONDS = 100e-6
"""Pieces shorter than this note no share of a core (:func:`_core_share`): too short to tell."""

_THREAD_CLOCK = sys.platform.startswith("linux")
"""Whether a thread's CPU clock has the resolution a piece's share needs (Linux's: nanoseconds;
Windows' counts whole scheduler ticks)."""


def _core_share(kernel: Callable[..., None], args: tuple, piece: tuple[int, ...]) -> float:
    """``kernel(*args, *piece)``, and the share of a core its thread got meanwhile (its CPU time over
    its wall time; 1 where too short to tell or without a fine thread clock)."""
    start, cpu = time.perf_counter(), time.thread_time()
    kernel(*args, *piece)
    wall = time.perf_counter() - start
    if not _THREAD_CLOCK or wall < SHARE_MIN_SECONDS:
        return 1.0
    return (time.thread_time() - cpu) / wall


def rows2d(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` as a C-contiguous ``(rows, n)`` array of ``dtype``: a shared ``(n,)`` operand is one
    row (the kernels read row 0 for every sample), a per-sample ``(B, n)`` one is itself."""
    array = np.ascontiguousarray(array, dtype=dtype)
    return array.reshape(1, -1) if array.ndim == 1 else array
