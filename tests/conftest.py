"""Shared fixtures: the ``gpu`` marker skips where no GPU is usable, and the backends to parametrise."""

from __future__ import annotations

import pytest

from sparse_scan import backend, spgemm


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


@pytest.fixture(params=["default", "all"], ids=["blocks-default", "blocks-always"])
def block_products(request, monkeypatch):
    """Plan dense-block products as usual, or for every dense-block pair however small."""
    if request.param == "all":
        monkeypatch.setattr(spgemm, "BLOCK_MIN_INNER", 1)
        monkeypatch.setattr(spgemm, "BLOCK_MIN_OUTER", 1)
    return request.param
