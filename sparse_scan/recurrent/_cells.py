"""One step of a recurrent cell, PyTorch's ``nn.RNNCell``/``nn.GRUCell``/``nn.LSTMCell``, and
:class:`CellSequence`, which back-propagates a user's own loop over a cell with the scan.

A cell's call is one step (``h' = cell(x, h)``, ``(h', c') = cell(x, (h, c))``); its
:meth:`~RNNCell.backward` is the scan of a one-step chain. A loop written with a
:class:`CellSequence` records every step; its backward stacks them into one chain over time and runs
the same engine as :class:`~sparse_scan.recurrent.RNN` (any schedule, CPU or GPU).

Examples
--------
>>> import numpy as np
>>> cell = LSTMCell(3, 4, dtype=np.float64, rng=0)
>>> loop = CellSequence(cell)
>>> x = np.random.default_rng(0).standard_normal((6, 2, 3))     # (T, B, input)
>>> state, outputs = None, []
>>> for x_t in x:
...     state = loop(x_t, state)
...     outputs.append(state[0])
>>> grads = loop.backward([np.ones((2, 4))] * 6, method="blelloch")   # loss = sum of every h_t
>>> bp = loop.backward([np.ones((2, 4))] * 6, method="linear")
>>> grads["input"].shape, sorted(grads)[:3], bool(np.allclose(grads["weight_hh"], bp["weight_hh"]))
((6, 2, 3), ['bias_hh', 'bias_ih', 'c0'], True)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .. import backend as _backend
from .._checks import as_float_dtype, as_rng, flag, integer
from .._types import Array, RngLike
from ..engine.schedule import checked_levels
from ._base import Cell, Run, cell_flops, resolve_levels
from ._gru import GRUSteps
from ._lstm import LSTMSteps
from ._module import as_real_array, copy_parameters
from ._rnn import ElmanSteps, check_nonlinearity

__all__ = ["CellSequence", "GRUCell", "LSTMCell", "RNNCell"]


class RecurrentCell:
    """Base of the cells: parameters ``weight_ih``, ``weight_hh`` (and ``bias_ih``, ``bias_hh``) in
    PyTorch's shapes, one step per call, its backward by a scan of one step."""

    gates = 1

    def _setup(self, input_size: int, hidden_size: int, bias: bool, dtype: Any, rng: RngLike,
               name: str | None) -> None:
        label = f"layer {type(self).__name__}"
        self.input_size = integer(input_size, f"{label}: input_size", 1)
        self.hidden_size = integer(hidden_size, f"{label}: hidden_size", 1)
        self.bias = flag(bias, f"{label}: bias")
        self.dtype = as_float_dtype(dtype, type(self).__name__)
        self.name = name
        shapes = self.parameter_shapes()
        self.parameter_names = tuple(shapes)
        generator, bound = as_rng(rng), 1.0 / math.sqrt(self.hidden_size)  # PyTorch's initialisation
        for key, shape in shapes.items():
            setattr(self, key, generator.uniform(-bound, bound, shape).astype(self.dtype))
        self.run = Run(self._cell(), self, {key: key for key in shapes}, self.dtype)
        self._record: dict[str, Any] | None = None

    def _cell(self) -> Cell:
        raise NotImplementedError

    def _state_parts(self) -> list[tuple[str, int]]:
        return [("h0", self.hidden_size)]

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """PyTorch's names and shapes of the parameters, in its order."""
        rows = self.gates * self.hidden_size
        shapes = {"weight_ih": (rows, self.input_size), "weight_hh": (rows, self.hidden_size)}
        if self.bias:
            shapes.update(bias_ih=(rows,), bias_hh=(rows,))
        return shapes

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters by PyTorch's names (not copies)."""
        return {key: getattr(self, key) for key in self.parameter_names}

    def load_state_dict(self, values: dict[str, Any]) -> None:
        """Copy parameters in by PyTorch's names (a PyTorch cell's ``state_dict()`` works directly).

        Raises
        ------
        ValueError
            A name is unknown or missing, or a value has the wrong shape or is not finite.
        """
        copy_parameters(self, dict(values), self.parameter_shapes(), f"layer {type(self).__name__}")

    # states ------------------------------------------------------------------------------------------
    def step_input(self, input: Any) -> tuple[Array, bool]:
        """The input as ``(1, B, input_size)`` of this dtype, and whether it was batched."""
        label = f"layer {type(self).__name__}"
        x = as_real_array(input, f"{label}: input")
        if x.ndim not in (1, 2) or x.shape[-1] != self.input_size:
            raise ValueError(f"{label}: input: expected (batch, {self.input_size}) or unbatched "
                             f"({self.input_size},), got {tuple(x.shape)}")
        xp = _backend.of(x).xp
        if not bool(xp.all(xp.isfinite(x))):
            raise ValueError(f"{label}: input: values must be finite")
        x = xp.asarray(x, dtype=self.dtype)
        return xp.ascontiguousarray(x[None, None] if x.ndim == 1 else x[None]), x.ndim == 2

    def step_state(self, hx: Any, batch: int, batched: bool, be: _backend.Backend) -> Array:
        """The state before the step, ``(B, S)`` (zeros for None)."""
        label = f"layer {type(self).__name__}"
        parts = self._state_parts()
        if hx is None:
            return be.xp.zeros((batch, sum(size for _, size in parts)), dtype=self.dtype)
        if len(parts) > 1 and (not isinstance(hx, (tuple, list)) or len(hx) != len(parts)):
            raise ValueError(f"{label}: hx: expected a pair (h0, c0), got {type(hx).__name__}")
        arrays = []
        for (field, size), value in zip(parts, hx if len(parts) > 1 else (hx,), strict=True):
            array = as_real_array(value, f"{label}: {field}")
            expected = (batch, size) if batched else (size,)
            if tuple(array.shape) != expected:
                raise ValueError(f"{label}: {field}: expected {expected}, got {tuple(array.shape)}")
            array = be.asarray(array, dtype=self.dtype)
            if not bool(be.xp.all(be.xp.isfinite(array))):  # sync: the check must raise before use
                raise ValueError(f"{label}: {field}: values must be finite")
            arrays.append(array if batched else array[None])
        return arrays[0] if len(arrays) == 1 else be.xp.concatenate(arrays, axis=-1)

    def returned_state(self, final: Array, batched: bool) -> Array | tuple[Array, ...]:
        """The state after a step as the call returns it (``h``, or the pair ``(h, c)``)."""
        parts, start, out = self._state_parts(), 0, []
        for _, size in parts:
            part = final[:, start:start + size]
            out.append(part if batched else part[0])
            start += size
        return out[0] if len(out) == 1 else tuple(out)

    def step_gradient(self, grad: Any, batch: int, batched: bool, be: _backend.Backend,
                      label: str) -> Array | None:
        """A gradient w.r.t. a returned state (an array, or a pair for the LSTM, parts may be None)
        as ``(B, S)``, or None."""
        if grad is None:
            return None
        parts = self._state_parts()
        if len(parts) > 1 and not isinstance(grad, (tuple, list)):
            grad = (grad, None)  # an array alone: the gradient w.r.t. h
        values = grad if len(parts) > 1 else (grad,)
        if len(values) != len(parts):
            raise ValueError(f"layer {type(self).__name__}: {label}: expected a pair (grad_h, grad_c)")
        arrays = []
        for (field, size), value in zip(parts, values, strict=True):
            name = f"{label} (w.r.t. {field[0]})"
            if value is None:
                arrays.append(be.xp.zeros((batch, size), dtype=self.dtype))
                continue
            array = as_real_array(value, f"layer {type(self).__name__}: {name}")
            expected = (batch, size) if batched else (size,)
            if tuple(array.shape) != expected:
                raise ValueError(f"layer {type(self).__name__}: {name}: expected {expected}, "
                                 f"got {tuple(array.shape)}")
            array = be.asarray(array, dtype=self.dtype)
            arrays.append(array if batched else array[None])
        return arrays[0] if len(arrays) == 1 else be.xp.concatenate(arrays, axis=-1)

    def gradients(self, run: Run, direct: Array, batched: bool, steps_axis: bool, method: str,
                  levels: int | str | None, threads: int | None) -> dict[str, Array]:
        """Backward of ``run`` (the steps it holds) as ``input``, ``h0`` (``c0``) and the parameters."""
        saved = run.saved
        be = _backend.of(saved["h"])
        steps, batch = saved["h"].shape[:2]
        levels = resolve_levels(method, levels, steps, batch, run.cell.state_size, be.name,
                                (cell_flops(run.cell, saved["x"].shape[-1]),))
        levels = checked_levels(steps, method, levels, unit="time steps")
        result = run.backward(direct, method, levels, threads)
        grad_x = result.pop("x")
        grad_x = (grad_x if steps_axis else grad_x[0]) if batched else (grad_x[:, 0] if steps_axis
                                                                        else grad_x[0, 0])
        out = {"input": grad_x}
        start, first = 0, result.pop("state")[0]
        for field, size in self._state_parts():
            part = first[:, start:start + size]
            out[field] = part if batched else part[0]
            start += size
        out.update({key: result[key] for key in self.parameter_names})
        return out

    # one step --------------------------------------------------------------------------------------
    def __call__(self, input: Any, hx: Any = None) -> Array | tuple[Array, ...]:
        """One step: ``h'`` (``(h', c')`` for the LSTM cell) from ``input`` ``(B, input_size)`` or
        unbatched ``(input_size,)`` and ``hx`` (zeros by default), NumPy or CuPy."""
        x, batched = self.step_input(input)
        be = _backend.of(x)
        state0 = self.step_state(hx, x.shape[1], batched, be)
        _, final = self.run.forward(x, state0)
        self._record = {"batched": batched}
        return self.returned_state(final, batched)

    def backward(self, grad: Any = None, method: str = "blelloch", levels: int | str | None = None,
                 threads: int | None = None) -> dict[str, Array]:
        """Gradients through the last step.

        Parameters
        ----------
        grad : ndarray or pair, optional
            The loss's gradient w.r.t. the returned state (a pair ``(grad_h, grad_c)`` for the LSTM
            cell; either may be None).
        method, levels, threads
            Of the scan (over one step: every schedule gives the same result).

        Returns
        -------
        dict
            ``input``, ``h0`` (and ``c0``) shaped like them, and every parameter by PyTorch's name.
        """
        if self._record is None:
            raise RuntimeError(f"layer {type(self).__name__}: call the cell before backward")
        batched = self._record["batched"]
        be = _backend.of(self.run.saved["h"])
        batch = self.run.saved["h"].shape[1]
        direct = self.step_gradient(grad, batch, batched, be, "grad")
        if direct is None:
            direct = be.xp.zeros((batch, self.run.cell.state_size), dtype=self.dtype)
        return self.gradients(self.run, direct, batched, False, method, levels, threads)


