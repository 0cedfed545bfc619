"""The stand-in's ``cupy.RawModule`` / ``cupy.RawKernel``: the CUDA source built by g++, launched with
CuPy's calling convention.

``RawModule(code=..., options=..., name_expressions=[...])`` builds the source with
``tests/cuda_shim.h`` (blocks one after another, a block's threads as fibers meeting at barriers) and
one C entry point per name expression, which takes the kernel by address (so a template
instantiates exactly as NVRTC instantiates it for that expression). Each entry point also reports the
kernel's parameter types, so a launch is checked as strictly as a GPU would punish it:

- ``grid`` and ``block`` are tuples of 1-3 positive ints within CUDA's limits (block 1024 threads,
  x/y ≤ 1024, z ≤ 64; grid x < 2^31, y/z ≤ 65535), and the block within the kernel's
  ``__launch_bounds__``;
- ``args`` is a tuple with one value per kernel parameter: a device array for a pointer (C-contiguous,
  of the pointee's dtype), a NumPy scalar of the parameter's exact type and width (CuPy passes a Python
  ``int`` as 8 bytes and a ``float`` as a double: refused for an ``int``/``float`` parameter), ``None``
  for a null pointer; a host ``numpy.ndarray`` is refused as CuPy refuses it;
- ``get_function`` knows only the module's name expressions.

Every launch is recorded in :data:`~._array.STATS`. What this cannot show: races between blocks (they
run one after another), streams and asynchrony, the GPU's rounding (FMA contraction, flush-to-zero),
memory limits and out-of-bounds accesses (``tools/gpu_run.sh``'s compute-sanitizer call does that).
"""

from __future__ import annotations

import ctypes
import hashlib
import pathlib
import re
import shutil
import subprocess
import tempfile
from typing import Any, Sequence

import numpy as np

from ._array import STATS, ndarray

SHIM_HEADER = pathlib.Path(__file__).resolve().parents[1] / "cuda_shim.h"
BUILD_DIR = pathlib.Path(tempfile.gettempdir()) / "sparse-scan-cupy-standin"
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_THREADS = 1024
MAX_SHARED = 48 * 1024

_KINDS = {"i": "signed integer", "u": "unsigned integer", "f": "floating", "b": "bool"}


class CompileException(Exception):
    """The source did not build (the stand-in's counterpart of CuPy's NVRTC error)."""


class LaunchError(RuntimeError):
    """A launch the GPU would refuse or that would misbehave on it (bad configuration, arguments,
    or barriers not reached by every thread of a block)."""


def _launch_bounds(code: str) -> dict[str, str]:
    """Kernel name -> the expression of its ``__launch_bounds__`` (its maximum threads per block)."""
    return {name: bound for bound, name in
            re.findall(r"__launch_bounds__\(\s*([^,)]+)[^)]*\)\s*(\w+)\s*\(", code)}


def _build(code: str, options: Sequence[str], expressions: Sequence[str]) -> ctypes.CDLL:
    if shutil.which("g++") is None:
        raise CompileException("g++ is needed to build CUDA sources for the CuPy stand-in")
    bounds = _launch_bounds(code)
    entries = []
    for k, expression in enumerate(expressions):
        kernel = expression.split("<", 1)[0].strip()
        bound = bounds.get(kernel, str(MAX_THREADS))
        entries.append(
            f'extern "C" int standin_launch_{k}(const unsigned* grid, const unsigned* block, void** args)'
            f" {{ return shim::launch(&{expression}, grid, block, args); }}\n"
            f'extern "C" const char* standin_signature_{k}()'
            f" {{ static const std::string s = shim::signature(&{expression}); return s.c_str(); }}\n"
            f'extern "C" long long standin_bounds_{k}() {{ return (long long)({bound}); }}\n')
    defines = [o for o in options if o.startswith(("-D", "-U"))]
    text = (f'#include "{SHIM_HEADER}"\n#line 1 "rawkernel.cu"\n{code}\n#line 1 "standin_entries.cpp"\n'
            + "".join(entries)
            + 'extern "C" const char* standin_error() { return shim::error_text; }\n')
    digest = hashlib.sha256((text + SHIM_HEADER.read_text() + " ".join(defines)).encode()).hexdigest()[:20]
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    library = BUILD_DIR / f"module-{digest}.so"
    if not library.exists():
        source = BUILD_DIR / f"module-{digest}.cpp"
        source.write_text(text)
        partial = BUILD_DIR / f"module-{digest}.{id(text)}.tmp.so"
        result = subprocess.run(
            ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unused-variable",
             "-Wno-unused-function", *defines, "-o", str(partial), str(source)],
            capture_output=True, text=True)
        if result.returncode:
            raise CompileException(f"the CuPy stand-in could not build the kernel source:\n{result.stderr}")
        partial.replace(library)
    return ctypes.CDLL(str(library))


