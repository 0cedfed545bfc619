"""Export a PyTorch ``nn.Sequential`` of supported layers to a model spec plus ``.npz`` weights.

PyTorch is imported by the caller's module only: this module reads attributes of the modules it is
given and never imports torch itself.
"""

from __future__ import annotations

import inspect
import pathlib
from typing import Any, Sequence

import numpy as np
import yaml

from .spec import SpecError, load_model

__all__ = ["export_torch"]

WRITTEN, IGNORED = "written", "ignored"

_MODULES: dict[str, tuple[str, dict[str, Any]]] = {
    "Conv2d": ("conv2d", {"in_channels": WRITTEN, "out_channels": WRITTEN, "kernel_size": WRITTEN,
                          "stride": WRITTEN, "padding": WRITTEN, "dilation": WRITTEN, "groups": WRITTEN,
                          "bias": WRITTEN, "padding_mode": ("zeros",)}),
    "Linear": ("linear", {"in_features": WRITTEN, "out_features": WRITTEN, "bias": WRITTEN}),
    "MaxPool2d": ("maxpool2d", {"kernel_size": WRITTEN, "stride": WRITTEN, "padding": WRITTEN,
                                "dilation": WRITTEN, "ceil_mode": WRITTEN, "return_indices": (False,)}),
    "AvgPool2d": ("avgpool2d", {"kernel_size": WRITTEN, "stride": WRITTEN, "padding": WRITTEN,
                                "ceil_mode": WRITTEN, "count_include_pad": WRITTEN,
                                "divisor_override": (None,)}),
    "Flatten": ("flatten", {"start_dim": WRITTEN, "end_dim": WRITTEN}),
    "ReLU": ("relu", {"inplace": IGNORED}),
    "LeakyReLU": ("leaky_relu", {"negative_slope": WRITTEN, "inplace": IGNORED}),
    "Tanh": ("tanh", {}), "Sigmoid": ("sigmoid", {}), "Identity": ("identity", {}),
    "SiLU": ("silu", {"inplace": IGNORED}),
    "GELU": ("gelu", {"approximate": WRITTEN}),
    "ELU": ("elu", {"alpha": WRITTEN, "inplace": IGNORED}),
    "Hardtanh": ("hardtanh", {"min_val": WRITTEN, "max_val": WRITTEN, "inplace": IGNORED,
                              "min_value": IGNORED, "max_value": IGNORED}),  # deprecated aliases
    "Softplus": ("softplus", {"beta": WRITTEN, "threshold": WRITTEN}),
}
"""PyTorch module type -> (spec type, what becomes of each argument of its constructor): written to
the spec, ignored (``inplace``: no effect on values or gradients; deprecated aliases torch folds into
other arguments), or a tuple of the only values the spec represents (anything else is refused).
An argument not listed (a newer PyTorch's) is refused too: nothing is dropped silently."""

_KEEP_FIELDS = ("device", "dtype")  # constructor arguments that leave no trace in the module


def _entry(name: str, child: Any) -> dict[str, Any]:
    """The spec entry of one module: every constructor argument written or refused."""
    kind = type(child).__name__
    if kind not in _MODULES:
        raise ValueError(f"layer {name!r}: type: {kind} is not supported (supported: {', '.join(_MODULES)})")
    spec_type, arguments = _MODULES[kind]
    entry: dict[str, Any] = {"name": name, "type": spec_type}
    for argument, parameter in inspect.signature(type(child).__init__).parameters.items():
        if argument == "self" or argument in _KEEP_FIELDS or parameter.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        rule = arguments.get(argument)
        if rule is None:
            raise ValueError(f"layer {name!r}: {argument}: an argument of {kind} the spec cannot represent")
        if rule == IGNORED:
            continue
        value = (getattr(child, "bias", None) is not None) if argument == "bias" else getattr(child, argument)
        if rule == WRITTEN:
            entry[argument] = _plain(value)
        elif value not in rule:
            allowed = " or ".join(repr(v) for v in rule)
            raise ValueError(f"layer {name!r}: {argument}: {value!r} cannot be represented (only {allowed})")
    return entry


def _plain(value: Any) -> Any:
    """YAML-friendly: tuples become lists, numbers stay numbers."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def export_torch(module: Any, input_shape: Sequence[int], path: str | pathlib.Path) -> pathlib.Path:
    """Write ``path`` (YAML spec) and ``path`` with suffix ``.npz`` (weights) for ``module``.

    Parameters
    ----------
    module : torch.nn.Sequential
        Of Conv2d (zeros padding), Linear, MaxPool2d, AvgPool2d (no ``divisor_override``), Flatten,
        ReLU, LeakyReLU, Tanh, Sigmoid, Identity, SiLU, GELU, ELU, Hardtanh and Softplus modules;
        layer names are the module's child names. Every argument of every module is written to the
        spec, or refused with a ``ValueError`` naming the layer and the argument (before anything is
        written) where the spec cannot represent it.
    input_shape : sequence of int
        One sample's shape, no batch axis.
    path : str or path-like
        The spec to write; neither it nor the weights file may exist.

    Returns
    -------
    pathlib.Path
        The spec's path (load it with :func:`sparse_scan.load_model`).
    """
    path = pathlib.Path(path)
    weights_path = path.with_suffix(".npz")
    if weights_path == path:
        raise ValueError(f"{path}: the spec needs a name of its own (e.g. model.yaml); its weights go to "
                         f"{weights_path.name}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: no such directory {path.parent}")
    for target in (path, weights_path):
        if target.exists():
            raise FileExistsError(f"{target} exists; export_torch never overwrites")
    layers, weights = [], {}
    for name, child in module.named_children():
        layers.append(_entry(name, child))
        for parameter in ("weight", "bias"):
            tensor = getattr(child, parameter, None)
            if tensor is not None:
                weights[f"{name}.{parameter}"] = tensor.detach().cpu().numpy()
    spec = {"input_shape": [int(s) for s in input_shape], "weights": weights_path.name, "layers": layers}
    np.savez(weights_path, **weights)
    path.write_text(yaml.safe_dump(spec, sort_keys=False, default_flow_style=None))
    try:  # what it wrote must load (an input shape the module does not take, NaN weights, no layers)
        load_model(path)
    except SpecError as error:
        path.unlink()
        weights_path.unlink()
        raise ValueError(f"export_torch: nothing written, the spec would not load: {error}") from None
    return path
