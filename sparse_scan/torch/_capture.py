"""A PyTorch module's ``forward()`` as sparse-scan layers, exactly, or a refusal that names the node.

torch.fx traces the whole forward (:mod:`sparse_scan.torch._graph`): PyTorch's own layers are leaves,
everything else (custom submodules, ``ModuleList`` loops, nested ``Sequential``) is traced through.
Then every node the output depends on becomes part of one chain:

- a call of a supported layer module, or a functional or method form of one (``F.relu``,
  ``torch.relu``, ``x.relu()``, ``F.max_pool2d``, ``F.dropout(x, p, training=...)``, ...): a layer;
- a reshape that keeps the batch axis (``x.view(x.size(0), -1)``, ``torch.flatten(x, 1)``, ...): a
  ``flatten`` layer over the axes it merges (read off the probes' shapes), or nothing when it keeps the
  shape; ``x.mean((2, 3))``: a global average pool;
- a constant scaling or shift (``x * 2.0``, ``1 - x``, ``-x``): an ``affine`` layer;
- a piece of ``x.chunk(n, dim=1)`` or ``x.split(size, dim=1)``: a ``narrow`` layer (its channels); a
  channel shuffle (``x.view(B, g, C // g, H, W)``, ``torch.transpose(x, 1, 2)``, ``x.view(B, C, H, W)``,
  ShuffleNet's) or ``nn.ChannelShuffle``: a ``channel_shuffle`` layer;
- the sum (or difference) of two branches that leave one node: an inline residual block
  (``scoped: false``: its layers keep the module's names), nested blocks for sums of sums;
- ``torch.cat`` of branches that leave one node, along the channels (``dim=1``): an inline ``block``
  with ``join: concat``; a concatenation that extends an earlier one's tensors (DenseNet's
  ``torch.cat(features, 1)`` after each layer appends its output) is read as that one's output and the
  new tensors (``cat([x, f(x)])``, blocks in a chain); the product of two branches (``f(x) * g(x)``, a
  squeeze-and-excitation module's ``scale * input`` with its ``(B, C, 1, 1)`` gate broadcast): an
  inline ``block`` with ``join: product``; joins nest in each other's branches;
- a recurrent layer read by its head (``out[:, -1]``, ``out[-1]``, ``h_n[-1]``, ``out.mean(dim=1)``)
  and one ``Linear``: a recurrent classifier.

A parameter-free module called twice becomes one layer per call (``pool``, ``pool_1``); a module with
parameters called twice (weight tying) is refused. Anything else is refused, never approximated: a
:class:`~sparse_scan.torch._graph.CaptureError` naming the node, its operation, the line of the forward
it comes from, and why. Layers are named by their module's path, so parameters keep PyTorch's
state_dict names.

Last, the model built from the captured spec runs on a probe batch in float64 beside the module's own
forward (dropout off in both): a difference refuses the capture, naming the first layer whose output
differs.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import operator
from typing import Any

import numpy as np

from ..spec import SpecError, model_from_spec
from ..weights import every_layer
from ._graph import (
    CaptureError,
    Traced,
    activations,
    attention,
    describe,
    live_nodes,
    no_dropout,
    probe,
    swaps_time_and_batch,
    time_major,
    trace,
)

__all__ = ["Capture", "CaptureError", "Source", "capture"]

WRITTEN, IGNORED = "written", "ignored"

MODULES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "Conv2d": ("conv2d", {"in_channels": WRITTEN, "out_channels": WRITTEN, "kernel_size": WRITTEN,
                          "stride": WRITTEN, "padding": WRITTEN, "dilation": WRITTEN, "groups": WRITTEN,
                          "bias": WRITTEN, "padding_mode": ("zeros",)}, {}),
    "Linear": ("linear", {"in_features": WRITTEN, "out_features": WRITTEN, "bias": WRITTEN}, {}),
    "MaxPool2d": ("maxpool2d", {"kernel_size": WRITTEN, "stride": WRITTEN, "padding": WRITTEN,
                                "dilation": WRITTEN, "ceil_mode": WRITTEN, "return_indices": (False,)}, {}),
    "AvgPool2d": ("avgpool2d", {"kernel_size": WRITTEN, "stride": WRITTEN, "padding": WRITTEN,
                                "ceil_mode": WRITTEN, "count_include_pad": WRITTEN,
                                "divisor_override": (None,)}, {}),
    "Flatten": ("flatten", {"start_dim": WRITTEN, "end_dim": WRITTEN}, {}),
    "ReLU": ("relu", {"inplace": IGNORED}, {}),
    "ReLU6": ("hardtanh", {"inplace": IGNORED}, {"min_val": 0.0, "max_val": 6.0}),
    "LeakyReLU": ("leaky_relu", {"negative_slope": WRITTEN, "inplace": IGNORED}, {}),
    "Tanh": ("tanh", {}, {}), "Sigmoid": ("sigmoid", {}, {}), "Identity": ("identity", {}, {}),
    "SiLU": ("silu", {"inplace": IGNORED}, {}),
    "GELU": ("gelu", {"approximate": WRITTEN}, {}),
    "ELU": ("elu", {"alpha": WRITTEN, "inplace": IGNORED}, {}),
    "Hardtanh": ("hardtanh", {"min_val": WRITTEN, "max_val": WRITTEN, "inplace": IGNORED,
                              "min_value": IGNORED, "max_value": IGNORED}, {}),  # deprecated aliases
    "Softplus": ("softplus", {"beta": WRITTEN, "threshold": WRITTEN}, {}),
    "BatchNorm2d": ("batchnorm2d", {"num_features": WRITTEN, "eps": WRITTEN, "momentum": WRITTEN,
                                    "affine": WRITTEN, "track_running_stats": (True,), "bias": WRITTEN}, {}),
    "Dropout": ("dropout", {"p": WRITTEN, "inplace": IGNORED}, {}),
    "AdaptiveAvgPool2d": ("adaptive_avgpool2d", {"output_size": WRITTEN}, {}),
    "LogSoftmax": ("log_softmax", {"dim": WRITTEN}, {}),
    "Softmax": ("softmax", {"dim": WRITTEN}, {}),
    "ChannelShuffle": ("channel_shuffle", {"groups": WRITTEN}, {}),
    "Hardswish": ("hardswish", {"inplace": IGNORED}, {}),
    "Hardsigmoid": ("hardsigmoid", {"inplace": IGNORED}, {}),
    "Mish": ("mish", {"inplace": IGNORED}, {}),
    "LayerNorm": ("layer_norm", {"normalized_shape": WRITTEN, "eps": WRITTEN, "elementwise_affine": WRITTEN,
                                 "bias": WRITTEN}, {}),
    "Upsample": ("upsample", {"size": WRITTEN, "scale_factor": WRITTEN, "mode": WRITTEN,
                              "align_corners": WRITTEN, "recompute_scale_factor": WRITTEN}, {}),
    "UpsamplingNearest2d": ("upsample", {"size": WRITTEN, "scale_factor": WRITTEN}, {"mode": "nearest"}),
    "UpsamplingBilinear2d": ("upsample", {"size": WRITTEN, "scale_factor": WRITTEN},
                             {"mode": "bilinear", "align_corners": True}),
}
"""PyTorch module type -> (spec type, what becomes of each argument of its constructor, fields the spec
entry always has). An argument is written to the spec, ignored (``inplace``: no effect on values or
gradients; deprecated aliases torch folds into other arguments), or a tuple of the only values the
spec represents (anything else is refused, with the reason in :data:`REASONS` where there is one). An
argument not listed (a newer PyTorch's) is refused too: nothing is dropped silently."""

REASONS: dict[tuple[str, str], str] = {
    ("BatchNorm2d", "track_running_stats"): "without running statistics BatchNorm2d normalises every batch "
    "by its own mean and variance, in eval mode too, so every output depends on every sample of the batch "
    "(no per-sample Jacobian to scan)",
}
"""Why a value outside a rule's tuple cannot be represented, by (module type, argument)."""

MODES = ("BatchNorm2d", "Dropout")
"""Module types whose spec entry has ``training``: the module's mode."""

SAMPLE_DROP_LAYERS = ("Dropout", "StochasticDepth", "DropPath")
"""Layers that draw random masks in training mode: the float64 check runs them in eval mode (the module's
side runs with dropout off and its sample drops keeping every sample)."""

UPSAMPLE_MODES = ("nearest", "nearest-exact", "bilinear")
"""``nn.Upsample``'s and ``F.interpolate``'s modes of a 4-D input that the ``upsample`` layer computes."""

POINTWISE = ("relu", "leaky_relu", "tanh", "sigmoid", "identity", "silu", "gelu", "elu", "hardtanh",
             "softplus", "hardswish", "hardsigmoid", "mish", "dropout", "affine")
"""Spec types that map each element on its own: the same layer over a channels-last tensor and over its
channels-first permutation (ConvNeXt's block, :meth:`_Builder._op_permute`)."""

CHANNELS_LAST, CHANNELS_FIRST = (0, 2, 3, 1), (0, 3, 1, 2)
"""ConvNeXt's ``permute`` of an NCHW batch to NHWC, and back."""

FUNCTIONAL_PARAMETERS = {"conv2d": ("weight", "bias"), "linear": ("weight", "bias"),
                         "batch_norm": ("running_mean", "running_var", "weight", "bias"),
                         "layer_norm": ("weight", "bias")}
"""Functional layers a forward may call with its module's own parameters and buffers -> the arguments
that take them (their spec weights have these names)."""

RECURRENT: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    kind: (kind.lower(), {"mode": IGNORED, "input_size": WRITTEN, "hidden_size": WRITTEN,
                          "num_layers": WRITTEN, "bias": WRITTEN, "batch_first": WRITTEN, "dropout": WRITTEN,
                          "bidirectional": WRITTEN, "proj_size": WRITTEN if kind == "LSTM" else (0,)}, {})
    for kind in ("RNN", "GRU", "LSTM")}
"""The recurrent modules, by the arguments of their common base ``RNNBase`` (theirs are ``*args``):
``mode`` is the module's type (and, for ``nn.RNN``, its ``nonlinearity``, written)."""

