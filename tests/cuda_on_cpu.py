"""Compile a RawKernel source with g++ for the CPU and load it with ctypes.

``cuda_shim.h`` defines what a ``rawkernels/*.cu`` source needs from CUDA and runs a grid block after
block, the threads of a block as cooperative fibers that meet at every ``__syncthreads`` (a barrier
that not every thread of a block reaches aborts the launch with a message). ``SHIM_LAUNCH(grid, block,
kernel<...>(...))`` runs a launch from a C wrapper. Tests compare this against the NumPy twins, which
checks index arithmetic, bounds, barriers and dtype handling without a GPU. The CuPy stand-in
(``tests/cupy_standin``) builds the same header under CuPy's calling convention.
"""

from __future__ import annotations

import ctypes
import hashlib
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

RAWKERNELS = pathlib.Path(__file__).resolve().parents[1] / "rawkernels"

SHIM_HEADER = pathlib.Path(__file__).resolve().parent / "cuda_shim.h"
SHIM = f'#include "{SHIM_HEADER}"\n'


def compile_for_cpu(cu_file: str, wrappers: str) -> ctypes.CDLL:
    """Build ``rawkernels/<cu_file>`` plus C wrappers into a shared library (cached by content).

    ``wrappers`` defines ``extern "C"`` functions taking ``int grid, int block`` plus the kernel's
    arguments and calling ``SHIM_LAUNCH(grid, block, kernel<...>(...))``.
    """
    if shutil.which("g++") is None:
        pytest.skip("g++ is not available to run kernel sources on the CPU")
    path = RAWKERNELS / cu_file
    text = SHIM + f'#include "{path}"\n' + wrappers
    digest = hashlib.sha256((text + path.read_text() + SHIM_HEADER.read_text()).encode()).hexdigest()[:16]
    build_dir = pathlib.Path(tempfile.gettempdir()) / "sparse-scan-cuda-on-cpu"
    build_dir.mkdir(exist_ok=True)
    library = build_dir / f"{path.stem}-{digest}.so"
    if not library.exists():
        cpp = build_dir / f"{path.stem}-{digest}.cpp"
        cpp.write_text(text)
        partial = library.with_suffix(".tmp.so")
        result = subprocess.run(
            ["g++", "-std=c++20", "-pthread", "-O1", "-shared", "-fPIC", "-Wall", "-Werror",
             "-Wno-unused-variable", "-o", str(partial), str(cpp)],
            capture_output=True, text=True,
        )
        if result.returncode:
            raise RuntimeError(f"g++ could not build {cu_file} for the CPU:\n{result.stderr}")
        partial.replace(library)
    return ctypes.CDLL(str(library))


def pointer(array: np.ndarray) -> ctypes.c_void_p:
    """A ctypes pointer to a C-contiguous array's buffer."""
    assert array.flags.c_contiguous, "kernels take contiguous arrays"
    return ctypes.c_void_p(array.ctypes.data)
