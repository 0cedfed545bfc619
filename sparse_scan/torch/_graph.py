"""Tracing a module's ``forward()`` with torch.fx and reading its graph: the probe runs, the nodes'
values, what each node computes (its operation and arguments) and how to name it in a message.

The capture (:mod:`sparse_scan.torch._capture`) turns the graph into layers; this module knows
torch.fx and PyTorch's functions, and nothing of sparse-scan's layers.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
import pathlib
import traceback
from typing import Any, Callable

__all__ = ["ATTENTION", "CaptureError", "Op", "SAMPLE_DROPS", "Traced", "activations", "attention",
           "describe", "live_nodes", "no_dropout", "probe", "run_graph", "swaps_time_and_batch", "time_major",
           "trace"]

PROBE_BATCHES = (2, 3)
"""The batch sizes of the two probe runs: a value that differs between them depends on the batch size
(``x.size(0)``), and a reshape must keep the batch axis in both."""


class CaptureError(ValueError):
    """A module's forward cannot be captured exactly: the message (one line) names the graph node, its
    operation and the line of the forward it comes from, and why."""


# --- the operations, by what people write -------------------------------------------------------
# Each signature stub binds a call's arguments as PyTorch's function takes them (its names and
# defaults); the method forms take the tensor first, as ``input``.
def _sig_inplace(input, inplace=False): ...  # noqa: E704, ANN001, ANN201 - argument names only
def _sig_unary(input): ...  # noqa: E704, ANN001, ANN201
def _sig_leaky_relu(input, negative_slope=0.01, inplace=False): ...  # noqa: E704, ANN001, ANN201
def _sig_elu(input, alpha=1.0, inplace=False): ...  # noqa: E704, ANN001, ANN201
def _sig_gelu(input, approximate="none"): ...  # noqa: E704, ANN001, ANN201
def _sig_hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False): ...  # noqa: E704, ANN001, ANN201
def _sig_softplus(input, beta=1.0, threshold=20.0): ...  # noqa: E704, ANN001, ANN201
def _sig_max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: E704
                    return_indices=False): ...  # noqa: ANN001, ANN201
def _sig_avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False,  # noqa: E704
                    count_include_pad=True, divisor_override=None): ...  # noqa: ANN001, ANN201
def _sig_adaptive_avg_pool2d(input, output_size): ...  # noqa: E704, ANN001, ANN201
def _sig_dropout(input, p=0.5, training=True, inplace=False): ...  # noqa: E704, ANN001, ANN201
def _sig_softmax(input, dim=None, _stacklevel=3, dtype=None): ...  # noqa: E704, ANN001, ANN201
def _sig_mean(input, dim=None, keepdim=False, *, dtype=None): ...  # noqa: E704, ANN001, ANN201
def _sig_binary(input, other, *, alpha=1): ...  # noqa: E704, ANN001, ANN201
def _sig_product(input, other): ...  # noqa: E704, ANN001, ANN201
def _sig_div(input, other, *, rounding_mode=None): ...  # noqa: E704, ANN001, ANN201
def _sig_reshape(input, *shape, **options): ...  # noqa: E704, ANN001, ANN002, ANN003, ANN201
def _sig_getitem(input, index): ...  # noqa: E704, ANN001, ANN201
def _sig_cat(tensors, dim=0, *, out=None): ...  # noqa: E704, ANN001, ANN201
def _sig_chunk(input, chunks, dim=0): ...  # noqa: E704, ANN001, ANN201
def _sig_split(input, split_size_or_sections, dim=0): ...  # noqa: E704, ANN001, ANN201
def _sig_transpose(input, dim0, dim1): ...  # noqa: E704, ANN001, ANN201
def _sig_permute(input, *dims): ...  # noqa: E704, ANN001, ANN002, ANN201
def _sig_narrow(input, dim, start, length): ...  # noqa: E704, ANN001, ANN201
def _sig_conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1): ...  # noqa: E704, ANN001, ANN201
def _sig_linear(input, weight, bias=None): ...  # noqa: E704, ANN001, ANN201
def _sig_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,  # noqa: E704
                    momentum=0.1, eps=1e-5): ...  # noqa: ANN001, ANN201
def _sig_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5): ...  # noqa: E704, ANN001, ANN201
def _sig_interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,  # noqa: E704
                     recompute_scale_factor=None, antialias=False): ...  # noqa: ANN001, ANN201
def _sig_stochastic_depth(input, p, mode, training=True): ...  # noqa: E704, ANN001, ANN201
def _sig_drop_path(input, drop_prob=0.0, training=False, scale_by_keep=True): ...  # noqa: E704, ANN001, ANN201


_SIGNATURES: dict[str, Callable[..., Any]] = {
    "relu": _sig_inplace, "relu6": _sig_inplace, "silu": _sig_inplace, "sigmoid": _sig_unary,
    "tanh": _sig_unary, "leaky_relu": _sig_leaky_relu, "elu": _sig_elu, "gelu": _sig_gelu,
    "hardtanh": _sig_hardtanh, "softplus": _sig_softplus, "max_pool2d": _sig_max_pool2d,
    "avg_pool2d": _sig_avg_pool2d, "adaptive_avg_pool2d": _sig_adaptive_avg_pool2d,
    "dropout": _sig_dropout, "softmax": _sig_softmax, "log_softmax": _sig_softmax, "mean": _sig_mean,
    "add": _sig_binary, "sub": _sig_binary, "mul": _sig_product, "div": _sig_div, "neg": _sig_unary,
    "reshape": _sig_reshape, "getitem": _sig_getitem, "contiguous": _sig_reshape, "cat": _sig_cat,
    "chunk": _sig_chunk, "split": _sig_split, "transpose": _sig_transpose, "permute": _sig_permute,
    "narrow": _sig_narrow, "hardswish": _sig_inplace, "hardsigmoid": _sig_inplace, "mish": _sig_inplace,
    "conv2d": _sig_conv2d, "linear": _sig_linear, "batch_norm": _sig_batch_norm,
    "layer_norm": _sig_layer_norm, "interpolate": _sig_interpolate,
    "stochastic_depth": _sig_stochastic_depth, "drop_path": _sig_drop_path,
}
"""Operation -> the stub its arguments bind to. ``reshape`` stands for every reshape (``view``,
``flatten``, ``squeeze``, ...): their arguments are not read, the probes' shapes are. ``drop_path`` binds
its tensor as ``input`` (timm names it ``x``)."""

SAMPLE_DROPS = {"stochastic_depth": ("input", "p", "mode", "training"),
                "drop_path": ("x", "drop_prob", "training")}
"""Functions that drop whole samples, by name -> the leading parameters a function of that name must
have to be taken for one: torchvision's ``stochastic_depth(input, p, mode, training)`` and timm's
``drop_path(x, drop_prob, training, scale_by_keep)`` (older copies without ``scale_by_keep``). Found in a
traced forward's globals, they are kept as one graph node each (torch.fx's autowrap), not traced into
their random masks."""

ATTENTION = ("scaled_dot_product_attention", "multi_head_attention_forward", "matmul", "bmm", "einsum",
             "baddbmm", "__matmul__")
"""Operations of attention: PyTorch's fused ones, and the products that multiply two activations
(queries by keys, weights by values); a function whose name holds ``attention`` too
(torchvision's Swin ``shifted_window_attention``)."""

_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid", "tanh": "tanh",
            "tanh_": "tanh", "softmax": "softmax", "log_softmax": "log_softmax", "mean": "mean",
            "add": "add", "add_": "add", "sub": "sub", "sub_": "sub", "mul": "mul", "mul_": "mul",
            "div": "div", "div_": "div", "neg": "neg", "neg_": "neg", "view": "reshape",
            "reshape": "reshape", "flatten": "reshape", "squeeze": "reshape", "unsqueeze": "reshape",
            "contiguous": "contiguous", "chunk": "chunk", "split": "split", "transpose": "transpose",
            "permute": "permute", "narrow": "narrow"}
