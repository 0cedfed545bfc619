"""Elman RNN (paper Eq. 7): ``h_t = φ(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, φ = tanh or ReLU.

``(dh_t/dh_{t-1})^T = W_hh^T diag(φ'_t)``: one scaled copy of ``W_hh^T`` per step and sample.

Examples
--------
>>> import numpy as np
>>> rnn = RNN(1, 4, dtype=np.float64, rng=0)
>>> x = np.random.default_rng(1).random((2, 9, 1))
>>> h = rnn.forward(x)
>>> grads = rnn.backward(np.ones((2, 4)), method="blelloch")   # loss = sum of the last hidden state
>>> bp = rnn.backward(np.ones((2, 4)), method="linear")
>>> h.shape, grads["weight_hh"].shape, bool(np.allclose(grads["x"], bp["x"]))
((2, 9, 4), (4, 4), True)
"""

from __future__ import annotations

from typing import Any

from ._base import Recurrent

__all__ = ["RNN"]


class RNN(Recurrent):
    """PyTorch's ``nn.RNN`` (one layer, ``batch_first=True``) with its backward as a scan.

    Parameters
    ----------
    input_size, hidden_size : int
    nonlinearity : {"tanh", "relu"}
    dtype : numpy dtype, optional
        float32 (default) or float64.
    rng : numpy.random.Generator or int, optional
        Source of PyTorch's uniform initialisation ``U(-1/sqrt(H), 1/sqrt(H))``.
    name : str, optional
    """

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, nonlinearity: str = "tanh", **kwargs: Any) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"layer RNN: nonlinearity: must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, **kwargs)

    def _forward_steps(self, xp: Any, x: Any, h0: Any, p: dict[str, Any]) -> dict[str, Any]:
        pre = x @ p["weight_ih"].T + (p["bias_ih"] + p["bias_hh"])  # every step's input part at once
        w_hh_t = p["weight_hh"].T
        hs = xp.empty(pre.shape, dtype=pre.dtype)
        h = h0
        for t in range(len(pre)):
            a = pre[t] + h @ w_hh_t
            h = xp.tanh(a, out=hs[t]) if self.nonlinearity == "tanh" else xp.maximum(a, 0, out=hs[t])
        slope = 1 - hs * hs if self.nonlinearity == "tanh" else (hs > 0).astype(hs.dtype)
        return {"h": hs, "slope": slope}

    def _factors(self, xp: Any, saved: dict[str, Any], p: dict[str, Any]) -> tuple[Any, Any, Any]:
        return p["weight_hh"].T[None], saved["slope"][:, :, None, :], None

    def _pre_activation_grads(self, xp: Any, saved: dict[str, Any], totals: Any) -> tuple[Any, Any]:
        delta = saved["slope"] * totals
        return delta, delta
