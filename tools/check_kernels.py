#!/usr/bin/env python3
"""Compile every RawKernel instantiation the glue can request, the way CuPy compiles it, without a GPU.

    python tools/check_kernels.py [--arch 80 --arch 90] [--rawkernels DIR]

``nvcc --ptx`` of a bare ``.cu`` file emits no kernel for a template that nothing instantiates and
checks only its syntax: a template body calling a helper with the wrong arguments passes it. CuPy
compiles a ``cupy.RawModule(code=..., options=..., name_expressions=[...])`` with NVRTC, which
instantiates exactly the name expressions it is given. This tool does the same, file by file, from the
one registry the glue uses (``sparse_scan._gpu_kernels.INSTANTIATIONS``): each file is compiled once per
architecture with all its name expressions, through CuPy's own
``cupy.cuda.compiler.compile_using_nvrtc``, and the lowered (mangled) name of every expression is
checked. It prints one line per instantiation and architecture, NVRTC's log (file and line of the error)
for a file that does not compile, and a summary; it exits 0 when all compile, 1 on any error, and 2 when
CuPy or NVRTC is missing (``pip install -e '.[nvrtc]'``: ``cupy-cuda13x`` and ``nvidia-cuda-nvrtc``).

The options are what ``RawModule`` passes on a GPU of that architecture (CuPy 14, checked in
``cupy/_core/core.pyx`` and ``cupy/cuda/compiler.py``):

- ``cupy._core.core.assemble_cupy_compiler_options(COMPILE_OPTIONS)``: CuPy's CCCL and CUDA include
  folders around our ``COMPILE_OPTIONS`` (``-std=c++17``); ``RawModule`` does not prepend CuPy's
  headers to the source (``prepend_cupy_headers=False``);
- ``-ftz=true``, added by ``_compile_with_cache_cuda``;
- ``-arch=sm_XX`` (a cubin), from ``_get_arch_for_options_for_nvrtc``, and
  ``--device-as-default-execution-space``, both added by ``compile_using_nvrtc`` itself (plus ``--pch``
  when ``CUPY_NVRTC_USE_PCH=1``, which changes no code).

``_get_arch_for_options_for_nvrtc`` is memoized per device and so asks the driver for the current device
even when given an architecture; this tool replaces it, for its own run only, by a function returning
``("-arch=sm_XX", "cubin")``: what CuPy returns for a GPU of compute capability XX (below NVRTC's
maximum, without ``CUPY_COMPILE_WITH_PTX``). The rest runs without a driver.

Cost, measured on the shared 2-core development machine (CuPy 14.2, NVRTC 13.5 from the
nvidia-cuda-nvrtc wheel): 24 instantiations from 4 files for each of sm_80 and sm_90, i.e. 8 NVRTC
compilations of 0.4 s (scan.cu) to 1.8 s (conv.cu) each, 5.4-6.1 s in all; 6.0-6.6 s of wall time
with Python start-up and CuPy's import (0.5 s).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import pathlib
import re
import sys
import time
from types import ModuleType
from typing import Any, Iterator, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the registry of this checkout, installed or not

from sparse_scan import _gpu_kernels  # noqa: E402 - after the path above

DEFAULT_ARCHS = ("80", "90")
INSTALL_HINT = "pip install -e '.[nvrtc]' (cupy-cuda13x and nvidia-cuda-nvrtc)"


class Unavailable(Exception):
    """CuPy or NVRTC cannot be loaded (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class FileResult:
    """One file compiled for one architecture: the lowered name of each expression that compiled,
    NVRTC's error log (empty when it compiled) and its warnings."""

    arch: str
    filename: str
    expressions: tuple[str, ...]
    mapping: dict[str, str]
    error: str
    warnings: str

    @property
    def failed(self) -> int:
        """How many of the file's instantiations did not compile (or have no lowered name)."""
        return sum(not self.mapping.get(name) for name in self.expressions)


def load_compiler() -> tuple[ModuleType, tuple[str, ...], str]:
    """CuPy's compiler module, the options ``RawModule`` passes before the architecture, and a version
    line; raise :class:`Unavailable` when CuPy or NVRTC cannot be loaded."""
    try:
        import cupy  # noqa: PLC0415 - optional: the tool exits 2 without it
        import cupy.cuda.compiler as compiler  # noqa: PLC0415
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable here"
        raise Unavailable(f"CuPy cannot be imported ({type(error).__name__}: {error})") from error
    try:
        nvrtc = compiler._get_nvrtc_version()
    except Exception as error:  # noqa: BLE001 - a missing libnvrtc surfaces as various errors
        raise Unavailable(f"NVRTC cannot be loaded ({type(error).__name__}: {error})") from error
    core = sys.modules.get("cupy._core.core")
    assemble = getattr(core, "assemble_cupy_compiler_options", None)
    options = tuple(assemble(_gpu_kernels.COMPILE_OPTIONS)) if assemble else _gpu_kernels.COMPILE_OPTIONS
    version = f"CuPy {cupy.__version__}, NVRTC {nvrtc[0]}.{nvrtc[1]}"
    return compiler, options + ("-ftz=true",), version


@contextlib.contextmanager
def pinned_arch(compiler: ModuleType, arch: str) -> Iterator[None]:
    """Within the block, CuPy's architecture choice is ``arch`` instead of the current device's.

    ``_get_arch_for_options_for_nvrtc`` needs a driver (it is memoized per device); for a GPU of compute
    capability ``arch`` CuPy returns exactly ``("-arch=sm_<arch>", "cubin")``.
    """
    original = compiler._get_arch_for_options_for_nvrtc

    def for_arch(arch_: Any = None) -> tuple[str, str]:
        return f"-arch=sm_{arch}", "cubin"

    compiler._get_arch_for_options_for_nvrtc = for_arch
    try:
        yield
    finally:
        compiler._get_arch_for_options_for_nvrtc = original


def compile_file(compiler: ModuleType, options: tuple[str, ...], path: pathlib.Path,
                 expressions: Sequence[str], arch: str) -> FileResult:
    """Compile ``path`` once for ``arch`` with all ``expressions``, as ``cupy.RawModule`` would."""
    log = io.StringIO()
    mapping: dict[str, str] = {}
    error = ""
    with pinned_arch(compiler, arch):
        try:
            _, lowered = compiler.compile_using_nvrtc(
                path.read_text(), options=options, arch=arch, filename=path.name,
                name_expressions=list(expressions), log_stream=log)
            mapping = dict(lowered or {})
        except compiler.CompileException as exception:
            error = _real_paths(exception.get_message(), path) or "NVRTC failed without a log"
    return FileResult(arch, path.name, tuple(expressions), mapping, error, _real_paths(log.getvalue(), path))


def _real_paths(log: str, path: pathlib.Path) -> str:
    """NVRTC's log with the path of CuPy's temporary copy replaced by the source's own path."""
    return re.sub(r"[^\s\"]*/" + re.escape(path.name) + r"\b", str(path), log.strip())


def report(result: FileResult) -> list[str]:
    """The output lines of one file and architecture: one per instantiation, then NVRTC's log."""
    arch, width = f"sm_{result.arch}", max(len(name) for name in result.expressions)
    lines = []
    for name in result.expressions:
        lowered = result.mapping.get(name)
        status = "ok  " if lowered else "FAIL"
        lines.append(f"{status} {arch}  {result.filename}  {name:<{width}}  -> {lowered or 'not compiled'}")
    lines += ["     " + line for line in result.error.splitlines()]
    lines += ["     NVRTC warning: " + line for line in result.warnings.splitlines()]
    return lines


def unregistered(folder: pathlib.Path) -> list[str]:
    """``.cu`` files of ``folder`` that the registry does not list (nothing would compile them)."""
    return sorted(p.name for p in folder.glob("*.cu") if p.name not in _gpu_kernels.INSTANTIATIONS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line: ``--arch`` (repeatable, ``90`` or ``sm_90``) and ``--rawkernels``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", metavar="CC",
                        help="compute capability to compile for, e.g. 90 (repeatable; default: 80 and 90)")
    parser.add_argument("--rawkernels", type=pathlib.Path, default=REPO / "rawkernels", metavar="DIR",
                        help="folder of the .cu sources (default: the repository's rawkernels/)")
    args = parser.parse_args(argv)
    args.arch = [a.removeprefix("sm_") for a in (args.arch or DEFAULT_ARCHS)]
    for arch in args.arch:
        if not arch.isdigit():
            parser.error(f"--arch takes a compute capability such as 80 or 90; got {arch!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; return the exit status (0 ok, 1 an error, 2 CuPy or NVRTC missing)."""
    args = parse_args(argv)
    try:
        compiler, options, version = load_compiler()
    except Unavailable as error:
        print(f"check_kernels: {error}; install them: {INSTALL_HINT}", file=sys.stderr)
        return 2
    print(f"check_kernels: {version}; options as cupy.RawModule passes them: {' '.join(options)} "
          "-arch=sm_XX --device-as-default-execution-space")
    start, count, failed = time.perf_counter(), 0, 0
    for name in unregistered(args.rawkernels):
        print(f"FAIL {name}: not in sparse_scan._gpu_kernels.INSTANTIATIONS (nothing would compile it)")
        failed += 1
    for filename in _gpu_kernels.INSTANTIATIONS:
        path, expressions = args.rawkernels / filename, _gpu_kernels.name_expressions(filename)
        count += len(expressions) * len(args.arch)
        if not path.is_file():
            print(f"FAIL {filename}: registered in sparse_scan._gpu_kernels.INSTANTIATIONS but not in "
                  f"{args.rawkernels}")
            failed += len(expressions) * len(args.arch)
            continue
        for arch in args.arch:
            result = compile_file(compiler, options, path, expressions, arch)
            print("\n".join(report(result)), flush=True)
            failed += result.failed
    archs = ", ".join(f"sm_{a}" for a in args.arch)
    outcome = "all ok" if failed == 0 else f"{failed} FAILED"
    print(f"check_kernels: {count} instantiations ({count // max(1, len(args.arch))} per arch; {archs}) "
          f"from {len(_gpu_kernels.INSTANTIATIONS)} files in {time.perf_counter() - start:.1f} s: {outcome}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