"""Tensor method -> operation (a trailing ``_``: in place)."""

_OPERATORS = {operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
              operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
              operator.neg: "neg", operator.getitem: "getitem"}
_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv)


def _functions(reference: Any) -> dict[Any, tuple[str, bool]]:
    """PyTorch's functions (the objects ``call_function`` nodes hold) -> (operation, in place), and the
    sample drops ``reference``'s forwards call (:func:`_sample_drop_functions`)."""
    import torch  # noqa: PLC0415 - the caller's torch, imported with the capture
    import torch.nn.functional as F  # noqa: PLC0415, N812

    table: dict[Any, tuple[str, bool]] = {function: (name, function in _IN_PLACE_OPERATORS)
                                          for function, name in _OPERATORS.items()}
    table.update({function: (name, False) for function, name in _sample_drop_functions(reference).items()})
    for name in ("conv2d", "linear", "batch_norm", "layer_norm", "interpolate"):
        table.setdefault(getattr(F, name), (name, False))  # torch.batch_norm takes other arguments
    table.setdefault(F.upsample, ("interpolate", False))  # deprecated; interpolate's first arguments
    for name in ("relu", "relu6", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "gelu", "hardtanh",
                 "softplus", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "dropout", "softmax",
                 "log_softmax", "hardswish", "hardsigmoid", "mish"):
        for owner in (F, torch):
            function = getattr(owner, name, None)
            if function is not None:
                table.setdefault(function, (name, False))
        for owner in (F, torch):
            function = getattr(owner, name + "_", None)
            if function is not None:
                table.setdefault(function, (name, True))
    for name in ("mean", "add", "sub", "mul", "div", "neg"):
        table.setdefault(getattr(torch, name), (name, False))
    for name in ("flatten", "reshape", "squeeze", "unsqueeze"):
        table.setdefault(getattr(torch, name), ("reshape", False))
    for name in ("cat", "concat"):  # torch.concatenate takes axis=: not bound, refused as unknown
        table.setdefault(getattr(torch, name), ("cat", False))
    for name in ("chunk", "split", "transpose", "permute", "narrow"):
        table.setdefault(getattr(torch, name), (name, False))
    return table


