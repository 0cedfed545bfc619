"""GRU (paper Eq. 8, PyTorch's gate layout ``[r, z, n]``):

``r = σ(W_ir x + b_ir + W_hr h + b_hr)``, ``z = σ(W_iz x + b_iz + W_hz h + b_hz)``,
``n = tanh(W_in x + b_in + r ∘ (W_hn h + b_hn))``, ``h' = (1 - z) ∘ n + z ∘ h``.

Appendix D's decomposition, fused into one block per step and sample:
``(dh_t/dh_{t-1})^T = W_hr^T diag(a) + W_hz^T diag(e) + W_hn^T diag(c) + diag(z)`` with
``a = (1-z)(1-n²) M r(1-r)``, ``c = (1-z)(1-n²) r``, ``e = (h_{t-1} - n) z(1-z)``, ``M = W_hn h + b_hn``.

Examples
--------
>>> import numpy as np
>>> gru = GRU(3, 5, dtype=np.float64, rng=0)
>>> h = gru.forward(np.random.default_rng(1).standard_normal((2, 7, 3)))
>>> grads = gru.backward(np.ones((2, 7, 5)), method="hybrid", levels=2)
>>> sorted(grads)
['bias_hh', 'bias_ih', 'h', 'h0', 'weight_hh', 'weight_ih', 'x']
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._types import Array, RngLike
from ._base import Cell, compiled_back_propagation
from ._kernels import gru_backward
from ._module import RecurrentModule

__all__ = ["GRU", "GRUSteps"]


def sigmoid(xp: ModuleType, a: Array) -> Array:
    return 1 / (1 + xp.exp(-a))


class GRUSteps(Cell):
    """The GRU cell over a sequence (see the module docstring)."""

    gates = 3

    def forward_steps(self, xp: ModuleType, gi: Array, state0: Array, p: dict[str, Array | None]
                      ) -> dict[str, Array]:
        size = self.hidden_size
        w_hh_t, b_hh = p["weight_hh"].T, p["bias_hh"]
        steps, batch = gi.shape[:2]
        saved = {key: xp.empty((steps, batch, size), dtype=gi.dtype) for key in ("h", "r", "z", "n", "m")}
        h = state0
        for t in range(steps):
            gh = h @ w_hh_t
            if b_hh is not None:
                gh += b_hh
            r = sigmoid(xp, gi[t, :, :size] + gh[:, :size])
            z = sigmoid(xp, gi[t, :, size:2 * size] + gh[:, size:2 * size])
            m = gh[:, 2 * size:]
            n = xp.tanh(gi[t, :, 2 * size:] + r * m)
            h = n + z * (h - n)
            for key, value in (("h", h), ("r", r), ("z", z), ("n", n), ("m", m)):
                saved[key][t] = value
        return saved

    def factors(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None]
                ) -> tuple[Array, Array, Array | None]:
        size = self.hidden_size
        r, z, n, m = saved["r"], saved["z"], saved["n"], saved["m"]
        gate_n = (1 - z) * (1 - n * n)
        weights_t = p["weight_hh"].reshape(3, size, size).transpose(0, 2, 1)  # W_hr^T, W_hz^T, W_hn^T
        coefficients = xp.stack([gate_n * m * r * (1 - r), (saved["h_prev"] - n) * z * (1 - z), gate_n * r],
                                axis=2)
        return weights_t, coefficients, z

    def back_propagate(self, saved: dict[str, Array], p: dict[str, Array | None], direct: Array
                       ) -> dict[str, Array]:
        return compiled_back_propagation(gru_backward, tuple(saved[key] for key in "rznm"),
                                         saved, p, direct, self.state_size)

    def pre_activation_grads(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None],
                             totals: Array) -> tuple[Array, Array, dict[str, Array]]:
        r, z, n, m = saved["r"], saved["z"], saved["n"], saved["m"]
        grad_pre_n = totals * (1 - z) * (1 - n * n)
        grad_r = grad_pre_n * m * r * (1 - r)
        grad_z = totals * (saved["h_prev"] - n) * z * (1 - z)
        grad_gi = xp.concatenate([grad_r, grad_z, grad_pre_n], axis=-1)
        grad_gh = xp.concatenate([grad_r, grad_z, grad_pre_n * r], axis=-1)
        return grad_gi, grad_gh, {}


class GRU(RecurrentModule):
    """PyTorch's ``nn.GRU`` with its backward as a scan (see :mod:`._module` for the two calling forms).

    Parameters
    ----------
    input_size, hidden_size : int
    num_layers : int
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
    seed : int, optional
        Of the dropout masks.
    """

    gates = 3

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, *,
                 dtype: Any = None, rng: RngLike = None, name: str | None = None,
                 seed: int | None = None) -> None:
        self._setup(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, 0,
                    dtype, rng, name, seed)

    def _cell(self) -> Cell:
        return GRUSteps(self.hidden_size)
