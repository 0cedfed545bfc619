"""The installed package: kernel sources as package data, version and console script agree.

These tests check the installation the suite runs against (``make test`` installs the package in
editable mode first). ``make wheel-check`` checks a real wheel in a fresh virtual environment.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.resources
import pathlib
import subprocess
import sys
import sysconfig

import pytest

import sparse_scan
from sparse_scan import _gpu_kernels

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cu", ".cuh")


def _distribution():
    try:
        return importlib.metadata.distribution("sparse-scan")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"sparse-scan is not installed for {sys.executable}: run `make install` first")


def test_kernel_sources_are_package_resources():
    shipped = sorted(
        entry.name
        for entry in importlib.resources.files("sparse_scan.rawkernels").iterdir()
        if entry.name.endswith(KERNEL_SUFFIXES)
    )
    in_repo = sorted(p.name for p in (REPO / "rawkernels").iterdir() if p.suffix in KERNEL_SUFFIXES)
    assert shipped == in_repo
    assert any(name.endswith(".cu") for name in shipped), "no .cu file in sparse_scan.rawkernels"
    for name in shipped:
        text = _gpu_kernels.source(name)
        assert text.strip(), f"{name} is empty"
        assert text == (REPO / "rawkernels" / name).read_text()


def test_distribution_metadata():
    dist = _distribution()
    assert dist.version == sparse_scan.__version__
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"sparse-scan": "sparse_scan.cli.app:main"}
    requires = " ".join(dist.requires or [])
    for dependency in ("numpy", "scipy", "click", "pyyaml"):
        assert dependency in requires.lower()
    assert "cupy" in requires  # the gpu extra


def test_console_script_version():
    _distribution()
    script = pathlib.Path(sysconfig.get_path("scripts")) / "sparse-scan"
    if not script.exists():
        pytest.fail(f"console script {script} is missing: run `make install` first")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert result.stdout == f"sparse-scan {sparse_scan.__version__}\n"


def test_cli_module_runs_with_python_m():
    result = subprocess.run(
        [sys.executable, "-m", "sparse_scan.cli.app", "--version"],
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.strip() == f"sparse-scan {sparse_scan.__version__}"


def test_cli_and_kernels_live_inside_the_package():
    import sparse_scan.cli.app
    import sparse_scan.rawkernels

    assert sparse_scan.cli.app.__name__ == "sparse_scan.cli.app"
    # the repository's cli/ and rawkernels/ folders are mapped into the sparse_scan namespace
    assert pathlib.Path(sparse_scan.cli.app.__file__).resolve().parent.name == "cli"
    assert sparse_scan.rawkernels.__name__ == "sparse_scan.rawkernels"


def test_setup_cfg_lists_every_package():
    """setup.cfg names the packages one by one: a new folder under sparse_scan/ must be added there, or
    the wheel leaves it out (an editable install would not notice)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg", encoding="utf-8")
    listed = set(config["options"]["packages"].split())
    folders = {".".join(("sparse_scan", *path.parent.relative_to(REPO / "sparse_scan").parts))
               for path in (REPO / "sparse_scan").rglob("__init__.py")}
    assert listed == folders | {"sparse_scan.cli", "sparse_scan.rawkernels"}
