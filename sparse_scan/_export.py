"""Export a PyTorch ``nn.Sequential`` of supported layers and residual blocks, or a recurrent classifier
(an ``nn.RNN``, ``nn.GRU`` or ``nn.LSTM`` followed by an ``nn.Linear`` head on its last output), to a
model spec plus ``.npz`` weights.

PyTorch is imported by the caller's module only: this module reads attributes of the modules it is
given, and imports ``torch.fx`` only to trace a module that is no supported layer (a residual block).
"""

from __future__ import annotations

import inspect
import operator
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


_ADDS = {("call_function", operator.add), ("call_function", operator.iadd), ("call_method", "add"),
         ("call_method", "add_")}
"""The graph nodes that sum a residual block's two branches (``out + identity``, ``out += identity``,
``out.add(identity)``; ``torch.add`` is matched by name)."""


def _is_add(node: Any) -> bool:
    if node.kwargs or len(node.args) != 2:
        return False
    target = node.target
    if (node.op, target) in _ADDS:
        return True
    return node.op == "call_function" and getattr(target, "__name__", "") == "add" and "torch" in str(
        getattr(target, "__module__", "") or type(target))


def _builtin(module: Any) -> bool:
    """A module of PyTorch's own (``torch.nn``): a layer, never traced into."""
    return type(module).__module__.startswith("torch.nn")


def _flatten(prefix: str, module: Any) -> list[tuple[str, Any]]:
    """``(path, module)`` of ``module``'s children in order, ``nn.Sequential`` children expanded (their
    paths ``<prefix><child>.<grandchild>``, PyTorch's state_dict prefixes)."""
    out = []
    for name, child in module.named_children():
        if type(child).__name__ == "Sequential" and _builtin(child):
            out += _flatten(f"{prefix}{name}.", child)
        else:
            out.append((f"{prefix}{name}", child))
    return out


def _chain(name: str, node: Any, stop: Any, describe: Any) -> list[Any]:
    """The ``call_module`` nodes from ``stop`` (exclusive) up to ``node`` (inclusive), each taking the
    previous one as its only argument; refused naming the node otherwise."""
    nodes = []
    while node is not stop:
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            raise ValueError(f"layer {name!r}: {describe(node)}: not a residual pattern (a chain of "
                             "submodules from the input, the sum of two such chains, then submodules)")
        nodes.append(node)
        node = node.args[0]
    return nodes[::-1]


