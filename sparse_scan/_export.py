"""Export a PyTorch ``nn.Sequential`` of supported layers, or a recurrent classifier (an ``nn.RNN``,
``nn.GRU`` or ``nn.LSTM`` followed by an ``nn.Linear`` head on its last output), to a model spec plus
``.npz`` weights.

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
    "BatchNorm2d": ("batchnorm2d", {"num_features": WRITTEN, "eps": WRITTEN, "momentum": WRITTEN,
                                    "affine": WRITTEN, "track_running_stats": (True,), "bias": WRITTEN}),
    "Dropout": ("dropout", {"p": WRITTEN, "inplace": IGNORED}),
    "AdaptiveAvgPool2d": ("adaptive_avgpool2d", {"output_size": WRITTEN}),
}
"""PyTorch module type -> (spec type, what becomes of each argument of its constructor): written to
the spec, ignored (``inplace``: no effect on values or gradients; deprecated aliases torch folds into
other arguments), or a tuple of the only values the spec represents (anything else is refused, with
the reason in :data:`_REASONS` where there is one). An argument not listed (a newer PyTorch's) is
refused too: nothing is dropped silently."""

_REASONS: dict[tuple[str, str], str] = {
    ("BatchNorm2d", "track_running_stats"): "without running statistics BatchNorm2d normalises every batch "
    "by its own mean and variance, in eval mode too, so every output depends on every sample of the batch "
    "(no per-sample Jacobian to scan)",
}
"""Why a value outside a rule's tuple cannot be represented, by (module type, argument)."""

_MODES = ("BatchNorm2d", "Dropout")
"""Module types whose spec entry has ``training``: the module's mode (``module.training``)."""

_DROPPED_BUFFERS = ("num_batches_tracked",)
"""Buffers not written to the weights: BatchNorm2d's count of training batches, which frozen
statistics never use. Every other buffer (``running_mean``, ``running_var``) is written."""

_RECURRENT: dict[str, tuple[str, dict[str, Any]]] = {
    kind: (kind.lower(), {"mode": IGNORED, "input_size": WRITTEN, "hidden_size": WRITTEN,
                          "num_layers": WRITTEN, "bias": WRITTEN, "batch_first": WRITTEN, "dropout": WRITTEN,
                          "bidirectional": WRITTEN, "proj_size": WRITTEN if kind == "LSTM" else (0,)})
    for kind in ("RNN", "GRU", "LSTM")}
"""The recurrent modules, by the arguments of their common base ``RNNBase`` (theirs are ``*args``):
``mode`` is the module's type (and, for ``nn.RNN``, its ``nonlinearity``, written); ``proj_size``
is the LSTM's only."""

_KEEP_FIELDS = ("device", "dtype")  # constructor arguments that leave no trace in the module


def _constructor(cls: type) -> inspect.Signature:
    """The signature of ``cls.__init__``, or for a recurrent module its base's (``nn.LSTM.__init__``
    takes ``*args, **kwargs`` and passes them to ``RNNBase.__init__``, the first along the MRO
    that names them)."""
    if cls.__name__ not in _RECURRENT:
        return inspect.signature(cls.__init__)
    for klass in cls.__mro__:
        signature = inspect.signature(klass.__init__)
        if not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
            return signature
    raise ValueError(f"{cls.__name__}: no constructor with named arguments")


def _entry(name: str, child: Any, position: int, count: int) -> dict[str, Any]:
    """The spec entry of child ``position`` of ``count``: every constructor argument written or
    refused; a recurrent module only first, followed by the linear head alone."""
    kind = type(child).__name__
    supported = ", ".join(list(_MODULES) + list(_RECURRENT))
    if kind not in _MODULES and kind not in _RECURRENT:
        raise ValueError(f"layer {name!r}: type: {kind} is not supported (supported: {supported})")
    if kind in _RECURRENT and (position != 0 or count != 2):
        raise ValueError(f"layer {name!r}: type: a {kind} must be the first of two layers, followed by the "
                         "Linear classifier head on its last output")
    spec_type, arguments = _MODULES[kind] if kind in _MODULES else _RECURRENT[kind]
    entry: dict[str, Any] = {"name": name, "type": spec_type}
    if kind == "RNN":
        entry["nonlinearity"] = child.nonlinearity
    for argument, parameter in _constructor(type(child)).parameters.items():
        if argument == "self" or argument in _KEEP_FIELDS or parameter.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        rule = arguments.get(argument)
        if rule is None:
            raise ValueError(f"layer {name!r}: {argument}: an argument of {kind} the spec cannot represent")
        if rule == IGNORED:
            continue
        value = getattr(child, argument)
        if argument == "bias" and not isinstance(value, bool):  # a layer's bias tensor, a recurrent flag
            value = value is not None
        if rule == WRITTEN:
            entry[argument] = _plain(value)
        elif value not in rule:
            allowed = " or ".join(repr(v) for v in rule)
            reason = _REASONS.get((kind, argument))
            raise ValueError(f"layer {name!r}: {argument}: {value!r} cannot be represented (only {allowed})"
                             + (f": {reason}" if reason else ""))
    if kind == "BatchNorm2d" and child.training:
        raise ValueError(f"layer {name!r}: training: the BatchNorm2d is in training mode, where it "
                         "normalises by each batch's own mean and variance, coupling the samples of a batch "
                         "(no per-sample Jacobian to scan); call module.eval() before export_torch to export "
                         "it with its frozen running_mean and running_var")
    if kind in _MODES:
        entry["training"] = bool(child.training)
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
    module : torch.nn.Module
        An ``nn.Sequential`` (or any module whose children run in order) of Conv2d (zeros padding),
        Linear, MaxPool2d, AvgPool2d (no ``divisor_override``), Flatten, ReLU, LeakyReLU, Tanh,
        Sigmoid, Identity, SiLU, GELU, ELU, Hardtanh, Softplus, BatchNorm2d (in eval mode, with
        running statistics: a BatchNorm2d in training mode is refused, call ``module.eval()`` first),
        Dropout (its mode written: masks in training mode, the identity in eval mode) and
        AdaptiveAvgPool2d modules; or a recurrent classifier:
        two children, an ``nn.RNN``, ``nn.GRU`` or ``nn.LSTM`` (any of their arguments) and an
        ``nn.Linear`` head, which the spec applies to the recurrent layer's last output (PyTorch's
        ``fc(output[:, -1])``, ``fc(output[-1])`` without ``batch_first``; the module's own
        ``forward`` is not read), loaded as a :class:`~sparse_scan.recurrent.RecurrentClassifier`.
        Layer names are the module's child names, weights keep PyTorch's state_dict names (BatchNorm2d's
        ``running_mean`` and ``running_var`` included, ``num_batches_tracked`` left out). Every
        argument of every module is written to the spec, or refused with a ``ValueError`` naming the
        layer and the argument (before anything is written) where the spec cannot represent it.
    input_shape : sequence of int
        One sample's shape, no batch axis: ``(time steps, input_size)`` for a recurrent classifier.
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
    children = list(module.named_children())
    for position, (name, child) in enumerate(children):
        layers.append(_entry(name, child, position, len(children)))
        for parameter, tensor in (*child.named_parameters(), *child.named_buffers()):
            if parameter not in _DROPPED_BUFFERS:
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
