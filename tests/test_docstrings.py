"""Every example in the package's docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import pkgutil

import pytest
import torch_optional

import sparse_scan

# cli/ is mapped into the namespace by setup.cfg, so it is not under sparse_scan.__path__ here
MODULES = sorted({info.name for info in pkgutil.walk_packages(sparse_scan.__path__, "sparse_scan.")}
                 | {"sparse_scan.cli.app", "sparse_scan.cli._progress",
                                  "sparse_scan.cli._common"})


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = torch_optional.import_module(name)
    if module is None:
        pytest.skip(f"{name} needs PyTorch, which is not installed")
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0


def test_public_modules_have_examples():
    """Without PyTorch, the modules of sparse_scan.torch that need it are left out (none is listed)."""
    finder = doctest.DocTestFinder()
    modules = [module for module in map(torch_optional.import_module, MODULES) if module is not None]
    documented = {module.__name__ for module in modules if any(test.examples for test in finder.find(module))}
    assert {"sparse_scan.backend", "sparse_scan.csr", "sparse_scan.engine.products", "sparse_scan.model",
            "sparse_scan._sequential", "sparse_scan.flops", "sparse_scan.layers._conv"} <= documented
