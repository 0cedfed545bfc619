"""Export a PyTorch ``nn.Sequential`` of supported layers to a model spec plus ``.npz`` weights.

PyTorch is imported by the caller's module only: this module reads attributes of the modules it is
given and never imports torch itself.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import numpy as np
import yaml

from .spec import SpecError, load_model

__all__ = ["export_torch"]

_ARGUMENTS = {
    "Conv2d": ("conv2d", ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups")),
    "Linear": ("linear", ("out_features",)),
    "MaxPool2d": ("maxpool2d", ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
    "AvgPool2d": ("avgpool2d", ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")),
    "ReLU": ("relu", ()), "Tanh": ("tanh", ()), "Sigmoid": ("sigmoid", ()),
    "LeakyReLU": ("leaky_relu", ("negative_slope",)), "Flatten": ("flatten", ()),
}


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
        Of Conv2d (zeros padding), Linear, MaxPool2d, AvgPool2d, ReLU, LeakyReLU, Tanh, Sigmoid and
        Flatten modules; layer names are the module's child names.
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
        kind = type(child).__name__
        if kind not in _ARGUMENTS:
            raise ValueError(f"layer {name!r}: type: {kind} is not supported "
                             f"(supported: {', '.join(_ARGUMENTS)})")
        if kind == "Conv2d" and child.padding_mode != "zeros":
            raise ValueError(f"layer {name!r}: padding_mode: only 'zeros' is supported")
        spec_type, arguments = _ARGUMENTS[kind]
        entry: dict[str, Any] = {"name": name, "type": spec_type}
        entry.update({argument: _plain(getattr(child, argument)) for argument in arguments})
        for parameter in ("weight", "bias"):
            tensor = getattr(child, parameter, None)
            if tensor is not None:
                weights[f"{name}.{parameter}"] = tensor.detach().cpu().numpy()
        if kind in ("Conv2d", "Linear"):
            entry["bias"] = getattr(child, "bias", None) is not None
        layers.append(entry)
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