class RawModule:
    """``cupy.RawModule``: ``code=`` with ``name_expressions`` (``path=`` takes cubin/PTX in CuPy,
    which the stand-in cannot run)."""

    def __init__(self, code: str | None = None, *, path: str | None = None, options: tuple = (),
                 backend: str = "nvrtc", translate_cucomplex: bool = False,
                 enable_cooperative_groups: bool = False, name_expressions: Sequence[str] | None = None,
                 jitify: Any = None) -> None:
        if code is None or path is not None:
            raise NotImplementedError("the CuPy stand-in builds RawModule(code=...) only")
        if not isinstance(options, tuple):
            raise TypeError(f"options must be a tuple of str; got {type(options)}")
        if backend != "nvrtc":
            raise ValueError(f"the CuPy stand-in compiles like backend='nvrtc'; got {backend!r}")
        self.code, self.options = code, options
        self.name_expressions = None if name_expressions is None else tuple(name_expressions)
        self._library: ctypes.CDLL | None = None

    def _module(self) -> ctypes.CDLL:
        if self._library is None:
            if not self.name_expressions:
                raise NotImplementedError("the CuPy stand-in needs name_expressions (it builds the entry "
                                          "points of exactly those kernels)")
            self._library = _build(self.code, self.options, self.name_expressions)
        return self._library

    def get_function(self, name: str) -> "RawKernel":
        """The kernel ``name``, which must be one of the module's name expressions."""
        if self.name_expressions is None or name not in self.name_expressions:
            raise LaunchError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name!r} is not among the "
                              f"module's name_expressions {self.name_expressions}")
        library = self._module()
        k = self.name_expressions.index(name)
        return RawKernel._bound(name, library, k)