def _sample_drop_functions(reference: Any) -> dict[Any, str]:
    """The functions of :data:`SAMPLE_DROPS` that the forwards of ``reference``'s modules can call (by
    name in their modules' globals, with the parameters that name promises) -> their operation."""
    found: dict[Any, str] = {}
    for module in reference.modules():
        scope = getattr(type(module).forward, "__globals__", {})
        for name, leading in SAMPLE_DROPS.items():
            function = scope.get(name)
            if inspect.isfunction(function) and tuple(
                    inspect.signature(function).parameters)[:len(leading)] == leading:
                found[function] = name
    return found


def activations(graph: Any) -> set[Any]:
    """The nodes of ``graph`` whose value depends on the forward's input (the activations, and values
    such as ``x.size(0)``); a parameter, a buffer and what is computed from them alone are not."""
    found: set[Any] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(source in found for source in node.all_input_nodes):
            found.add(node)
    return found


def attention(node: Any, depends: set[Any]) -> str | None:
    """The attention operation ``node`` computes (:data:`ATTENTION`), or None: a fused attention, a
    function named for attention, or a product of two activations (``depends``: :func:`activations`)."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.target is operator.matmul:
        name = "__matmul__"
    if "attention" in name:
        return name
    if name not in ATTENTION:
        return None
    operands = [source for source in node.all_input_nodes if source in depends]
    return name if len(operands) >= 2 else None


@dataclasses.dataclass(frozen=True)
class Op:
    """What one graph node computes.

    Attributes
    ----------
    name : str
        The operation (``"relu"``, ``"max_pool2d"``, ``"add"``, ``"reshape"``, ...; a module call:
        ``"module"``), or the target's own name where it is none of those.
    known : bool
        Whether the capture knows the operation.
    in_place : bool
        Whether it overwrites its first argument (``relu_``, ``inplace=True``, ``+=`` on a tensor
        method, an ``nn.ReLU(inplace=True)``).
    """

    name: str
    known: bool
    in_place: bool = False


@dataclasses.dataclass
class Traced:
    """A module's forward as a torch.fx graph, with the values of its nodes on two probe batches.

    Attributes
    ----------
    reference : torch.nn.Module
        A float64 copy of the module on the CPU (the one traced and run).
    graph : torch.fx.Graph
    values : list of dict
        Per probe batch (:data:`PROBE_BATCHES`), node -> its value (tensors cloned as computed).
    inputs : list of torch.Tensor
        The probe batches as the module takes them.
    time_major : bool
        Whether the module takes its input time-major ``(T, B, F)`` (a recurrent layer without
        ``batch_first`` reads it directly).
    """

    reference: Any
    graph: Any
    values: list[dict[Any, Any]]
    inputs: list[Any]
    time_major: bool
    functions: dict[Any, tuple[str, bool]]

    # --- the nodes -------------------------------------------------------------------------
    def is_tensor(self, node: Any) -> bool:
        """Whether ``node`` computes a tensor (on the probes)."""
        import torch  # noqa: PLC0415

        return isinstance(self.values[0].get(node), torch.Tensor)

    def live(self) -> list[Any]:
        """The nodes the output depends on, in graph (forward) order."""
        return live_nodes(self.graph)

    def kind_of(self, value: Any) -> str:
        """How a message names a value that is no tensor: ``"a tuple of 2 values"``, ``"None"``, ..."""
        if isinstance(value, (tuple, list)):
            return f"a {type(value).__name__} of {len(value)} values"
        return type(value).__name__ if value is not None else "None"

    def output(self) -> Any:
        return next(node for node in self.graph.nodes if node.op == "output")

    def placeholder(self) -> Any:
        return next(node for node in self.graph.nodes if node.op == "placeholder")

    def module(self, node: Any) -> Any:
        """The submodule a ``call_module`` node calls."""
        return self.reference.get_submodule(node.target)

    def op(self, node: Any) -> Op:
        """What ``node`` computes."""
        if node.op == "call_module":
            return Op("module", True, bool(getattr(self.module(node), "inplace", False)))
        if node.op == "call_method":
            name = _METHODS.get(node.target)
            if name is None:
                return Op(str(node.target), False)
            return Op(name, True, node.target.endswith("_") or _inplace_argument(node, name))
        if node.op == "call_function":
            found = self.functions.get(node.target)
            if found is None:
                return Op(getattr(node.target, "__name__", str(node.target)), False)
            return Op(found[0], True, found[1] or _inplace_argument(node, found[0]))
        return Op(node.op, node.op in ("placeholder", "output"))

    def arguments(self, node: Any, op: Op) -> dict[str, Any]:
        """``node``'s arguments bound to PyTorch's names for ``op`` (defaults applied), the values of
        non-tensor nodes (``x.size(3)``) filled in from the probes; tensors stay graph nodes.

        Raises
        ------
        CaptureError
            Arguments the operation does not take, or a value that depends on the batch size.
        """
        import torch.fx  # noqa: PLC0415

        def fill(argument: Any) -> Any:
            if self.is_tensor(argument):
                return argument
            first, second = (values.get(argument) for values in self.values)
            if first != second:
                raise CaptureError(f"{describe(node)}: an argument ({argument.name!r}: {first!r} at batch "
                                   f"{PROBE_BATCHES[0]}, {second!r} at batch {PROBE_BATCHES[1]}) depends on "
                                   "the batch size; a layer's arguments must not")
            return first

        args = torch.fx.node.map_arg(node.args, fill)
        kwargs = torch.fx.node.map_arg(node.kwargs, fill)
        try:
            bound = inspect.signature(_SIGNATURES[op.name]).bind(*args, **kwargs)
        except TypeError as error:
            raise CaptureError(f"{describe(node)}: arguments not understood ({error})") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def tensor_inputs(self, node: Any) -> list[Any]:
        """The tensor-valued nodes ``node`` reads, in argument order, repeats kept (``x + x``)."""
        import torch.fx  # noqa: PLC0415

        found: list[Any] = []
        torch.fx.node.map_arg((node.args, node.kwargs),
                              lambda n: found.append(n) if self.is_tensor(n) else None)
        return found

    def shapes(self, node: Any) -> list[tuple[int, ...]]:
        """``node``'s value's shape on each probe."""
        return [tuple(values[node].shape) for values in self.values]


def _inplace_argument(node: Any, name: str) -> bool:
    """Whether a call of operation ``name`` passes ``inplace=True`` (by keyword or position)."""
    signature = inspect.signature(_SIGNATURES[name])
    if "inplace" not in signature.parameters:
        return False
    try:
        return signature.bind(*node.args, **node.kwargs).arguments.get("inplace") is True
    except TypeError:
        return False


# --- messages ------------------------------------------------------------------------------------
def _user_line(stack: str | None) -> str:
    """``" at file.py:12: `code`"`` from a node's recorded stack: its last frame outside PyTorch and
    sparse-scan, or ``""``."""
    if not stack:
        return ""
    lines = stack.splitlines()
    found = ""
    for index, line in enumerate(lines):
        text = line.strip()
        if not text.startswith("File "):
            continue
        try:
            file = text.split('"')[1]
            number = int(text.split("line ")[1].split(",")[0])
        except (IndexError, ValueError):
            continue
        if _library_file(file):
            continue
        code = lines[index + 1].strip() if index + 1 < len(lines) else ""
        found = f" at {pathlib.Path(file).name}:{number}" + (f": `{code}`" if code else "")
    return found


def _library_file(file: str) -> bool:
    """Whether ``file`` is PyTorch's or sparse-scan's own source (not the user's forward)."""
    import torch  # noqa: PLC0415

    parts = pathlib.Path(file).parts
    libraries = (pathlib.Path(torch.__file__).parent, pathlib.Path(__file__).parents[1])
    return any(tuple(parts[:len(root.parts)]) == root.parts for root in libraries)


def describe(node: Any) -> str:
    """How a message names ``node``: ``node 'relu_1' (F.relu, at net.py:12: `x = F.relu(x)`)``."""
    if node.op == "call_module":
        what = f"module {node.target!r}"
    elif node.op == "call_method":
        what = f".{node.target}()"
    elif node.op == "call_function":
        target = node.target
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", str(target))
        what = f"F.{name}" if module == "torch.nn.functional" else f"torch.{name}" if module == "torch" \
            else name
        if module in ("_operator", "operator"):
            what = {"add": "+", "iadd": "+=", "sub": "-", "isub": "-=", "mul": "*", "imul": "*=",
                    "truediv": "/", "itruediv": "/=", "neg": "unary -", "getitem": "[]"}.get(name, name)
    else:
        what = f"{node.op} {node.target}"
    return f"node {node.name!r} ({what}{_user_line(node.stack_trace)})"


def _traceback_line(error: BaseException) -> str:
    """``" at file.py:12: `code`"`` for the innermost frame of ``error``'s traceback in the user's code."""
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if not _library_file(frame.filename):
            found = f" at {pathlib.Path(frame.filename).name}:{frame.lineno}" + (
                f": `{frame.line.strip()}`" if frame.line else "")
    return found


# --- tracing and the probe runs ------------------------------------------------------------------
def trace(module: Any) -> tuple[Any, Any]:
    """A float64 copy of ``module`` on the CPU and the torch.fx graph of its forward (PyTorch's own
    layers are leaves, custom submodules are traced through).

    Raises
    ------
    CaptureError
        The module cannot be copied or traced (data-dependent control flow, an unsupported Python
        construct: the tracer's reason and the line), or its forward takes other than one input.
    """
    import torch  # noqa: PLC0415
    import torch.fx  # noqa: PLC0415

    if not isinstance(module, torch.nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(module).__name__}")
    # tensors a hook computed (torch.nn.utils.prune's weight = weight_orig * weight_mask) are no graph
    # leaves, which deepcopy refuses: copy them detached (the hook computes them anew at each forward)
    memo = {id(value): value.detach().clone() for submodule in module.modules()
            for value in vars(submodule).values() if isinstance(value, torch.Tensor) and not value.is_leaf}
    try:
        reference = copy.deepcopy(module, memo).to(device="cpu", dtype=torch.float64)
    except Exception as error:  # noqa: BLE001 - any failure to copy: the reason goes to the user
        raise CaptureError(f"cannot copy the module to check the capture in float64: "
                           f"{type(error).__name__}: {error}") from None
    parameters = list(inspect.signature(reference.forward).parameters.values())
    if not parameters or parameters[0].kind in (inspect.Parameter.VAR_KEYWORD,):
        raise CaptureError("forward takes no input; a model takes one tensor")
    concrete = {p.name: p.default for p in parameters[1:] if p.default is not inspect.Parameter.empty}

    class Tracer(torch.fx.Tracer):
        """Marks the nodes the forward makes with gradients off (``torch.no_grad()``): PyTorch gives
        them no gradient, a scan would."""

        def create_node(self, *args: Any, **kwargs: Any) -> Any:
            node = super().create_node(*args, **kwargs)
            node.meta["no_grad"] = not torch.is_grad_enabled()
            return node

        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            """PyTorch's layers are leaves, unless a forward was patched onto the instance: that
            function is traced instead (what the module computes)."""
            return super().is_leaf_module(m, qualname) and "forward" not in vars(m)

    tracer = Tracer(autowrap_functions=tuple(_sample_drop_functions(reference)))
    tracer.record_stack_traces = True
    try:
        with torch.enable_grad():  # whatever the caller's mode: the forward's own no_grad shows
            graph = tracer.trace(reference, concrete_args=concrete or None)
    except Exception as error:  # noqa: BLE001 - data-dependent control flow and the like
        message = " ".join(str(error).strip().splitlines()[0].split()) if str(error).strip() else ""
        raise CaptureError(f"torch.fx cannot trace the forward{_traceback_line(error)}: "
                           f"{type(error).__name__}: {message}") from None
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if len(placeholders) != 1:
        raise CaptureError(f"node {placeholders[1].name!r} (input {placeholders[1].target!r} of forward): "
                           f"forward takes {len(placeholders)} inputs; a model takes one tensor")
    return reference, graph


def probe(reference: Any, graph: Any, input_shape: tuple[int, ...]) -> Traced:
    """Run the traced ``graph`` on two probe batches of ``input_shape`` (float64, seeded), recording
    every node's value.

    Raises
    ------
    CaptureError
        A node fails on a batch of ``input_shape``, named.
    """
    import torch  # noqa: PLC0415

    layout = time_major(reference, graph)
    generator = torch.Generator().manual_seed(0)
    inputs, values = [], []
    for batch in PROBE_BATCHES:
        x = torch.randn((batch,) + tuple(input_shape), dtype=torch.float64, generator=generator)
        if layout:
            x = x.transpose(0, 1).contiguous()
        inputs.append(x)
        values.append(run_graph(reference, graph, x, tuple(input_shape)))
    return Traced(reference, graph, values, inputs, layout, _functions(reference))


def swaps_time_and_batch(node: Any) -> bool:
    """Whether ``node`` swaps the first two axes of a 3-d tensor (``x.transpose(0, 1)``,
    ``x.permute(1, 0, 2)``, ``torch.transpose(x, 0, 1)``): a batch-first input made time-major."""
    import torch  # noqa: PLC0415

    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None) \
        if node.op == "call_function" and node.target in (torch.transpose, torch.permute) else None
    rest = tuple(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = tuple(rest[0])
    return (name == "transpose" and sorted(rest) == [0, 1] and not node.kwargs) or (
        name == "permute" and rest == (1, 0, 2) and not node.kwargs)


def time_major(reference: Any, graph: Any) -> bool:
    """Whether the module takes its input time-major: a recurrent layer without ``batch_first`` reads
    the input as it comes, or one with ``batch_first`` reads it with time and batch swapped."""
    placeholder = next(node for node in graph.nodes if node.op == "placeholder")
    for node in graph.nodes:
        if node.op != "call_module" or not node.args:
            continue
        module = reference.get_submodule(node.target)
        if type(module).__name__ not in ("RNN", "GRU", "LSTM"):
            continue
        source = node.args[0]
        if source is placeholder:
            return not module.batch_first
        if hasattr(source, "op") and swaps_time_and_batch(source) and source.args[0] is placeholder:
            return bool(module.batch_first)
    return False


def live_nodes(graph: Any) -> list[Any]:
    """The nodes of ``graph`` its output depends on, in graph (forward) order."""
    output = next(node for node in graph.nodes if node.op == "output")
    needed, stack = {output}, [output]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in needed:
                needed.add(source)
                stack.append(source)
    return [node for node in graph.nodes if node in needed]


def run_graph(reference: Any, graph: Any, x: Any, sample_shape: tuple[int, ...]) -> dict[Any, Any]:
    """Every node's value when ``graph`` runs on ``x`` (dropout off: :class:`NoDropout`; a sample drop
    of :data:`SAMPLE_DROPS` in training mode gives its input: no sample dropped), tensors cloned as they
    are computed (a later in-place operation changes none).

    Raises
    ------
    CaptureError
        A node fails on ``x`` (an input shape the module does not take), naming the node.
    """
    import torch  # noqa: PLC0415
    import torch.fx  # noqa: PLC0415

    values: dict[Any, Any] = {}
    failures: list[tuple[Any, BaseException]] = []
    drops = _sample_drop_functions(reference)

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            if target in drops:
                bound = inspect.signature(_SIGNATURES[drops[target]]).bind(*args, **kwargs)
                bound.apply_defaults()
                if bound.arguments["training"] is True:
                    return bound.arguments["input"]
            return super().call_function(target, args, kwargs)

        def run_node(self, node: Any) -> Any:
            try:
                result = super().run_node(node)
            except Exception as error:
                failures.append((node, error))  # the interpreter appends its own notes to the error
                raise
            values[node] = _cloned(result)
            return result

    try:
        with torch.no_grad(), no_dropout():
            Recorder(torch.fx.GraphModule(reference, graph)).run(x)
    except Exception as error:  # noqa: BLE001 - named with the node that failed
        node, cause = failures[0] if failures else (None, error)
        lines = str(cause).strip().splitlines()
        message = " ".join(lines[0].split()) if lines else ""
        where = describe(node) if node is not None else "the forward"
        raise CaptureError(f"{where} fails on a batch of the input shape {list(sample_shape)}: "
                           f"{type(cause).__name__}: {message}") from None
    return values


def _cloned(value: Any) -> Any:
    import torch  # noqa: PLC0415

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    return value


def no_dropout() -> Any:
    """A context in which PyTorch's dropout is the identity (``F.dropout`` and ``nn.Dropout``): the
    capture's checks compare forwards without random masks."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415, N812

    class NoDropout(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is F.dropout:
                return args[0] if args else kwargs["input"]
            return func(*args, **(kwargs or {}))

    return NoDropout()
