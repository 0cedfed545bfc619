"""LSTM (PyTorch's gate layout ``[i, f, g, o]``, optional projection ``h = W_hr (o ∘ tanh c)``):

``i, f, o = σ(W_i* x + b_i* + W_h* h_{t-1} + b_h*)``, ``g = tanh(W_ig x + b_ig + W_hg h_{t-1} + b_hg)``,
``c_t = f ∘ c_{t-1} + i ∘ g``, ``h̃_t = o ∘ tanh(c_t)``, ``h_t = W_hr h̃_t`` (``h_t = h̃_t`` without
a projection).

The scan runs over the state ``s_t = (h_t, c_t)`` (``S = H_out + H``). With ``δ = o (1 - tanh² c_t)``,
``a_i = g i(1-i)``, ``a_f = c_{t-1} f(1-f)``, ``a_g = i (1-g²)``, ``a_o = tanh(c_t) o(1-o)`` and
``U = Σ_{k=i,f,g} W_hk^T diag(a_k)``, ``L = U diag(δ) + W_ho^T diag(a_o)``, the transposed Jacobian
is the block

    (ds_t/ds_{t-1})^T = [[ L W_hr^T,            U       ],
                         [ diag(f δ) W_hr^T,    diag(f) ]]

(``W_hr = I`` without a projection): the gradient ``(g_h, g_c)`` at ``t`` gives ``g̃ = W_hr^T g_h``,
``g_c' = g_c + δ g̃`` (the total w.r.t. ``c_t``), the gate gradients ``(a_i g_c', a_f g_c', a_g g_c',
a_o g̃)``, ``g_h`` at ``t-1`` as ``W_hh^T`` times them and ``g_c`` at ``t-1`` as ``f g_c'``.

Scans of depth > 0 fill it as a dense ``S×S`` block per step and sample (products of blocks are dense
after the first level, so the engine's dense products serve every level, CPU and GPU); back-propagation
on the CPU applies it in that factored form, one ``(B, 4H) × (4H, H_out)`` GEMM per step, no block filled.

Examples
--------
>>> import numpy as np
>>> lstm = LSTM(3, 5, num_layers=2, dtype=np.float64, rng=0)
>>> x = np.random.default_rng(1).standard_normal((7, 2, 3))      # (T, B, input)
>>> output, (h_n, c_n) = lstm(x)
>>> output.shape, h_n.shape, c_n.shape
((7, 2, 5), (2, 2, 5), (2, 2, 5))
>>> grads = lstm.backward(np.ones(output.shape), method="blelloch", grad_state=(None, np.ones(c_n.shape)))
>>> bp = lstm.backward(np.ones(output.shape), method="linear", grad_state=(None, np.ones(c_n.shape)))
>>> grads["input"].shape, grads["c0"].shape, bool(np.allclose(grads["weight_hh_l0"], bp["weight_hh_l0"]))
((7, 2, 3), (2, 2, 5), True)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .._types import Array, RngLike
from ._base import Cell, compiled_back_propagation, fill_blocks
from ._gru import sigmoid
from ._kernels import lstm_backward
from ._module import RecurrentModule, legacy_alias

__all__ = ["LSTM", "LSTMSteps"]


class LSTMSteps(Cell):
    """The LSTM cell over a sequence (see the module docstring); the state is ``(h, c)`` stacked."""

    gates = 4

    @property
    def state_size(self) -> int:
        return self.output_size + self.hidden_size

    def forward_steps(self, xp: ModuleType, gi: Array, state0: Array, p: dict[str, Array | None]
                      ) -> dict[str, Array]:
        size, out = self.hidden_size, self.output_size
        w_hh_t, b_hh, w_hr = p["weight_hh"].T, p["bias_hh"], p["weight_hr"]
        steps, batch = gi.shape[:2]
        saved = {key: xp.empty((steps, batch, size), dtype=gi.dtype)
                 for key in ("i", "f", "g", "o", "c", "tanh_c", "c_prev")}
        saved["h"] = xp.empty((steps, batch, out), dtype=gi.dtype)
        if w_hr is not None:
            saved["h_cell"] = xp.empty((steps, batch, size), dtype=gi.dtype)
        h, c = state0[:, :out], state0[:, out:]
        for t in range(steps):
            gates = gi[t] + h @ w_hh_t
            if b_hh is not None:
                gates += b_hh
            i, f = sigmoid(xp, gates[:, :size]), sigmoid(xp, gates[:, size:2 * size])
            g, o = xp.tanh(gates[:, 2 * size:3 * size]), sigmoid(xp, gates[:, 3 * size:])
            saved["c_prev"][t] = c
            c = f * c + i * g
            tanh_c = xp.tanh(c)
            h = o * tanh_c
            if w_hr is not None:
                saved["h_cell"][t] = h
                h = h @ w_hr.T
            for key, value in (("i", i), ("f", f), ("g", g), ("o", o), ("c", c), ("tanh_c", tanh_c),
                               ("h", h)):
                saved[key][t] = value
        return saved

    def final_state(self, xp: ModuleType, saved: dict[str, Array]) -> Array:
        return xp.concatenate([saved["h"][-1], saved["c"][-1]], axis=-1)

    def _coefficients(self, xp: ModuleType, saved: dict[str, Array]) -> tuple[Array, Array, Array]:
        """``(a_i, a_f, a_g)`` stacked ``(T, B, 3, H)``, ``a_o`` and ``δ``."""
        i, f, g, o, tanh_c = (saved[key] for key in ("i", "f", "g", "o", "tanh_c"))
        cell_gates = xp.stack([g * i * (1 - i), saved["c_prev"] * f * (1 - f), i * (1 - g * g)], axis=2)
        return cell_gates, tanh_c * o * (1 - o), o * (1 - tanh_c * tanh_c)

    def fill(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None], out: Array) -> None:
        size, rows = self.hidden_size, self.output_size
        cell_gates, a_o, delta = self._coefficients(xp, saved)
        weights_t = p["weight_hh"].reshape(4, size, rows).transpose(0, 2, 1)  # W_hk^T: (4, H_out, H)
        w_hr = p["weight_hr"]
        fill_blocks(weights_t[:3], cell_gates, out[:, :, :rows, rows:])  # U
        left = xp.concatenate([cell_gates * delta[:, :, None], a_o[:, :, None]], axis=2)
        out[:, :, rows:] = 0
        index = xp.arange(size)
        if w_hr is None:
            fill_blocks(weights_t, left, out[:, :, :rows, :rows])  # L
            out[:, :, rows + index, index] = saved["f"] * delta
        else:
            steps, batch = delta.shape[:2]
            full = xp.empty((steps, batch, rows, size), dtype=out.dtype)
            fill_blocks(weights_t, left, full)
            out[:, :, :rows, :rows] = full @ w_hr.T
            out[:, :, rows:, :rows] = (saved["f"] * delta)[:, :, :, None] * w_hr.T
        out[:, :, rows + index, rows + index] = saved["f"]

    def chain(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None],
              direct: Array) -> Array:
        """BP with the blocks in factored form: per step one GEMM ``(B, 4H) × (4H, H_out)``."""
        size, rows = self.hidden_size, self.output_size
        cell_gates, a_o, delta = self._coefficients(xp, saved)
        forget, w_hh, w_hr = saved["f"], xp.ascontiguousarray(p["weight_hh"]), p["weight_hr"]
        steps, batch = delta.shape[:2]
        affine = direct.ndim == 3
        totals = xp.empty((steps + 1, batch, rows + size), dtype=delta.dtype)
        totals[steps] = direct[steps - 1] if affine else direct
        gates = xp.empty((batch, 4, size), dtype=delta.dtype)
        for t in range(steps, 0, -1):
            grad_h, grad_c = totals[t][:, :rows], totals[t][:, rows:]
            grad_cell = grad_h if w_hr is None else grad_h @ w_hr
            grad_c_total = grad_c + delta[t - 1] * grad_cell
            xp.multiply(cell_gates[t - 1], grad_c_total[:, None, :], out=gates[:, :3])
            xp.multiply(a_o[t - 1], grad_cell, out=gates[:, 3])
            totals[t - 1][:, :rows] = gates.reshape(batch, 4 * size) @ w_hh
            totals[t - 1][:, rows:] = forget[t - 1] * grad_c_total
            if affine and t > 1:
                totals[t - 1] += direct[t - 2]
        return totals

    def back_propagate(self, saved: dict[str, Array], p: dict[str, Array | None], direct: Array
                       ) -> dict[str, Array]:
        w_hr, dtype = p["weight_hr"], saved["h"].dtype
        weight_hr, h_cell = (w_hr, saved["h_cell"]) if w_hr is not None else (np.empty((0, 0), dtype),
                                                                            np.empty((0, 0, 0), dtype))
        gates = tuple(saved[key] for key in ("i", "f", "g", "o", "tanh_c", "c_prev"))
        return compiled_back_propagation(lstm_backward, (weight_hr, *gates, h_cell), saved, p,
                                         direct, self.state_size, {"weight_hr": weight_hr.shape})

    def pre_activation_grads(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None],
                             totals: Array) -> tuple[Array, Array, dict[str, Array]]:
        rows, w_hr = self.output_size, p["weight_hr"]
        cell_gates, a_o, delta = self._coefficients(xp, saved)
        grad_h, grad_c = totals[:, :, :rows], totals[:, :, rows:]
        grad_cell = grad_h if w_hr is None else grad_h @ w_hr
        grad_c_total = grad_c + delta * grad_cell
        steps, batch, size = grad_c_total.shape
        grad_gates = xp.concatenate([cell_gates * grad_c_total[:, :, None], (a_o * grad_cell)[:, :, None]],
                                    axis=2).reshape(steps, batch, 4 * size)
        extra = {}
        if w_hr is not None:
            extra["weight_hr"] = grad_h.reshape(-1, rows).T @ saved["h_cell"].reshape(-1, size)
        return grad_gates, grad_gates, extra


class LSTM(RecurrentModule):
    """PyTorch's ``nn.LSTM`` with its backward as a scan (see :mod:`._module` for the two calling forms).

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
    proj_size : int
        ``0`` or the size ``H_out < hidden_size`` of the projected ``h`` (``weight_hr_l*``).
    dtype : numpy dtype, optional
        float32 (default) or float64.
    rng : numpy.random.Generator or int, optional
        Source of PyTorch's uniform initialisation ``U(-1/sqrt(H), 1/sqrt(H))``.
    name : str, optional
    seed : int, optional
        Of the dropout masks.
    """

    gates = 4
    weight_hr = legacy_alias("weight_hr")

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, *, dtype: Any = None, rng: RngLike = None, name: str | None = None,
                 seed: int | None = None) -> None:
        self._setup(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                    proj_size, dtype, rng, name, seed)

    def _cell(self) -> Cell:
        return LSTMSteps(self.hidden_size, self.output_size)

    def _state_parts(self) -> list[tuple[str, int]]:
        return [("h0", self.output_size), ("c0", self.hidden_size)]