DROPPED_BUFFERS = ("num_batches_tracked",)
"""Buffers not written: BatchNorm2d's count of training batches, which frozen statistics never use."""

_KEEP_FIELDS = ("device", "dtype")  # constructor arguments that leave no trace in the module

FORWARD_TOLERANCE = 1e-9
"""The float64 check: a layer's output may differ from the module's by this much relative to the
output's largest magnitude (different summation orders), not more."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a spec weight comes from in the module.

    Attributes
    ----------
    module : str
        The path of the module holding it.
    attribute : str
        Its name there (``"weight"``, ``"running_mean"``, ``"weight_ih_l0"``).
    parameter : str or None
        The module's parameter (``named_parameters`` name) it is, or for a layer pruned with
        ``torch.nn.utils.prune`` the one it is computed from (``"conv.weight_orig"``); None for a
        buffer.
    mask : str or None
        The pruning mask (a buffer's name, ``"conv.weight_mask"``): the weight is
        ``parameter * mask``, and the parameter's gradient the weight's times the mask.
    shape : tuple of int or None
        The layer's shape of the weight where it differs from the module's (a ``Linear`` read as a 1x1
        convolution: ``(out, in, 1, 1)``; a scale per channel: ``(C, 1, 1)``): the weight is a view of
        the module's tensor in that shape, and its gradient goes back in the module's.
    """

    module: str
    attribute: str
    parameter: str | None
    mask: str | None = None
    shape: tuple[int, ...] | None = None

    def read(self, root: Any) -> Any:
        """The weight's current value in ``root`` (the module itself where it is one; a pruned weight:
        ``parameter * mask`` of now; a reshaped one: a view of it in :attr:`shape`). ``root`` is the
        module, or what answers its ``get_submodule``, ``get_parameter`` and ``get_buffer``."""
        if self.mask is not None:
            return (root.get_parameter(self.parameter) * root.get_buffer(self.mask)).detach()
        value = getattr(root.get_submodule(self.module), self.attribute)
        return value if self.shape is None else value.detach().reshape(self.shape)


@dataclasses.dataclass
class Capture:
    """A module's forward as a model spec, checked.

    Attributes
    ----------
    spec : dict
        ``input_shape`` and ``layers`` (what :func:`~sparse_scan.spec.model_from_spec` takes).
    weights : dict
        ``"<layer>.<parameter>"`` -> the module's own tensor at the capture (not a copy): its
        parameters and buffers (a pruned layer's effective ``weight``, ``weight_orig * weight_mask``).
    sources : dict
        The same keys -> :class:`Source`: where each weight lives in the module, to read it again.
    time_major : bool
        Whether the module takes its input time-major ``(T, B, F)``; the spec's model takes batch-first
        ``(B, T, F)``.
    """

    spec: dict[str, Any]
    weights: dict[str, Any]
    sources: dict[str, Source]
    time_major: bool


@dataclasses.dataclass
class _Layer:
    """Layer entries (names come later) that one graph node computes from its tensor input."""

    node: Any
    entries: list[dict[str, Any]]
    module: str | None = None  # the path of the module it calls; where `weights` is given: its name
    synthetic: bool = False  # a sum's scaling of its second operand (the sum's node is the block's)
    weights: dict[str, Source] | None = None  # a function's weights, a module's own tensors (by spec name)
    shapes: dict[str, tuple[int, ...]] | None = None  # a module's weights the layer holds reshaped


@dataclasses.dataclass
class _Block:
    """An inline join of branches: the arms from the split node to the join's operands (a sum's: its
    inner chain first, then its shortcut)."""

    node: Any
    join: str
    arms: list[list[Any]]


def capture(module: Any, input_shape: Any = None, *, batch_shape: Any = None) -> Capture:
    """Capture ``module``'s forward as a spec, checked against the module in float64.

    Parameters
    ----------
    module : torch.nn.Module
        Any module whose forward the capture accepts (module docstring).
    input_shape : sequence of int
        One sample's shape, no batch axis (``(T, input_size)`` for a recurrent model).
    batch_shape : sequence of int, optional
        Instead of ``input_shape``: the shape of a batch as the module takes it (``(T, B, F)`` for a
        time-major recurrent module), one sample's shape read off it.

    Returns
    -------
    Capture

    Raises
    ------
    CaptureError
        The forward cannot be captured exactly, or the captured model's forward differs from the
        module's (the node, or the first layer that differs, named).
    """
    reference, graph = trace(module)
    if (input_shape is None) == (batch_shape is None):
        raise CaptureError("give one of input_shape (one sample's) and batch_shape (a batch's)")
    if batch_shape is not None:
        batch = tuple(batch_shape)
        input_shape = (batch[:1] + batch[2:]) if time_major(reference, graph) else batch[1:]
    shape = _input_shape(input_shape)
    _check_first(reference, graph)
    traced = probe(reference, graph, shape)
    live = traced.live()
    recurrent = [node for node in live if node.op == "call_module"
                 and type(traced.module(node)).__name__ in RECURRENT]
    builder = _Builder(module, traced, live)
    if recurrent:
        layers, mapped = builder.recurrent(recurrent[0])
    else:
        layers, mapped = builder.sequential()
    spec = {"input_shape": list(shape), "layers": layers}
    _check(traced, spec, builder.weights, mapped, builder.channels_last)
    return Capture(spec, builder.weights, builder.sources, traced.time_major)


def _check_first(reference: Any, graph: Any) -> None:
    """Before anything runs, refuse the first node (forward order) that calls a module of a type no
    layer represents or computes attention (:func:`~sparse_scan.torch._graph.attention`), and any node
    the output does not depend on that writes into an activation in place (``x[:, 0] = 0``, a method
    ``x.add_(1)`` whose result is not used): torch.fx records the values such a write changes as they
    were before it."""
    supported = ", ".join(sorted(set(MODULES) | set(RECURRENT)))
    depends = activations(graph)
    live = live_nodes(graph)
    for node in live:
        if node.op == "call_module":
            kind = type(reference.get_submodule(node.target)).__name__
            if kind not in MODULES and kind not in RECURRENT:
                raise CaptureError(f"{describe(node)}: {kind} is not supported (supported layers: "
                                   f"{supported})")
        found = attention(node, depends)
        if found is not None:
            raise CaptureError(f"{describe(node)}: {found}: attention (a product of two activations, such as "
                               "queries by keys) is not supported: its Jacobian couples every position with "
                               "every other, and no sparse-scan layer computes it")
    unused = set(graph.nodes) - set(live)
    for node in graph.nodes:
        if node in unused and _writes_in_place(node) and node.all_input_nodes \
                and node.all_input_nodes[0] in depends:
            raise CaptureError(f"{describe(node)}: writes into {node.all_input_nodes[0].name!r} in place and "
                               "nothing reads its result: the values it changes are captured as they were "
                               "before it; write the operation out of place")


def _writes_in_place(node: Any) -> bool:
    """Whether ``node`` changes its first argument in place: a method ``x.add_(...)``, ``x[i] = v``, an
    augmented assignment."""
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    return node.op == "call_function" and node.target in (operator.setitem, operator.iadd, operator.isub,
                                                          operator.imul, operator.itruediv)


def _input_shape(value: Any) -> tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        shape = ()
    if not shape or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s > 0
                            for s in shape):
        raise CaptureError(f"input_shape: must be one sample's shape (positive ints, no batch axis), got "
                           f"{value!r}")
    return tuple(int(s) for s in shape)


