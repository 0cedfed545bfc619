"""Shared fixtures: the ``gpu`` marker skips where no GPU is usable, and the backends to parametrise.

``SPARSE_SCAN_REQUIRE_GPU=1`` (a GPU machine's run, ``tools/gpu_run.sh``) makes a missing GPU an error
instead of skips; ``SPARSE_SCAN_NO_MEMPOOL=1`` turns CuPy's memory pool off, so that
``compute-sanitizer`` sees every array as its own allocation (the pool sub-allocates large blocks,
which hides out-of-bounds accesses into neighbouring arrays).
"""

from __future__ import annotations

import os

import pytest

from sparse_scan import backend, spgemm


def pytest_configure(config):
    if os.environ.get("SPARSE_SCAN_NO_MEMPOOL") and backend.gpu_usable():
        backend.get("gpu").xp.cuda.set_allocator(None)


def pytest_collection_modifyitems(config, items):
    if backend.gpu_usable():
        return
    if os.environ.get("SPARSE_SCAN_REQUIRE_GPU"):
        raise pytest.UsageError("SPARSE_SCAN_REQUIRE_GPU is set but no GPU is usable (CuPy missing, "
                                "failing to import, or cupy.cuda.is_available() is False)")
    skip = pytest.mark.skip(reason="no usable GPU (cupy.cuda.is_available() is False or no CuPy)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def be(request):
    """Each backend in turn: the same test body runs on NumPy and, where usable, on CuPy."""
    return backend.get(request.param)


@pytest.fixture(params=["default", "all"], ids=["blocks-default", "blocks-always"])
def block_products(request, monkeypatch):
    """Plan dense-block products as usual, or for every dense-block pair however small."""
    if request.param == "all":
        monkeypatch.setattr(spgemm, "BLOCK_MIN_INNER", 1)
        monkeypatch.setattr(spgemm, "BLOCK_MIN_OUTER", 1)
    return request.param
