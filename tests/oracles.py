"""Independent oracles for transposed Jacobians: float64 finite differences and PyTorch autograd."""

from __future__ import annotations

import functools
import types
from typing import Callable

import numpy as np


def finite_difference_jt(forward: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
                         eps: float = 1e-6) -> np.ndarray:
    """Dense transposed Jacobian of ``forward`` at one sample ``x`` (no batch axis), float64.

    Central differences, one input element at a time: row ``i`` of the result is ``d out / d x_i``,
    so the result has shape ``(x.size, out.size)`` like the engine's JT.
    """
    x = np.asarray(x, dtype=np.float64)
    flat = x.ravel()
    rows = []
    for i in range(flat.size):
        step = np.zeros_like(flat)
        step[i] = eps
        plus = forward((flat + step).reshape(x.shape)[None])[0]
        minus = forward((flat - step).reshape(x.shape)[None])[0]
        rows.append(((plus - minus) / (2 * eps)).ravel())
    return np.stack(rows)


def torch_jt(module, x: np.ndarray) -> np.ndarray:
    """Dense transposed Jacobian of a torch module at one sample ``x`` via autograd (float64)."""
    import torch

    def f(inp):
        return module(inp[None])[0].reshape(-1)

    jac = torch.autograd.functional.jacobian(f, torch.from_numpy(np.asarray(x, np.float64)))
    return jac.reshape(-1, x.size).T.numpy()


def torch_modules(model) -> list:
    """PyTorch float64 mirrors of a sparse_scan model's layers, with its weights copied."""
    import torch  # noqa: PLC0415 - the callers importorskip it

    modules = []
    for layer in model.layers:
        name = type(layer).__name__
        if name == "Conv2d":
            module = torch.nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                                     layer.padding, layer.dilation, layer.groups)
        elif name == "Linear":
            module = torch.nn.Linear(layer.in_features, layer.out_features)
        elif name == "MaxPool2d":
            module = torch.nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                                        ceil_mode=layer.ceil_mode)
        elif name == "AvgPool2d":
            module = torch.nn.AvgPool2d(layer.kernel_size, layer.stride, layer.padding,
                                        ceil_mode=layer.ceil_mode, count_include_pad=layer.count_include_pad)
        elif name == "LeakyReLU":
            module = torch.nn.LeakyReLU(layer.negative_slope)
        else:
            module = getattr(torch.nn, name)()
        if hasattr(layer, "weight"):  # copied: a pruned layer's weight is read-only
            module.weight.data = torch.from_numpy(np.array(layer.weight, np.float64))
            if layer.bias is not None:
                module.bias.data = torch.from_numpy(np.asarray(layer.bias, np.float64))
        modules.append(module.double())
    return modules


def randomize_batch_norms(net) -> None:
    """Random running statistics and affine parameters for every ``nn.BatchNorm2d`` of ``net`` (in
    place): PyTorch's initial ones make a frozen batch norm nearly the identity, which would hide a
    wrong batch-norm JT."""
    import torch  # noqa: PLC0415 - torch is optional: only tests that importorskip it call this

    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_()