class RawKernel:
    """A kernel of a :class:`RawModule`: ``kernel(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, code: str, name: str, options: tuple = (), **kwargs: Any) -> None:
        module = RawModule(code=code, options=options, name_expressions=[name])
        bound = module.get_function(name)
        self.__dict__.update(bound.__dict__)

    @classmethod
    def _bound(cls, name: str, library: ctypes.CDLL, k: int) -> "RawKernel":
        self = cls.__new__(cls)
        self.name = name
        self._launch = getattr(library, f"standin_launch_{k}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                 ctypes.POINTER(ctypes.c_void_p)]
        signature = getattr(library, f"standin_signature_{k}")
        signature.restype = ctypes.c_char_p
        self.parameters = [p for p in signature().decode().split(",") if p]
        bounds = getattr(library, f"standin_bounds_{k}")
        bounds.restype = ctypes.c_longlong
        self.max_threads = int(bounds())
        error = library.standin_error
        error.restype = ctypes.c_char_p
        self._error = error
        return self

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, shared_mem: int = 0, stream: Any = None,
                 enable_cooperative_groups: bool = False) -> None:
        grid3 = self._dims("grid", grid, MAX_GRID)
        block3 = self._dims("block", block, MAX_BLOCK)
        threads = block3[0] * block3[1] * block3[2]
        if threads > min(MAX_THREADS, self.max_threads):
            raise LaunchError(f"{self.name}: {threads} threads per block exceed "
                              f"{'its __launch_bounds__ of ' if self.max_threads < MAX_THREADS else ''}"
                              f"{min(MAX_THREADS, self.max_threads)} (cudaErrorInvalidValue)")
        if not 0 <= int(shared_mem) <= MAX_SHARED:
            raise LaunchError(f"{self.name}: shared_mem={shared_mem} bytes is over the 48 KiB default limit")
        if not isinstance(args, tuple):
            raise TypeError(f"{self.name}: args must be a tuple; got {type(args).__name__}")
        if len(args) != len(self.parameters):
            raise LaunchError(f"{self.name} takes {len(self.parameters)} arguments "
                              f"({','.join(self.parameters)}); got {len(args)}")
        keep = [self._argument(position, parameter, value)
                for position, (parameter, value) in enumerate(zip(self.parameters, args, strict=True))]
        pointers = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.addressof(v) for v in keep])
        STATS.launches.append((self.name, grid3, block3))
        if self._launch((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), pointers):
            raise LaunchError(f"{self.name} (grid {grid3}, block {block3}): {self._error().decode()}")

    def _dims(self, what: str, dims: Any, limits: tuple[int, int, int]) -> tuple[int, int, int]:
        if not isinstance(dims, tuple) or not 1 <= len(dims) <= 3:
            raise TypeError(f"{self.name}: {what} must be a tuple of 1 to 3 ints; got {dims!r}")
        values = []
        for axis, value in enumerate(dims):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{self.name}: {what}[{axis}] must be an int; got {type(value).__name__}")
            if not 1 <= int(value) <= limits[axis]:
                raise LaunchError(f"{self.name}: {what}[{axis}] = {int(value)} is outside CUDA's limits "
                                  f"1..{limits[axis]} (cudaErrorInvalidConfiguration)")
            values.append(int(value))
        return tuple(values + [1] * (3 - len(values)))  # type: ignore[return-value]

    def _argument(self, position: int, parameter: str, value: Any) -> ctypes._SimpleCData:
        where = f"{self.name}: argument {position} ({parameter})"
        if isinstance(value, np.ndarray):
            raise TypeError(f"{where}: Unsupported type {type(value)} (a host array passed to a kernel)")
        if value is None or isinstance(value, ndarray):
            if not parameter.startswith("p"):
                raise LaunchError(f"{where}: a device array given for a {_describe(parameter)} parameter")
            if value is None:
                return ctypes.c_void_p(0)
            if not value.flags.c_contiguous:
                raise LaunchError(f"{where}: a kernel takes the array's data pointer; this array is not "
                                  "C-contiguous (CuPy would pass the pointer all the same)")
            pointee = parameter[1:]
            if pointee != "v0" and not _matches(pointee, value.dtype):
                raise LaunchError(f"{where}: an array of {value.dtype} given for a pointer to "
                                  f"{_describe(pointee)}")
            return ctypes.c_void_p(value.data.ptr)
        if isinstance(value, bool) or isinstance(value, int):
            value = np.int64(value)  # CuPy: a Python int (bool too) goes as 8 bytes
        elif isinstance(value, float):
            value = np.float64(value)
        elif not isinstance(value, np.generic):
            raise TypeError(f"{where}: Unsupported type {type(value)}")
        if parameter.startswith("p"):
            raise LaunchError(f"{where}: a scalar ({value.dtype}) given for a pointer parameter")
        if not _matches(parameter, value.dtype):
            raise LaunchError(f"{where}: a {value.dtype} scalar given for a {_describe(parameter)} "
                              "parameter (pass the NumPy scalar type of the parameter's exact width)")
        buffer = (ctypes.c_char * value.itemsize).from_buffer_copy(value.tobytes())
        return buffer


def _matches(parameter: str, dtype: np.dtype) -> bool:
    kind, size = parameter[0], int(parameter[1:])
    dtype = np.dtype(dtype)
    return dtype.itemsize == size and {"i": "i", "u": "u", "f": "f", "b": "b"}.get(kind) == dtype.kind


def _describe(parameter: str) -> str:
    if parameter.startswith("p"):
        return "pointer"
    return f"{int(parameter[1:]) * 8}-bit {_KINDS.get(parameter[0], 'struct')}"
