"""Model specs: a YAML list of layers with PyTorch's argument names, plus optional weights.

.. code-block:: yaml

    input_shape: [3, 32, 32]          # one sample, no batch axis
    weights: model.npz                # optional, relative to the spec; "<layer>.weight", "<layer>.bias",
                                      # "<layer>.running_mean", ... (PyTorch's state_dict names);
                                      # .safetensors too when the safetensors package is installed
    init: {seed: 0}                   # optional: seeded initialisation for layers without stored weights
    prune: {amount: 0.97}             # optional: magnitude-prune conv/linear weights, pattern follows
    layers:
      - {name: conv1, type: conv2d, out_channels: 64, kernel_size: 3, padding: 1}
      - {name: bn1, type: batchnorm2d}
      - {name: relu1, type: relu}
      - {name: pool1, type: maxpool2d, kernel_size: 2, stride: 2}
      - {name: gap, type: adaptive_avgpool2d, output_size: [2, null]}
      - {name: flat, type: flatten}
      - {name: drop, type: dropout, p: 0.5}
      - {name: fc, type: linear, out_features: 10}

A ``residual`` layer is a residual block ``y = f(x) + shortcut(x)``
(:class:`~sparse_scan.layers.Residual`, one scan element): ``layers`` is its inner chain ``f``,
``shortcut`` is absent (the identity), one layer (a mapping, named ``shortcut_name``) or a chain (a list,
its layers named ``<shortcut_name>.0``, ...), and ``shortcut_name`` (default ``"shortcut"``) names the
shortcut's parameters; blocks nest. Inner layers are named under the block, as PyTorch names a module's
children, so a torchvision ``BasicBlock``'s ``state_dict`` loads as is (its final ReLU, after the sum,
is a layer of its own after the block):

.. code-block:: yaml

      - name: layer2.0
        type: residual
        shortcut_name: downsample     # weights: layer2.0.downsample.0.weight, ...
        layers:                       # weights: layer2.0.conv1.weight, layer2.0.bn1.running_mean, ...
          - {name: conv1, type: conv2d, out_channels: 32, kernel_size: 3, stride: 2, padding: 1, bias: false}
          - {name: bn1, type: batchnorm2d}
          - {name: relu, type: relu}
          - {name: conv2, type: conv2d, out_channels: 32, kernel_size: 3, padding: 1, bias: false}
          - {name: bn2, type: batchnorm2d}
        shortcut:
          - {type: conv2d, out_channels: 32, kernel_size: 1, stride: 2, bias: false}
          - {type: batchnorm2d}
      - {name: layer2.0.relu_out, type: relu}

A ``block`` layer joins branches of the same input (:class:`~sparse_scan.layers.Block`, one scan
element): ``join`` is ``sum``, ``concat`` (along the channels: Inception, DenseNet's ``cat([x, f(x)])``)
or ``product`` (two branches, with broadcasting: a squeeze-and-excitation gate), ``branches`` a list of
chains (``[]``: the identity), optional ``branch_names`` (a child name per branch, or null: its layers are
the block's own children; default the branch's index) and ``scoped``:

.. code-block:: yaml

      - name: mixed
        type: block
        join: concat                  # weights: mixed.0.0.weight, mixed.1.0.weight, ...
        branches:
          - [{type: conv2d, out_channels: 8, kernel_size: 1}]
          - [{type: conv2d, out_channels: 4, kernel_size: 1}, {type: relu},
             {type: conv2d, out_channels: 8, kernel_size: 3, padding: 1}]
          - []

``in_channels``/``in_features``/``num_features``/``dim`` (``layer_scale``) are inferred from the previous
layer (given, they must
agree), along a block's chains (inner, shortcut, branches) from its input too. Messages name a nested
layer by its path and place (``layer 'layer2.0.conv1' (layers[5].layers[0])``); ``init`` and ``prune``
reach every layer of every block. Every problem is a :class:`SpecError` naming the file, the layer and
the field; the spec and the weights file are only read.

Nothing unbounded is read or made: the spec and its weights file must be regular files (a named pipe,
``/dev/zero`` or a symlink loop is refused before a byte is read), the spec at most
:data:`MAX_SPEC_BYTES` and :data:`MAX_SPEC_NODES` YAML nodes with its aliases expanded; and each layer's
parameters (counted from its arguments before it is made) and one sample's activations
(:func:`sample_bytes`) are held to the memory budget (``SPARSE_SCAN_MEMORY_BUDGET``, else half the memory
available) as the model is built, the message naming the layer, the field, the size and the budget.

A spec model loads in eval mode, like ``module.eval()`` in PyTorch: layers with a mode (``batchnorm2d``,
``dropout``, ``stochastic_depth``, ``drop_path``) take ``training: false`` unless the spec says otherwise.
``batchnorm2d`` normalises by its
frozen ``running_mean`` and ``running_var`` (loaded from the weights file; ``init`` gives PyTorch's
zeros and ones, and ones and zeros for ``weight`` and ``bias``) and refuses ``training: true`` and
``track_running_stats: false``: both normalise by each batch's own statistics, coupling the samples of a
batch, which a scan over per-sample Jacobians cannot hold. ``dropout`` with ``training: true`` draws a
new mask every forward pass from the spec's generator (seeded by ``init``: the same seed, the same
masks); in eval mode it is the identity (``stochastic_depth`` and ``drop_path`` alike, with masks of whole
samples). ``prune`` prunes the ``conv2d`` and ``linear`` weights only.

A recurrent model is a recurrent layer (``rnn``, ``gru`` or ``lstm``, PyTorch's ``nn.RNN``/``nn.GRU``/
``nn.LSTM`` arguments) followed by one ``linear`` layer, the classifier head on the last output (or,
with ``reduction: mean`` on the head, on the mean of the outputs over time); it loads as a
:class:`~sparse_scan.recurrent.RecurrentClassifier`, in eval mode unless the recurrent layer says
``training: true`` (as a ``dropout`` layer does: its dropout between layers then applies). One sample
is ``[time steps, input_size]`` (batch-first data ``(N, T, input_size)`` whatever ``batch_first``
says: that argument is the module's call layout), ``input_size`` and ``in_features`` are inferred, and
the weights have PyTorch's state_dict names (``rnn.weight_ih_l0``, ``rnn.weight_hh_l1_reverse``, ...):

.. code-block:: yaml

    input_shape: [1000, 1]
    init: {seed: 0}
    layers:
      - {name: rnn, type: lstm, hidden_size: 20, num_layers: 2, bidirectional: true}
      - {name: fc, type: linear, out_features: 10}

Examples
--------
>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.yaml"
>>> _ = path.write_text("input_shape: [1, 6, 6]\\ninit: {seed: 0}\\nlayers:\\n"
...                     "  - {name: conv, type: conv2d, out_channels: 2, kernel_size: 3}\\n"
...                     "  - {type: relu}\\n  - {type: flatten}\\n"
...                     "  - {name: fc, type: linear, out_features: 3}\\n")
>>> model = load_model(path)
>>> model.input_shape, [layer.name for layer in model.layers]
((1, 6, 6), ['conv', '1', '2', 'fc'])
>>> model.layers[3].in_features
32
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
import re
from typing import Any, Sequence

import numpy as np
import yaml

from ._checks import MAX_SIZE, as_float_dtype, flag, is_int
from ._sequential import Sequential, default_memory_budget
from .engine.figures import size_text
from .layers import (
    ELU,
    GELU,
    AdaptiveAvgPool2d,
    Affine,
    AvgPool2d,
    BatchNorm2d,
    Block,
    ChannelShuffle,
    Conv2d,
    Dropout,
    DropPath,
    Flatten,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    Layer,
    LayerNorm,
    LayerScale,
    LeakyReLU,
    Linear,
    LogSoftmax,
    MaxPool2d,
    Mish,
    Narrow,
    ReLU,
    Residual,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    StochasticDepth,
    Tanh,
    Upsample,
)
from .recurrent import GRU, LSTM, REDUCTIONS, RNN, RecurrentClassifier
from .weights import budget_problem, named_layers, open_regular_file, read_npz

__all__ = ["LAYER_TYPES", "MAX_SPEC_BYTES", "MAX_SPEC_NODES", "RECURRENT_TYPES", "SAMPLE_COPIES", "SpecError",
           "load_model", "model_from_spec", "sample_bytes"]

LAYER_TYPES: dict[str, type[Layer]] = {
    "conv2d": Conv2d, "linear": Linear, "relu": ReLU, "leaky_relu": LeakyReLU, "tanh": Tanh,
    "sigmoid": Sigmoid, "maxpool2d": MaxPool2d, "avgpool2d": AvgPool2d, "flatten": Flatten,
    "identity": Identity, "silu": SiLU, "gelu": GELU, "elu": ELU, "hardtanh": Hardtanh, "softplus": Softplus,
    "hardswish": Hardswish, "hardsigmoid": Hardsigmoid, "mish": Mish,
    "layer_norm": LayerNorm, "layer_scale": LayerScale, "upsample": Upsample,
    "stochastic_depth": StochasticDepth, "drop_path": DropPath,
    "batchnorm2d": BatchNorm2d, "dropout": Dropout, "adaptive_avgpool2d": AdaptiveAvgPool2d,
    "affine": Affine, "log_softmax": LogSoftmax, "softmax": Softmax, "residual": Residual,
    "block": Block, "narrow": Narrow, "channel_shuffle": ChannelShuffle,
}
"""Spec ``type`` -> layer class (arguments: the class's, PyTorch's names; ``residual``'s:
:data:`RESIDUAL_FIELDS`; ``block``'s: :data:`BLOCK_FIELDS`)."""

RESIDUAL_FIELDS = ("layers", "shortcut", "shortcut_name", "scoped")
"""A ``residual`` block's fields: its inner chain, its shortcut (absent: the identity), the name its
shortcut's parameters take (``"shortcut"`` by default; ``"downsample"`` gives torchvision's names) and
whether its layers are named under the block (``scoped``, true by default; false: a sum written inline
in a module's forward, whose layers keep their own names in the scope holding the block)."""

BLOCK_FIELDS = ("join", "branches", "branch_names", "scoped")
"""A ``block``'s fields: how it joins its branches (``sum``, ``concat``, ``product``: required), its
branches (a list of chains, each a list of layers; ``[]`` the identity), the name of each branch among
the block's children (default its index; null: the branch's layers are the block's own children) and
whether its layers are named under the block (``scoped``, true by default)."""

RECURRENT_TYPES: dict[str, type] = {"rnn": RNN, "gru": GRU, "lstm": LSTM}
"""Spec ``type`` of a recurrent first layer -> its class (arguments: PyTorch's; ``input_size`` inferred)."""

TOP_LEVEL = ("input_shape", "layers", "weights", "init", "prune")
INFERRED = {Conv2d: ("in_channels", lambda shape: shape[0]), Linear: ("in_features", lambda shape: shape[0]),
            BatchNorm2d: ("num_features", lambda shape: shape[0]),
            LayerScale: ("dim", lambda shape: shape[0])}
ENGINE_ARGUMENTS = ("dtype", "rng", "prune_pattern")  # set by the loader (those a class takes), not the spec
IGNORED_KEYS = {BatchNorm2d: ("num_batches_tracked",)}
"""Entries of PyTorch's state_dict a weights file may hold that the layer never uses (frozen statistics
are never updated, so the count of training batches means nothing): accepted and ignored."""
RECURRENT_ENGINE_ARGUMENTS = ("dtype", "rng", "name", "seed")
MAX_SPEC_BYTES = 2**22
"""The largest spec file read (4 MiB; the bundled specs take 5 KiB at most): a larger one, or one that
is no regular file (a named pipe, ``/dev/zero``), is refused before it is parsed."""
MAX_SPEC_NODES = 10**6
"""The most YAML nodes (scalars, lists, mappings) a spec may hold, counted with its aliases expanded
(each as many times as it is used), before anything is built: so a few lines of aliases of aliases
(a "billion laughs") are refused, not walked."""
SAMPLE_COPIES = 3
"""Arrays the size of an activation that a batch holds per sample, by the memory estimate
(:func:`sample_bytes`): the activation, the gradient w.r.t. it, and the JT entries that map it (a
pattern's indices or a sample's values)."""
_LAYER_MESSAGE = re.compile(r"^layer [^:]+: ([^:]+): (.*)$", re.DOTALL)


class SpecError(ValueError):
    """A model spec or its weights are invalid: the message names the file, the layer and the field."""


def _fail(path: pathlib.Path, where: str, field: str, message: str) -> SpecError:
    return SpecError(f"{path}: {where}{', ' if where else ''}field {field!r}: {message}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        for index, key in enumerate(keys):
            if key in keys[:index]:
                mark = node.value[index][0].start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} repeated in one mapping", mark)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    """The spec's mapping: a regular file of at most :data:`MAX_SPEC_BYTES` of UTF-8 YAML holding at
    most :data:`MAX_SPEC_NODES` nodes (aliases expanded), read and counted before it is built."""
    try:
        with open_regular_file(path) as stream:
            data = stream.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except ValueError as error:  # a symlink loop, a named pipe, a device
        raise SpecError(f"{path}: {error}") from None
    except OSError as error:
        raise SpecError(f"{path}: cannot read: {error.strerror or error}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {size_text(MAX_SPEC_BYTES)}, not a model spec (a spec is a "
                        "short YAML file; weights go in the file its weights: field names)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a YAML text file (not UTF-8)") from None
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        _check_nodes(path, node)
        spec = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{path}: malformed YAML{at}: {getattr(error, 'problem', None) or error}") from None
    except RecursionError:
        raise SpecError(f"{path}: YAML nested too deeply to be a model spec") from None
    finally:
        loader.dispose()
    return _checked_top_level(path, spec)


def _check_nodes(path: pathlib.Path, root: yaml.Node | None) -> None:
    """Refuse a YAML document of more than :data:`MAX_SPEC_NODES` nodes once its aliases are expanded,
    or one whose alias refers to a node that holds it (a structure without end), from its composed
    nodes (each one once: the count of an aliased node is kept)."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [] if root is None else [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = ([] if isinstance(node, yaml.ScalarNode) else
                    [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode)
                    else node.value)
        if children_done:
            open_nodes.discard(id(node))
            counts[id(node)] = min(1 + sum(counts[id(child)] for child in children), MAX_SPEC_NODES + 1)
            if counts[id(node)] > MAX_SPEC_NODES:
                raise SpecError(f"{path}: more than {MAX_SPEC_NODES:,} YAML nodes once its aliases are "
                                "expanded, not a model spec")
            continue
        if id(node) in counts:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in open_nodes:
                mark = child.start_mark
                raise SpecError(f"{path}: the node at line {mark.line + 1}, column {mark.column + 1} holds "
                                "an alias of itself (a structure without end)")
            if id(child) not in counts:
                stack.append((child, False))


