#!/usr/bin/env python3
"""Build the distribution and check what a user gets from ``pip install``.

Run as ``make wheel-check`` (CI runs it from ``.ci/run``). Steps:

1. ``python -m build`` into a temporary folder outside the repository: the sdist first, then the wheel
   built *from the sdist*, so a file missing from the sdist, or stale output in ``build/``, cannot hide.
2. Inspect the wheel: the only top-level entries are ``sparse_scan/`` and its ``.dist-info`` (no generic
   ``cli`` or ``rawkernels`` module), every ``rawkernels/*.cu``/``*.cuh`` of the source tree is inside
   ``sparse_scan/rawkernels/``, and the ``sparse-scan`` console script points at the click group.
3. Create a fresh virtual environment outside the repository, ``pip install`` the wheel there, and from
   a working directory outside the repository run ``sparse-scan --version`` and a Python check that the
   kernels are readable through :mod:`importlib.resources` and that nothing but ``sparse_scan`` was added
   to site-packages.

Needs the ``build`` package (part of the ``test`` extra) and network access (or a local index) for the
build requirements and the runtime dependencies. Exits non-zero with a message naming the first problem.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cu", ".cuh")
ENTRY_POINT = "sparse-scan = sparse_scan.cli.app:main"
# Folders of the repository that must never become top-level modules of the installed distribution.
FORBIDDEN_TOP_LEVEL = ("cli", "rawkernels", "tests", "bench", "data", "tools")

INSTALLED_CHECK = r"""
import importlib.resources, importlib.util, json, pathlib, sys, sysconfig
import sparse_scan
from sparse_scan import _gpu_kernels

expected = set(json.loads(sys.argv[1]))
forbidden = json.loads(sys.argv[2])
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
package = pathlib.Path(sparse_scan.__file__).resolve().parent
assert package.parent == site, f"sparse_scan imported from {package}, not from {site}"
kernels = importlib.resources.files("sparse_scan.rawkernels")
found = {entry.name for entry in kernels.iterdir() if entry.name.endswith((".cu", ".cuh"))}
assert found == expected, f"kernels in the installed package: {sorted(found)}; expected {sorted(expected)}"
for name in sorted(expected):
    text = kernels.joinpath(name).read_text()
    assert text.strip(), f"{name} is empty"
    assert _gpu_kernels.source(name) == text, f"_gpu_kernels.source({name!r}) differs from the resource"
for name in forbidden:
    assert importlib.util.find_spec(name) is None, f"a top-level module {name!r} is importable"
    assert not (site / name).exists() and not (site / f"{name}.py").exists(), f"{name} in {site}"
import sparse_scan.cli.app  # the console script's target imports cleanly
print(f"installed check: {len(found)} kernel sources via importlib.resources, no generic top-level module")
"""


class CheckError(RuntimeError):
    """A problem with the built distribution."""


def run(cmd: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None) -> str:
    """Run ``cmd``, echoing it; return its stdout, or raise CheckError with its output on failure."""
    shown = [str(c) if "\n" not in str(c) else "<script>" for c in cmd]
    print("+", " ".join(shown), flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        raise CheckError(
            f"command failed with exit code {proc.returncode}: {' '.join(shown)}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def source_version() -> str:
    text = (REPO / "sparse_scan" / "_version.py").read_text()
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    if match is None:
        raise CheckError("no __version__ = '...' line in sparse_scan/_version.py")
    return match.group(1)


def source_kernels() -> list[str]:
    names = sorted(p.name for p in (REPO / "rawkernels").iterdir() if p.suffix in KERNEL_SUFFIXES)
    if not any(name.endswith(".cu") for name in names):
        raise CheckError("rawkernels/ holds no .cu file: nothing to ship")
    return names


def check_wheel_contents(wheel: pathlib.Path, version: str, kernels: list[str]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = f"sparse_scan-{version}.dist-info"
        top_level = {name.split("/", 1)[0] for name in names}
        unexpected = top_level - {"sparse_scan", dist_info}
        if unexpected:
            raise CheckError(f"unexpected top-level entries in {wheel.name}: {sorted(unexpected)}")
        missing = [k for k in kernels if f"sparse_scan/rawkernels/{k}" not in names]
        if missing:
            raise CheckError(f"kernel sources missing from {wheel.name}: {missing}")
        for required in ("sparse_scan/__init__.py", "sparse_scan/cli/app.py",
                         "sparse_scan/rawkernels/__init__.py", "sparse_scan/layers/__init__.py"):
            if required not in names:
                raise CheckError(f"{required} missing from {wheel.name}")
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
        if ENTRY_POINT not in entry_points.replace("  ", " "):
            raise CheckError(f"console script {ENTRY_POINT!r} not in entry_points.txt:\n{entry_points}")
    print(f"wheel contents: {len(names)} files, top level {sorted(top_level)}, kernels {kernels}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder and print it")
    args = parser.parse_args(argv)

    try:
        version = source_version()
        kernels = source_kernels()
    except CheckError as error:
        print(f"wheel-check FAILED: {error}", file=sys.stderr)
        return 1
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="sparse-scan-wheel-check-")).resolve()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    try:
        if REPO in workdir.parents:
            raise CheckError(f"temporary folder {workdir} is inside the repository")
        try:
            import build  # noqa: F401, PLC0415
        except ImportError:
            raise CheckError(
                f"the 'build' package is not installed for {sys.executable}; "
                "install the test extra (make install) first"
            ) from None
        dist = workdir / "dist"
        run([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], cwd=workdir, env=env)
        wheels = sorted(dist.glob("*.whl"))
        sdists = sorted(dist.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            raise CheckError(f"expected one wheel and one sdist in {dist}, got {sorted(dist.iterdir())}")
        check_wheel_contents(wheels[0], version, kernels)

        venv = workdir / "venv"
        run([sys.executable, "-m", "venv", str(venv)], cwd=workdir, env=env)
        bindir = venv / ("Scripts" if os.name == "nt" else "bin")
        python = bindir / "python"
        run([str(python), "-m", "pip", "install", "--quiet", str(wheels[0])], cwd=workdir, env=env)

        out = run([str(bindir / "sparse-scan"), "--version"], cwd=workdir, env=env).strip()
        if out != f"sparse-scan {version}":
            raise CheckError(f"`sparse-scan --version` printed {out!r}; expected 'sparse-scan {version}'")
        print(f"console script: {out}")
        out = run([str(bindir / "sparse-scan"), "--help"], cwd=workdir, env=env)
        if "Usage:" not in out:
            raise CheckError(f"`sparse-scan --help` printed no usage:\n{out}")

        print(run([str(python), "-I", "-c", INSTALLED_CHECK, json.dumps(kernels),
                   json.dumps(list(FORBIDDEN_TOP_LEVEL))], cwd=workdir, env=env).strip())
    except CheckError as error:
        print(f"wheel-check FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"wheel-check OK: sparse-scan {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
