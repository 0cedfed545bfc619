"""BPPSA as the backward of a PyTorch training loop: :func:`bppsa` wraps a module so that autograd's
backward through it is sparse-scan's scan.

``bnet = bppsa(net)`` is an ``nn.Module`` holding ``net`` (the same parameters: ``bnet.parameters()``
are ``net``'s objects, ``bnet.train()`` sets ``net``'s mode). Its forward runs the engine's model of
``net``'s forward (:func:`~sparse_scan.torch.capture`, once per mode and input shape) through a
``torch.autograd.Function`` whose inputs are the input and every parameter, so autograd accumulates the
scan's ``dL/dx`` and parameter gradients where it would its own: ``.grad``, hooks, clipping, optimizers
and PyTorch layers before and after ``bnet`` work unchanged.

The engine reads the parameters where PyTorch keeps them: its layers hold NumPy views of the
parameters' and buffers' storage (no copy; a non-contiguous one is copied at each forward), checked
against the module at every forward, so a weight PyTorch changes in place (``opt.step()``,
``p.data.mul_()``, ``load_state_dict``) is read as it is, and one replaced (``p.data = w``, a new
``nn.Parameter``) is bound anew. A weight changed between a forward and its backward is refused by
autograd's own check of the tensors the forward saved. A layer pruned with ``torch.nn.utils.prune`` is
``weight_orig * weight_mask``: the engine reads ``weight_orig`` (a view) at the kept weights, its
pattern is the mask's (derived again only when the mask changes), and ``weight_orig``'s gradient is
the kept weights' sampled product, zero at the pruned ones (autograd's gradient times the mask), so
that sparsity pays in the forward, the scan and the weight gradient, on the CPU and on CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.dlpack
from torch.utils.weak import WeakIdKeyDictionary

from .. import backend as _backend
from ..engine.schedule import SCHEDULES
from ..spec import SpecError, model_from_spec
from ..weights import named_layers
from ._capture import Capture, capture

__all__ = ["BPPSA", "bppsa", "pruned_gradient"]


def bppsa(module: torch.nn.Module, method: str = "auto", levels: int | str | None = None,
          prune_pattern: bool | None = None) -> "BPPSA":
    """``module`` with sparse-scan's scan as its backward.

    Parameters
    ----------
    module : torch.nn.Module
        Any module :func:`~sparse_scan.torch.capture` accepts (its refusal is raised at the first
        forward, with its message).
    method : {"auto", "linear", "blelloch", "hybrid"}
        The scan's schedule (``linear`` is back-propagation run by the engine).
    levels : int or "auto", optional
        Up-sweep levels of ``hybrid``.
    prune_pattern : bool, optional
        Which Conv2d and Linear layers leave their exactly-zero weights out of the Jacobians' patterns
        (the paper's pruned networks): None, those pruned with ``torch.nn.utils.prune`` (their masks
        fix the zeros; nothing per forward scales with the weights); True, every one (a layer without
        a mask: its weights are copied into the engine at each forward, a change of the zeros re-plans,
        and its weight gradient is every weight's, a zero one's included, as autograd's); False, none.

    Returns
    -------
    BPPSA
        An ``nn.Module`` over the same parameters.

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> bnet = bppsa(net, method="blelloch")
    >>> loss = bnet(torch.randn(5, 4)).square().sum()
    >>> loss.backward()                       # the scan computes every gradient
    >>> [tuple(p.grad.shape) for p in net.parameters()]
    [(8, 4), (8,), (3, 8), (3,)]
    """
    return BPPSA(module, method, levels, prune_pattern)


class BPPSA(torch.nn.Module):
    """A module whose backward is sparse-scan's scan (:func:`bppsa` builds one).

    Attributes
    ----------
    module : torch.nn.Module
        The wrapped module (its parameters are this one's).
    method, levels
        The scan's schedule.
    """

    def __init__(self, module: torch.nn.Module, method: str = "auto", levels: int | str | None = None,
                 prune_pattern: bool | None = None) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"bppsa: expected a torch.nn.Module, got {type(module).__name__}")
        if method not in SCHEDULES:
            raise ValueError(f"bppsa: method must be one of {', '.join(SCHEDULES)}; got {method!r}")
        if prune_pattern not in (None, True, False):
            raise ValueError(f"bppsa: prune_pattern must be None, True or False; got {prune_pattern!r}")
        self.module = module
        self.method, self.levels, self.prune_pattern = method, levels, prune_pattern
        self._engines: dict[tuple[Any, ...], list[_Engine]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` computed by the engine; its backward runs the scan."""
        tree = _Tree(self.module)
        device = self._check_input(x, tree)
        engine = self._engine(x, device, tree)
        with engine.on_stream(x):
            parameters, masks = engine.bind(tree)
            return _Scan.apply(engine, masks, x, *parameters)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, levels={self.levels!r}, prune_pattern={self.prune_pattern!r}"

    @staticmethod
    def _device_of(x: torch.Tensor) -> str:
        """Where the engine runs for ``x``: ``"gpu"`` for a CUDA tensor (CuPy views of the same memory),
        else ``"cpu"`` (NumPy views)."""
        return "gpu" if x.is_cuda else "cpu"

    def _check_input(self, x: Any, tree: "_Tree") -> str:
        """Refuse what the engine would compute differently from PyTorch, or not at all; return the
        engine's device."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"bppsa: expected a tensor input, got {type(x).__name__}")
        if _autocast(x.device.type):
            raise RuntimeError("bppsa: autocast is on: sparse-scan computes in the parameters' float32 or "
                               "float64, never in half precision; run the wrapped module outside autocast")
        tensors = tree.tensors()
        floating = {t.dtype for t in tensors if t.is_floating_point()}
        if floating - {torch.float32, torch.float64}:
            raise TypeError(f"bppsa: the module's parameters are {sorted(map(str, floating))}; sparse-scan "
                            "computes in float32 or float64 (half precision is not supported)")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"bppsa: the input is {x.dtype}; sparse-scan computes in float32 or float64 "
                            "(half precision is not supported)")
        if floating and floating != {x.dtype}:
            raise TypeError(f"bppsa: the input is {x.dtype} and the parameters {sorted(map(str, floating))}; "
                            "convert one of them")
        devices = {t.device for t in tensors} | {x.device}
        if len(devices) > 1:
            raise RuntimeError(f"bppsa: the input and the parameters are on different devices "
                               f"({', '.join(sorted(map(str, devices)))})")
        if x.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"bppsa: tensors on {x.device}: the engine runs on the CPU and on CUDA GPUs")
        device = self._device_of(x)
        if device == "gpu" and not _backend.gpu_usable():
            raise RuntimeError(f"bppsa: CUDA tensors ({x.device}) need CuPy with a usable GPU (pip install "
                               "cupy-cuda12x, or the CuPy of your CUDA); none is usable here")
        return device

    def _engine(self, x: torch.Tensor, device: str, tree: "_Tree") -> "_Engine":
        """The engine of the module's forward as the module tree is now (:func:`_signature`: its
        modules, their types, hyper-parameters, modes, patched methods and hooks), for samples of
        ``x``'s shape on ``device``, captured at the first forward of each; the engines of the
        :data:`KEPT_SIGNATURES` trees seen last are kept (a tree changed back finds its engine)."""
        key = (_signature(tree), x.dtype, device)
        engines = self._engines.pop(key, [])
        self._engines[key] = engines  # the most recent last
        for engine in engines:
            if engine.takes(tuple(x.shape)):
                return engine
        engine = _Engine(capture(self.module, batch_shape=tuple(x.shape)), x.dtype, device, self.method,
                         self.levels, self.prune_pattern)
        engines.append(engine)
        while len({signature for signature, _, _ in self._engines}) > KEPT_SIGNATURES:
            del self._engines[next(iter(self._engines))]
        return engine


KEPT_SIGNATURES = 4
"""Module trees (:func:`_signature`) whose engines a :class:`BPPSA` keeps: training and evaluation
modes, a layer swapped and back, without re-capturing."""

_PLAIN = frozenset({bool, int, float, str, type(None), tuple, torch.dtype, torch.device})
"""Attribute types compared by value in :func:`_signature` (others by identity)."""


class _Tree:
    """One forward's module tree: every module by its path, from one walk that the signature, the
    input's checks and the binding of the weights share. ``get_submodule``, ``get_parameter`` and
    ``get_buffer`` are the root's, looked up in that map instead of walking each path (0.2 ms a
    forward of VGG-11); what the map does not hold is asked of the root, which raises as PyTorch does."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.walk = list(root.named_modules(remove_duplicate=False))
        self.modules = dict(self.walk)

    def tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer of the tree (a shared one more than once)."""
        return [tensor for _, module in self.walk
                for tensor in (*module._parameters.values(), *module._buffers.values()) if tensor is not None]

    def get_submodule(self, path: str) -> torch.nn.Module:
        module = self.modules.get(path)
        return self.root.get_submodule(path) if module is None else module

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        path, _, attribute = name.rpartition(".")
        module = self.modules.get(path)
        value = None if module is None else module._parameters.get(attribute)
        return self.root.get_parameter(name) if value is None else value

    def get_buffer(self, name: str) -> torch.Tensor:
        path, _, attribute = name.rpartition(".")
        module = self.modules.get(path)
        value = None if module is None else module._buffers.get(attribute)
        return self.root.get_buffer(name) if value is None else value


def _signature(tree: _Tree) -> tuple[Any, ...]:
    """What a capture of the tree's forward depends on besides the tensors' values, cheap enough for
    every forward (about 0.1 ms for a VGG): per module its path, identity, class and the class's
    ``forward``, its public attributes (hyper-parameters such as ``stride`` or ``p``, ``training``, by
    value; a function or method patched onto the instance, ``module.forward = f``, by identity; tensors
    are bound at each forward instead) and its forward hooks. A submodule replaced, added or removed, a
    hyper-parameter set, a forward patched or a hook added changes it, and the next forward captures
    again."""
    return tuple(
        (path, id(module), type(module), id(type(module).forward),
         tuple((name, value if type(value) in _PLAIN else id(value)) for name, value in vars(module).items()
               if name[0] != "_" and not isinstance(value, torch.Tensor)),
         tuple(module._forward_hooks), tuple(module._forward_pre_hooks))
        for path, module in tree.walk)


class _Engine:
    """One capture's model on one device, its weights bound to the module's tensors, its last forward."""

    def __init__(self, captured: Capture, dtype: torch.dtype, device: str, method: str, levels: Any,
                 prune_pattern: bool | None) -> None:
        self.capture, self.device = captured, device
        self.method, self.levels = method, levels
        numpy_dtype = np.float64 if dtype == torch.float64 else np.float32
        arrays = {key: tensor.detach().cpu().numpy() for key, tensor in captured.weights.items()}
        try:
            self.model = model_from_spec(captured.spec, arrays, dtype=numpy_dtype,
                                         source="the captured module")
        except SpecError as error:  # the capture checked it in float64: a dtype problem at most
            raise RuntimeError(f"bppsa: {error}") from None
        layers = named_layers(self.model)
        self.targets = {key: (layers[key.rpartition(".")[0]], key.rpartition(".")[2])
                        for key in captured.sources}
        for key, source in captured.sources.items():
            layer, attribute = self.targets[key]
            if attribute == "weight" and hasattr(layer, "prune_pattern"):
                pruned = source.mask is not None if prune_pattern is None else prune_pattern
                if pruned and source.mask is None and device == "gpu":
                    raise RuntimeError(f"bppsa: layer {key.rpartition('.')[0]!r}: prune_pattern=True "
                                       "without a torch.nn.utils.prune mask derives the pattern from the "
                                       "weights on the host, so it runs on CPU tensors only (prune the "
                                       "layer with torch.nn.utils.prune, or prune_pattern=None)")
                layer.prune_pattern = pruned
                layer.sampled_gradient = source.mask is not None  # zero weights without a mask: live
        # the pruned layers whose kept weights the forward gathers, last first (WeightedLayer.
        # gather_kept_values: an optimizer's step has just written them in parameter order)
        self.pruned_last_first = [layer for layer in dict.fromkeys(
            self.targets[key][0] for key, source in reversed(captured.sources.items())
            if source.mask is not None and self.targets[key][1] == "weight")
            if getattr(layer, "prune_pattern", False)]
        self.gradients = [key for key, source in captured.sources.items() if source.parameter is not None]
        self.masks: dict[int, tuple[int, int]] = {}  # layer id -> the (pointer, version) of its mask
        self.forwards = 0
        self.dropout = any(getattr(layer, "training", False) and type(layer).__name__ in (
            "Dropout", "StochasticDepth", "DropPath") for layer in layers.values())

    def takes(self, batch_shape: tuple[int, ...]) -> bool:
        """Whether a batch of ``batch_shape`` (the module's layout) holds samples of this capture's."""
        sample = batch_shape[:1] + batch_shape[2:] if self.capture.time_major else batch_shape[1:]
        return list(sample) == list(self.capture.spec["input_shape"])

    # --- tensors and arrays: views of the same memory ------------------------------------------
    def array(self, tensor: torch.Tensor) -> Any:
        """``tensor``'s memory as the engine's array (NumPy on the CPU, CuPy on the GPU): no copy."""
        tensor = tensor.detach()
        if self.device == "cpu":
            return tensor.numpy()
        import cupy  # noqa: PLC0415 - the GPU only

        return cupy.from_dlpack(tensor)

    def tensor(self, array: Any) -> torch.Tensor:
        """The engine's ``array`` as a tensor of the same memory."""
        return torch.from_numpy(array) if self.device == "cpu" else torch.utils.dlpack.from_dlpack(array)

    def on_stream(self, x: torch.Tensor) -> Any:
        """A context running CuPy's work on PyTorch's current stream of ``x``'s device (nothing on the
        CPU): no synchronisation added between the two libraries."""
        if not x.is_cuda:
            return contextlib.nullcontext()
        import cupy  # noqa: PLC0415 - the GPU only

        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream,
                                          x.device.index or 0)
        return _Both(cupy.cuda.Device(x.device.index or 0), stream)

    def bind(self, root: _Tree) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Point every layer weight at the module's tensor of now (a view: no copy where the tensor is
        contiguous; a pruned weight is computed); return the parameters the gradients go to, in
        :attr:`gradients`' order, and their pruning masks (None where unpruned)."""
        for key, source in self.capture.sources.items():
            layer, attribute = self.targets[key]
            if source.mask is not None and getattr(layer, "prune_pattern", False):
                self._bind_masked(layer, root, source)
                continue
            array = self.array(source.read(root))
            if not _same_memory(getattr(layer, attribute), array):
                setattr(layer, attribute, array)
        sources = [self.capture.sources[key] for key in self.gradients]
        return ([root.get_parameter(source.parameter) for source in sources],
                [None if source.mask is None else root.get_buffer(source.mask) for source in sources])

    def _bind_masked(self, layer: Any, root: _Tree, source: Any) -> None:
        """A layer pruned with ``torch.nn.utils.prune``: its weight ``weight_orig * weight_mask`` of now,
        as a view of ``weight_orig`` the layer reads at the kept weights (nothing copied or multiplied
        per forward), its pattern the module's mask, set again only when the mask changed (its memory
        or its version)."""
        mask = root.get_buffer(source.mask)
        seen = _seen(mask)
        values = self.array(root.get_parameter(source.parameter))
        if self.masks.get(id(layer)) == seen:
            layer.assign_masked(values)
            return
        kept = mask.detach().cpu().numpy()
        if not np.isin(kept, (0, 1)).all():
            raise RuntimeError(f"bppsa: the pruning mask {source.mask!r} holds values other than 0 and 1; "
                               "the engine keeps the weights where it is 1 and prunes them where it is 0")
        layer.assign_masked(values, kept)
        self.masks[id(layer)] = seen

    # --- the passes --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The engine's forward of ``x``, as a new tensor (the engine keeps its own activations)."""
        self.forwards += 1
        batch = self.array(x)
        be = _backend.of(batch)
        if be.name == "cpu":
            for layer in self.pruned_last_first:
                layer.gather_kept_values(be)
        xp = be.xp
        if self.capture.time_major:
            batch = xp.ascontiguousarray(batch.transpose(1, 0, 2))
        return self.tensor(xp.array(self.model.forward(batch), copy=True))

    def backward(self, grad: torch.Tensor, masks: list[torch.Tensor | None],
                 input_gradient: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor], list[Any]]:
        """The scan's ``dL/dx`` (None where ``input_gradient`` is False: the engine then skips the
        work only it needs), every parameter's gradient for the last forward, and for each its values
        at the kept weights where it is a pruned layer's sampled product (exactly zero at every other
        weight), else None."""
        grads = self.model.backward(self.array(grad.contiguous()), method=self.method, levels=self.levels,
                                    input_gradient=input_gradient, parameters_beside=True)
        parameters = self.model.parameter_gradients(grads)
        dx = grads[0] if input_gradient else None
        if dx is not None and self.capture.time_major:
            dx = dx.transpose(1, 0, 2)
        out, kept_values = [], []
        for key, mask in zip(self.gradients, masks, strict=True):
            value = parameters[key]
            layer, attribute = self.targets[key]
            pruned = mask is not None and getattr(layer, "prune_pattern", False)
            if mask is not None and not pruned:
                # weight_orig's gradient: the weight's, masked (in place: the engine's); a pruned layer's
                # is the kept weights' already
                xp = _backend.of(value).xp
                value = xp.multiply(value, self.array(mask), out=value, casting="unsafe")
            out.append(self.tensor(value))
            kept_values.append(layer.kept_gradient if pruned and attribute == "weight" else None)
        if dx is None:
            return None, out, kept_values
        return self.tensor(dx.copy() if self.capture.time_major else dx), out, kept_values