def _checked_top_level(path: pathlib.Path, spec: Any) -> dict[str, Any]:
    """``spec`` if it is a mapping of the known top-level keys holding ``input_shape`` and ``layers``."""
    if not isinstance(spec, dict):
        raise SpecError(f"{path}: expected a mapping with {', '.join(TOP_LEVEL[:2])}, ...; "
                        f"got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(TOP_LEVEL))
    if unknown:
        raise _fail(path, "", unknown[0], f"unknown key (allowed: {', '.join(TOP_LEVEL)})")
    for key in TOP_LEVEL[:2]:
        if key not in spec:
            raise _fail(path, "", key, "missing")
    return spec


def _input_shape(path: pathlib.Path, value: Any) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(is_int(s) and 0 < s <= MAX_SIZE for s in value)):
        raise _fail(path, "", "input_shape", f"must be a list of positive ints (one sample, no batch "
                    f"axis), got {value!r}")
    return tuple(value)


def _options(path: pathlib.Path, spec: dict[str, Any], key: str, field: str, check) -> Any:
    """``spec[key][field]`` (None when ``key`` is absent), validated by ``check``."""
    if key not in spec:
        return None
    block = spec[key]
    if not isinstance(block, dict) or set(block) != {field}:
        raise _fail(path, "", key, f"must be a mapping with exactly the key {field!r}, got {block!r}")
    value = block[field]
    if not check(value):
        raise _fail(path, "", f"{key}.{field}", f"invalid value {value!r}")
    return value