class RNNCell(RecurrentCell):
    """PyTorch's ``nn.RNNCell``: ``h' = φ(W_ih x + b_ih + W_hh h + b_hh)``.

    Parameters
    ----------
    input_size, hidden_size : int
    bias : bool
    nonlinearity : {"tanh", "relu"}
    dtype : numpy dtype, optional
        float32 (default) or float64.
    rng : numpy.random.Generator or int, optional
        Source of PyTorch's uniform initialisation ``U(-1/sqrt(H), 1/sqrt(H))``.
    name : str, optional
    """

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh", *,
                 dtype: Any = None, rng: RngLike = None, name: str | None = None) -> None:
        self.nonlinearity = check_nonlinearity(nonlinearity, type(self).__name__)
        self._setup(input_size, hidden_size, bias, dtype, rng, name)

    def _cell(self) -> Cell:
        return ElmanSteps(self.hidden_size, self.nonlinearity)


class GRUCell(RecurrentCell):
    """PyTorch's ``nn.GRUCell`` (gate layout ``[r, z, n]``; parameters as :class:`RNNCell`'s)."""

    gates = 3

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, *, dtype: Any = None,
                 rng: RngLike = None, name: str | None = None) -> None:
        self._setup(input_size, hidden_size, bias, dtype, rng, name)

    def _cell(self) -> Cell:
        return GRUSteps(self.hidden_size)


