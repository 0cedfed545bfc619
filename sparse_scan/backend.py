"""Array backends: NumPy/SciPy on the CPU, CuPy on the GPU.

The one place that decides where work runs. CuPy is imported lazily, and "a GPU is usable" means
``cupy.cuda.is_available()``, not merely "cupy imports". Asking for ``"gpu"`` when none is usable is an
error (:class:`GPUUnavailableError`); only ``"auto"`` may choose the CPU.

Every operation with two implementations (a NumPy twin and a CuPy/RawKernel twin) is dispatched through
:func:`twin`, so backend branches live in one table per operation rather than throughout the code.

Examples
--------
>>> from sparse_scan import backend
>>> cpu = backend.get("cpu")
>>> cpu.name, cpu.xp.__name__
('cpu', 'numpy')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Hashable, Literal

import numpy as np

from ._types import Array

__all__ = ["Backend", "Device", "GPUUnavailableError", "get", "gpu_usable", "of", "twin"]

Device = Literal["cpu", "gpu", "auto"]
DEVICES: tuple[str, ...] = ("cpu", "gpu", "auto")


class GPUUnavailableError(RuntimeError):
    """Raised when the GPU is asked for explicitly and no usable GPU (or CuPy) is present."""


@dataclass(frozen=True)
class Backend:
    """An array module and its sparse companion.

    Attributes
    ----------
    name : {"cpu", "gpu"}
        Where the arrays live.
    xp : module
        ``numpy`` or ``cupy``.
    sparse_module : module or None
        ``scipy.sparse`` or ``cupyx.scipy.sparse``; None: :attr:`sparse` imports SciPy's on first
        use (the host backend's: 0.14 s of import that loading and planning a model do without).
    """

    name: str
    xp: ModuleType
    sparse_module: ModuleType | None = None

    @property
    def sparse(self) -> ModuleType:
        """``scipy.sparse`` or ``cupyx.scipy.sparse``."""
        if self.sparse_module is not None:
            return self.sparse_module
        import scipy.sparse  # noqa: PLC0415 - on first use

        return scipy.sparse

    def asarray(self, array: Any, dtype: Any = None) -> Array:
        """Move ``array`` onto this backend (a no-op when it is already there)."""
        if self.name == "cpu" and type(array).__module__.startswith("cupy"):
            array = array.get()
        return self.xp.asarray(array, dtype=dtype)

    def to_host(self, array: Array) -> np.ndarray:
        """Return ``array`` as a NumPy array (copying from the GPU when needed; host arrays pass)."""
        return array.get() if type(array).__module__.startswith("cupy") else np.asarray(array)

    def device_key(self) -> Hashable:
        """Where this backend's arrays live now: ``"cpu"``, or ``("gpu", current CUDA device id)``
        (caches of device data are per device)."""
        return "cpu" if self.name == "cpu" else ("gpu", self.xp.cuda.Device().id)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing); a no-op on the CPU."""
        if self.name == "gpu":
            self.xp.cuda.get_current_stream().synchronize()  # sync: timing only


@functools.lru_cache(maxsize=None)
def _cupy() -> ModuleType | None:
    try:
        import cupy  # noqa: PLC0415 - lazy by design
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def gpu_usable() -> bool:
    """Return whether CuPy imports and reports a usable CUDA device."""
    cupy = _cupy()
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _cpu_backend() -> Backend:
    return Backend("cpu", np)


@functools.lru_cache(maxsize=None)
def _gpu_backend() -> Backend:
    import cupyx.scipy.sparse  # noqa: PLC0415

    return Backend("gpu", _cupy(), cupyx.scipy.sparse)


def get(device: str = "auto") -> Backend:
    """Return the backend for ``device``.

    Parameters
    ----------
    device : {"cpu", "gpu", "auto"}
        ``"auto"`` picks the GPU when one is usable, else the CPU.

    Returns
    -------
    Backend

    Raises
    ------
    GPUUnavailableError
        ``device="gpu"`` and no GPU is usable.
    ValueError
        ``device`` is not one of the three names.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device == "cpu":
        return _cpu_backend()
    if gpu_usable():
        return _gpu_backend()
    if device == "auto":
        return _cpu_backend()
    reason = "CuPy is not installed" if _cupy() is None else "cupy.cuda.is_available() is False"
    raise GPUUnavailableError(
        f"device='gpu' was requested but no GPU is usable ({reason}); "
        "install the 'gpu' extra on a CUDA machine, or use device='cpu' or 'auto'"
    )


def of(array: Array) -> Backend:
    """Return the backend that owns ``array`` (CuPy arrays -> GPU, anything else -> CPU)."""
    if type(array).__module__.startswith("cupy"):
        return _gpu_backend()
    return _cpu_backend()


def twin(cpu: Callable[..., Any], gpu: Callable[..., Any]) -> Callable[..., Any]:
    """Build a dispatcher over a NumPy twin and a GPU twin of one operation.

    The returned function takes the :class:`Backend` as its first argument and calls the matching
    implementation with the remaining arguments.

    Parameters
    ----------
    cpu, gpu : callable
        Implementations with identical signatures and results (up to the backend's array type).

    Examples
    --------
    >>> double = twin(cpu=lambda be, a: 2 * a, gpu=lambda be, a: 2 * a)
    >>> int(double(get("cpu"), 21))
    42
    """
    table = {"cpu": cpu, "gpu": gpu}

    @functools.wraps(cpu)
    def dispatch(be: Backend, *args: Any, **kwargs: Any) -> Any:
        return table[be.name](be, *args, **kwargs)

    dispatch.twins = table  # type: ignore[attr-defined]  # parity tests reach both twins
    return dispatch