def sample_bytes(shapes: Sequence[Sequence[int]], itemsize: int) -> int:
    """Estimated bytes one sample takes in a batch whose activations have ``shapes`` (per sample, no
    batch axis) and ``itemsize`` bytes per value: :data:`SAMPLE_COPIES` arrays of each activation's size
    (what a forward and a backward hold at once, an estimate).

    Examples
    --------
    >>> sample_bytes([(1, 8, 8), (10,)], 4)
    888
    """
    return SAMPLE_COPIES * itemsize * sum(math.prod(shape) for shape in shapes)


@dataclasses.dataclass
class _Memory:
    """What a spec's model will hold, added up from estimates before each allocation (weights, one
    sample's activations and JT entries: :func:`sample_bytes`) and held to the memory budget."""

    path: pathlib.Path
    itemsize: int
    budget: int = dataclasses.field(default_factory=default_memory_budget)
    held: int = 0

    def hold(self, where: str, field: str, what: str, nbytes: int, transient: int = 0) -> None:
        """Add ``nbytes`` (``what``: the parameters of a layer, its output...), with ``transient`` more
        bytes while they are made, or refuse them: a :class:`SpecError` naming the layer (``where``) and
        ``field``, the size and the budget."""
        problem = budget_problem(self.held + nbytes + transient, f"the model up to {what}", self.budget)
        if problem is not None:
            raise _fail(self.path, where, field, problem)
        self.held += nbytes

    def hold_parameters(self, where: str, field: str, entries: int | None) -> None:
        """:meth:`hold` the ``entries`` parameters a layer's ``field`` sizes (None: not known), drawn in
        float64 by the initialisation and then cast (8 bytes more per entry while it runs)."""
        if entries is not None:
            self.hold(where, field, f"its {entries:,} parameters", entries * self.itemsize, 8 * entries)

    def hold_sample(self, where: str, field: str, shape: Sequence[int], what: str = "its output") -> None:
        """:meth:`hold` one sample's activation of ``shape`` (:func:`sample_bytes`)."""
        self.hold(where, field, f"{what} ({list(shape)} per sample)", sample_bytes([shape], self.itemsize))