def _residual(name: str, module: Any) -> list[dict[str, Any]]:
    """The spec entries of a module whose ``forward`` is a residual pattern, traced with ``torch.fx``:
    ``x -> pre -> (f(x) + s(x)) -> post``, where ``f`` and ``s`` are chains of submodules (``s`` empty:
    the identity; its modules one submodule or the children of one ``nn.Sequential``, whose name becomes
    ``shortcut_name``). Modules before the sum and after it become layers before and after the block
    (those after it, torchvision's final ReLU, parameterless). Submodules that are no supported layer are
    traced in turn (nested blocks). Anything else is refused with the node named."""
    import torch.fx  # noqa: PLC0415 - torch is the caller's; only a residual module needs tracing

    class Tracer(torch.fx.Tracer):
        """Submodules are leaves but ``nn.Sequential`` (traced through: its children's paths)."""

        def is_leaf_module(self, m: Any, qualname: str) -> bool:
            return not (type(m).__name__ == "Sequential" and _builtin(m))

    try:
        graph = Tracer().trace(module)
    except Exception as error:  # any failure to trace: data-dependent control flow, unsupported calls
        raise ValueError(f"layer {name!r}: type: {type(module).__name__} is no supported layer and torch.fx "
                         f"cannot trace its forward: {type(error).__name__}: {error}") from None
    nodes = list(graph.nodes)

    def describe(node: Any) -> str:
        target = getattr(node.target, "__name__", node.target)
        return f"node {node.name!r} ({node.op} {target})"

    inputs = [node for node in nodes if node.op == "placeholder"]
    outputs = [node for node in nodes if node.op == "output"]
    if len(inputs) != 1:
        raise ValueError(f"layer {name!r}: forward takes {len(inputs)} inputs; a residual block takes one")
    adds = [node for node in nodes if _is_add(node)]
    if len(adds) != 1:
        node = next((n for n in nodes if n.op not in ("placeholder", "output", "call_module")), outputs[0])
        raise ValueError(f"layer {name!r}: {describe(node)}: not a residual pattern (one sum of two chains "
                         f"of submodules; the forward has {len(adds)} sums)")
    add, (x,) = adds[0], inputs
    result = outputs[0].args[0]
    post = _chain(name, result, add, describe)
    branches = list(add.args)
    for arg in branches:
        if not hasattr(arg, "op"):
            raise ValueError(f"layer {name!r}: {describe(add)}: adds a constant, not a branch")

    # the split point: the deepest node both branches reach through single-input chains
    paths = [[x] + _chain(name, arg, x, describe) for arg in branches]
    split = 0
    while split + 1 < min(len(p) for p in paths) and paths[0][split + 1] is paths[1][split + 1]:
        split += 1
    pre = paths[0][1:split + 1]
    arms = [p[split + 1:] for p in paths]
    inner, short = (arms[0], arms[1]) if len(arms[0]) >= len(arms[1]) else (arms[1], arms[0])
    for node in nodes:
        used = node in (x, add, outputs[0]) or node in pre or node in inner or node in short or node in post
        if not used:
            raise ValueError(f"layer {name!r}: {describe(node)}: not part of a residual pattern")
    calls = [node.target for node in pre + inner + short + post]
    submodules = dict(module.named_modules())
    for node in pre + inner + short + post:
        child = submodules[node.target]
        if calls.count(node.target) > 1 and any(True for _ in (*child.parameters(), *child.buffers())):
            raise ValueError(f"layer {name!r}: {describe(node)}: module {node.target!r} is called more than "
                             "once and has parameters (a spec cannot share them)")
    entries_pre, entries_post = [], []
    for group, out in ((pre, entries_pre), (post, entries_post)):
        for node in group:
            entry_name = f"{name}.{node.target}"
            if calls.count(node.target) > 1:  # parameterless: one more layer of its kind
                entry_name = f"{name}.{node.target}_{'in' if group is pre else 'out'}"
            out += _entries(entry_name, submodules[node.target])
    block: dict[str, Any] = {"name": name, "type": "residual", "layers": []}
    for node in inner:
        block["layers"] += _relative(name, _entries(f"{name}.{node.target}", submodules[node.target]))
    if short:
        heads = {str(node.target).split(".")[0] for node in short}
        single = len(short) == 1 and "." not in str(short[0].target)
        if len(heads) != 1 or (not single and not all(str(n.target).count(".") == 1 for n in short)):
            raise ValueError(f"layer {name!r}: {describe(short[0])}: the shortcut's modules must be one "
                             "submodule or the children of one nn.Sequential (its name: shortcut_name)")
        shortcut_name = heads.pop()
        if shortcut_name in {node.target.split(".")[0] for node in inner}:
            raise ValueError(f"layer {name!r}: {describe(short[0])}: the shortcut's module is used by the "
                             "inner chain too")
        block["shortcut_name"] = shortcut_name
        entries = [entry for node in short for entry in
                   _relative(f"{name}.{shortcut_name}" if not single else name,
                             _entries(f"{name}.{node.target}", submodules[node.target]))]
        block["shortcut"] = entries[0] if single and len(entries) == 1 else entries
    return entries_pre + [block] + entries_post


def _relative(prefix: str, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` named by their paths under ``prefix`` (a block's children)."""
    for entry in entries:
        entry["name"] = entry["name"][len(prefix) + 1:]
    return entries


def _entries(name: str, child: Any, position: int = 1, count: int = 0) -> list[dict[str, Any]]:
    """The spec entries of one module: a supported layer's one entry, or a traced residual block's."""
    if type(child).__name__ in _MODULES or type(child).__name__ in _RECURRENT or _builtin(child):
        return [_entry(name, child, position, count)]
    return _residual(name, child)


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
        Children that are ``nn.Sequential`` are expanded (their children named ``layer1.0``, ...), and a
        child that is no PyTorch layer must be a residual block, its ``forward`` traced with
        ``torch.fx``: ``x -> pre -> f(x) + s(x) -> post`` with ``f`` and ``s`` chains of submodules
        (``s`` empty: the identity; else one submodule or the children of one ``nn.Sequential``, whose
        name becomes the spec's ``shortcut_name``), nested blocks traced in turn, the modules before
        the sum and (parameterless, torchvision's final ReLU) after it written as layers of their own
        (``layer1.0.relu_out``): a torchvision ``BasicBlock`` with ``downsample`` exports as a
        ``residual`` layer. Any other pattern (functional calls, several sums, a module with parameters
        called twice) is refused with the graph node named.
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
    children = _flatten("", module)
    for position, (name, child) in enumerate(children):
        layers += _entries(name, child, position, len(children))
        for parameter, tensor in (*child.named_parameters(), *child.named_buffers()):
            if parameter.rpartition(".")[2] not in _DROPPED_BUFFERS:
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
