"""SGD (with momentum) and Adam with PyTorch's update rules and defaults.

An optimizer holds a model and its state; ``step(grads)`` takes :meth:`Sequential.parameter_gradients`'
dict and updates the layers' ``weight``/``bias`` in place (arrays it copied once, never one the caller
assigned). The same hyper-parameters give PyTorch's trajectory (``torch.optim.SGD`` /
``torch.optim.Adam``, single-tensor implementation, same order of operations and roundings). Weights of
layers with ``prune_pattern=True`` that are zero when the optimizer is created stay exactly zero: their
gradients count as zero (non-finite ones too), so only the live weights are updated (with state for
those only: 3% of the work on a 97%-pruned layer, written through the layer's ``update_weights``), and
the pruned Jacobian pattern stays valid: a step changes it only where a live weight lands on exactly
zero (or weights loaded since made a pruned one live), and then the next backward re-plans. (A pruned
layer's gradient is its current zero set's kept weights' alone, so a weight zeroed since the optimizer
was built gets a zero gradient: only a momentum or Adam's moments can move it.)

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
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._checks import flag, number
from ._types import Array
from .weights import named_layers, state_dict

__all__ = ["SGD", "Adam", "Optimizer", "check_built_on"]


class Optimizer:
    """Parameters by state_dict name, pruning masks, and the per-parameter update hook.

    Updates run in place, as PyTorch's do: on arrays the optimizer owns. At its first step on a
    parameter (and whenever a new array was assigned since) the optimizer copies the parameter once and
    gives the layer the copy, so an array the caller assigned or holds is never changed.
    """

    def __init__(self, model: Any, lr: float) -> None:
        self.model, self.lr = model, number(lr, "lr", 0, inclusive=False)
        pruned = {path: layer for path, layer in named_layers(model).items()
                  if getattr(layer, "prune_pattern", False)}
        self._live = {f"{path}.weight": np.flatnonzero(layer.weight)  # the pruned layers' live weights
                      for path, layer in pruned.items()}
        self.state: dict[str, dict[str, Any]] = {}
        self._owned: dict[str, np.ndarray] = {}

    def step(self, grads: dict[str, Array]) -> None:
        """Update every parameter that has a gradient in ``grads`` (``grads`` is not changed).

        Raises
        ------
        ValueError
            A key names no parameter, or a gradient is not real numbers of its parameter's shape.
            Every gradient is checked before any parameter changes.
        """
        if not isinstance(grads, Mapping):
            raise TypeError(f"grads: expected a dict of state_dict names to arrays, "
                            f"got {type(grads).__name__}")
        parameters = state_dict(self.model)
        unknown = sorted(set(grads) - set(parameters))
        if unknown:
            raise ValueError(f"grads: {unknown[0]!r} names no parameter of the model "
                             f"(known: {', '.join(parameters)})")
        checked = {}
        for key, parameter in parameters.items():
            if key not in grads:
                continue
            grad = np.asarray(grads[key])
            if grad.dtype.kind not in "fiu":
                raise ValueError(f"{key}: gradient of dtype {grad.dtype}, expected real numbers")
            if grad.shape != parameter.shape:
                raise ValueError(f"{key}: gradient has shape {grad.shape}, the parameter {parameter.shape}")
            checked[key] = grad.astype(parameter.dtype, copy=False)
        layers = named_layers(self.model)  # nested blocks' layers by path, like their parameters
        for key, grad in checked.items():
            parameter = parameters[key]
            target, state = self._own(key, parameter, layers), self.state.setdefault(key, {})
            live = self._live.get(key)
            if live is None:
                self._update(target, grad, state)
                continue
            # a pruned weight's gradient is zero and so is its update: only the live entries move
            # (their state is kept compressed), and a pruned weight is never written; the layer
            # writes them (its weight is read-only) and notes a changed zero set
            values = np.take(target.reshape(-1), live)
            self._update(values, np.take(grad.reshape(-1), live), state)
            layers[key.rpartition(".")[0]].update_weights(live, values)

    def _own(self, key: str, parameter: np.ndarray, layers: dict[str, Any]) -> np.ndarray:
        """``parameter`` if this optimizer made it, else a copy that the layer now holds."""
        if self._owned.get(key) is not parameter:
            layer_name, _, name = key.rpartition(".")
            setattr(layers[layer_name], name, np.array(parameter, copy=True))
            self._owned[key] = getattr(layers[layer_name], name)
        return self._owned[key]

    def _update(self, parameter: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        """Update ``parameter`` in place (``grad`` is read only)."""
        raise NotImplementedError


def check_built_on(optimizer: Any, model: Any) -> None:
    """Raise ValueError unless ``optimizer`` updates ``model`` (one built on another model would
    silently train that one)."""
    if getattr(optimizer, "model", None) is not model:
        raise ValueError("optimizer: built on another model (it would update that one's weights)")


class SGD(Optimizer):
    """``torch.optim.SGD(lr, momentum=0, dampening=0, weight_decay=0, nesterov=False)``."""

    def __init__(self, model: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(model, lr)
        self.momentum = number(momentum, "momentum", 0)
        self.dampening = number(dampening, "dampening")
        self.weight_decay = number(weight_decay, "weight_decay", 0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        self.nesterov = flag(nesterov, "nesterov")

    def _update(self, parameter: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        # the same roundings as torch's buf.mul_(momentum).add_(grad, alpha=1 - dampening), etc.
        if self.weight_decay:
            grad = grad + self.weight_decay * parameter
        if self.momentum:
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = state["momentum_buffer"] = grad.copy()
            else:
                buffer *= self.momentum
                buffer += grad if self.dampening == 0 else (1 - self.dampening) * grad
            grad = grad + self.momentum * buffer if self.nesterov else buffer
        parameter -= self.lr * grad


class Adam(Optimizer):
    """``torch.optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)``."""

    def __init__(self, model: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(model, lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas: expected a pair of numbers in [0, 1), got {betas!r}")
        self.betas = (number(betas[0], "betas[0]", 0, 1), number(betas[1], "betas[1]", 0, 1))
        self.eps = number(eps, "eps", 0)
        self.weight_decay = number(weight_decay, "weight_decay", 0)

    def _update(self, parameter: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        # the same roundings as torch's single-tensor Adam: lerp_, mul_().addcmul_(), sqrt/div/add
        beta1, beta2 = self.betas
        if self.weight_decay:
            grad = grad + self.weight_decay * parameter
        step = state["step"] = state.get("step", 0) + 1
        if "exp_avg" not in state:
            state["exp_avg"], state["exp_avg_sq"] = np.zeros_like(parameter), np.zeros_like(parameter)
        first, second = state["exp_avg"], state["exp_avg_sq"]
        scratch = grad - first
        scratch *= 1 - beta1
        first += scratch
        second *= beta2
        np.multiply(grad, 1 - beta2, out=scratch)
        scratch *= grad
        second += scratch
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denominator = np.sqrt(second)
        denominator /= math.sqrt(bias_correction2)
        denominator += self.eps
        np.divide(first, denominator, out=scratch)
        scratch *= self.lr / bias_correction1
        parameter -= scratch