def _positive_ints(*values: Any) -> bool:
    return all(is_int(value) and value > 0 for value in values)


def _pair(value: Any) -> tuple[Any, Any]:
    """A kernel size as PyTorch takes it (an int or two) as two values, checked by the layer later."""
    return (value, value) if not isinstance(value, (list, tuple)) or len(value) != 2 else tuple(value)


def _parameter_entries(cls: type[Layer], arguments: dict[str, Any]) -> tuple[str, int | None]:
    """The argument that sizes the parameters ``cls(**arguments)`` would allocate, and their count
    from the arguments alone (None for arguments the constructor will refuse, and for layers whose few
    parameters per channel the input's size already bounds)."""
    if cls is Linear:
        sizes = (arguments.get("in_features"), arguments.get("out_features"))
        return "out_features", math.prod(sizes) if _positive_ints(*sizes) else None
    if cls is Conv2d:
        sizes = (arguments.get("out_channels"), arguments.get("in_channels"), arguments.get("groups", 1),
                 *_pair(arguments.get("kernel_size")))
        if not _positive_ints(*sizes):
            return "out_channels", None
        out, channels, groups, height, width = sizes
        return "out_channels", out * max(channels // groups, 1) * height * width
    return "input", None


def _recurrent_entries(cls: type, arguments: dict[str, Any]) -> int | None:
    """The parameters of a recurrent layer of ``arguments`` (PyTorch's shapes: per layer and direction
    ``gates·H`` rows over the input and the state, two biases, a projection), from the arguments alone
    (None for arguments the constructor will refuse)."""
    hidden, layers, projection = (arguments.get("hidden_size"), arguments.get("num_layers", 1),
                                  arguments.get("proj_size", 0))
    size, directions = arguments.get("input_size"), 2 if arguments.get("bidirectional") is True else 1
    if not _positive_ints(hidden, layers, size) or not is_int(projection) or projection < 0:
        return None
    rows, out = cls.gates * hidden, projection or hidden

    def per_layer(columns: int) -> int:
        return directions * (rows * (columns + out + 2) + projection * hidden)

    return per_layer(size) + (layers - 1) * per_layer(directions * out)


@dataclasses.dataclass
class _Context:
    """What building every layer of a spec shares: the file (for messages), the parameter dtype, the
    init generator, the stored weights, whether ``init`` seeds, the prune amount, the memory estimate
    and every layer path used so far (state_dict prefixes must be unique)."""

    path: pathlib.Path
    dtype: Any
    rng: np.random.Generator
    stored: dict[str, np.ndarray]
    initialised: bool
    amount: float | None
    memory: _Memory
    paths: set[str] = dataclasses.field(default_factory=set)


def _layer_name(path: pathlib.Path, location: str, entry: Any, default: str,
                prefix: str = "") -> tuple[str, str]:
    """The name of the layer at ``location`` (``default`` unless the entry names it) and how messages
    name the layer: its path (``prefix`` + name, a nested layer's state_dict prefix) and location."""
    if not isinstance(entry, dict):
        raise _fail(path, location, "type", f"each layer must be a mapping, got {entry!r}")
    name = entry.get("name", default)
    if not isinstance(name, str) or not name:
        raise _fail(path, location, "name", f"must be a non-empty string, got {name!r}")
    return name, f"layer {prefix + name!r} ({location})"


def _build_chain(ctx: _Context, entries: Any, shape: tuple[int, ...], location: str, prefix: str,
                 where: str, key: str) -> tuple[list[Layer], tuple[int, ...]]:
    """The layers of the list ``entries`` (at ``location``, e.g. ``layers[3].layers``) from input
    ``shape``, their paths under ``prefix``; ``where``/``key`` name the list itself in messages."""
    if not isinstance(entries, list) or not entries:
        raise _fail(ctx.path, where, key, f"must be a non-empty list of layers, got {entries!r}")
    layers = []
    for index, entry in enumerate(entries):
        layer, shape = _build_entry(ctx, entry, shape, f"{location}[{index}]", str(index), prefix)
        layers.append(layer)
    return layers, shape


def _build_entry(ctx: _Context, entry: Any, shape: tuple[int, ...], location: str, default: str,
                 prefix: str) -> tuple[Layer, tuple[int, ...]]:
    """One layer (a ``residual`` or ``block`` with its chains) with its weights set and pruned."""
    name, where = _layer_name(ctx.path, location, entry, default, prefix)
    full = prefix + name
    if full in ctx.paths:
        raise _fail(ctx.path, where, "name", "used by an earlier layer")
    ctx.paths.add(full)
    if entry.get("type") == "residual":
        return _build_residual(ctx, entry, shape, location, name, where, full, prefix)
    if entry.get("type") == "block":
        return _build_block(ctx, entry, shape, location, name, where, full, prefix)
    layer, out_shape = _build_layer(ctx.path, where, name, entry, shape, ctx.dtype, ctx.rng,
                                    ctx.amount is not None, ctx.memory)
    _set_weights(ctx.path, where, full, layer, ctx.stored, ctx.initialised)
    if ctx.amount is not None and getattr(layer, "prune_pattern", False):  # conv2d and linear
        _magnitude_prune(layer, ctx.amount)
    return layer, out_shape


def _build_residual(ctx: _Context, entry: dict[str, Any], shape: tuple[int, ...], location: str,
                    name: str, where: str, full: str, prefix: str) -> tuple[Residual, tuple[int, ...]]:
    """A ``residual`` block: its inner chain ``layers`` and its ``shortcut`` (absent or null: the
    identity; one mapping: a single layer named ``shortcut_name``; a list: a chain under it), its
    layers' paths under the block's (``full``), or in the block's scope (``prefix``) when it is not
    ``scoped``."""
    for argument in entry:
        if argument not in ("name", "type") + RESIDUAL_FIELDS:
            raise _fail(ctx.path, where, argument, f"unknown argument of residual (allowed: "
                        f"{', '.join(RESIDUAL_FIELDS)})")
    if "layers" not in entry:
        raise _fail(ctx.path, where, "layers", "missing (required by residual: the inner chain f of "
                    "y = f(x) + shortcut(x))")
    scoped = entry.get("scoped", True)
    if not isinstance(scoped, bool):
        raise _fail(ctx.path, where, "scoped", f"must be true or false, got {scoped!r}")
    if not scoped:
        return _build_inline_residual(ctx, entry, shape, location, name, where, prefix)
    shortcut_name = entry.get("shortcut_name", "shortcut")
    if not isinstance(shortcut_name, str) or not shortcut_name or "." in shortcut_name:
        raise _fail(ctx.path, where, "shortcut_name", f"must be a non-empty name without dots, got "
                    f"{shortcut_name!r}")
    inner, inner_shape = _build_chain(ctx, entry["layers"], shape, f"{location}.layers", f"{full}.",
                                      where, "layers")
    if any(layer.name == shortcut_name for layer in inner):
        raise _fail(ctx.path, where, "shortcut_name", f"{shortcut_name!r} names an inner layer too")
    shortcut = entry.get("shortcut")
    short_shape = shape
    if isinstance(shortcut, dict):
        given = shortcut.get("name", shortcut_name)
        if given != shortcut_name:
            raise _fail(ctx.path, f"layer {full + '.' + shortcut_name!r} ({location}.shortcut)", "name",
                        f"a single shortcut layer is named by the block's shortcut_name "
                        f"({shortcut_name!r}), got {given!r}")
        single, short_shape = _build_entry(ctx, shortcut, shape, f"{location}.shortcut", shortcut_name,
                                           f"{full}.")
        chain: Layer | list[Layer] | None = single
    elif shortcut is not None:
        chain, short_shape = _build_chain(ctx, shortcut, shape, f"{location}.shortcut",
                                          f"{full}.{shortcut_name}.", where, "shortcut")
    else:
        chain = None
    return _residual_block(ctx, where, name, shape, inner, inner_shape, chain, short_shape,
                           dict(shortcut_name=shortcut_name))


def _build_inline_residual(ctx: _Context, entry: dict[str, Any], shape: tuple[int, ...], location: str,
                           name: str, where: str, prefix: str) -> tuple[Residual, tuple[int, ...]]:
    """A ``residual`` block with ``scoped: false``: its inner layers and its shortcut (absent or null:
    the identity; a mapping or a list: one layer or a chain) named by their own names in the block's
    scope ``prefix``; ``shortcut_name`` has no use there."""
    if "shortcut_name" in entry:
        raise _fail(ctx.path, where, "shortcut_name", "names the shortcut's layers under the block; with "
                    "scoped: false every layer is named by its own name")
    inner, inner_shape = _build_chain(ctx, entry["layers"], shape, f"{location}.layers", prefix, where,
                                      "layers")
    shortcut = entry.get("shortcut")
    chain, short_shape = None, shape
    if shortcut is not None:
        entries = [shortcut] if isinstance(shortcut, dict) else shortcut
        chain, short_shape = _build_chain(ctx, entries, shape, f"{location}.shortcut", prefix, where,
                                          "shortcut")
    return _residual_block(ctx, where, name, shape, inner, inner_shape, chain, short_shape,
                           dict(scoped=False))


def _residual_block(ctx: _Context, where: str, name: str, shape: tuple[int, ...], inner: list[Layer],
                    inner_shape: tuple[int, ...], chain: Layer | list[Layer] | None,
                    short_shape: tuple[int, ...],
                    options: dict[str, Any]) -> tuple[Residual, tuple[int, ...]]:
    """The :class:`Residual` of built chains whose output shapes must agree (``options``: its naming)."""
    if inner_shape != short_shape:
        which = (f"the shortcut gives {list(short_shape)}" if chain is not None else
                 "the identity shortcut keeps it; add a shortcut (e.g. a strided 1x1 conv2d and a "
                 "batchnorm2d) that maps the input to the layers' output shape")
        raise _fail(ctx.path, where, "shortcut", f"the layers map the block's input {list(shape)} to "
                    f"{list(inner_shape)} but {which} (y = f(x) + shortcut(x) needs equal shapes)")
    try:
        block = Residual(*inner, shortcut=chain, **options)
    except (TypeError, ValueError) as error:  # defensive: the checks above cover Residual's own
        raise _fail(ctx.path, where, "layers", str(error)) from None
    block.name = name
    block.training = False  # its own flag only: its layers keep the modes their entries gave them
    return block, inner_shape


def _build_block(ctx: _Context, entry: dict[str, Any], shape: tuple[int, ...], location: str, name: str,
                 where: str, full: str, prefix: str) -> tuple[Block, tuple[int, ...]]:
    """A ``block``: its ``branches`` (lists of layers, ``[]`` the identity) joined by ``join``, each
    branch's layers under ``<full>.<branch name>`` (under ``full`` for a branch named null), or in the
    block's scope ``prefix`` when it is not ``scoped``."""
    for argument in entry:
        if argument not in ("name", "type") + BLOCK_FIELDS:
            raise _fail(ctx.path, where, argument, f"unknown argument of block (allowed: "
                        f"{', '.join(BLOCK_FIELDS)})")
    join = entry.get("join")
    if not isinstance(join, str) or join not in Block.joins:
        given = "missing" if "join" not in entry else f"got {join!r}"
        raise _fail(ctx.path, where, "join", f"must be one of {', '.join(Block.joins)} ({given})")
    branches = entry.get("branches")
    count = "two" if join == "product" else "at least two"
    if not isinstance(branches, list) or len(branches) < 2 or (join == "product" and len(branches) != 2):
        raise _fail(ctx.path, where, "branches", f"must be a list of {count} branches (each a list of "
                    f"layers, [] the identity) for a {join}, got {branches!r}")
    scoped = entry.get("scoped", True)
    if not isinstance(scoped, bool):
        raise _fail(ctx.path, where, "scoped", f"must be true or false, got {scoped!r}")
    names = entry.get("branch_names", [str(index) for index in range(len(branches))])
    if "branch_names" in entry and not scoped:
        raise _fail(ctx.path, where, "branch_names", "names the branches under the block; with scoped: false "
                    "every layer is named by its own name")
    if not isinstance(names, list) or len(names) != len(branches) or not all(
            branch is None or (isinstance(branch, str) and branch and "." not in branch) for branch in names):
        raise _fail(ctx.path, where, "branch_names", f"must be a list of {len(branches)} names without dots "
                    f"(or null), one per branch, got {names!r}")
    chains = []
    for index, (branch, branch_name) in enumerate(zip(branches, names, strict=True)):
        if not isinstance(branch, list):
            raise _fail(ctx.path, where, "branches", f"branch {index} must be a list of layers ([] is the "
                        f"identity), got {branch!r}")
        under = prefix if not scoped else f"{full}." if branch_name is None else f"{full}.{branch_name}."
        chain = _build_chain(ctx, branch, shape, f"{location}.branches[{index}]", under, where,
                             "branches")[0] if branch else []
        chains.append(chain)
    try:
        block = Block(*chains, join=join, names=names, scoped=scoped)
    except (TypeError, ValueError) as error:  # defensive: the checks above cover Block's own
        raise _fail(ctx.path, where, "branches", str(error)) from None
    try:
        out_shape = tuple(block.output_shape(shape))
    except ValueError as error:  # the branches' outputs do not join
        match = _LAYER_MESSAGE.match(str(error))
        raise _fail(ctx.path, where, "branches", match.group(2) if match else str(error)) from None
    block.name = name
    block.training = False  # its own flag only: its layers keep the modes their entries gave them
    return block, out_shape


def _build_layer(path: pathlib.Path, where: str, name: str, entry: dict[str, Any], shape: tuple[int, ...],
                 dtype: Any, rng: np.random.Generator, prune: bool,
                 memory: _Memory) -> tuple[Layer, tuple[int, ...]]:
    """A layer of one of :data:`LAYER_TYPES` but ``residual`` and ``block``, from its entry and its input
    ``shape``;
    its parameters and one sample's output held to the memory budget (``memory``) before either is
    allocated."""
    kind = entry.get("type")
    if isinstance(kind, str) and kind in RECURRENT_TYPES:
        raise _fail(path, where, "type", f"a recurrent layer ({kind}) must be the first layer, followed by "
                    "one linear layer (the classifier head)")
    if not isinstance(kind, str) or kind not in LAYER_TYPES:
        raise _fail(path, where, "type", f"unknown layer type {kind!r} (known: {', '.join(LAYER_TYPES)}; "
                    f"first layer of a recurrent model: {', '.join(RECURRENT_TYPES)})")
    cls = LAYER_TYPES[kind]
    arguments = {k: v for k, v in entry.items() if k not in ("name", "type")}
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self",)]
    for argument in arguments:
        if argument not in accepted or argument in ENGINE_ARGUMENTS:
            allowed = [p for p in accepted if p not in ENGINE_ARGUMENTS]
            raise _fail(path, where, argument, f"unknown argument of {kind} (allowed: {', '.join(allowed)})")
    required = [name for name, parameter in inspect.signature(cls.__init__).parameters.items()
                if name != "self" and parameter.default is inspect.Parameter.empty]
    for argument in required:
        if argument not in arguments and not (cls in INFERRED and INFERRED[cls][0] == argument):
            raise _fail(path, where, argument, f"missing (required by {kind})")
    if cls is Linear and len(shape) != 1:
        raise _fail(path, where, "input", f"a linear layer needs a flat input, got shape {list(shape)}; "
                    "add a flatten layer before it")
    if cls in INFERRED:
        field, infer = INFERRED[cls]
        inferred = infer(shape)
        if field in arguments and arguments[field] != inferred:
            raise _fail(path, where, field, f"is {arguments[field]!r} but the input to this layer has "
                        f"{inferred} (shape {list(shape)})")
        arguments[field] = inferred
    engine = dict(zip(ENGINE_ARGUMENTS, (dtype, rng, prune), strict=True))
    arguments.update({k: v for k, v in engine.items() if k in accepted})
    if "training" in accepted:
        arguments.setdefault("training", False)  # eval mode unless the spec asks for training
    size_field, entries = _parameter_entries(cls, arguments)
    memory.hold_parameters(where, size_field, entries)
    try:
        layer = cls(**arguments)
        layer.name = name
        if "training" not in accepted:
            layer.training = False  # a spec model loads in eval mode, every layer included
        out_shape = tuple(layer.output_shape(shape))
    except (TypeError, ValueError, OverflowError) as error:
        match = _LAYER_MESSAGE.match(str(error))
        field, message = match.groups() if match else ("arguments", str(error))
        raise _fail(path, where, field, message) from None
    memory.hold_sample(where, size_field, out_shape)
    if isinstance(layer, BatchNorm2d) and layer.training:
        raise _fail(path, where, "training", "true normalises by each batch's own mean and variance, so "
                    "every output depends on every sample of the batch (no per-sample Jacobian to scan); a "
                    "spec's batchnorm2d uses its frozen running_mean and running_var: training: false (the "
                    "default)")
    return layer, out_shape


def _load_weights(path: pathlib.Path, weights: Any) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` or (when the ``safetensors`` package is installed) ``.safetensors``."""
    if not isinstance(weights, str):
        raise _fail(path, "", "weights", f"must be a file name, got {weights!r}")
    file = path.parent / weights
    try:
        with open_regular_file(file):  # a named pipe, a device or a symlink loop: refused before reading
            pass
    except FileNotFoundError:
        raise _fail(path, "", "weights", f"no such file: {file}") from None
    except (OSError, ValueError) as error:
        raise _fail(path, "", "weights", f"{getattr(error, 'strerror', None) or error}: {file}") from None
    if file.suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file  # noqa: PLC0415 - optional
        except ImportError:
            raise _fail(path, "", "weights", f"{file}: reading .safetensors needs the safetensors "
                        "package (pip install safetensors)") from None
        try:
            return load_file(str(file))
        except Exception as error:  # the package's own errors for a corrupt file
            raise _fail(path, "", "weights", f"{file} is not a readable .safetensors: {error}") from None
    try:
        return read_npz(file, default_memory_budget())
    except (OSError, ValueError) as error:
        raise _fail(path, "", "weights", f"{file} is not a readable .npz: {error}") from None


def _magnitude_prune(layer: Any, amount: float) -> None:
    """Zero the ``amount`` fraction of smallest-magnitude weights (ties at the threshold included)."""
    weight = layer.weight.copy()
    threshold = np.quantile(np.abs(weight), amount, overwrite_input=True)  # partitions its own temporary
    weight[np.abs(weight) <= threshold] = 0
    layer.weight = weight


def load_model(path: str | pathlib.Path, dtype: Any = np.float32) -> Sequential | RecurrentClassifier:
    """Build the :class:`~sparse_scan.Sequential` (or, for a recurrent first layer, the
    :class:`~sparse_scan.recurrent.RecurrentClassifier`) a spec describes.

    Parameters
    ----------
    path : str or path-like
        The YAML spec (format in the module docstring).
    dtype : numpy dtype
        Parameter dtype (float32 or float64); stored weights are cast to it.

    Returns
    -------
    Sequential or RecurrentClassifier
        A :class:`~sparse_scan.model.Model` with ``input_shape`` (per-sample) set, in eval mode unless
        the spec sets ``training: true`` on a dropout layer or a recurrent one (whose dropout between
        its layers then applies).

    Raises
    ------
    SpecError
        Unreadable or malformed file (or none that ends: a named pipe, a device, more than
        :data:`MAX_SPEC_BYTES` or :data:`MAX_SPEC_NODES`), unknown key, layer type or argument, shapes that
        do not chain, missing, unused or misshaped weights, a model over the memory budget: the message
        names the file, the layer and the field.
    """
    dtype = as_float_dtype(dtype, "load_model")
    path = pathlib.Path(path)
    spec = _read_yaml(path)
    stored = _load_weights(path, spec["weights"]) if "weights" in spec else {}
    return _build_model(path, spec, stored, dtype)


def model_from_spec(spec: dict[str, Any], weights: dict[str, Any] | None = None, dtype: Any = np.float32,
                    source: str | pathlib.Path = "<spec>") -> Sequential | RecurrentClassifier:
    """Build the model a spec describes from the spec's mapping and its weights, in memory.

    What :func:`load_model` does after reading the files, with the same checks and messages (naming
    ``source`` as the file): :func:`sparse_scan.export_torch` builds the model it is about to write
    this way, to check it before writing anything.

    Parameters
    ----------
    spec : dict
        The spec's YAML as a mapping (``input_shape``, ``layers``, optional ``init`` and ``prune``;
        a ``weights`` file name is not read: ``weights`` gives the arrays).
    weights : dict, optional
        ``"<layer>.<parameter>"`` -> array (the weights file's content).
    dtype : numpy dtype
        Parameter dtype (float32 or float64).
    source : str or path-like
        How messages name the spec.

    Returns
    -------
    Sequential or RecurrentClassifier

    Raises
    ------
    SpecError
        As :func:`load_model`.
    """
    dtype = as_float_dtype(dtype, "model_from_spec")
    path = pathlib.Path(source)
    stored = {key: np.asarray(value) for key, value in (weights or {}).items()}
    return _build_model(path, _checked_top_level(path, spec), stored, dtype)


def _build_model(path: pathlib.Path, spec: dict[str, Any], stored: dict[str, np.ndarray],
                 dtype: Any) -> Sequential | RecurrentClassifier:
    """The model of a checked spec mapping and its stored weights (``path`` names it in messages)."""
    shape = _input_shape(path, spec["input_shape"])
    memory = _Memory(path, dtype.itemsize)
    memory.hold_sample("", "input_shape", shape, "one sample's input")
    seed = _options(path, spec, "init", "seed", lambda v: isinstance(v, int) and not isinstance(v, bool)
                    and v >= 0)
    amount = _options(path, spec, "prune", "amount",
                      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1)
    if not isinstance(spec["layers"], list) or not spec["layers"]:
        raise _fail(path, "", "layers", "must be a non-empty list of layers")
    first = spec["layers"][0]
    if isinstance(first, dict) and isinstance(first.get("type"), str) and first["type"] in RECURRENT_TYPES:
        if amount is not None:
            raise _fail(path, "", "prune", "applies to the conv2d and linear weights of a sequential model, "
                        "not to a recurrent one")
        return _load_recurrent(path, spec["layers"], shape, dtype, seed, stored, memory)
    ctx = _Context(path, dtype, np.random.default_rng(seed), stored, seed is not None, amount, memory)
    layers, _ = _build_chain(ctx, spec["layers"], shape, "layers", "", "", "layers")
    model = Sequential(*layers, input_shape=shape)
    ignored = {f"{name}.{key}" for name, layer in named_layers(model).items()
               for key in IGNORED_KEYS.get(type(layer), ())}
    unused = sorted(set(stored) - set(model.state_dict()) - ignored)
    if unused:
        raise _fail(path, "", "weights", f"{unused[0]!r} in the weights file matches no layer parameter")
    return model


def _stored(path: pathlib.Path, where: str, name: str, parameter: str, stored: dict[str, np.ndarray],
            initialised: bool, dtype: Any) -> np.ndarray | None:
    """Parameter ``parameter`` of layer ``name`` from the weights file, checked and cast to ``dtype``
    (None where the file has none and ``init`` initialised it)."""
    key = f"{name}.{parameter}"
    if key not in stored:
        if not initialised:
            raise _fail(path, where, parameter, f"no {key!r} in the weights file and no init: seed "
                        "to initialise it")
        return None
    value = stored[key]
    if value.dtype.kind != "f":
        raise _fail(path, where, parameter, f"{key!r} has dtype {value.dtype}, expected floats")
    if not np.all(np.isfinite(value)):
        raise _fail(path, where, parameter, f"{key!r} holds NaN or Inf")
    with np.errstate(over="ignore"):
        cast = value.astype(dtype)
    if not np.all(np.isfinite(cast)):
        raise _fail(path, where, parameter, f"{key!r} holds values too large for {dtype}")
    return cast


def _set_weights(path: pathlib.Path, where: str, full: str, layer: Layer, stored: dict[str, np.ndarray],
                 initialised: bool) -> None:
    """Set the layer's parameters (its ``parameter_names``, by default ``weight`` and ``bias``; those it
    has: not None) from ``stored``, by the layer's path ``full`` (``"<path>.weight"``)."""
    for parameter in getattr(layer, "parameter_names", ("weight", "bias")):
        if getattr(layer, parameter, None) is None:
            continue
        cast = _stored(path, where, full, parameter, stored, initialised, layer.dtype)
        if cast is None:
            continue
        try:
            setattr(layer, parameter, cast)
        except ValueError as error:
            match = _LAYER_MESSAGE.match(str(error))
            raise _fail(path, where, parameter, match.group(2) if match else str(error)) from None


def _load_recurrent(path: pathlib.Path, entries: list[Any], shape: tuple[int, ...], dtype: Any,
                    seed: int | None, stored: dict[str, np.ndarray], memory: _Memory) -> RecurrentClassifier:
    """A recurrent first layer and its linear head (see the module docstring), held to the memory
    budget before each allocation (``memory``)."""
    name, where = _layer_name(path, "layers[0]", entries[0], "0")
    kind = entries[0]["type"]
    cls = RECURRENT_TYPES[kind]
    if len(shape) != 2:
        raise _fail(path, "", "input_shape", f"a recurrent model takes [time steps, input_size] per sample, "
                    f"got {list(shape)}")
    arguments = {k: v for k, v in entries[0].items() if k not in ("name", "type", "training")}
    accepted = [p for p in inspect.signature(cls.__init__).parameters
                if p != "self" and p not in RECURRENT_ENGINE_ARGUMENTS]
    try:  # the mode, as a dropout layer's: eval (no dropout between the layers) unless the spec says so
        training = flag(entries[0].get("training", False), "training")
    except ValueError as error:
        raise _fail(path, where, "training", str(error).partition(": ")[2]) from None
    for argument in arguments:
        if argument not in accepted:
            raise _fail(path, where, argument,
                        f"unknown argument of {kind} (allowed: {', '.join([*accepted, 'training'])})")
    if "hidden_size" not in arguments:
        raise _fail(path, where, "hidden_size", f"missing (required by {kind})")
    if arguments.setdefault("input_size", shape[1]) != shape[1]:
        raise _fail(path, where, "input_size", f"is {arguments['input_size']!r} but the input has {shape[1]} "
                    f"features (input_shape {list(shape)})")
    rng = np.random.default_rng(seed)
    memory.hold_parameters(where, "hidden_size", _recurrent_entries(cls, arguments))
    try:
        recurrent = cls(**arguments, dtype=dtype, rng=rng, name=name, seed=seed)
    except (TypeError, ValueError, OverflowError) as error:
        match = _LAYER_MESSAGE.match(str(error))
        field, message = match.groups() if match else ("arguments", str(error))
        raise _fail(path, where, field, message) from None
    recurrent.train(training)
    memory.hold_sample(where, "hidden_size", (shape[0], recurrent.num_layers * recurrent.num_directions
                                              * recurrent.output_size), "its outputs, every layer's")
    if len(entries) != 2:
        raise _fail(path, where, "layers", f"a recurrent layer is followed by exactly one linear layer (the "
                    f"classifier head on its last output); the spec has {len(entries) - 1} after it")
    head_name, head_where = _layer_name(path, "layers[1]", entries[1], "1")
    if entries[1].get("type") != "linear":
        raise _fail(path, head_where, "type", f"the layer after a recurrent layer is its classifier head: "
                    f"linear, got {entries[1].get('type')!r}")
    if head_name == name:
        raise _fail(path, head_where, "name", "used by an earlier layer")
    head_entry = {key: value for key, value in entries[1].items() if key != "reduction"}
    reduction = entries[1].get("reduction", "last")
    if reduction not in REDUCTIONS:
        raise _fail(path, head_where, "reduction", f"what the head reads of the recurrent outputs: one of "
                    f"{', '.join(REDUCTIONS)} (the last output, or the mean over time), got {reduction!r}")
    head, _ = _build_layer(path, head_where, head_name, head_entry,
                           (recurrent.num_directions * recurrent.output_size,), dtype, rng, False, memory)
    model = RecurrentClassifier(recurrent, head=head, input_shape=shape, reduction=reduction)
    for parameter, expected in recurrent.parameter_shapes().items():
        cast = _stored(path, where, name, parameter, stored, seed is not None, recurrent.dtype)
        if cast is None:
            continue
        if cast.shape != expected:
            raise _fail(path, where, parameter, f"'{name}.{parameter}' has shape {list(cast.shape)}, "
                        f"expected {list(expected)}")
        setattr(recurrent, parameter, cast)
    _set_weights(path, head_where, head_name, head, stored, seed is not None)
    unused = sorted(set(stored) - set(model.state_dict()))
    if unused:
        raise _fail(path, "", "weights", f"{unused[0]!r} in the weights file matches no layer parameter")
    return model