def _plain(value: Any) -> Any:
    """YAML-friendly: tuples become lists, numbers stay numbers."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _scalar(value: Any) -> bool:
    """A finite real Python number (a constant in the forward)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class _Builder:
    """Turns the traced graph into spec entries, names them and gathers their weights."""

    def __init__(self, module: Any, traced: Traced, live: list[Any]) -> None:
        self.original = module
        self.traced = traced
        self.live = live
        self.weights: dict[str, Any] = {}
        self.sources: dict[str, Source] = {}
        self.used: set[str] = set()
        self.reserved = {path for path, _ in traced.reference.named_modules() if path}
        self.module_layers: set[str] = set()
        self.calls: dict[str, int] = {}
        self._decided: dict[Any, list[dict[str, Any]]] = {}  # the rest of a channel shuffle, a region's end
        self.activations = activations(traced.graph)
        self.parameters = self._parameter_nodes()
        self.channels_last: set[Any] = set()  # nodes between ConvNeXt's permutes (their values are NHWC)
        self._given: dict[Any, tuple[str, dict[str, Source]]] = {}  # a node -> its layer's name, weights
        self._reshaped: dict[Any, dict[str, tuple[int, ...]]] = {}  # a module call -> weights reshaped
        self._owners: dict[str, Any] = {}  # a module path -> the node whose layer takes its tensors
        self._live = set(live)

    def _parameter_nodes(self) -> set[Any]:
        """The nodes that read a tensor attribute of a module (a parameter or a buffer), directly or
        through reshapes (``self.gamma.view(1, -1, 1, 1)``)."""
        traced = self.traced
        found: set[Any] = set()
        for node in traced.graph.nodes:
            if node.op == "get_attr" and traced.is_tensor(node):
                found.add(node)
            elif node.op in ("call_method", "call_function") and node.all_input_nodes and all(
                    source in found for source in node.all_input_nodes) and traced.op(node).name in (
                    "reshape", "contiguous"):
                found.add(node)
        return found

    def _root_parameter(self, node: Any) -> Any:
        """The ``get_attr`` node a parameter node (:meth:`_parameter_nodes`) reshapes."""
        while node.op != "get_attr":
            node = node.all_input_nodes[0]
        return node

    def _parameter_read(self, node: Any) -> bool:
        """Whether every node reading the parameter node ``node`` is one the capture represents: a reshape
        of it, a functional layer taking it as a weight (``F.conv2d(x, self.weight)``), or a product with
        one activation (a scale per channel)."""
        for user in node.users:
            if user in self.parameters:
                continue
            op = self.traced.op(user)
            tensors = [n for n in self.traced.tensor_inputs(user) if n in self.activations]
            if op.name in FUNCTIONAL_PARAMETERS and tensors and user.args and user.args[0] is not node:
                continue
            if op.name == "mul" and len(tensors) == 1:
                continue
            return False
        return True

    # --- checks over every node, in forward order ----------------------------------------------
    def _check_nodes(self, nodes: list[Any]) -> None:
        """Refuse the first node (in forward order) that no layer represents."""
        traced = self.traced
        for node in nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.meta.get("no_grad") and traced.is_tensor(node):
                raise CaptureError(f"{describe(node)}: runs with gradients off (torch.no_grad()): PyTorch "
                                   "passes no gradient through it, a scan would")
            if node in self.parameters:
                if not self._parameter_read(node):
                    root = self._root_parameter(node)
                    raise CaptureError(f"{describe(root)}: the forward uses the tensor attribute "
                                       f"{root.target!r} in an expression; only the parameters of PyTorch's "
                                       "own layers (modules), of F.conv2d, F.linear, F.batch_norm and "
                                       "F.layer_norm given a module's own tensors, and a scale per channel "
                                       "(x * gamma) are captured")
                continue
            if node.op == "get_attr":
                continue
            op = traced.op(node)
            if node.op == "call_module":
                self._check_module(node)
            elif not traced.is_tensor(node) and (op.name == "getitem" or not op.known):
                continue  # x.size(0), x.shape, a recurrent layer's outputs: read by other nodes
            elif not op.known:
                raise CaptureError(f"{describe(node)}: {op.name} is not supported (no sparse-scan layer "
                                   "computes it)")
            if op.in_place:
                self._check_in_place(node)

    def _check_module(self, node: Any) -> None:
        module = self.traced.module(node)
        kind = type(module).__name__
        if kind in RECURRENT:
            return  # its arguments and its head: recurrent()
        self._module_entry(node, module)  # every argument representable
        if len(self.traced.tensor_inputs(node)) != 1 or len(node.args) + len(node.kwargs) != 1:
            raise CaptureError(f"{describe(node)}: {kind} is called with {len(node.args) + len(node.kwargs)} "
                               "arguments; a layer takes its input alone")
        count = self.calls[node.target] = self.calls.get(node.target, 0) + 1
        if any(True for _ in module.parameters()):
            self._owners.setdefault(node.target, node)
        if count > 1 and any(True for _ in module.parameters()):
            raise CaptureError(f"{describe(node)}: module {node.target!r} is called more than once (call "
                               f"{count}) and has parameters (weight tying): a spec layer cannot share "
                               "its weights with another")

    def _check_in_place(self, node: Any) -> None:
        tensors = self.traced.tensor_inputs(node)
        if not tensors:
            return
        target = tensors[0]
        others = [user for user in target.users if user is not node and self.traced.is_tensor(user)]
        if others:
            raise CaptureError(f"{describe(node)}: changes {target.name!r} in place, and "
                               f"{describe(others[0])} reads it too; write the operation out of place")

    # --- the chain -------------------------------------------------------------------------------
    def sequential(self) -> tuple[list[dict[str, Any]], list[tuple[int, Any]]]:
        """The spec's layers of a (non-recurrent) forward and, per top-level layer index, the node
        whose value its output is."""
        traced = self.traced
        self._check_nodes(self.live)
        output = traced.output()
        result = output.args[0]
        if not hasattr(result, "op") or not traced.is_tensor(result):
            raise CaptureError(f"{describe(output)}: the forward returns {self._returned(result)}; a model "
                               "returns one tensor")
        start = traced.placeholder()
        self._predecessors: dict[Any, Any] = {}
        self._converted: dict[Any, list[dict[str, Any]]] = {}
        for node in self.live:  # every node's entries in forward order: the first refusal is the first node
            if node.op in ("placeholder", "output", "get_attr") or not traced.is_tensor(node) \
                    or node in self.parameters:
                continue
            op = traced.op(node)
            tensors = self._inputs(node)
            if _join(op, tensors) is not None:
                continue  # a join of branches: its arms are chains of these nodes
            if len(tensors) != 1:
                raise self._joins(node, op, tensors)
            self._converted[node] = self._entries(node, op)
        items = self._chain(result, start)
        self._check_coverage(items)
        if not any(self._entries_of(item) for item in items):
            raise CaptureError(f"{describe(output)}: the forward computes no layer (it returns its input)")
        layers, mapped = [], []
        for item in items:
            for entry in self._name(item):
                layers.append(entry)
            if layers and (not mapped or mapped[-1][0] != len(layers) - 1):
                mapped.append((len(layers) - 1, item.node))
        return layers, mapped

    def _returned(self, result: Any) -> str:
        """How a message names what the forward returns, when it is no tensor."""
        value = self.traced.values[0].get(result) if hasattr(result, "op") else result
        return self.traced.kind_of(value)

    def _chain(self, end: Any, start: Any) -> list[Any]:
        """The items from ``start`` (exclusive) to ``end`` (inclusive), in forward order."""
        items = []
        node = end
        while node is not start:
            if node.op == "placeholder":  # cannot happen: every branch is walked from its split
                raise CaptureError(f"{describe(end)}: not one chain from the input")
            item, node = self._item(node)
            items.append(item)
        return items[::-1]

    def _item(self, node: Any) -> tuple[Any, Any]:
        """The item ``node`` computes and the node it reads."""
        traced = self.traced
        op = traced.op(node)
        tensors = self._inputs(node)
        join = _join(op, tensors)
        if join == "sum":
            return self._sum(node, op)
        if join is not None:
            return self._branches(node, join)
        if len(tensors) != 1:
            raise self._joins(node, op, tensors)
        name, weights = self._given.get(node, (node.target if node.op == "call_module" else None, None))
        return _Layer(node, self._converted[node], name, weights=weights, shapes=self._reshaped.get(node)), \
            tensors[0]

    def _predecessor(self, node: Any) -> Any:
        """The node ``node``'s value comes from along the chain: its tensor input, or for a join of
        branches the node they split from."""
        if node not in self._predecessors:
            op = self.traced.op(node)
            tensors = self._inputs(node)
            if _join(op, tensors) is not None:
                self._predecessors[node] = self._split(self._operands(node, op))
            elif len(tensors) == 1:
                self._predecessors[node] = tensors[0]
            else:
                raise self._joins(node, op, tensors)
        return self._predecessors[node]

    def _inputs(self, node: Any) -> list[Any]:
        """The activations ``node`` reads: its tensor inputs but the module's parameters and buffers, or
        for a piece of ``x.chunk(n, 1)`` (of ``x.split(size, 1)``), ``x``."""
        piece = self._piece(node)
        if piece is not None:
            return [piece[0]]
        return [n for n in self.traced.tensor_inputs(node) if n not in self.parameters]

    def _piece(self, node: Any) -> tuple[Any, int, int] | None:
        """``(x, start, length)`` where ``node`` is a piece ``x.chunk(n, 1)[i]`` (``x.split(size,
        1)[i]``): its channels ``start .. start + length - 1``; None for any other node."""
        if node.op != "call_function" or self.traced.op(node).name != "getitem" or not hasattr(
                node.args[0], "op") or self.traced.op(node.args[0]).name not in ("chunk", "split"):
            return None
        pieces, index = node.args[0], node.args[1]
        op = self.traced.op(pieces)
        arguments = self.traced.arguments(pieces, op)
        (source,) = self.traced.tensor_inputs(pieces)
        rank = len(self.traced.shapes(source)[0])
        sizes = [[int(piece.shape[1]) for piece in values[pieces]] for values in self.traced.values]
        dim = arguments["dim"]
        if dim not in (1, 1 - rank) or isinstance(dim, bool) or sizes[0] != sizes[1]:
            raise CaptureError(f"{describe(pieces)}: {op.name} along dim {dim!r} of {rank}-axis "
                               "tensors; only pieces of the channels (dim 1) are layers")
        if not isinstance(index, int) or isinstance(index, bool):
            raise CaptureError(f"{describe(node)}: takes {index!r} of {op.name}'s pieces; one piece (an "
                               "int) is a layer")
        index %= len(sizes[0])
        return source, sum(sizes[0][:index]), sizes[0][index]

    def _joins(self, node: Any, op: Any, tensors: list[Any]) -> CaptureError:
        """The refusal of a node that reads other than one tensor and is no sum of two branches."""
        if not tensors:
            return CaptureError(f"{describe(node)}: {op.name} makes a tensor of no input (a constant "
                                "tensor in the forward); no layer computes it")
        what = {"mul": "multiplies", "div": "divides"}.get(op.name, f"{op.name} combines")
        return CaptureError(f"{describe(node)}: {what} {len(tensors)} tensors; only a sum (or difference) "
                            "or a product of two branches, or torch.cat of branches, joins branches (a "
                            "block)")

    def _ancestry(self, node: Any) -> list[Any]:
        chain = [node]
        while chain[-1].op != "placeholder":
            chain.append(self._predecessor(chain[-1]))
        return chain

    def _split(self, operands: list[Any]) -> Any:
        """The node every operand of a join comes from (the deepest common node of their chains)."""
        others = [set(self._ancestry(operand)) for operand in operands[1:]]
        return next(candidate for candidate in self._ancestry(operands[0])
                    if all(candidate in seen for seen in others))

    def _operands(self, node: Any, op: Any) -> list[Any]:
        """A join's operands: its tensor inputs, those of a concatenation read as an earlier live
        concatenation of its first ones (along the same axis) and the rest, the longest such."""
        tensors = self.traced.tensor_inputs(node)
        if op.name != "cat":
            return tensors
        if not hasattr(self, "_concatenations"):
            self._concatenations: dict[tuple[Any, ...], Any] = {}
            for other in self.live:
                if other.op == "call_function" and self.traced.op(other).name == "cat":
                    self._concatenations.setdefault((tuple(self.traced.tensor_inputs(other)),
                                                     self._cat_axis(other)), other)
        axis = self._cat_axis(node)
        for length in range(len(tensors) - 1, 1, -1):
            earlier = self._concatenations.get((tuple(tensors[:length]), axis))
            if earlier is not None:
                return [earlier, *tensors[length:]]
        return tensors

    def _cat_axis(self, node: Any) -> int:
        """The axis of a ``torch.cat`` node: refused unless the first per-sample one (the channels)."""
        arguments = self.traced.arguments(node, self.traced.op(node))
        dim, tensors = arguments["dim"], self.traced.tensor_inputs(node)
        ranks = {len(shape) for tensor in tensors for shape in self.traced.shapes(tensor)}
        if arguments["out"] is not None:
            raise CaptureError(f"{describe(node)}: torch.cat with out=: writes into a tensor; write it "
                               "out of place")
        if len(ranks) != 1 or isinstance(dim, bool) or dim not in (1, 1 - max(ranks)):
            what = f"{max(ranks)}-axis tensors" if len(ranks) == 1 else "tensors of different ranks"
            raise CaptureError(f"{describe(node)}: torch.cat along dim {dim!r} of {what}; only the "
                               "concatenation along the channels (dim 1, the first axis of a sample) is a "
                               "block")
        return 1

    def _sum(self, node: Any, op: Any) -> tuple[Any, Any]:
        """``a + b`` (``a - b``, ``alpha``) of two branches: a residual block from their split, or an
        affine layer for ``x + x``."""
        arguments = self.traced.arguments(node, op)
        a, b = arguments["input"], arguments["other"]
        alpha = arguments.get("alpha", 1)
        if not _scalar(alpha):
            raise CaptureError(f"{describe(node)}: alpha must be a constant number, got {alpha!r}")
        factor = (-1.0 if op.name == "sub" else 1.0) * float(alpha)
        split = self._split([a, b])
        arms = [self._chain(a, split), self._chain(b, split)]
        if factor != 1:
            arms[1].append(_Layer(node, [{"type": "affine", "scale": factor}], synthetic=True))
        if not any(self._entries_of(item) for arm in arms for item in arm):  # x + x, x - x
            return _Layer(node, [{"type": "affine", "scale": 1.0 + factor}]), split
        sizes = [sum(len(self._entries_of(item)) for item in arm) for arm in arms]
        inner, shortcut = (arms[0], arms[1]) if sizes[0] >= sizes[1] else (arms[1], arms[0])
        return _Block(node, "sum", [inner, shortcut]), split

    def _branches(self, node: Any, join: str) -> tuple[Any, Any]:
        """``torch.cat([a, b, ...], 1)`` or ``a * b`` of branches: a block from their split, the arms in
        the operands' order."""
        op = self.traced.op(node)
        operands = self._operands(node, op)
        if join == "product":
            self._check_broadcast(node, operands)
        split = self._split(operands)
        return _Block(node, join, [self._chain(operand, split) for operand in operands]), split

    def _check_broadcast(self, node: Any, operands: list[Any]) -> None:
        """Refuse a product whose operands' shapes the block does not broadcast: equal lengths, the batch
        axis alike, every other axis equal or 1."""
        for run in range(len(self.traced.values)):
            shapes = [self.traced.shapes(operand)[run] for operand in operands]
            out = tuple(max(sizes) for sizes in zip(*shapes, strict=False))
            if len({len(shape) for shape in shapes}) != 1 or len({shape[0] for shape in shapes}) != 1 or any(
                    size not in (1, full) for shape in shapes for size, full in zip(shape, out, strict=True)):
                raise CaptureError(f"{describe(node)}: multiplies tensors of shapes "
                                   f"{' and '.join(str(list(shape)) for shape in shapes)}; a product of two "
                                   "branches needs shapes of one length, the batch axis alike and every "
                                   "other axis equal or 1 (broadcast)")

    def _entries_of(self, item: Any) -> list[Any]:
        return item.entries if isinstance(item, _Layer) else [item]

    def _check_coverage(self, items: list[Any]) -> None:
        """Every node the output reads is in the chain exactly once (a node read by two branches that
        do not form one sum would be computed twice)."""
        covered: list[Any] = []

        def visit(entries: list[Any]) -> None:
            for item in entries:
                if isinstance(item, _Block):
                    for arm in item.arms:
                        visit(arm)
                if not getattr(item, "synthetic", False):
                    covered.append(item.node)

        visit(items)
        seen: set[Any] = set()
        for node in covered:
            if node in seen:
                raise CaptureError(f"{describe(node)}: its value feeds branches that are not one join (a "
                                   "sum, a product or a concatenation; the chain would compute it twice)")
            seen.add(node)
        for node in self.live:
            if node.op in ("placeholder", "output", "get_attr") or not self.traced.is_tensor(node) \
                    or node in self.parameters:
                continue
            if node not in seen:
                raise CaptureError(f"{describe(node)}: not part of one chain of layers and joins of branches")

    # --- one node's layer entries ----------------------------------------------------------------
    def _entries(self, node: Any, op: Any) -> list[dict[str, Any]]:
        """The spec entries (no names) of a one-input node."""
        if node in self.channels_last:  # between ConvNeXt's permutes: its channels-first layers
            return self._channels_first(node, op)
        if node.op == "call_module":
            return [self._module_entry(node, self.traced.module(node))]
        if node in self._decided:  # the rest of a channel shuffle or a region an earlier node recognised
            return self._decided[node]
        piece = self._piece(node)
        if piece is not None:
            return [{"type": "narrow", "start": piece[1], "length": piece[2]}]
        handler = getattr(self, f"_op_{op.name}", None)
        if handler is None:
            raise CaptureError(f"{describe(node)}: {op.name} is not supported here")
        if op.name in ("reshape", "contiguous"):  # the probes' shapes decide, not the arguments
            return handler(node, {})
        return handler(node, self.traced.arguments(node, op))

    def _module_entry(self, node: Any, module: Any) -> dict[str, Any]:
        """The spec entry of a module: every constructor argument written or refused."""
        kind = type(module).__name__
        spec_type, rules, fixed = MODULES[kind] if kind in MODULES else RECURRENT[kind]
        entry: dict[str, Any] = {"type": spec_type, **fixed}
        if kind == "RNN":
            entry["nonlinearity"] = module.nonlinearity
        for argument, parameter in _constructor(type(module)).parameters.items():
            if argument == "self" or argument in _KEEP_FIELDS or parameter.kind in (
                    inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                continue
            rule = rules.get(argument)
            if rule is None:
                raise CaptureError(f"{describe(node)}: {argument}: an argument of {kind} the spec cannot "
                                   "represent")
            if rule == IGNORED:
                continue
            value = getattr(module, argument)
            if argument == "bias" and not isinstance(value, bool):  # a layer's bias tensor, a recurrent flag
                value = value is not None
            if rule == WRITTEN:
                entry[argument] = _plain(value)
            elif value not in rule:
                allowed = " or ".join(repr(v) for v in rule)
                reason = REASONS.get((kind, argument))
                raise CaptureError(f"{describe(node)}: {argument}: {value!r} cannot be represented (only "
                                   f"{allowed})" + (f": {reason}" if reason else ""))
        if kind == "BatchNorm2d" and module.training:
            raise CaptureError(f"{describe(node)}: the BatchNorm2d is in training mode, where it normalises "
                               "by each batch's own mean and variance, coupling the samples of a batch (no "
                               "per-sample Jacobian to scan); call module.eval() first to capture it with "
                               "its frozen running_mean and running_var")
        if entry["type"] == "upsample":
            self._check_upsample(node, entry["mode"], False)
        if kind in ("LogSoftmax", "Softmax") and entry.get("dim") is None:
            entry["dim"] = 1  # PyTorch's implicit dim of a (B, n) batch
        if kind in MODES:
            entry["training"] = bool(module.training)
        return entry

    def _activation(self, spec_type: str, **fields: Any) -> list[dict[str, Any]]:
        return [{"type": spec_type, **fields}]

    def _op_relu(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("relu")

    def _op_relu6(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("hardtanh", min_val=0.0, max_val=6.0)

    def _op_silu(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("silu")

    def _op_sigmoid(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("sigmoid")

    def _op_tanh(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("tanh")

    def _op_leaky_relu(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("leaky_relu", negative_slope=self._number(node, args, "negative_slope"))

    def _op_elu(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("elu", alpha=self._number(node, args, "alpha"))

    def _op_gelu(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("gelu", approximate=args["approximate"])

    def _op_hardtanh(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("hardtanh", min_val=self._number(node, args, "min_val"),
                                max_val=self._number(node, args, "max_val"))

    def _op_softplus(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("softplus", beta=self._number(node, args, "beta"),
                                threshold=self._number(node, args, "threshold"))

    def _op_hardswish(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("hardswish")

    def _op_hardsigmoid(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("hardsigmoid")

    def _op_mish(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._activation("mish")

    def _op_interpolate(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``F.interpolate`` (``F.upsample``) of an NCHW batch: an ``upsample`` layer."""
        self._check_upsample(node, args["mode"], args.get("antialias", False))
        return [{"type": "upsample", **{key: _plain(args[key]) for key in (
            "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor")}}]

    def _check_upsample(self, node: Any, mode: Any, antialias: Any) -> None:
        shape = self.traced.shapes(self._inputs(node)[0])[0]
        if len(shape) != 4 or mode not in UPSAMPLE_MODES or antialias is not False:
            raise CaptureError(f"{describe(node)}: upsamples a tensor of shape {list(shape)} with mode "
                               f"{mode!r}, antialias={antialias!r}; the upsample layer computes the modes "
                               f"{', '.join(UPSAMPLE_MODES)} of an NCHW batch, without antialias")

    def _op_stochastic_depth(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """torchvision's ``stochastic_depth(x, p, mode, training)``: a ``stochastic_depth`` layer."""
        p, mode, training = args["p"], args["mode"], args["training"]
        if not _scalar(p) or not 0 <= p <= 1 or mode not in ("row", "batch") or not isinstance(training,
                                                                                               bool):
            raise CaptureError(f"{describe(node)}: stochastic_depth with p={p!r}, mode={mode!r}, "
                               f"training={training!r}: expected a constant probability, mode and training")
        if training:
            self._check_sample_drop(node, float(p), mode, True)
        return [{"type": "stochastic_depth", "p": float(p), "mode": mode, "training": training}]

    def _op_drop_path(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """timm's ``drop_path(x, drop_prob, training, scale_by_keep)``: a ``drop_path`` layer."""
        p, training, scale = args["drop_prob"], args["training"], args["scale_by_keep"]
        if not _scalar(p) or not 0 <= p <= 1 or not isinstance(training, bool) or not isinstance(scale, bool):
            raise CaptureError(f"{describe(node)}: drop_path with drop_prob={p!r}, training={training!r}, "
                               f"scale_by_keep={scale!r}: expected a constant probability and flags")
        if training:
            self._check_sample_drop(node, float(p), "row", scale)
        return [{"type": "drop_path", "drop_prob": float(p), "scale_by_keep": scale, "training": training}]

    def _check_sample_drop(self, node: Any, p: float, mode: str, scale: bool) -> None:
        """Refuse a sample drop in training mode whose function, run on a probe batch (seeded), does other
        than keep or zero whole samples (``mode`` row) or the batch (``batch``), the kept ones scaled by
        ``1 / (1 - p)`` (``scale``): a function that only bears torchvision's or timm's name."""
        import torch  # noqa: PLC0415
        import torch.fx  # noqa: PLC0415

        values = self.traced.values[-1]
        x = values[self._inputs(node)[0]]
        factor = 1.0 / (1.0 - p) if scale and p < 1 else 1.0
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # the CPU's generator, restored after
            torch.default_generator.manual_seed(0)
            out = node.target(*torch.fx.node.map_arg(node.args, values.get),
                              **torch.fx.node.map_arg(node.kwargs, values.get))
        kept = [bool(torch.allclose(out[b], x[b] * factor, rtol=1e-12, atol=0)) for b in range(len(x))]
        dropped = [bool((out[b] == 0).all()) for b in range(len(x))]
        whole = all(k or d for k, d in zip(kept, dropped, strict=True))
        if not whole or (mode == "batch" and len(set(kept)) > 1):
            raise CaptureError(f"{describe(node)}: in training mode it does not keep or drop whole "
                               f"samples as the {mode} mode of stochastic depth does (kept ones scaled by "
                               f"{factor:g}) on a probe batch; no layer computes it")

    def _op_permute(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """ConvNeXt's ``x.permute(0, 2, 3, 1)`` of an NCHW batch, where one chain of layers over the
        channels leads to ``permute(0, 3, 1, 2)``: no layer; the chain's layers become their channels-first
        forms (:meth:`_channels_first`). Any other permutation is refused."""
        dims = self._dims(node)
        rule = ("only ConvNeXt's channels-last block is captured: permute(0, 2, 3, 1) of an NCHW batch, one "
                "chain of LayerNorm over the channels, Linear, pointwise layers and scales per channel, then "
                "permute(0, 3, 1, 2)")
        if dims != CHANNELS_LAST:
            raise CaptureError(f"{describe(node)}: permutes axes {list(dims)}; {rule}")
        middle, current = [], node
        while True:
            readers = [user for user in current.users if user in self._live and self.traced.is_tensor(user)]
            if len(readers) == 1 and readers[0].op == "output":
                raise CaptureError(f"{describe(node)}: permutes axes {list(dims)}, and the forward returns "
                                   f"{describe(current)} before permute(0, 3, 1, 2); {rule}")
            if len(readers) != 1:
                raise CaptureError(f"{describe(node)}: permutes axes {list(dims)}, and {describe(current)} "
                                   f"is read by {len(readers)} nodes; {rule}")
            current = readers[0]
            if self.traced.op(current).name == "permute" and self._dims(current) == CHANNELS_FIRST:
                break
            middle.append(current)
        self._decided[current] = []
        self.channels_last.update(middle)
        return []

    def _dims(self, node: Any) -> tuple[int, ...]:
        """The permutation a ``permute`` node applies, non-negative (``x.permute(0, 2, 3, 1)``,
        ``torch.permute(x, [0, 2, 3, 1])``)."""
        dims = self.traced.arguments(node, self.traced.op(node))["dims"]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        rank = len(self.traced.shapes(node)[0])
        return tuple(d % rank if isinstance(d, int) else d for d in dims)

    def _channels_first(self, node: Any, op: Any) -> list[dict[str, Any]]:
        """The layers of ``node`` between ConvNeXt's permutes, over the NCHW batch: a ``Linear`` a 1x1
        convolution (its weight viewed ``(out, in, 1, 1)``), a ``LayerNorm`` over the channels
        (``data_format: channels_first``), pointwise layers as they are; the functional forms and a scale
        per channel by their handlers."""
        traced = self.traced
        kind = type(traced.module(node)).__name__ if node.op == "call_module" else None
        if kind == "Linear":
            module = traced.module(node)
            if hasattr(module, "weight_orig"):
                raise CaptureError(f"{describe(node)}: a pruned Linear between ConvNeXt's permutes (a 1x1 "
                                   "convolution of the NCHW batch) is not supported")
            self._reshaped[node] = {"weight": (module.out_features, module.in_features, 1, 1)}
            return [{"type": "conv2d", "in_channels": module.in_features, "out_channels": module.out_features,
                     "kernel_size": 1, "bias": module.bias is not None}]
        if kind == "LayerNorm":
            module = traced.module(node)
            return self._layer_norm(node, module.normalized_shape, module.eps, module.weight is not None,
                                    module.bias is not None)
        if kind is None and op.name in ("linear", "layer_norm", "mul"):  # their handlers know the region
            return getattr(self, f"_op_{op.name}")(node, traced.arguments(node, op))
        entries = [self._module_entry(node, traced.module(node))] if kind is not None else getattr(
            self, f"_op_{op.name}", self._unsupported)(node, traced.arguments(node, op))
        if all(entry["type"] in POINTWISE for entry in entries):
            return entries
        what = entries[0]["type"] if entries else op.name
        raise CaptureError(f"{describe(node)}: between ConvNeXt's permute(0, 2, 3, 1) and permute(0, 3, 1, "
                           f"2) (channels last), {what} is not supported: only LayerNorm over the channels, "
                           "Linear, pointwise layers and scales per channel")

    def _unsupported(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        raise CaptureError(f"{describe(node)}: {self.traced.op(node).name} is not supported here")

    def _layer_norm(self, node: Any, normalized_shape: Any, eps: Any, weight: bool,
                    bias: bool) -> list[dict[str, Any]]:
        """A ``layer_norm`` entry: over the last dims, or between ConvNeXt's permutes over the channels
        (``normalized_shape`` must then be the channels alone)."""
        if not _scalar(eps):
            raise CaptureError(f"{describe(node)}: eps must be a constant number, got {eps!r}")
        if not weight and bias:
            raise CaptureError(f"{describe(node)}: a bias without a weight cannot be represented (a "
                               "layer_norm's bias comes with elementwise_affine)")
        entry = {"type": "layer_norm", "normalized_shape": _plain(normalized_shape), "eps": float(eps),
                 "elementwise_affine": weight, "bias": bias}
        if node not in self.channels_last:
            return [entry]
        channels = self.traced.shapes(self._inputs(node)[0])[0][-1]
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if shape != (channels,):
            raise CaptureError(f"{describe(node)}: a LayerNorm over {list(shape)} between ConvNeXt's "
                               f"permutes; only one over the {channels} channels is a layer (channels_first)")
        return [{**entry, "normalized_shape": channels, "data_format": "channels_first"}]

    # --- functional layers given a module's own tensors --------------------------------------------
    def _op_conv2d(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``F.conv2d(x, self.weight, self.bias, stride, padding, dilation, groups)``: a ``conv2d`` layer
        with the module's weights, as if the module were an ``nn.Conv2d``."""
        shape = self._batch_of(node, 4, "F.conv2d")
        self._given_weights(node, args, "conv2d")
        out_channels, _, *kernel = self.traced.values[0][args["weight"]].shape
        return [{"type": "conv2d", "in_channels": shape[1], "out_channels": int(out_channels),
                 "kernel_size": [int(k) for k in kernel], **{key: _plain(args[key]) for key in (
                     "stride", "padding", "dilation", "groups")}, "bias": args["bias"] is not None}]

    def _op_linear(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``F.linear(x, self.weight, self.bias)``: a ``linear`` layer with the module's weights (between
        ConvNeXt's permutes: a 1x1 convolution)."""
        weights = self._given_weights(node, args, "linear")
        out_features, in_features = (int(n) for n in self.traced.values[0][args["weight"]].shape)
        bias = args["bias"] is not None
        if node in self.channels_last:
            weights["weight"] = dataclasses.replace(weights["weight"],
                                                    shape=(out_features, in_features, 1, 1))
            return [{"type": "conv2d", "in_channels": in_features, "out_channels": out_features,
                     "kernel_size": 1, "bias": bias}]
        return [{"type": "linear", "in_features": in_features, "out_features": out_features, "bias": bias}]

    def _op_batch_norm(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, momentum,
        eps)``: a frozen ``batchnorm2d`` layer with the module's tensors."""
        shape = self._batch_of(node, 4, "F.batch_norm")
        if args["running_mean"] is None or args["running_var"] is None:
            raise CaptureError(f"{describe(node)}: F.batch_norm without running statistics: "
                               f"{REASONS[('BatchNorm2d', 'track_running_stats')]}")
        if args["training"] is not False:
            raise CaptureError(f"{describe(node)}: F.batch_norm with training={args['training']!r} "
                               "normalises by each batch's own mean and variance, coupling the samples of a "
                               "batch (no per-sample Jacobian to scan); call module.eval() first to capture "
                               "it with its frozen running_mean and running_var")
        momentum = args["momentum"]
        if momentum is not None and not _scalar(momentum):
            raise CaptureError(f"{describe(node)}: momentum must be a constant number or None, got "
                               f"{momentum!r}")
        if args["weight"] is None and args["bias"] is not None:
            raise CaptureError(f"{describe(node)}: a bias without a weight cannot be represented (a "
                               "batchnorm2d's bias comes with affine)")
        self._given_weights(node, args, "batch_norm")
        return [{"type": "batchnorm2d", "num_features": shape[1], "eps": self._number(node, args, "eps"),
                 "momentum": momentum, "affine": args["weight"] is not None, "bias": args["bias"] is not None,
                 "training": False}]

    def _op_layer_norm(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``F.layer_norm(x, shape, self.weight, self.bias, eps)`` (torchvision's ``LayerNorm2d`` between
        its permutes): a ``layer_norm`` layer with the module's weights."""
        self._given_weights(node, args, "layer_norm")
        return self._layer_norm(node, args["normalized_shape"], args["eps"], args["weight"] is not None,
                                args["bias"] is not None)

    def _batch_of(self, node: Any, rank: int, what: str) -> tuple[int, ...]:
        shape = self.traced.shapes(self._inputs(node)[0])[0]
        if len(shape) != rank:
            raise CaptureError(f"{describe(node)}: {what} of a tensor of shape {list(shape)}; the layer "
                               f"takes batches of {rank} axes")
        return shape

    def _given_weights(self, node: Any, args: dict[str, Any], op: str) -> dict[str, Source]:
        """The weights a functional layer ``node`` is given: each a tensor of one module, passed as it is
        (``self.weight``) and named as the layer names it, that feeds no other layer; the layer takes the
        module's path as its name. Empty where it is given none (``F.layer_norm(x, shape)``)."""
        given = {name: args[name] for name in FUNCTIONAL_PARAMETERS[op] if args[name] is not None}
        for name, value in given.items():
            if not hasattr(value, "op") or value.op != "get_attr":
                raise CaptureError(f"{describe(node)}: its {name} is computed in the forward "
                                   f"({getattr(value, 'name', value)!r}); a functional layer is captured "
                                   "where it is given its module's own tensors as they are (self.weight)")
        if not given:
            return {}
        targets = {name: value.target.rpartition(".") for name, value in given.items()}
        paths = {path for path, _, _ in targets.values()}
        renamed = any(attribute != name for name, (_, _, attribute) in targets.items())
        if len(paths) != 1 or "" in paths or renamed:
            found = ", ".join(f"{name}={value.target!r}" for name, value in given.items())
            raise CaptureError(f"{describe(node)}: it is given {found}; a functional layer is captured where "
                               "its tensors are one submodule's own, named as the layer names them "
                               f"({', '.join(FUNCTIONAL_PARAMETERS[op])}), so that the spec's weights keep "
                               "their state_dict names")
        (path,) = paths
        self._claim(path, node)
        parameters = {name for name, _ in self.traced.reference.named_parameters()}
        sources = {name: Source(path, name, value.target if value.target in parameters else None)
                   for name, value in given.items()}
        self._given[node] = (path, sources)
        return sources

    def _claim(self, name: str, node: Any) -> None:
        """``node``'s layer takes the weights of ``name`` (a module's path, a parameter's name): refused
        where another layer has them."""
        owner = self._owners.setdefault(name, node)
        if owner is not node:
            raise CaptureError(f"{describe(node)}: the tensors of {name!r} feed {describe(owner)} too "
                               "(weight tying): a spec layer cannot share its weights with another")

    def _op_max_pool2d(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        if args["return_indices"]:
            raise CaptureError(f"{describe(node)}: return_indices=True returns a pair; a layer returns one "
                               "tensor")
        return [{"type": "maxpool2d", **{key: _plain(args[key]) for key in (
            "kernel_size", "stride", "padding", "dilation", "ceil_mode")}}]

    def _op_avg_pool2d(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        if args["divisor_override"] is not None:
            raise CaptureError(f"{describe(node)}: divisor_override={args['divisor_override']!r} cannot be "
                               "represented (only None)")
        return [{"type": "avgpool2d", **{key: _plain(args[key]) for key in (
            "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")}}]

    def _op_adaptive_avg_pool2d(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "adaptive_avgpool2d", "output_size": _plain(args["output_size"])}]

    def _op_dropout(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        p, training = args["p"], args["training"]
        if not _scalar(p) or not 0 <= p <= 1 or not isinstance(training, bool):
            raise CaptureError(f"{describe(node)}: dropout with p={p!r}, training={training!r}: expected a "
                               "constant probability and mode")
        return [{"type": "dropout", "p": float(p), "training": training}]

    def _op_softmax(self, node: Any, args: dict[str, Any],
                    spec_type: str = "softmax") -> list[dict[str, Any]]:
        shape = self.traced.shapes(self.traced.tensor_inputs(node)[0])[0]
        dim = args["dim"]
        if dim is None and len(shape) == 2:
            dim = 1  # PyTorch's implicit dim of a (B, n) batch
        if len(shape) != 2 or dim not in (1, -1) or args["dtype"] is not None:
            raise CaptureError(f"{describe(node)}: {spec_type} over dim {dim!r} of a tensor of shape "
                               f"{list(shape)} (dtype {args['dtype']!r}); sparse-scan's runs over the "
                               "features of a flat (B, n) batch, in the input's dtype")
        return [{"type": spec_type, "dim": dim}]

    def _op_log_softmax(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._op_softmax(node, args, "log_softmax")

    def _op_contiguous(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def _op_reshape(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """A reshape that keeps the batch axis and merges consecutive per-sample axes: a flatten layer
        (none when it keeps the shape). The probes' shapes decide, not the arguments."""
        source = self.traced.tensor_inputs(node)[0]
        before, after = self.traced.shapes(source), self.traced.shapes(node)
        batches = [shape[0] for shape in before]
        if any(len(shape) == 0 or shape[0] != batch for shape, batch in zip(after, batches, strict=True)):
            raise CaptureError(f"{describe(node)}: reshapes a batch of {before[0][0]} samples "
                               f"{list(before[0])} to {list(after[0])}: it does not keep the batch axis "
                               "first (a layer maps each sample on its own)")
        sample_in, sample_out = before[0][1:], after[0][1:]
        if before[1][1:] != sample_in or after[1][1:] != sample_out:
            raise CaptureError(f"{describe(node)}: the per-sample shape it gives depends on the batch size")
        if sample_out == sample_in:
            return []
        if self._channel_shuffle(node, sample_in, sample_out):
            return []
        merged = _merged_axes(sample_in, sample_out)
        if merged is None:
            raise CaptureError(f"{describe(node)}: reshapes each sample {list(sample_in)} to "
                               f"{list(sample_out)}, which is no flattening of consecutive axes (the only "
                               "reshape sparse-scan has: flatten)")
        start, end = merged
        return [{"type": "flatten", "start_dim": start + 1, "end_dim": end + 1}]

    def _channel_shuffle(self, node: Any, sample_in: tuple[int, ...], sample_out: tuple[int, ...]) -> bool:
        """Whether the reshape ``node`` begins a channel shuffle: it splits the channels ``C`` into ``g``
        groups (``(g, C // g, ...)``), its one reader swaps those two axes (``torch.transpose(x, 1,
        2)``, maybe then ``.contiguous()``) and that one's reader reshapes the result back to the
        input's shape: ``node`` and the transpose are then no layer, the last reshape a
        ``channel_shuffle``."""
        if len(sample_out) != len(sample_in) + 1 or sample_out[2:] != sample_in[1:] or \
                sample_out[0] * sample_out[1] != sample_in[0]:
            return False
        transpose = _single_reader(node)
        if transpose is None or self.traced.op(transpose).name != "transpose":
            return False
        middle, last = [transpose], _single_reader(transpose)
        if last is not None and self.traced.op(last).name == "contiguous":
            middle, last = [transpose, last], _single_reader(last)
        if last is None or self.traced.op(last).name != "reshape" or \
                self.traced.shapes(last)[0][1:] != sample_in:
            return False
        arguments = self.traced.arguments(transpose, self.traced.op(transpose))
        if sorted(d % (len(sample_out) + 1) for d in (arguments["dim0"], arguments["dim1"])) != [1, 2]:
            return False
        self._decided.update({reader: [] for reader in middle})
        self._decided[last] = [{"type": "channel_shuffle", "groups": sample_out[0]}]
        return True

    def _op_transpose(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        raise CaptureError(f"{describe(node)}: transposes axes {args['dim0']} and {args['dim1']}; only a "
                           "channel shuffle (x.view(B, g, C // g, H, W), torch.transpose(x, 1, 2), "
                           "x.view(B, C, H, W)) moves entries between axes")

    def _op_mean(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``x.mean((2, 3))`` of an image batch: a global average pool (and a flatten unless keepdim)."""
        shape = self.traced.shapes(self.traced.tensor_inputs(node)[0])[0]
        dims = args["dim"]
        dims = (dims,) if isinstance(dims, int) else tuple(dims) if isinstance(dims, (tuple, list)) else None
        if (len(shape) != 4 or dims is None or not all(isinstance(d, int) for d in dims)
                or sorted(d % 4 for d in dims) != [2, 3] or args["dtype"] is not None):
            raise CaptureError(f"{describe(node)}: a mean over dim {args['dim']!r} of a tensor of shape "
                               f"{list(shape)}; only the mean over the spatial axes (2, 3) of an image batch "
                               "(a global average pool) is a layer")
        pool = {"type": "adaptive_avgpool2d", "output_size": 1}
        return [pool] if args["keepdim"] else [pool, {"type": "flatten"}]

    def _op_mul(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        scale = next((a for a in (args["input"], args["other"]) if hasattr(a, "op") and a in self.parameters),
                     None)
        if scale is not None:
            return self._layer_scale(node, scale)
        constant = self._constant(node, args)
        return [{"type": "affine", "scale": float(constant)}]

    def _layer_scale(self, node: Any, scale: Any) -> list[dict[str, Any]]:
        """``gamma * x`` (either order) of an NCHW batch, ``gamma`` a module's tensor of one value per
        channel broadcast over them (ConvNeXt's ``layer_scale`` of shape ``(C, 1, 1)``, timm's
        ``LayerScale2d``'s ``(C,)`` viewed ``(1, C, 1, 1)``; between ConvNeXt's permutes ``(C,)`` over the
        last axis): a ``layer_scale`` layer, its ``gamma`` a view of the tensor as ``(C, 1, 1)``, named by
        the module (a tensor named ``gamma``) or the tensor's own name."""
        shape = self.traced.shapes(self._inputs(node)[0])[0]
        broadcast = self.traced.shapes(scale)[0]
        root = self._root_parameter(scale)
        size = int(np.prod(self.traced.values[0][root].shape))
        region = node in self.channels_last
        channels = shape[-1] if region else shape[1]
        padded = (1,) * (4 - len(broadcast)) + tuple(broadcast)
        if len(shape) != 4 or len(broadcast) > 4 or size != channels or padded != (
                (1, 1, 1, channels) if region else (1, channels, 1, 1)):
            raise CaptureError(f"{describe(node)}: multiplies a tensor of shape {list(shape)} by the tensor "
                               f"attribute {root.target!r} broadcast as {list(broadcast)}; only a scale per "
                               "channel of an NCHW batch ((C, 1, 1), or (C,) viewed (1, C, 1, 1): ConvNeXt's "
                               "layer_scale, timm's LayerScale2d) is a layer (layer_scale)")
        path, _, attribute = root.target.rpartition(".")
        name = path if attribute == "gamma" and path else root.target
        self._claim(name, node)
        parameters = {key for key, _ in self.traced.reference.named_parameters()}
        self._given[node] = (name, {"gamma": Source(path, attribute, root.target if root.target in parameters
                                                    else None, shape=(channels, 1, 1))})
        return [{"type": "layer_scale", "dim": int(channels)}]

    def _op_narrow(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``torch.narrow(x, 1, start, length)``: a ``narrow`` layer (channels ``start .. start + length -
        1``)."""
        shape = self.traced.shapes(self._inputs(node)[0])[0]
        dim, start, length = args["dim"], args["start"], args["length"]
        if isinstance(dim, bool) or dim not in (1, 1 - len(shape)) or not isinstance(start, int) \
                or not isinstance(length, int):
            raise CaptureError(f"{describe(node)}: narrow along dim {dim!r} of a tensor of shape "
                               f"{list(shape)} (start {start!r}, length {length!r}); only a constant range "
                               "of the channels (dim 1) is a layer")
        return [{"type": "narrow", "start": start % shape[1], "length": length}]

    def _op_div(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        if not hasattr(args["input"], "op") or args["rounding_mode"] is not None:
            raise CaptureError(f"{describe(node)}: divides by a tensor or rounds; only the division of a "
                               "tensor by a constant is a layer")
        divisor = self._constant(node, args)
        if divisor == 0:
            raise CaptureError(f"{describe(node)}: divides by zero")
        return [{"type": "affine", "scale": 1.0 / float(divisor)}]

    def _op_neg(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "affine", "scale": -1.0}]

    def _op_add(self, node: Any, args: dict[str, Any], sign: float = 1.0) -> list[dict[str, Any]]:
        constant = self._constant(node, args)
        alpha = args.get("alpha", 1)
        if not _scalar(alpha):
            raise CaptureError(f"{describe(node)}: alpha must be a constant number, got {alpha!r}")
        if hasattr(args["input"], "op"):  # x + c, x - c
            return [{"type": "affine", "shift": sign * float(alpha) * float(constant)}]
        return [{"type": "affine", "scale": sign * float(alpha), "shift": float(constant)}]  # c + x, c - x

    def _op_sub(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self._op_add(node, args, -1.0)

    def _op_cat(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """``torch.cat`` of one tensor (DenseNet's first layer reads ``cat([x], 1)``): its input."""
        self._cat_axis(node)
        return []

    def _op_getitem(self, node: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        raise CaptureError(f"{describe(node)}: indexes a tensor ({args['index']!r}); no layer selects part "
                           "of a sample")

    def _constant(self, node: Any, args: dict[str, Any]) -> Any:
        """The constant operand of a binary operation with one tensor."""
        operand = args["other"] if hasattr(args["input"], "op") else args["input"]
        if not _scalar(operand):
            raise CaptureError(f"{describe(node)}: combines a tensor with {operand!r}; only a constant "
                               "number (a scaling or a shift) is a layer")
        return operand

    def _number(self, node: Any, args: dict[str, Any], key: str) -> float:
        if not _scalar(args[key]):
            raise CaptureError(f"{describe(node)}: {key} must be a constant number, got {args[key]!r}")
        return float(args[key])

    # --- names and weights -----------------------------------------------------------------------
    def _allocate(self, base: str) -> str:
        """A layer name not used yet and no module's path: ``base``, else ``base_1``, ``base_2``, ..."""
        candidate, k = base, 0
        while candidate in self.used or candidate in self.reserved:
            k += 1
            candidate = f"{base}_{k}"
        self.used.add(candidate)
        return candidate

    def _name(self, item: Any) -> list[dict[str, Any]]:
        """``item``'s named spec entries; a module's layer takes its path (a later call of a
        parameter-free module ``<path>_<k>``) and its weights."""
        if isinstance(item, _Block):
            arms = [[entry for sub in arm for entry in self._name(sub)] for arm in item.arms]
            if item.join != "sum":
                return [{"name": self._block_name(item), "type": "block", "join": item.join, "scoped": False,
                         "branches": arms}]
            block: dict[str, Any] = {"name": self._block_name(item), "type": "residual", "scoped": False,
                                     "layers": arms[0]}
            if arms[1]:
                block["shortcut"] = arms[1]
            return [block]
        out = []
        for index, entry in enumerate(item.entries):
            if item.module is None:  # a function's layers: its node's name (then "<name>_<type>")
                name = self._allocate(item.node.name if index == 0 else f"{item.node.name}_{entry['type']}")
            elif item.module not in self.used:  # a module's first call, a function's module: its path
                name = item.module
                self.used.add(name)
            else:  # a parameter-free module's later call
                name = self._allocate(item.module)
            if item.weights is not None:  # a function given a module's tensors
                for attribute, source in item.weights.items():
                    self.weights[f"{name}.{attribute}"] = source.read(self.original)
                    self.sources[f"{name}.{attribute}"] = source
            elif item.module is not None:
                self._take_weights(name, item.module, item.shapes)
            out.append({"name": name, **entry})
        return out

    def _block_name(self, block: _Block) -> str:
        """The longest module path every module of the block lies under, where that is no layer's name
        (torchvision's ``layer1.0``), else the sum's node name."""
        paths = [item.module.split(".") for item in _members(block) if item.module is not None]
        prefix: list[str] = []
        if paths:
            for parts in zip(*paths, strict=False):
                if len(set(parts)) != 1:
                    break
                prefix.append(parts[0])
        candidate = ".".join(prefix)
        if candidate and candidate not in self.used and candidate not in self._owners and all(
                len(parts) > len(prefix) for parts in paths) and candidate not in self._module_paths():
            self.used.add(candidate)
            return candidate
        return self._allocate(block.node.name)

    def _module_paths(self) -> set[str]:
        return {node.target for node in self.live if node.op == "call_module"}

    def _take_weights(self, name: str, path: str, shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Layer ``name``'s weights: module ``path``'s parameters and buffers (a pruned layer's effective
        ``weight`` for its ``weight_orig`` and ``weight_mask``), the module's own tensors (views of them in
        ``shapes`` where given: a ``Linear``'s weight as a 1x1 convolution's)."""
        shapes = shapes or {}
        module = self.original.get_submodule(path)
        parameters = {key for key, _ in module.named_parameters()}
        for key, tensor in (*module.named_parameters(), *module.named_buffers()):
            if key.rpartition(".")[2] in DROPPED_BUFFERS:
                continue
            if key.endswith("_mask") and hasattr(module, key[:-5] + "_orig"):
                continue
            if key.endswith("_orig") and hasattr(module, key[:-5] + "_mask"):  # torch.nn.utils.prune
                attribute = key[:-5]
                source = Source(path, attribute, f"{path}.{key}", f"{path}.{attribute}_mask")
            else:
                attribute = key
                source = Source(path, key, f"{path}.{key}" if key in parameters else None,
                                shape=shapes.get(key))
            self.weights[f"{name}.{attribute}"] = source.read(self.original) if source.mask or source.shape \
                else tensor
            self.sources[f"{name}.{attribute}"] = source

    # --- a recurrent classifier ------------------------------------------------------------------
    def recurrent(self, node: Any) -> tuple[list[dict[str, Any]], list[tuple[int, Any]]]:
        """A recurrent layer reading the input, a head selection of its outputs, one Linear."""
        traced = self.traced
        module = traced.module(node)
        kind = type(module).__name__
        rule = (f"a recurrent model is an {kind} reading the forward's input, its head's selection "
                "(out[:, -1] or out[-1], h_n[-1], out.mean over time), optionally dropout in eval mode, "
                "then one Linear")
        placeholder, output = traced.placeholder(), traced.output()
        source = node.args[0] if node.args else None
        swapped = hasattr(source, "op") and swaps_time_and_batch(source) and source.args[0] is placeholder
        if source is not placeholder and not swapped:
            raise CaptureError(f"{describe(node)}: {kind} must read the forward's input (or its time and "
                               f"batch axes swapped); {rule}")
        if any(a is not None for a in (*node.args[1:], *node.kwargs.values())):
            raise CaptureError(f"{describe(node)}: {kind} is given an initial state; {rule}")
        result = output.args[0]
        if not hasattr(result, "op") or not traced.is_tensor(result):
            raise CaptureError(f"{describe(output)}: the forward returns {self._returned(result)}; {rule}")
        self._check_nodes([n for n in self.live if n is not node and n is not source])
        if result.op != "call_module" or type(traced.module(result)).__name__ != "Linear":
            raise CaptureError(f"{describe(result)}: {rule}")
        path = [result]
        current = traced.tensor_inputs(result)[0]
        while self._eval_identity(current):
            path.append(current)
            current = traced.tensor_inputs(current)[0]
        reduction, used = self._selection(current, node, module, rule)
        path += used
        selected = current
        if swapped:
            path.append(source)  # x.transpose(0, 1): the module's own layout swapped
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise CaptureError(f"{describe(node)}: the {kind}'s dropout between layers is active (training "
                               "mode): a spec's recurrent layer runs without it; call module.eval() first")
        covered = set(path) | {node, placeholder, output}
        for other in self.live:
            if other not in covered and (traced.is_tensor(other) or other.op == "call_module"):
                raise CaptureError(f"{describe(other)}: {rule}")
        name = node.target
        self.used.add(name)
        entry = {"name": name, **self._module_entry(node, module)}
        self._take_weights(name, name)
        head = result.target
        if head in self.used:
            raise CaptureError(f"{describe(result)}: {rule}")
        self.used.add(head)
        head_entry = {"name": head, **self._module_entry(result, traced.module(result))}
        if reduction != "last":
            head_entry["reduction"] = reduction
        self._take_weights(head, head)
        return [entry, head_entry], [(0, selected), (1, result)]

    def _eval_identity(self, node: Any) -> bool:
        """Dropout in eval mode (or p = 0) and identities between the head's selection and its Linear."""
        traced = self.traced
        if node.op == "call_module":
            module = traced.module(node)
            kind = type(module).__name__
            return kind == "Identity" or (kind == "Dropout" and (not module.training or module.p == 0))
        op = traced.op(node)
        if op.name == "dropout":
            arguments = traced.arguments(node, op)
            return arguments["training"] is False or arguments["p"] == 0
        return op.name == "contiguous"

    def _selection(self, node: Any, recurrent: Any, module: Any, rule: str) -> tuple[str, list[Any]]:
        """What the head reads of the recurrent layer's outputs: ``"last"`` or ``"mean"``, and the nodes
        of that selection."""
        traced = self.traced
        steps = int(traced.inputs[0].shape[0 if traced.time_major else 1])
        time_major = not module.batch_first  # the layout of the recurrent layer's outputs
        finals = module.num_layers * (2 if module.bidirectional else 1)
        op = traced.op(node)
        tensors = traced.tensor_inputs(node)
        source = tensors[0] if len(tensors) == 1 else node.args[0] if node.args else None
        outputs = self._item_of(source, recurrent, 0)
        states = self._state_of(source, recurrent, module)
        if op.name == "getitem" and outputs is not None:
            index = _index(node.args[1])
            want = ((-1,), (steps - 1,)) if time_major else ((_ALL, -1), (_ALL, steps - 1))
            if index in want:
                return "last", [node, source]
        if op.name == "mean" and outputs is not None:
            arguments = traced.arguments(node, op)
            axis = 0 if time_major else 1
            if arguments["dim"] in (axis, axis - 3, (axis,), [axis]) and not arguments["keepdim"] \
                    and arguments["dtype"] is None:
                return "mean", [node, source]
        if states is not None:
            chain = [node, source] + states
            if op.name == "getitem" and _index(node.args[1]) in ((-1,), (finals - 1,)):
                if finals == module.num_layers:
                    return "last", chain
                raise CaptureError(f"{describe(node)}: h_n[-1] of a bidirectional {type(module).__name__} is "
                                   "the reverse direction's final state, not the last output the head reads "
                                   "(out[:, -1]); use out[:, -1] or out[-1]")
            if finals == 1 and node.op == "call_method" and node.target == "squeeze" and (
                    tuple(node.args[1:]) == (0,) or dict(node.kwargs) == {"dim": 0}):
                return "last", chain
            if finals == 1 and op.name == "getitem" and _index(node.args[1]) == (0,):
                return "last", chain
        raise CaptureError(f"{describe(node)}: {rule}")

    def _item_of(self, node: Any, parent: Any, index: int) -> Any:
        """``node`` if it is ``parent[index]``, else None."""
        if node is None or node.op != "call_function" or self.traced.op(node).name != "getitem":
            return None
        return node if node.args[0] is parent and node.args[1] == index else None

    def _state_of(self, node: Any, recurrent: Any, module: Any) -> list[Any] | None:
        """The nodes reading ``h_n`` off the recurrent module's result, ending at ``node``, or None."""
        if type(module).__name__ == "LSTM":
            if node is None or self.traced.op(node).name != "getitem" or node.args[1] != 0:
                return None
            pair = self._item_of(node.args[0], recurrent, 1)
            return None if pair is None else [pair]
        return [] if self._item_of(node, recurrent, 1) is not None else None


_ALL = slice(None, None, None)


def _index(index: Any) -> tuple[Any, ...]:
    """A subscript as a tuple, trailing full slices dropped (``out[:, -1, :]`` is ``out[:, -1]``)."""
    items = list(index) if isinstance(index, tuple) else [index]
    while items and items[-1] == _ALL:
        items.pop()
    return tuple(items)


def _members(block: _Block) -> list[_Layer]:
    out = []
    for item in (item for arm in block.arms for item in arm):
        out += _members(item) if isinstance(item, _Block) else [item]
    return out


def _single_reader(node: Any) -> Any:
    """The one node that reads ``node``, or None."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def _join(op: Any, tensors: list[Any]) -> str | None:
    """How a node joins branches: ``"sum"`` (a sum or difference of two tensors), ``"concat"``
    (``torch.cat`` of two or more), ``"product"`` (of two); None for any other node."""
    if op.name in ("add", "sub") and len(tensors) == 2:
        return "sum"
    if op.name == "cat" and len(tensors) >= 2:
        return "concat"
    if op.name == "mul" and len(tensors) == 2:
        return "product"
    return None


def _merged_axes(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, int] | None:
    """``(start, end)`` such that merging axes ``start..end`` of ``before`` gives ``after``, or None."""
    for start in range(len(before)):
        for end in range(start + 1, len(before)):
            merged = before[:start] + (int(np.prod(before[start:end + 1])),) + before[end + 1:]
            if merged == after:
                return start, end
    return None


def _constructor(cls: type) -> Any:
    """The signature of ``cls.__init__``, or for a recurrent module its base's (``nn.LSTM.__init__``
    takes ``*args, **kwargs`` and passes them to ``RNNBase.__init__``)."""
    if cls.__name__ not in RECURRENT:
        return inspect.signature(cls.__init__)
    for klass in cls.__mro__:
        signature = inspect.signature(klass.__init__)
        if not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
            return signature
    raise CaptureError(f"{cls.__name__}: no constructor with named arguments")


# --- the check -------------------------------------------------------------------------------------
def _check(traced: Traced, spec: dict[str, Any], weights: dict[str, Any],
           mapped: list[tuple[int, Any]], channels_last: set[Any]) -> None:
    """The spec's model, float64, against the module's traced graph on a probe batch (dropout off in
    both, every sample kept by sample drops), layer by layer (``channels_last``: nodes whose values are
    NHWC, the layers' NCHW), refused naming the first layer that differs; then the module's own forward
    against its graph run, with the same random draws: refused where they differ."""
    import torch  # noqa: PLC0415
    import torch.fx  # noqa: PLC0415

    arrays = {key: tensor.detach().to("cpu", torch.float64).numpy() for key, tensor in weights.items()}
    try:
        model = model_from_spec(spec, arrays, dtype=np.float64, source="the captured spec")
    except SpecError as error:
        raise CaptureError(f"the captured model does not build: {error}") from None
    for layer in every_layer(model):
        if type(layer).__name__ in SAMPLE_DROP_LAYERS:
            layer.training = False
    x_module = traced.inputs[-1]
    runs = []
    for forward in (traced.reference, torch.fx.GraphModule(traced.reference, traced.graph)):
        with torch.no_grad(), no_dropout(), torch.random.fork_rng(devices=[]):  # the reference is on the CPU
            torch.default_generator.manual_seed(0)
            runs.append(forward(x_module).numpy())
    expected, graphed = runs
    x = x_module.numpy()
    if traced.time_major:
        x = np.ascontiguousarray(x.transpose(1, 0, 2))
    values = traced.values[-1]
    try:
        outputs = _layer_outputs(model, x)
    except ValueError as error:
        raise CaptureError(f"the captured model fails on the probe batch: {error}") from None
    for index, node in mapped:
        reference = values[node].permute(*CHANNELS_FIRST).numpy() if node in channels_last else \
            values[node].numpy()
        if reference.shape != outputs[index].shape or not _close(outputs[index], reference):
            name = spec["layers"][index]["name"]
            raise CaptureError(f"{describe(node)}: the captured layer {name!r} gives outputs that differ "
                               f"from the module's ({_difference(outputs[index], reference)}); nothing "
                               "exported")
    result = values[traced.output().args[0]].numpy()
    if not _close(outputs[-1], result):
        raise CaptureError(f"the captured model's output differs from the module's traced graph's "
                           f"({_difference(outputs[-1], result)}); nothing exported")
    if not _close(graphed, expected):
        raise CaptureError(f"the module's forward gives outputs that differ from its traced graph's "
                           f"({_difference(graphed, expected)}): its forward changes with each call "
                           "(state, randomness other than dropout and sample drops, in-place changes "
                           "torch.fx does not see)")


def _layer_outputs(model: Any, x: np.ndarray) -> list[np.ndarray]:
    """Every top-level layer's output on ``x`` (a recurrent classifier: its pooled output, the logits)."""
    if hasattr(model, "recurrent"):
        logits = model.forward(x)
        return [np.asarray(model._pooled), logits]  # noqa: SLF001 - the head's input, what the module computes
    outputs = []
    for layer in model.layers:
        x = layer.forward(x)
        outputs.append(x)
    return outputs


def _close(ours: np.ndarray, reference: np.ndarray) -> bool:
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    return ours.shape == reference.shape and bool(
        np.all(np.abs(ours - reference) <= FORWARD_TOLERANCE * scale + 1e-12))


def _difference(ours: np.ndarray, reference: np.ndarray) -> str:
    if ours.shape != reference.shape:
        return f"shape {list(ours.shape)} against {list(reference.shape)}"
    return f"by up to {float(np.max(np.abs(ours - reference))):.3g} on values up to " \
           f"{float(np.max(np.abs(reference))):.3g}"
