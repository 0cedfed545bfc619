"""Loading and launching the CUDA RawKernels shipped in :mod:`sparse_scan.rawkernels`.

Sources are read as text from the package data. :data:`INSTANTIATIONS` is the one list of the template
instantiations the glue may request, per source file; each file is compiled by CuPy once per device,
with all its instantiations as ``name_expressions`` (``tools/check_kernels.py`` compiles the same list
with CuPy's NVRTC path, for sm_80 and sm_90, where no GPU is at hand). Kernels are written as
grid-stride loops, so any launch size covers any problem size. Only GPU twins call into this module, so
CuPy is imported here lazily.
"""

from __future__ import annotations

import importlib.resources
import itertools
from typing import Any, Final, Sequence

import numpy as np

from ._types import Array

__all__ = ["COMPILE_OPTIONS", "INSTANTIATIONS", "cupy_module", "current_device", "device_pointer",
           "expression", "function", "launch", "launch_blocks", "name_expressions", "source",
           "type_name"]

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65535 * 8
#: The options of every ``cupy.RawModule`` built here (CuPy adds ``-ftz=true`` and the architecture).
COMPILE_OPTIONS: Final[tuple[str, ...]] = ("-std=c++17",)

_INDEX: Final = (np.dtype(np.int32), np.dtype(np.int64))
_VALUE: Final = (np.dtype(np.float32), np.dtype(np.float64))

#: Per ``rawkernels/`` file, every kernel and the domain of each of its template parameters (in order):
#: the glue may request any combination, and each file is compiled with all of them.
INSTANTIATIONS: Final[dict[str, dict[str, tuple[tuple[np.dtype[Any], ...], ...]]]] = {
    "scan.cu": {"scan_level": (_INDEX, _VALUE)},
    "dense_scan.cu": {"dense_scan_level": (_VALUE,), "dense_scan_tiled": (_VALUE,),
                      "dense_scan_chain": (_VALUE,)},
    "pooling.cu": {"pool_row_counts": (_INDEX,), "pool_fill": (_INDEX,), "maxpool_values": (_INDEX, _VALUE)},
    "conv.cu": {"conv_jt_fill_pattern": (_INDEX,), "conv_jt_fill_values": (_INDEX, _VALUE),
                "pruned_conv_forward": (_VALUE,), "pruned_conv_weight_grad": (_VALUE,)},
}

_MODULES: dict[tuple[int, str], Any] = {}
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


def expression(kernel: str, template_dtypes: Sequence[Any] = ()) -> str:
    """The CUDA name expression of ``kernel<T...>``.

    Examples
    --------
    >>> import numpy as np
    >>> expression("scan_level", (np.int64, np.float32))
    'scan_level<long long, float>'
    """
    if not template_dtypes:
        return kernel
    return kernel + "<" + ", ".join(type_name(d) for d in template_dtypes) + ">"


def name_expressions(filename: str) -> list[str]:
    """Every name expression of ``filename`` in :data:`INSTANTIATIONS`, in the registry's order.

    Examples
    --------
    >>> name_expressions("scan.cu")  # doctest: +NORMALIZE_WHITESPACE
    ['scan_level<int, float>', 'scan_level<int, double>', 'scan_level<long long, float>',
     'scan_level<long long, double>']
    """
    if filename not in INSTANTIATIONS:
        raise ValueError(f"no kernel source {filename!r} is registered; known: {sorted(INSTANTIATIONS)}")
    return [expression(kernel, dtypes)
            for kernel, domains in INSTANTIATIONS[filename].items()
            for dtypes in itertools.product(*domains)]


def _check_registered(filename: str, kernel: str, template_dtypes: tuple[Any, ...]) -> str:
    """The name expression of a request, or a ValueError if the registry does not list it."""
    kernels = INSTANTIATIONS.get(filename)
    if kernels is None:
        raise ValueError(f"no kernel source {filename!r} is registered in "
                         f"sparse_scan._gpu_kernels.INSTANTIATIONS; known: {sorted(INSTANTIATIONS)}")
    domains = kernels.get(kernel)
    if domains is None:
        raise ValueError(f"{filename} has no registered kernel {kernel!r}; known: {sorted(kernels)}")
    dtypes = tuple(np.dtype(d) for d in template_dtypes)
    if len(dtypes) != len(domains) or any(d not in domain for d, domain in zip(dtypes, domains, strict=True)):
        allowed = " x ".join("{" + ", ".join(str(d) for d in domain) + "}" for domain in domains)
        raise ValueError(f"{filename}: {kernel}<{', '.join(str(d) for d in dtypes)}> is not a registered "
                         f"instantiation; {kernel} takes {allowed} (sparse_scan._gpu_kernels.INSTANTIATIONS)")
    return expression(kernel, dtypes)


def function(filename: str, kernel: str, *template_dtypes: Any) -> Any:
    """Return the compiled kernel ``kernel<T...>`` from ``filename`` on the current device.

    The request must be listed in :data:`INSTANTIATIONS` (checked before CuPy is imported; a
    ValueError otherwise). The file is compiled once per device with all its name expressions, so the
    first request compiles every instantiation and later ones only look the kernel up.
    """
    name = _check_registered(filename, kernel, template_dtypes)
    import cupy  # noqa: PLC0415 - GPU twins only

    key = (cupy.cuda.Device().id, filename)
    module = _MODULES.get(key)
    if module is None:
        module = cupy.RawModule(code=source(filename), options=COMPILE_OPTIONS,
                                name_expressions=name_expressions(filename))
        _MODULES[key] = module
    return module.get_function(name)


def launch(kernel: Any, work_items: int, args: Sequence[Any]) -> None:
    """Launch a grid-stride kernel over ``work_items`` items (at least one block)."""
    blocks = max(1, min((int(work_items) + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK, MAX_BLOCKS))
    kernel((blocks,), (THREADS_PER_BLOCK,), tuple(args))


def launch_blocks(kernel: Any, blocks: int, threads: int, args: Sequence[Any]) -> None:
    """Launch a kernel whose work is cut by thread block (one block per sample, say; it loops when
    there are more than the launch's blocks) with ``threads`` threads per block."""
    kernel((max(1, min(int(blocks), MAX_BLOCKS)),), (int(threads),), tuple(args))


def cupy_module() -> Any:
    """CuPy, imported on first use (GPU code only)."""
    import cupy  # noqa: PLC0415 - GPU code only

    return cupy


def current_device() -> int:
    """The id of the current CUDA device (caches of device data are per device)."""
    return int(cupy_module().cuda.Device().id)


def device_pointer(array: Array) -> int:
    """The device address of a CuPy array's data, as an integer for a descriptor table."""
    return int(array.data.ptr)
