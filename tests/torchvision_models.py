"""torchvision's classification models for the zoo tests and ``bench/zoo.py``: every family, its smallest
variant and input, importable where torchvision's compiled operators do not load.

Why :func:`load` and not ``import torchvision``: CI installs torchvision 0.28.0 beside the CPU build of
torch 2.13.0 (``.ci/run``, docs/testing.md). The torchvision 0.28.0 wheel there is a CUDA build, and its
compiled library (``_C.so``: the detection operators ``nms``, ``roi_align``, ...) does not load against
a CPU torch. ``torchvision/extension.py`` expects that: it catches the failure, and every registration
guarded by its ``_has_ops()`` is then skipped. But ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms`` unguarded, and ``torch.library.register_fake``
of an operator that does not exist raises, so ``import torchvision`` fails with ``RuntimeError: operator
torchvision::nms does not exist`` (torchvision's issue 9085) before any model is defined.

:func:`load` imports torchvision as it is. Only on that failure, and only where torchvision's own
``extension._has_ops()`` says its compiled library did not load, it declares the schemas of those two
operators (``torch.library``: a declaration, no kernel) and imports torchvision again, whole. Everything
in torchvision is then its own code, behaving as torchvision intends without its compiled library: the
models build and run (plain PyTorch), and a compiled operator (``torchvision.ops.nms``, ...) raises
torchvision's own "Couldn't load custom C++ ops". Nothing in site-packages is changed, and where the
compiled library loads (a CPU wheel of torchvision), nothing is declared.

Imports torch only when :func:`load` or :func:`build` is called: a test calls them after
``pytest.importorskip("torch")`` and a check of :func:`installed`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
import types
from typing import Any

UNGUARDED_FAKES = ("nms", "qnms")
"""The operators ``torchvision/_meta_registrations.py`` registers fake kernels for whether or not its
compiled library loaded (both ``(Tensor dets, Tensor scores, float iou_threshold) -> Tensor``)."""

_DECLARED: list[Any] = []
"""The ``torch.library.Library`` that declares them: kept alive, since a collected library removes its
declarations again."""


def installed() -> bool:
    """Whether torch and torchvision are installed here (the zoo tests skip otherwise)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "torchvision"))


def load() -> types.ModuleType:
    """``import torchvision``, declaring the operators of :data:`UNGUARDED_FAKES` first where its compiled
    library does not load (the module docstring).

    Returns
    -------
    module
        The ``torchvision`` package (``torchvision.models`` and all).

    Raises
    ------
    ImportError
        torchvision (or torch) is not installed.
    RuntimeError
        Any other failure of ``import torchvision``: only the one described above is worked around.
    """
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as error:
        extension = sys.modules.get("torchvision.extension")
        if (not any(f"torchvision::{op}" in str(error) for op in UNGUARDED_FAKES) or extension is None
                or extension._has_ops()):
            raise
    import torch  # noqa: PLC0415 - torch is optional: imported by torchvision above already

    for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
        del sys.modules[name]  # what the failed import left half-done: imported again, whole
    if not _DECLARED:
        library = torch.library.Library("torchvision", "FRAGMENT")
        for op in UNGUARDED_FAKES:
            library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED.append(library)
    return importlib.import_module("torchvision")


@dataclasses.dataclass(frozen=True)
class Family:
    """One family of ``torchvision.models``' classification models.

    Attributes
    ----------
    name : str
        The family (its test's id).
    builder : str
        Its smallest variant (fewest parameters, narrowest), built with ``weights=None``.
    members : str
        A regular expression every name of the family in ``torchvision.models.list_models`` matches in
        full (and no other family's).
    side : int
        The input's height and width: 32 where the model takes 3x32x32, else the smallest it takes.
    transformer : bool
        An attention model (issue 46 keeps those refused, naming the op).
    kwargs : tuple of (str, Any)
        More keywords of the builder: GoogLeNet's and Inception-v3's ``init_weights=True`` is their
        default with ``weights=None``, stated to silence the FutureWarning saying the default will
        change (warnings are errors in the tests).
    """

    name: str
    builder: str
    members: str
    side: int = 32
    transformer: bool = False
    kwargs: tuple[tuple[str, Any], ...] = ()


FAMILIES = (
    Family("alexnet", "alexnet", "alexnet", side=63),  # 62x62 leaves nothing for its third max-pool
    Family("convnext", "convnext_tiny", r"convnext_\w+"),
    Family("densenet", "densenet121", r"densenet\d+"),
    Family("efficientnet", "efficientnet_b0", r"efficientnet_b\d"),
    Family("efficientnet_v2", "efficientnet_v2_s", r"efficientnet_v2_[sml]"),
    Family("googlenet", "googlenet", "googlenet", kwargs=(("init_weights", True),)),
    Family("inception_v3", "inception_v3", "inception_v3", side=75, kwargs=(("init_weights", True),)),
    Family("mnasnet", "mnasnet0_5", r"mnasnet\d_\d+"),
    Family("mobilenet_v2", "mobilenet_v2", "mobilenet_v2"),
    Family("mobilenet_v3", "mobilenet_v3_small", r"mobilenet_v3_(small|large)"),
    Family("regnet_x", "regnet_x_400mf", r"regnet_x_\w+"),
    Family("regnet_y", "regnet_y_400mf", r"regnet_y_\w+"),
    Family("resnet", "resnet18", r"resnet\d+"),
    Family("resnext", "resnext50_32x4d", r"resnext\w+"),
    Family("shufflenet_v2", "shufflenet_v2_x0_5", r"shufflenet_v2_x\d_\d"),
    Family("squeezenet", "squeezenet1_1", r"squeezenet1_[01]"),
    Family("vgg", "vgg11", r"vgg\d+(_bn)?"),
    Family("wide_resnet", "wide_resnet50_2", r"wide_resnet\d+_2"),
    Family("vit", "vit_b_32", r"vit_[bhl]_\d+", side=224, transformer=True),  # its image size, fixed
    Family("swin", "swin_t", r"swin_[tsb]", transformer=True),
    Family("swin_v2", "swin_v2_t", r"swin_v2_[tsb]", transformer=True),
    Family("maxvit", "maxvit_t", "maxvit_t", side=224, transformer=True),  # its input size, fixed
)
"""Every classification family of torchvision 0.28 (``tests/test_zoo.py`` checks that each model
``torchvision.models.list_models`` names belongs to exactly one)."""


def family_of(model_name: str) -> list[Family]:
    """The families whose :attr:`Family.members` match ``model_name`` (one, for a classification model)."""
    return [family for family in FAMILIES if re.fullmatch(family.members, model_name)]


def build(family: Family, dtype: Any) -> Any:
    """``family``'s smallest variant, ``weights=None``, seeded (``torch.manual_seed(0)``), in ``dtype``
    and evaluation mode."""
    import torch  # noqa: PLC0415 - torch is optional: the callers check it first

    models = load().models
    torch.manual_seed(0)
    return models.get_model(family.builder, weights=None, **dict(family.kwargs)).to(dtype).eval()
