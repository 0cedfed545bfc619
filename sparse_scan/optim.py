"""SGD (with momentum) and Adam with PyTorch's update rules and defaults.

An optimizer holds a model and its state; ``step(grads)`` takes :meth:`Sequential.parameter_gradients`'
dict and updates the layers' ``weight``/``bias`` in place. The same hyper-parameters give PyTorch's
trajectory (``torch.optim.SGD`` / ``torch.optim.Adam``, single-tensor implementation, same order of
operations). Weights of layers with ``prune_pattern=True`` that are zero when the optimizer is created
stay exactly zero: their gradients and updates are masked, so the pruned Jacobian pattern stays valid.

Examples
--------
>>> import numpy as np
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Linear
>>> model = Sequential(Linear(2, 1, dtype=np.float64, rng=0))
>>> before = model.layers[0].weight.copy()
>>> SGD(model, lr=0.1).step({"0.weight": np.ones((1, 2)), "0.bias": np.ones(1)})
>>> np.allclose(model.layers[0].weight, before - 0.1)
True
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .weights import state_dict

__all__ = ["SGD", "Adam", "Optimizer"]


class Optimizer:
    """Parameters by state_dict name, pruning masks, and the per-parameter update hook."""

    def __init__(self, model: Any, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr: must be positive, got {lr}")
        self.model, self.lr = model, float(lr)
        self.masks: dict[str, np.ndarray] = {}
        for layer in model.layers:
            if getattr(layer, "prune_pattern", False):
                self.masks[f"{layer.name}.weight"] = layer.weight != 0
        self.state: dict[str, dict[str, Any]] = {}

    def step(self, grads: dict[str, Any]) -> None:
        """Update every parameter that has a gradient in ``grads``."""
        layers = {layer.name: layer for layer in self.model.layers}
        for key, parameter in state_dict(self.model).items():
            if key not in grads:
                continue
            grad = np.asarray(grads[key], dtype=parameter.dtype)
            mask = self.masks.get(key)
            if mask is not None:
                grad = grad * mask
            updated = self._update(key, parameter, grad, self.state.setdefault(key, {}))
            if mask is not None:
                updated = updated * mask
            layer_name, _, name = key.rpartition(".")
            setattr(layers[layer_name], name, updated.astype(parameter.dtype, copy=False))

    def _update(self, key: str, parameter: np.ndarray, grad: np.ndarray,
                state: dict[str, Any]) -> np.ndarray:
        raise NotImplementedError


class SGD(Optimizer):
    """``torch.optim.SGD(lr, momentum=0, dampening=0, weight_decay=0, nesterov=False)``."""

    def __init__(self, model: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(model, lr)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)

    def _update(self, key: str, parameter: np.ndarray, grad: np.ndarray,
                state: dict[str, Any]) -> np.ndarray:
        if self.weight_decay:
            grad = grad + self.weight_decay * parameter
        if self.momentum:
            if "momentum_buffer" not in state:
                buffer = grad.copy()
            else:
                buffer = state["momentum_buffer"] * self.momentum + (1 - self.dampening) * grad
            state["momentum_buffer"] = buffer
            grad = grad + self.momentum * buffer if self.nesterov else buffer
        return parameter - self.lr * grad


class Adam(Optimizer):
    """``torch.optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)``."""

    def __init__(self, model: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(model, lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def _update(self, key: str, parameter: np.ndarray, grad: np.ndarray,
                state: dict[str, Any]) -> np.ndarray:
        beta1, beta2 = self.betas
        if self.weight_decay:
            grad = grad + self.weight_decay * parameter
        step = state.get("step", 0) + 1
        first = state.get("exp_avg", np.zeros_like(parameter))
        second = state.get("exp_avg_sq", np.zeros_like(parameter))
        first = first + (grad - first) * (1 - beta1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        second = second * beta2 + (1 - beta2) * grad * grad
        state.update(step=step, exp_avg=first, exp_avg_sq=second)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denominator = np.sqrt(second) / math.sqrt(bias_correction2) + self.eps
        return parameter - (self.lr / bias_correction1) * (first / denominator)
