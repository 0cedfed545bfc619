"""Shared fixtures: where ``gpu`` tests run, and the backends to parametrise.

``gpu`` tests run on a real GPU where CuPy sees one. Elsewhere they run through the CuPy stand-in
(``tests/cupy_standin``: NumPy arrays that the code sees as CuPy arrays, the CUDA sources built by g++
and launched with CuPy's calling convention), which needs g++ and the real CuPy package (for its API);
without those they are skipped. The stand-in's device is switched on only while a ``gpu`` test runs,
so ``device="auto"`` everywhere else behaves as on a machine without a GPU.

Environment:

- ``SPARSE_SCAN_CUPY_STANDIN=1``: run the ``gpu`` tests through the stand-in, even on a GPU machine,
  and fail (not skip) if it cannot run; ``=0``: never use it.
- ``SPARSE_SCAN_REQUIRE_GPU=1`` (``tools/gpu_run.sh``): a real GPU must run the ``gpu`` tests (no
  stand-in, no skips).
- ``SPARSE_SCAN_NO_GPU_SKIPS=1`` (CI's ``make test-gpu-standin``): a skipped ``gpu`` test fails the run.
- ``SPARSE_SCAN_COST_MODEL``: set to ``defaults`` for every test (and the commands they start), so that
  no choice a test asserts depends on this machine's calibration or its load
  (:mod:`sparse_scan.engine.cost`); tests of the calibration cache set it themselves.
- ``SPARSE_SCAN_NO_MEMPOOL=1``: CuPy's memory pool off, so that ``compute-sanitizer`` sees every array
  as its own allocation (the pool sub-allocates large blocks, which hides out-of-bounds accesses into
  neighbouring arrays).
"""

from __future__ import annotations

import os
import subprocess
import sys

import cupy_standin
import pytest

from sparse_scan import backend
from sparse_scan.engine import products as product_planning

os.environ["SPARSE_SCAN_COST_MODEL"] = "defaults"

_PROBE = "import cupy, sys; sys.exit(0 if cupy.cuda.is_available() else 1)"


def _real_gpu_usable() -> bool:
    """Whether the real CuPy sees a GPU, asked in a child process (this one may get the stand-in)."""
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=120)
        return probe.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _choose_standin() -> bool:
    """Install the CuPy stand-in for this session, or not (see the module docstring)."""
    setting = os.environ.get("SPARSE_SCAN_CUPY_STANDIN", "")
    if setting == "0" or os.environ.get("SPARSE_SCAN_REQUIRE_GPU"):
        return False
    if setting != "1" and _real_gpu_usable():
        return False
    reason = cupy_standin.available()
    if reason is not None:
        if setting == "1":
            raise pytest.UsageError(f"SPARSE_SCAN_CUPY_STANDIN=1 but the CuPy stand-in cannot run: {reason}")
        return False
    cupy_standin.install()
    return True


STANDIN = _choose_standin()


def pytest_configure(config):
    if os.environ.get("SPARSE_SCAN_NO_MEMPOOL") and backend.gpu_usable():
        backend.get("gpu").xp.cuda.set_allocator(None)


def pytest_report_header(config):
    if STANDIN:
        return "gpu tests: the CuPy stand-in on the CPU (tests/cupy_standin)"
    return f"gpu tests: {'a real GPU' if backend.gpu_usable() else 'skipped (no GPU, no stand-in)'}"


def pytest_collection_modifyitems(config, items):
    if STANDIN or backend.gpu_usable():
        return
    if os.environ.get("SPARSE_SCAN_REQUIRE_GPU"):
        raise pytest.UsageError("SPARSE_SCAN_REQUIRE_GPU is set but no GPU is usable (CuPy missing, "
                                "failing to import, or cupy.cuda.is_available() is False)")
    reason = cupy_standin.available() or "SPARSE_SCAN_CUPY_STANDIN=0"
    skip = pytest.mark.skip(reason=f"no usable GPU, and the CuPy stand-in cannot run: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_plain_progress_lines(monkeypatch):
    """The commands' plain progress lines (one every 10 s where stderr is no terminal, cli/_progress.py)
    are off, so that no test's verdict on a command's exact output depends on the machine's speed;
    tests/test_cli_progress.py turns them on where it tests them."""
    from sparse_scan.cli import _progress

    monkeypatch.setattr(_progress, "PLAIN_INTERVAL_S", float("inf"))


_SKIPPED_GPU_TESTS: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" in report.keywords:
        _SKIPPED_GPU_TESTS.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("SPARSE_SCAN_NO_GPU_SKIPS") and _SKIPPED_GPU_TESTS and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("SPARSE_SCAN_NO_GPU_SKIPS") and _SKIPPED_GPU_TESTS:
        terminalreporter.write_line(f"SPARSE_SCAN_NO_GPU_SKIPS: {len(_SKIPPED_GPU_TESTS)} gpu tests were "
                                    f"skipped: {', '.join(_SKIPPED_GPU_TESTS[:5])}", red=True)


def _set_standin_device(on: bool) -> None:
    cupy_standin.AVAILABLE["value"] = on
    backend.gpu_usable.cache_clear()


@pytest.fixture(autouse=True)
def _standin_device(request):
    """Switch the stand-in's device on for the duration of a ``gpu`` test."""
    if not (STANDIN and "gpu" in request.node.keywords):
        yield
        return
    _set_standin_device(True)
    try:
        yield
    finally:
        _set_standin_device(False)


@pytest.fixture
def device_stats():
    """The stand-in's record of kernel launches and host synchronisations, emptied first (``gpu``
    tests on the stand-in only)."""
    if not STANDIN:
        pytest.skip("counts launches and synchronisations of the CuPy stand-in")
    cupy_standin.STATS.clear()
    return cupy_standin.STATS


@pytest.fixture
def on_the_gpu(monkeypatch):
    """The PyTorch bridge's engine on the GPU for every tensor: with a GPU, the tests' tensors are CUDA
    tensors; through the CuPy stand-in they stay host tensors whose memory the stand-in's device arrays
    share (the glue's DLPack views, the engine's GPU path and its kernels run; CUDA streams do not)."""
    import torch  # noqa: PLC0415 - the bridge's tests alone need PyTorch

    from sparse_scan.torch import BPPSA  # noqa: PLC0415

    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setattr(BPPSA, "_device_of", staticmethod(lambda x: "gpu"))
    return torch.device("cpu")


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def be(request):
    """Each backend in turn: the same test body runs on NumPy and, where usable, on CuPy."""
    return backend.get(request.param)


@pytest.fixture(params=["default", "all"], ids=["blocks-default", "blocks-always"])
def block_products(request, monkeypatch):
    """Plan dense-block products as usual, or for every dense-block pair however small."""
    if request.param == "all":
        monkeypatch.setattr(product_planning, "BLOCK_MIN_INNER", 1)
        monkeypatch.setattr(product_planning, "BLOCK_MIN_OUTER", 1)
    return request.param
