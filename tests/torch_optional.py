"""PyTorch is optional (README): what the tests that import every module or resolve every public name
leave out where it is not installed.

Only the modules of ``sparse_scan/torch/`` may import torch (``sparse_scan.torch._bridge`` subclasses
``nn.Module``, so it needs torch to be imported at all); the engine never does. Where torch is not
installed, a module or a name that needs it is left out of those tests only when the import of torch
that failed is in ``sparse_scan/torch/``: anything else that imports torch fails as any import error
does (CI runs these tests without torch, docs/testing.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import traceback
import types
from typing import Any

import sparse_scan

TORCH_INSTALLED = importlib.util.find_spec("torch") is not None
"""Whether ``import torch`` can succeed here."""

FRONT_DOOR = pathlib.Path(sparse_scan.__file__).resolve().parent / "torch"
"""The only folder whose modules may import torch."""

MISSING = object()
"""What :func:`resolve` gives for a name that needs the missing torch."""


def _importer(error: BaseException) -> pathlib.Path | None:
    """The source file whose ``import`` raised ``error``: the innermost frame outside importlib."""
    frames = [frame.filename for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith("<frozen")]
    return pathlib.Path(frames[-1]).resolve() if frames else None


def torch_missing_in_front_door(error: BaseException) -> bool:
    """Whether ``error`` is torch missing, met by an import in ``sparse_scan/torch/`` (:data:`FRONT_DOOR`)."""
    if not isinstance(error, ModuleNotFoundError) or (error.name or "").split(".")[0] != "torch":
        return False
    importer = _importer(error)
    return importer is not None and importer.is_relative_to(FRONT_DOOR)


def import_module(name: str) -> types.ModuleType | None:
    """``importlib.import_module(name)``, or None where the module is one of the front door's that
    needs the missing torch (any other import error is raised)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if torch_missing_in_front_door(error):
            return None
        raise


def resolve(owner: object, name: str, *default: Any) -> Any:
    """``getattr(owner, name, *default)`` (a lazy name imports its module), or :data:`MISSING` where
    that module is one of the front door's that needs the missing torch."""
    try:
        return getattr(owner, name, *default)
    except ModuleNotFoundError as error:
        if torch_missing_in_front_door(error):
            return MISSING
        raise
