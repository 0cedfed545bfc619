"""Every example in the package's docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import sparse_scan

# cli/ is mapped into the namespace by setup.cfg, so it is not under sparse_scan.__path__ here
MODULES = sorted({info.name for info in pkgutil.walk_packages(sparse_scan.__path__, "sparse_scan.")}
                 | {"sparse_scan.cli.app", "sparse_scan.cli._progress",
                                  "sparse_scan.cli._common"})


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name == "sparse_scan.torch._bridge":
        pytest.importorskip("torch")  # the PyTorch bridge is a torch module: its examples need PyTorch
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0


def test_public_modules_have_examples():
    finder = doctest.DocTestFinder()
    documented = {name for name in MODULES
                  if any(test.examples for test in finder.find(importlib.import_module(name)))}
    assert {"sparse_scan.backend", "sparse_scan.csr", "sparse_scan.engine.products", "sparse_scan.model",
            "sparse_scan._sequential", "sparse_scan.flops", "sparse_scan.layers._conv"} <= documented