def torch_mirror(layer, dtype=None):
    """A PyTorch module computing what one sparse_scan ``layer`` computes, with its hyper-parameters
    and a copy of its parameters, in ``dtype`` (a torch dtype; by default float64).

    Every layer class of ``sparse_scan.layers`` is mirrored: ``Affine`` by a module computing ``x *
    scale + shift`` as a module's forward writes it, ``Residual`` by a module summing its inner chain
    (children ``0``, ``1``, …) and its shortcut (child ``shortcut``: the layer, or a chain), so that
    parameter names match :meth:`~sparse_scan.layers.Residual.parameter_gradients`', and ``Block`` by a
    module joining its branches (``torch.cat`` along the channels, ``+`` or ``*``) whose children are
    placed at the paths :meth:`~sparse_scan.layers.Block.named_children` names. ``BatchNorm2d``
    and ``Dropout`` take the layer's mode; a ``Dropout`` in training mode draws its own masks (mirror
    the layer's mask with :func:`masked`)."""
    import torch  # noqa: PLC0415 - the callers importorskip it

    nn = torch.nn
    dtype = torch.float64 if dtype is None else dtype
    name = type(layer).__name__
    if name == "Residual":
        module = _torch_classes().Residual([torch_mirror(inner, dtype) for inner in layer.layers],
                           [torch_mirror(short, dtype) for short in layer.shortcut], layer._single_shortcut)
        return module.to(dtype)
    if name == "Block":
        children = [[(path, torch_mirror(inner, dtype)) for path, inner in branch]
                    for branch in layer._branch_children()]
        return _torch_classes().Block(children, layer.join).to(dtype)
    if name == "Affine":
        return _torch_classes().Affine(layer.scale, layer.shift)
    simple = {
        "Conv2d": lambda: nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                                    layer.padding, layer.dilation, layer.groups, layer.bias is not None),
        "Linear": lambda: nn.Linear(layer.in_features, layer.out_features, layer.bias is not None),
        "MaxPool2d": lambda: nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                                          ceil_mode=layer.ceil_mode),
        "AvgPool2d": lambda: nn.AvgPool2d(layer.kernel_size, layer.stride, layer.padding, layer.ceil_mode,
                                          layer.count_include_pad),
        "AdaptiveAvgPool2d": lambda: nn.AdaptiveAvgPool2d(layer.output_size),
        "BatchNorm2d": lambda: nn.BatchNorm2d(layer.num_features, layer.eps, layer.momentum, layer.affine),
        "Dropout": lambda: nn.Dropout(layer.p),
        "Flatten": lambda: nn.Flatten(layer.start_dim, layer.end_dim),
        "LeakyReLU": lambda: nn.LeakyReLU(layer.negative_slope),
        "ELU": lambda: nn.ELU(layer.alpha),
        "GELU": lambda: nn.GELU(layer.approximate),
        "Hardtanh": lambda: nn.Hardtanh(layer.min_val, layer.max_val),
        "Softplus": lambda: nn.Softplus(layer.beta, layer.threshold),
        "Softmax": lambda: nn.Softmax(layer.dim),
        "LogSoftmax": lambda: nn.LogSoftmax(layer.dim),
        "LayerNorm": lambda: (nn.LayerNorm if layer.data_format == "channels_last"
                              else _torch_classes().ChannelsLayerNorm)(
            layer.normalized_shape, layer.eps, layer.elementwise_affine, bias=layer.bias is not None),
        "LayerScale": lambda: _torch_classes().LayerScale(layer.dim),
        "Upsample": lambda: nn.Upsample(layer.size, layer.scale_factor, layer.mode, layer.align_corners,
                                        layer.recompute_scale_factor),
        "StochasticDepth": lambda: _torch_classes().StochasticDepth(layer.p, layer.mode, True),
        "DropPath": lambda: _torch_classes().StochasticDepth(layer.drop_prob, "row", layer.scale_by_keep),
    }
    module = simple[name]() if name in simple else getattr(nn, name)()
    module = module.to(dtype).train(layer.training)
    with torch.no_grad():
        for field in ("weight", "bias", "running_mean", "running_var", "gamma"):
            value = getattr(layer, field, None)
            if value is not None and getattr(module, field, None) is not None:
                getattr(module, field).copy_(torch.from_numpy(np.array(value)))
    return module


def masked(mask: np.ndarray):
    """A PyTorch module multiplying its input by a fixed ``mask`` of its shape: what PyTorch's dropout
    computes in training mode (``input * mask / (1 - p)``) given the mask."""
    import torch  # noqa: PLC0415 - the callers importorskip it

    factor = torch.from_numpy(np.asarray(mask))
    return _torch_classes().Lambda(lambda x: x * factor.reshape(x.shape))