class _Both:
    """Two contexts entered in order, left in reverse."""

    def __init__(self, first: Any, second: Any) -> None:
        self.contexts = (first, second)

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc)


class _Scan(torch.autograd.Function):
    """Forward: the engine's forward. Backward: the engine's scan, every gradient at once."""

    @staticmethod
    def forward(ctx: Any, engine: _Engine, masks: list[Any], x: torch.Tensor,
                *parameters: torch.Tensor) -> torch.Tensor:
        out = engine.forward(x)
        ctx.engine, ctx.masks, ctx.forward_number = engine, masks, engine.forwards
        ctx.masks_seen = [None if mask is None else _seen(mask) for mask in masks]
        ctx.save_for_backward(x, *parameters)  # autograd refuses a backward after they changed in place
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("bppsa: create_graph=True (a graph of the backward, for double backward) is "
                               "not supported: the scan's gradients are not themselves differentiable")
        engine: _Engine = ctx.engine
        x, *saved = ctx.saved_tensors
        with engine.on_stream(x):
            if ctx.forward_number != engine.forwards:  # another forward since: the engine kept that one's
                if engine.dropout:
                    raise RuntimeError("bppsa: a backward through an earlier forward of a model with "
                                       "dropout (or stochastic depth) in training mode: the engine keeps the "
                                       "last forward's masks; run the backward of each forward before the "
                                       "next forward")
                engine.forward(x)
            for parameter, mask in zip(saved, ctx.masks, strict=True):
                if mask is not None:  # what an earlier backward gave: not the gradient to come
                    _GIVEN.pop(parameter, None)
            # the input's gradient only where autograd wants it (an input batch requires none)
            dx, parameters, kept_values = engine.backward(grad, ctx.masks,
                                                          input_gradient=ctx.needs_input_grad[2])
        # in the parameters' own shapes (a Linear's weight the engine holds as a 1x1 convolution's)
        grads = [g if g.shape == p.shape else g.reshape(p.shape)
                 for g, p in zip(parameters, saved, strict=True)]
        for parameter, given, mask, seen, kept in zip(saved, grads, ctx.masks, ctx.masks_seen, kept_values,
                                                      strict=True):
            if mask is None:
                continue
            if kept is None:  # a dense product's, masked: not provably zero at the pruned weights
                _GIVEN[parameter] = _Given(mask, seen, None, None, None)
            else:
                _GIVEN[parameter] = _Given(mask, seen, _seen(given), engine.tensor(kept),
                                           given.untyped_storage())
        return (None, None, dx, *grads)


