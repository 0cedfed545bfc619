"""Shared fixtures: the ``gpu`` marker skips where no GPU is usable, and the backends to parametrise."""

from __future__ import annotations

import pytest

from sparse_scan import backend


def pytest_collection_modifyitems(config, items):
    if backend.gpu_usable():
        return
    skip = pytest.mark.skip(reason="no usable GPU (cupy.cuda.is_available() is False or no CuPy)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def be(request):
    """Each backend in turn: the same test body runs on NumPy and, where usable, on CuPy."""
    return backend.get(request.param)