@functools.cache
def _torch_classes() -> types.SimpleNamespace:
    """The ``nn.Module`` subclasses of :func:`torch_mirror` and :func:`masked`, defined once, after
    torch is imported (the callers importorskip it)."""
    import torch  # noqa: PLC0415

    class Affine(torch.nn.Module):
        def __init__(self, scale: float, shift: float) -> None:
            super().__init__()
            self.scale, self.shift = scale, shift

        def forward(self, x):
            out = x if self.scale == 1 else x * self.scale
            return out if self.shift == 0 else out + self.shift

    class Residual(torch.nn.Module):
        def __init__(self, inner: list, shortcut: list, single: bool) -> None:
            super().__init__()
            for index, module in enumerate(inner):
                self.add_module(str(index), module)
            self.inner = len(inner)
            self.shortcut = (shortcut[0] if single else torch.nn.Sequential(*shortcut)) if shortcut else None

        def forward(self, x):
            y = x
            for index in range(self.inner):
                y = getattr(self, str(index))(y)
            return y + (x if self.shortcut is None else self.shortcut(x))

    class Block(torch.nn.Module):
        def __init__(self, branches: list, join: str) -> None:
            super().__init__()
            self.paths = [[path for path, _ in branch] for branch in branches]
            self.join = join
            for branch in branches:
                for path, module in branch:
                    *scopes, leaf = path.split(".")
                    owner = self
                    for scope in scopes:
                        if not hasattr(owner, scope):
                            owner.add_module(scope, torch.nn.Module())
                        owner = getattr(owner, scope)
                    owner.add_module(leaf, module)

        def forward(self, x):
            outputs = []
            for paths in self.paths:
                y = x
                for path in paths:
                    y = self.get_submodule(path)(y)
                outputs.append(y)
            if self.join == "concat":
                return torch.cat(outputs, 1)
            total = outputs[0]
            for y in outputs[1:]:
                total = total * y if self.join == "product" else total + y
            return total

    class Lambda(torch.nn.Module):
        def __init__(self, function) -> None:
            super().__init__()
            self.function = function

        def forward(self, x):
            return self.function(x)

    class ChannelsLayerNorm(torch.nn.LayerNorm):
        """A LayerNorm over the channels of ``(N, C, ...)``: torchvision's ``LayerNorm2d`` (ConvNeXt's
        ``permute(0, 2, 3, 1)``, ``nn.LayerNorm(C)``, ``permute(0, 3, 1, 2)``)."""

        def forward(self, x):
            return super().forward(x.movedim(1, -1)).movedim(-1, 1)

    class LayerScale(torch.nn.Module):
        """ConvNeXt's ``layer_scale * x``, the parameter named ``gamma`` (timm's name)."""

        def __init__(self, dim: int) -> None:
            super().__init__()
            self.gamma = torch.nn.Parameter(torch.ones(dim, 1, 1))

        def forward(self, x):
            return self.gamma * x

    class StochasticDepth(torch.nn.Module):
        """torchvision's ``stochastic_depth`` (timm's ``drop_path``: mode ``row``, ``scale``
        ``scale_by_keep``), drawing its own masks in training mode (mirror a layer's mask with
        :func:`masked`)."""

        def __init__(self, p: float, mode: str, scale: bool) -> None:
            super().__init__()
            self.p, self.mode, self.scale = p, mode, scale

        def forward(self, x):
            if not self.training or self.p == 0.0:
                return x
            survival = 1.0 - self.p
            size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
            noise = torch.empty(size, dtype=x.dtype).bernoulli_(survival)
            if survival > 0.0 and self.scale:
                noise.div_(survival)
            return x * noise

    return types.SimpleNamespace(Affine=Affine, Residual=Residual, Block=Block, Lambda=Lambda,
                                 ChannelsLayerNorm=ChannelsLayerNorm, LayerScale=LayerScale,
                                 StochasticDepth=StochasticDepth)