class _Given(NamedTuple):
    """What the bridge's last backward gave a pruned layer's ``weight_orig``."""

    mask: torch.Tensor  # the layer's weight_mask
    mask_seen: tuple[int, int]  # the mask's (address, version) at the forward: the pattern's
    grad_seen: tuple[int, int] | None  # the gradient's (address, version) where it is the sampled product
    kept: torch.Tensor | None  # then its values at the kept weights, in order (the engine's array)
    memory: Any  # the gradient's storage, held until the next backward: no other tensor takes its address


_GIVEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""``weight_orig`` parameters -> the :class:`_Given` of the last backward through the bridge."""


def pruned_gradient(parameter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The pruning mask of a ``weight_orig`` whose last gradient the bridge computed, and that
    gradient's values at the kept weights where ``parameter.grad`` is provably that gradient, exactly
    zero at every other weight.

    It is when the gradient was the layer's sampled product (not a dense product masked: a gradient
    that is not finite keeps autograd's NaN at the pruned weights), autograd stored that very tensor
    (its memory, held here until the next backward, and its version counter: nothing added into it,
    scaled or written since) and the mask is the one of the forward (same memory and version).

    Parameters
    ----------
    parameter : torch.Tensor
        A parameter of a module wrapped by :func:`bppsa`.

    Returns
    -------
    tuple of (torch.Tensor, torch.Tensor or None), or None
        The mask and the kept weights' gradient (in the order of the mask's non-zeros; None where
        ``parameter.grad`` is not provably the bridge's), or None for a parameter the bridge gave no
        pruned gradient.
    """
    given = _GIVEN.get(parameter)
    if given is None:
        return None
    grad = parameter.grad
    exact = (given.grad_seen is not None and grad is not None and grad.is_contiguous()
             and _seen(grad) == given.grad_seen and _seen(given.mask) == given.mask_seen)
    return given.mask, given.kept if exact else None


def _seen(tensor: torch.Tensor) -> tuple[int, int]:
    """A tensor's memory and version: what changes when it is replaced or written in place."""
    return tensor.data_ptr(), tensor._version


def _same_memory(held: Any, array: Any) -> bool:
    """Whether the layer's array ``held`` is ``array``'s memory (same address, shape, strides, dtype)."""
    return (type(held) is type(array) and held.dtype == array.dtype and held.shape == array.shape
            and held.strides == array.strides and _address(held) == _address(array))


def _address(array: Any) -> int:
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


def _autocast(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # an older PyTorch: no device argument
        return bool(torch.is_autocast_enabled())
