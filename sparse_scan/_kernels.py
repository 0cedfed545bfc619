"""Loading and launching the CUDA RawKernels shipped in :mod:`sparse_scan.rawkernels`.

Sources are read as text from the package data and compiled by CuPy once per (device, file, template
instantiations); kernels are written as grid-stride loops, so any launch size covers any problem size.
Only GPU twins call into this module, so CuPy is imported here lazily.
"""

from __future__ import annotations

import importlib.resources
import weakref
from typing import Any, Sequence

import numpy as np

__all__ = ["cupy_module", "current_device", "device_pointer", "function", "launch", "launch_blocks",
           "per_plan", "source", "type_name", "upload_stream_ordered"]

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65535 * 8
_MODULES: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_CUDA_TYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.int32): "int",
    np.dtype(np.int64): "long long",
}


def source(filename: str) -> str:
    """Return the text of ``rawkernels/<filename>``."""
    return importlib.resources.files("sparse_scan.rawkernels").joinpath(filename).read_text()


def type_name(dtype: Any) -> str:
    """The CUDA spelling of a NumPy dtype, for template name expressions."""
    return _CUDA_TYPES[np.dtype(dtype)]


def function(filename: str, kernel: str, *template_dtypes: Any) -> Any:
    """Return the compiled kernel ``kernel<T...>`` from ``filename`` on the current device.

    Every instantiation the file declares in its ``NAME_EXPRESSIONS`` comment is not needed: the
    module is compiled per requested expression set and cached per device.
    """
    import cupy  # noqa: PLC0415 - GPU twins only

    expression = kernel
    if template_dtypes:
        expression += "<" + ", ".join(type_name(d) for d in template_dtypes) + ">"
    key = (cupy.cuda.Device().id, filename, (expression,))
    module = _MODULES.get(key)
    if module is None:
        module = cupy.RawModule(
            code=source(filename), options=("-std=c++17",), name_expressions=[expression]
        )
        _MODULES[key] = module
    return module.get_function(expression)


def launch(kernel: Any, work_items: int, args: Sequence[Any]) -> None:
    """Launch a grid-stride kernel over ``work_items`` items (at least one block)."""
    blocks = max(1, min((int(work_items) + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK, MAX_BLOCKS))
    kernel((blocks,), (THREADS_PER_BLOCK,), tuple(args))


def launch_blocks(kernel: Any, blocks: int, threads: int, args: Sequence[Any]) -> None:
    """Launch a kernel whose work is cut by thread block (one block per sample, say; it loops when
    there are more than the launch's blocks) with ``threads`` threads per block."""
    kernel((max(1, min(int(blocks), MAX_BLOCKS)),), (int(threads),), tuple(args))


def per_plan(store: dict[int, dict[Any, Any]], plan: Any) -> dict[Any, Any]:
    """The entry of ``store`` for ``plan`` (keyed by identity, dropped when the plan is collected):
    device workspaces live as long as the plan they were built for."""
    key = id(plan)
    if key not in store:
        store[key] = {}
        weakref.finalize(plan, store.pop, key, None)
    return store[key]


def cupy_module() -> Any:
    """CuPy, imported on first use (GPU code only)."""
    import cupy  # noqa: PLC0415 - GPU code only

    return cupy


def current_device() -> int:
    """The id of the current CUDA device (caches of device data are per device)."""
    return int(cupy_module().cuda.Device().id)


def device_pointer(array: Any) -> int:
    """The device address of a CuPy array's data, as an integer for a descriptor table."""
    return int(array.data.ptr)


def upload_stream_ordered(device: Any, host: np.ndarray) -> None:
    """Copy ``host`` into the device array, ordered on the current stream. (From pageable host memory
    CUDA may still return only once the copy is staged; ``host`` may be reused after the call.)"""
    device.set(host, stream=cupy_module().cuda.get_current_stream())
