"""Elman RNN (paper Eq. 7): ``h_t = φ(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, φ = tanh or ReLU.

``(dh_t/dh_{t-1})^T = W_hh^T diag(φ'_t)``: one scaled copy of ``W_hh^T`` per step and sample.

Examples
--------
>>> import numpy as np
>>> rnn = RNN(1, 4, dtype=np.float64, rng=0)
>>> x = np.random.default_rng(1).random((2, 9, 1))
>>> h = rnn.forward(x)                                  # the layer form: batch-first
>>> grads = rnn.backward(np.ones((2, 4)), method="blelloch")   # loss = sum of the last hidden state
>>> bp = rnn.backward(np.ones((2, 4)), method="linear")
>>> h.shape, grads["weight_hh"].shape, bool(np.allclose(grads["x"], bp["x"]))
((2, 9, 4), (4, 4), True)
>>> deep = RNN(3, 5, num_layers=2, bidirectional=True, dtype=np.float64, rng=0)   # PyTorch's call
>>> output, h_n = deep(np.ones((7, 2, 3)))
>>> output.shape, h_n.shape
((7, 2, 10), (4, 2, 5))
>>> sorted(deep.backward(np.ones(output.shape), method="hybrid", levels="auto"))[:4]
['bias_hh_l0', 'bias_hh_l0_reverse', 'bias_hh_l1', 'bias_hh_l1_reverse']
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._types import Array, RngLike
from ._base import Cell, compiled_back_propagation
from ._kernels import elman_backward
from ._module import RecurrentModule

__all__ = ["RNN", "ElmanSteps"]

NONLINEARITIES = ("tanh", "relu")


def check_nonlinearity(value: Any, label: str) -> str:
    if value not in NONLINEARITIES:
        raise ValueError(f"layer {label}: nonlinearity: must be 'tanh' or 'relu', got {value!r}")
    return str(value)


class ElmanSteps(Cell):
    """The Elman cell over a sequence (see the module docstring)."""

    gates = 1

    def __init__(self, hidden_size: int, nonlinearity: str = "tanh") -> None:
        super().__init__(hidden_size)
        self.nonlinearity = nonlinearity

    def forward_steps(self, xp: ModuleType, gi: Array, state0: Array, p: dict[str, Array | None]
                      ) -> dict[str, Array]:
        pre = gi if p["bias_hh"] is None else gi + p["bias_hh"]  # every step's input part at once
        w_hh_t = p["weight_hh"].T
        hs = xp.empty(pre.shape, dtype=pre.dtype)
        h = state0
        for t in range(len(pre)):
            a = pre[t] + h @ w_hh_t
            h = xp.tanh(a, out=hs[t]) if self.nonlinearity == "tanh" else xp.maximum(a, 0, out=hs[t])
        slope = 1 - hs * hs if self.nonlinearity == "tanh" else (hs > 0).astype(hs.dtype)
        return {"h": hs, "slope": slope}

    def factors(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None]
                ) -> tuple[Array, Array, Array | None]:
        return p["weight_hh"].T[None], saved["slope"][:, :, None, :], None

    def back_propagate(self, saved: dict[str, Array], p: dict[str, Array | None], direct: Array
                       ) -> dict[str, Array]:
        return compiled_back_propagation(elman_backward, (saved["slope"],), saved, p, direct,
                                         self.state_size)

    def pre_activation_grads(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None],
                             totals: Array) -> tuple[Array, Array, dict[str, Array]]:
        delta = saved["slope"] * totals
        return delta, delta, {}


class RNN(RecurrentModule):
    """PyTorch's ``nn.RNN`` with its backward as a scan (see :mod:`._module` for the two calling forms).

    Parameters
    ----------
    input_size, hidden_size : int
    num_layers : int
    nonlinearity : {"tanh", "relu"}
    bias : bool
    batch_first : bool
        Layout of the module's call (the layer form :meth:`forward` is always batch-first).
    dropout : float
        Between layers, in training mode (:meth:`train`/:meth:`eval`), masks from ``seed``.
    bidirectional : bool
    dtype : numpy dtype, optional
        float32 (default) or float64.
    rng : numpy.random.Generator or int, optional
        Source of PyTorch's uniform initialisation ``U(-1/sqrt(H), 1/sqrt(H))``.
    name : str, optional
        Prefix of the parameters in a model's state_dict.
    seed : int, optional
        Of the dropout masks (each training forward draws the next ones).
    """

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, *, dtype: Any = None, rng: RngLike = None,
                 name: str | None = None, seed: int | None = None) -> None:
        self.nonlinearity = check_nonlinearity(nonlinearity, type(self).__name__)
        self._setup(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, 0,
                    dtype, rng, name, seed)

    def _cell(self) -> Cell:
        return ElmanSteps(self.hidden_size, self.nonlinearity)
