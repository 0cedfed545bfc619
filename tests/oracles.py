"""Independent oracles for transposed Jacobians: float64 finite differences and PyTorch autograd."""

from __future__ import annotations

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