class LSTMCell(RecurrentCell):
    """PyTorch's ``nn.LSTMCell`` (gate layout ``[i, f, g, o]``): ``(h', c') = cell(x, (h, c))``."""

    gates = 4

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, *, dtype: Any = None,
                 rng: RngLike = None, name: str | None = None) -> None:
        self._setup(input_size, hidden_size, bias, dtype, rng, name)

    def _cell(self) -> Cell:
        return LSTMSteps(self.hidden_size)

    def _state_parts(self) -> list[tuple[str, int]]:
        return [("h0", self.hidden_size), ("c0", self.hidden_size)]


class CellSequence:
    """Records a loop over one cell and back-propagates it through the scan.

    Each call is one step of the cell; the state passed to a step must be the one the previous step
    returned (the loop is then a chain over time, scanned like a one-layer module), the first
    step's may be anything (zeros for None).

    Parameters
    ----------
    cell : RNNCell, GRUCell or LSTMCell
    """

    def __init__(self, cell: RecurrentCell) -> None:
        self.cell = cell
        self.run = Run(cell.run.cell, cell, cell.run.names, cell.dtype)
        self.reset()

    def reset(self) -> None:
        """Forget the recorded steps (start a new sequence)."""
        self._steps: list[dict[str, Array]] = []
        self._returned: Array | tuple[Array, ...] | None = None
        self._batched: bool | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def _continues(self, hx: Any) -> bool:
        previous = self._returned
        if isinstance(previous, tuple):
            return isinstance(hx, (tuple, list)) and len(hx) == len(previous) and all(
                a is b for a, b in zip(hx, previous, strict=True))
        return hx is previous

    def __call__(self, input: Any, hx: Any = None) -> Array | tuple[Array, ...]:
        """One step of the cell, recorded; returns what the cell returns."""
        cell = self.cell
        x, batched = cell.step_input(input)
        be = _backend.of(x)
        if self._steps:
            if not self._continues(hx):
                raise ValueError(f"CellSequence: step {len(self._steps)}: hx must be the state step "
                                 f"{len(self._steps) - 1} returned (call reset() to start a new sequence)")
            if batched != self._batched:
                raise ValueError(f"CellSequence: step {len(self._steps)}: batched and unbatched steps mixed")
        state0 = self._final if self._steps else cell.step_state(hx, x.shape[1], batched, be)
        _, final = self.run.forward(x, state0)
        self._steps.append(self.run.saved)
        self._final, self._batched = final, batched
        self._returned = cell.returned_state(final, batched)
        return self._returned

    def backward(self, grads: Sequence[Any] | Any = None, method: str = "blelloch",
                 levels: int | str | None = None, threads: int | None = None) -> dict[str, Array]:
        """Gradients through every recorded step, by one scan over them.

        Parameters
        ----------
        grads : list or ndarray, optional
            Per step, the loss's gradient w.r.t. the state it returned (None where there is none; a
            pair ``(grad_h, grad_c)`` or ``grad_h`` alone for the LSTM cell), or the gradients w.r.t.
            every returned ``h`` stacked ``(T, B, H)`` (``(T, H)`` unbatched).
        method, levels, threads
            Of the scan.

        Returns
        -------
        dict
            ``input`` stacked over the steps ``(T, B, input_size)``, ``h0`` (``c0``) of the first
            step's state, and every parameter by PyTorch's name.
        """
        if not self._steps:
            raise RuntimeError("CellSequence: no step recorded: call it before backward")
        steps = len(self._steps)
        be = _backend.of(self._steps[0]["h"])
        xp = be.xp
        batch = self._steps[0]["h"].shape[1]
        size = self.run.cell.state_size
        if grads is None:
            grads = [None] * steps
        elif not isinstance(grads, (list, tuple)):
            array = as_real_array(grads, "CellSequence: grads")
            if array.shape[:1] != (steps,):
                raise ValueError(f"CellSequence: grads: expected {steps} steps, got {tuple(array.shape)}")
            grads = list(array)
        if len(grads) != steps:
            raise ValueError(f"CellSequence: grads: expected {steps} entries, one per step, got {len(grads)}")
        direct = xp.zeros((steps, batch, size), dtype=self.cell.dtype)
        for t, grad in enumerate(grads):
            value = self.cell.step_gradient(grad, batch, self._batched, be, f"grads[{t}]")
            if value is not None:
                direct[t] = value
        self.run.load({key: xp.concatenate([step[key] for step in self._steps]) for key in self._steps[0]})
        return self.cell.gradients(self.run, direct, self._batched, True, method, levels, threads)
