"""What :class:`~sparse_scan.recurrent.RNN`, :class:`~sparse_scan.recurrent.GRU` and
:class:`~sparse_scan.recurrent.LSTM` share: PyTorch's constructor, call, parameter names and layouts
(stacked layers, two directions, no biases, ``batch_first``, dropout, unbatched input), over one
:class:`~sparse_scan.recurrent._base.Run` per layer and direction.

Two calling forms:

- the module's call, PyTorch's: ``output, h_n = rnn(input, h0)`` (``(output, (h_n, c_n))`` for the
  LSTM) in the module's layout, then ``rnn.backward(grad_output, grad_state=grad_h_n)``, which returns
  ``input``, ``h0`` (``c0``) and every parameter's gradient by PyTorch's name;
- the layer form of the one-layer API: ``h = rnn.forward(x)`` with ``x`` batch-first, every top-layer
  output returned batch-first, then ``rnn.backward(grad_h)`` with ``grad_h`` ``(B, T, ·)`` or ``(B, ·)``
  (w.r.t. the last output only), returning ``h`` (total gradients w.r.t. the outputs), ``x``, ``h0``
  and the parameters (short names ``weight_ih``, ... for one layer and direction).

The backward scans top-down: each layer and direction is a scan over time of its state chain; a
layer's input gradient (both directions summed, through the dropout mask) is the direct gradient of
the layer below.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._checks import as_float_dtype, as_rng, flag, integer, number
from .._types import Array, RngLike
from ..engine.schedule import checked_levels
from ._base import Cell, Horizon, Run, cell_flops, resolve_levels

__all__ = ["RecurrentModule", "as_real_array", "copy_parameters", "legacy_alias"]

SHORT_NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")


def as_real_array(value: Any, label: str) -> Array:
    """``value`` as an array of its own backend (PyTorch tensors and nested lists as NumPy), refusing
    complex and non-numeric values."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    array = value if hasattr(value, "dtype") and hasattr(value, "ndim") else np.asarray(value)
    if array.dtype.kind not in "fiub":  # complex would lose its imaginary part
        raise ValueError(f"{label}: expected real numbers, got {array.dtype}")
    return array


def copy_parameters(owner: Any, given: dict[str, Any], shapes: dict[str, tuple[int, ...]], label: str,
                    shown: Callable[[str], str] = lambda key: key) -> None:
    """Set ``owner.<key>`` for every parameter, all or none: each must be given, real, of its shape
    and finite (cast to ``owner.dtype``); ``shown(key)`` is its name in messages."""
    unknown, missing = sorted(set(given) - set(shapes)), sorted(set(shapes) - set(given))
    if unknown or missing:
        raise ValueError(f"{label}: state_dict: unknown {unknown}, missing {missing}")
    checked = {}
    for key, value in given.items():
        array = np.asarray(as_real_array(value, f"{label}: {shown(key)}"))
        if array.shape != shapes[key]:
            raise ValueError(f"{label}: {shown(key)}: expected shape {shapes[key]}, got {array.shape}")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{label}: {shown(key)}: values must be finite")
        checked[key] = array.astype(owner.dtype)
    for key, array in checked.items():
        setattr(owner, key, array)


def legacy_alias(short: str) -> property:
    def get(self: "RecurrentModule") -> Array:
        return getattr(self, self._single_name(short))

    def set_(self: "RecurrentModule", value: Array) -> None:
        setattr(self, self._single_name(short), value)

    return property(get, set_, doc=f"``{short}_l0`` of a module of one layer and direction.")


class RecurrentModule:
    """Base of the PyTorch-style recurrent modules (see the module docstring for the two forms).

    Attributes
    ----------
    parameter_names : tuple of str
        PyTorch's names, in its order (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ...,
        ``weight_hr_l0`` with a projection, ``..._reverse`` for the second direction).
    training : bool
        Dropout between layers applies in training mode only (:meth:`train`, :meth:`eval`).
    dropout_masks : list
        The masks of the last forward, one per layer below the top (None where none applied).
    output_size : int
        Size of each direction's output ``h`` (``proj_size`` of a projected LSTM, else
        ``hidden_size``).
    state_size : int
        Size of the state each layer and direction scans over: ``output_size``, plus ``hidden_size``
        for the LSTM's cell state.
    """

    gates = 1
    weight_ih = legacy_alias("weight_ih")
    weight_hh = legacy_alias("weight_hh")
    bias_ih = legacy_alias("bias_ih")
    bias_hh = legacy_alias("bias_hh")

    def _setup(self, input_size: int, hidden_size: int, num_layers: int, bias: bool, batch_first: bool,
               dropout: float, bidirectional: bool, proj_size: int, dtype: Any, rng: RngLike,
               name: str | None, seed: int | None) -> None:
        label = f"layer {type(self).__name__}"
        self.input_size = integer(input_size, f"{label}: input_size", 1)
        self.hidden_size = integer(hidden_size, f"{label}: hidden_size", 1)
        self.num_layers = integer(num_layers, f"{label}: num_layers", 1)
        self.bias = flag(bias, f"{label}: bias")
        self.batch_first = flag(batch_first, f"{label}: batch_first")
        self.dropout = number(dropout, f"{label}: dropout", 0.0)
        if self.dropout > 1:
            raise ValueError(f"{label}: dropout: must be a probability in [0, 1], got {dropout!r}")
        self.bidirectional = flag(bidirectional, f"{label}: bidirectional")
        self.proj_size = integer(proj_size, f"{label}: proj_size", 0, self.hidden_size - 1,
                                 note=" (hidden_size - 1)")
        self.dtype = as_float_dtype(dtype, type(self).__name__)
        self.name = name
        self.training = True
        self.dropout_masks: list[Array | None] = []
        self._dropout_rng = np.random.default_rng(seed)
        self.num_directions = 2 if self.bidirectional else 1
        self.output_size = self.proj_size or self.hidden_size
        self.state_size = sum(size for _, size in self._state_parts())
        shapes = self.parameter_shapes()
        self.parameter_names = tuple(shapes)
        generator, bound = as_rng(rng), 1.0 / math.sqrt(self.hidden_size)  # PyTorch's initialisation
        for key, shape in shapes.items():
            setattr(self, key, generator.uniform(-bound, bound, shape).astype(self.dtype))
        self._runs = [[Run(self._cell(), self, self._names(layer, direction), self.dtype)
                       for direction in range(self.num_directions)] for layer in range(self.num_layers)]
        self._record: dict[str, Any] | None = None

    # parameters ----------------------------------------------------------------------------------
    def _cell(self) -> Cell:
        raise NotImplementedError

    def _names(self, layer: int, direction: int) -> dict[str, str]:
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        shorts = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if self.bias else []) + (
            ["weight_hr"] if self.proj_size else [])
        return {short: short + suffix for short in shorts}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """PyTorch's names and shapes of the parameters, in its order."""
        rows, out = self.gates * self.hidden_size, self.output_size
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in range(self.num_layers):
            columns = self.input_size if layer == 0 else out * self.num_directions
            for direction in range(self.num_directions):
                names = self._names(layer, direction)
                by_short = {"weight_ih": (rows, columns), "weight_hh": (rows, out), "bias_ih": (rows,),
                            "bias_hh": (rows,), "weight_hr": (self.proj_size, self.hidden_size)}
                shapes.update({full: by_short[short] for short, full in names.items()})
        return shapes

    def _single_name(self, short: str) -> str:
        if self.num_layers * self.num_directions != 1:
            raise AttributeError(f"layer {type(self).__name__}: {short}: a module of {self.num_layers} "
                                 f"layer(s) and {self.num_directions} direction(s) has no {short}; its "
                                 f"parameters are {', '.join(self.parameter_names)}")
        full = f"{short}_l0"
        if full not in self.parameter_names:
            raise AttributeError(f"layer {type(self).__name__}: no {short} (bias={self.bias}, "
                                 f"proj_size={self.proj_size})")
        return full

    def layer_form_key(self, name: str) -> str:
        """The key of parameter ``name`` in the gradients of the layer form (its short name for one
        layer and direction)."""
        return name.removesuffix("_l0") if self.num_layers * self.num_directions == 1 else name

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters by PyTorch's names (not copies)."""
        return {key: getattr(self, key) for key in self.parameter_names}

    def load_state_dict(self, values: dict[str, Any]) -> None:
        """Copy parameters in by PyTorch's names (``module.state_dict()`` of a PyTorch module works
        directly; a one-layer, one-direction module also takes ``weight_ih``, ...).

        Raises
        ------
        ValueError
            A name is unknown or missing, or a value has the wrong shape or is not finite.
        """
        shapes = self.parameter_shapes()
        single = self.num_layers * self.num_directions == 1
        given = {(f"{key}_l0" if single and key in SHORT_NAMES else key): value
                 for key, value in values.items()}
        copy_parameters(self, given, shapes, f"layer {type(self).__name__}",
                        (lambda key: key.split("_l")[0]) if single else (lambda key: key))

    def train(self, mode: bool = True) -> "RecurrentModule":
        """Training mode (dropout between layers applies) or not; returns the module."""
        self.training = flag(mode, f"layer {type(self).__name__}: train: mode")
        return self

    def eval(self) -> "RecurrentModule":
        """Evaluation mode: no dropout. Returns the module."""
        return self.train(False)

    # one layer and direction, as in the one-layer API ------------------------------------------------
    def _single_run(self) -> Run:
        if self.num_layers * self.num_directions != 1:
            raise ValueError(f"layer {type(self).__name__}: a module of {self.num_layers} layer(s) and "
                             f"{self.num_directions} direction(s) has one chain per layer and direction")
        return self._runs[0][0]

    def jacobian_factors(self) -> tuple[Array, Array, Array | None]:
        """Every ``(dh_t/dh_{t-1})^T`` of the last forward of a one-layer, one-direction module in
        factored form ``(weights_t, coefficients, diagonal)``: see :meth:`Run.jacobian_factors`."""
        return self._single_run().jacobian_factors()

    def transposed_jacobians(self, threads: int | None = None) -> Array:
        """Every ``(ds_t/ds_{t-1})^T`` of the last forward of a one-layer, one-direction module,
        time-major ``(T, B, S, S)``."""
        return self._single_run().transposed_jacobians(threads)

    def factored_chain(self, direct: Array) -> Array:
        """BP through the factored blocks of a one-layer, one-direction module: ``(T + 1, B, S)``."""
        return self._single_run().factored_chain(direct)

    def scan_cell_flops(self) -> tuple[int, ...]:
        """Per layer and direction, in the order the backward scans them (layers from the top, each
        direction), the FLOPs per step and sample of its cell's gradients (:func:`cell_flops`)."""
        return tuple(cell_flops(run.cell, self.input_size if layer == 0 else self.output_size * len(runs))
                     for layer, runs in reversed(list(enumerate(self._runs))) for run in runs)

    @property
    def horizon(self) -> Horizon | None:
        """Where the last back-propagation on the CPU of the top layer's forward direction stopped
        from a loss on its last state alone (:class:`~sparse_scan.recurrent._base.Horizon`; None
        before one)."""
        return self._runs[-1][0].horizon

    # states --------------------------------------------------------------------------------------------
    def _state_parts(self) -> list[tuple[str, int]]:
        """Names and sizes of the state's parts (``h``, and ``c`` for the LSTM)."""
        return [("h0", self.output_size)]

    def _states(self, hx: Any, batch: int, be: _backend.Backend, layer_form: bool,
                batched: bool) -> list[Array]:
        """The initial state ``(B, S)`` of every layer and direction, from PyTorch's ``hx`` (the
        layer form also takes ``(B, ·)`` parts for one layer and direction)."""
        label = f"layer {type(self).__name__}"
        xp, runs = be.xp, self.num_layers * self.num_directions
        parts = self._state_parts()
        if hx is None:
            return [xp.zeros((batch, sum(size for _, size in parts)), dtype=self.dtype)] * runs
        values = hx if len(parts) > 1 else (hx,)
        if len(parts) > 1 and (not isinstance(hx, (tuple, list)) or len(hx) != len(parts)):
            raise ValueError(f"{label}: hx: expected a pair (h0, c0), got {type(hx).__name__}")
        arrays = []
        for (field, size), value in zip(parts, values, strict=True):
            array = as_real_array(value, f"{label}: {field}")
            if layer_form and runs == 1 and array.ndim == 2:
                array = array[None]
            elif not batched:
                expected = (runs, size)
                if tuple(array.shape) != expected:
                    raise ValueError(f"{label}: {field}: expected {expected} for unbatched input, got "
                                     f"{tuple(array.shape)}")
                array = array[:, None]
            expected = (runs, batch, size)
            if tuple(array.shape) != expected:
                shown = f"({batch}, {size}) or {expected}" if layer_form and runs == 1 else f"{expected}"
                raise ValueError(f"{label}: {field}: expected {shown}, got {tuple(array.shape)}")
            array = be.asarray(array, dtype=self.dtype)
            if not bool(xp.all(xp.isfinite(array))):  # sync: the check must raise before the state is used
                raise ValueError(f"{label}: {field}: values must be finite")
            arrays.append(array)
        joined = arrays[0] if len(arrays) == 1 else xp.concatenate(arrays, axis=-1)
        return [joined[k] for k in range(runs)]

    def _split_state(self, xp: ModuleType, states: list[Array]) -> list[Array]:
        """Per state part, the stack ``(L*D, B, size)`` of the runs' states ``(B, S)``."""
        stacked, start, out = xp.stack(states), 0, []
        for _, size in self._state_parts():
            out.append(stacked[:, :, start:start + size])
            start += size
        return out

    # forward ---------------------------------------------------------------------------------------------
    def _sequence(self, input: Any, layer_form: bool) -> tuple[Array, bool]:
        """The input as a time-major ``(T, B, input_size)`` array of this dtype, and whether it was
        batched."""
        label = f"layer {type(self).__name__}"
        x = as_real_array(input, f"{label}: input")
        xp = _backend.of(x).xp
        size = self.input_size
        if layer_form:
            if x.ndim != 3 or x.shape[2] != size or x.shape[1] < 1:
                raise ValueError(f"{label}: input: expected (batch, time, {size}) with time >= 1, "
                                 f"got {tuple(x.shape)}")
            steps = x.transpose(1, 0, 2)
        else:
            layout = "(batch, time" if self.batch_first else "(time, batch"
            if x.ndim not in (2, 3) or x.shape[-1] != size or x.shape[1 if x.ndim == 3 and self.batch_first
                                                                         else 0] < 1:
                raise ValueError(f"{label}: input: expected {layout}, {size}) or unbatched (time, {size}) "
                                 f"with time >= 1, got {tuple(x.shape)}")
            steps = x[:, None] if x.ndim == 2 else x.transpose(1, 0, 2) if self.batch_first else x
        if not bool(xp.all(xp.isfinite(x))):
            raise ValueError(f"{label}: input: values must be finite")
        return xp.ascontiguousarray(xp.asarray(steps, dtype=self.dtype)), x.ndim == 3

    def _dropout_mask(self, be: _backend.Backend, shape: tuple[int, ...]) -> Array:
        """Bernoulli(1 - p) / (1 - p), drawn on the host from the module's seeded generator."""
        keep = 1.0 - self.dropout
        draws = self._dropout_rng.random(shape)
        mask = (draws < keep) / keep if keep > 0 else np.zeros(shape)
        return be.asarray(mask, dtype=self.dtype)

    def _run_forward(self, x: Array, states: list[Array]) -> tuple[Array, list[Array]]:
        be = _backend.of(x)
        xp = be.xp
        layer_input, finals, masks = x, [], []
        for layer, runs in enumerate(self._runs):
            outputs = []
            for direction, run in enumerate(runs):
                sequence = layer_input if direction == 0 else xp.ascontiguousarray(layer_input[::-1])
                out, final = run.forward(sequence, states[layer * self.num_directions + direction])
                outputs.append(out if direction == 0 else out[::-1])
                finals.append(final)
            output = outputs[0] if len(outputs) == 1 else xp.concatenate(outputs, axis=-1)
            mask = None
            if layer < self.num_layers - 1 and self.training and self.dropout > 0:
                mask = self._dropout_mask(be, output.shape)
                output = output * mask
            masks.append(mask)
            layer_input = output
        self.dropout_masks = masks[:-1]
        return layer_input, finals

    def __call__(self, input: Any, hx: Any = None) -> tuple[Array, Array | tuple[Array, ...]]:
        """PyTorch's forward: ``(output, h_n)``, or ``(output, (h_n, c_n))`` for the LSTM.

        Parameters
        ----------
        input : ndarray
            ``(T, B, input_size)``, ``(B, T, input_size)`` with ``batch_first``, or unbatched
            ``(T, input_size)``; NumPy (CPU) or CuPy (GPU).
        hx : ndarray or pair of ndarrays, optional
            ``h0`` ``(num_layers * D, B, H_out)`` (unbatched ``(num_layers * D, H_out)``), and for the
            LSTM ``c0`` ``(num_layers * D, B, hidden_size)``; zeros by default.
        """
        x, batched = self._sequence(input, layer_form=False)
        be = _backend.of(x)
        states = self._states(hx, x.shape[1], be, False, batched)
        output, finals = self._run_forward(x, states)
        self._record = {"layer_form": False, "batched": batched, "shape": x.shape}
        if not batched:
            output = output[:, 0]
        elif self.batch_first:
            output = be.xp.ascontiguousarray(output.transpose(1, 0, 2))
        parts = self._split_state(be.xp, finals)
        if not batched:
            parts = [part[:, 0] for part in parts]
        return output, (parts[0] if len(parts) == 1 else tuple(parts))

    def forward(self, x: Any, h0: Any = None) -> Array:
        """The layer form (the one-layer API): ``x`` batch-first ``(B, T, input_size)``; returns the
        top layer's outputs batch-first ``(B, T, D * H_out)``.

        ``h0`` is ``(B, H_out)`` for one layer and direction, else ``(num_layers * D, B, H_out)``
        (a pair with ``c0`` for the LSTM); zeros by default.
        """
        steps, _ = self._sequence(x, layer_form=True)
        be = _backend.of(steps)
        states = self._states(h0, steps.shape[1], be, True, True)
        output, _ = self._run_forward(steps, states)
        self._record = {"layer_form": True, "batched": True, "shape": steps.shape}
        return be.xp.ascontiguousarray(output.transpose(1, 0, 2))

    # backward ------------------------------------------------------------------------------------------
    def _direct(self, xp: ModuleType, dense: Array | None, last: Array | None, final: Array | None,
                direction: int, shape: tuple[int, int, int]) -> Array:
        """The direct gradient of one run in processing order: ``(T, B, S)``, or ``(B, S)`` when only
        its last state has one."""
        steps, batch, state = shape
        size = self.output_size
        columns = slice(direction * size, (direction + 1) * size)
        out = None
        if dense is not None or (last is not None and direction == 1):
            out = xp.zeros((steps, batch, state), dtype=self.dtype)
            if dense is not None:
                out[:, :, :size] = dense[:, :, columns] if direction == 0 else dense[::-1, :, columns]
            if last is not None:  # the output at the last time is the reverse direction's first state
                out[0, :, :size] += last[:, columns]
            if final is not None:
                out[-1] += final
            return out
        out = xp.zeros((batch, state), dtype=self.dtype)
        if last is not None:
            out[:, :size] += last[:, columns]
        if final is not None:
            out += final
        return out

    def _backward_runs(self, dense: Array | None, last: Array | None, finals: list[Array | None],
                       method: str, levels: int | None, threads: int | None
                       ) -> tuple[Array, list[Array], dict[str, Array], Array]:
        """Top-down over layers; returns the input gradient (time-major), every run's initial-state
        gradient, the parameters' gradients by full name and the top layer's total output gradients."""
        params: dict[str, Array] = {}
        starts: list[Array | None] = [None] * (self.num_layers * self.num_directions)
        top = None
        grad_input = None
        for layer in reversed(range(self.num_layers)):
            grad_input, outputs = None, []
            for direction, run in enumerate(self._runs[layer]):
                index = layer * self.num_directions + direction
                xp = _backend.of(run.saved["h"]).xp
                steps, batch = run.saved["h"].shape[:2]
                direct = self._direct(xp, dense, last, finals[index], direction,
                                      (steps, batch, run.cell.state_size))
                result = run.backward(direct, method, levels, threads)
                grad_x = result.pop("x") if direction == 0 else result.pop("x")[::-1]
                grad_input = grad_x if grad_input is None else grad_input + grad_x
                totals = result.pop("state")
                starts[index] = totals[0]
                outputs.append(totals[1:, :, :self.output_size][::1 if direction == 0 else -1])
                params.update({run.names[short]: value for short, value in result.items()})
            if layer == self.num_layers - 1:
                top = outputs[0] if len(outputs) == 1 else xp.concatenate(outputs, axis=-1)
            if layer > 0 and self.dropout_masks[layer - 1] is not None:
                grad_input = grad_input * self.dropout_masks[layer - 1]
            dense, last = grad_input, None
        return grad_input, starts, params, top

    def _gradient_array(self, value: Any, field: str, expected: tuple[int, ...], be: _backend.Backend,
                        extra: str = "") -> Array:
        label = f"layer {type(self).__name__}"
        array = as_real_array(value, f"{label}: {field}")
        if tuple(array.shape) != expected:
            raise ValueError(f"{label}: {field}: expected {expected}{extra}, got {tuple(array.shape)}")
        return be.asarray(array, dtype=self.dtype)

    def backward(self, grad: Any = None, method: str = "blelloch", levels: int | str | None = None,
                 threads: int | None = None, *, grad_state: Any = None) -> dict[str, Array]:
        """Gradients of a loss through the last forward, by a scan per layer and direction.

        Parameters
        ----------
        grad : ndarray, optional
            After the module's call: the loss's gradient w.r.t. ``output`` (its shape). After the
            layer form (:meth:`forward`): w.r.t. every output ``(B, T, D * H_out)``, or w.r.t. the
            last one only ``(B, D * H_out)``. None: the loss reaches the final states only.
        method : {"blelloch", "linear", "hybrid"}
            ``linear`` is back-propagation through time emulated with the Jacobians.
        levels : int or "auto", optional
            Up-sweep levels of ``hybrid``; ``"auto"`` picks them from the scan's cost model.
        threads : int, optional
            CPU threads sharing each scan level.
        grad_state : ndarray or pair, optional
            The loss's gradient w.r.t. ``h_n`` (and ``c_n``: a pair, either may be None), shaped like
            them.

        Returns
        -------
        dict
            After the call: ``input``, ``h0`` (and ``c0``) shaped like them, and every parameter by
            PyTorch's name. After the layer form: ``h`` (total gradients w.r.t. the outputs,
            batch-first), ``x``, ``h0`` (``c0``) and the parameters, by their short names
            (``weight_ih``, ...) for one layer and direction.
        """
        label = f"layer {type(self).__name__}"
        if self._record is None:
            raise RuntimeError(f"{label}: call forward before backward")
        be = _backend.of(self._runs[0][0].saved["h"])
        xp = be.xp
        layer_form, batched = self._record["layer_form"], self._record["batched"]
        steps, batch, _ = self._record["shape"]
        width = self.num_directions * self.output_size
        state_size = self._runs[0][0].cell.state_size
        levels = resolve_levels(method, levels, steps, batch, state_size, be.name, self.scan_cell_flops())
        levels = checked_levels(steps, method, levels, unit="time steps")
        dense = last = None
        if grad is not None:
            if layer_form:
                array = as_real_array(grad, f"{label}: grad_h")
                if tuple(array.shape) not in ((batch, steps, width), (batch, width)):
                    raise ValueError(f"{label}: grad_h: expected ({batch}, {steps}, {width}) or "
                                     f"({batch}, {width}), got {tuple(array.shape)}")
                array = be.asarray(array, dtype=self.dtype)
                if array.ndim == 2:
                    last = array
                else:
                    dense = xp.ascontiguousarray(array.transpose(1, 0, 2))
            else:
                shape = ((batch, steps) if self.batch_first else (steps, batch)) if batched else (steps,)
                array = self._gradient_array(grad, "grad_output", shape + (width,), be)
                dense = array[:, None] if not batched else (
                    xp.ascontiguousarray(array.transpose(1, 0, 2)) if self.batch_first else array)
        finals = self._final_gradients(grad_state, batch, be, layer_form, batched)
        grad_input, starts, params, top = self._backward_runs(dense, last, finals, method, levels, threads)
        parts = self._split_state(xp, starts)
        names = [field for field, _ in self._state_parts()]
        single = self.num_layers * self.num_directions == 1
        if layer_form:
            out = {"h": xp.ascontiguousarray(top.transpose(1, 0, 2)),
                   "x": xp.ascontiguousarray(grad_input.transpose(1, 0, 2))}
            out.update({field: part[0] if single else part for field, part in zip(names, parts, strict=True)})
            out.update({self.layer_form_key(key): params[key] for key in self.parameter_names})
            return out
        if not batched:
            grad_input, parts = grad_input[:, 0], [part[:, 0] for part in parts]
        elif self.batch_first:
            grad_input = xp.ascontiguousarray(grad_input.transpose(1, 0, 2))
        out = {"input": grad_input}
        out.update(dict(zip(names, parts, strict=True)))
        out.update({key: params[key] for key in self.parameter_names})
        return out

    def _final_gradients(self, grad_state: Any, batch: int, be: _backend.Backend, layer_form: bool,
                         batched: bool) -> list[Array | None]:
        """Per run, the gradient w.r.t. its final state ``(B, S)``, or None."""
        runs = self.num_layers * self.num_directions
        if grad_state is None:
            return [None] * runs
        parts = self._state_parts()
        values = grad_state if len(parts) > 1 else (grad_state,)
        if len(parts) > 1 and (not isinstance(grad_state, (tuple, list)) or len(grad_state) != len(parts)):
            raise ValueError(f"layer {type(self).__name__}: grad_state: expected a pair (grad_h_n, grad_c_n)")
        arrays = []
        for (field, size), value in zip(parts, values, strict=True):
            name = f"grad_{field[0]}_n"
            if value is None:
                arrays.append(be.xp.zeros((runs, batch, size), dtype=self.dtype))
                continue
            if layer_form and runs == 1:
                array = self._gradient_array(value, name, (batch, size), be, f" or {(1, batch, size)}") \
                    if as_real_array(value, name).ndim == 2 else \
                    self._gradient_array(value, name, (1, batch, size), be)
                arrays.append(array if array.ndim == 3 else array[None])
            elif batched:
                arrays.append(self._gradient_array(value, name, (runs, batch, size), be))
            else:
                arrays.append(self._gradient_array(value, name, (runs, size), be)[:, None])
        joined = arrays[0] if len(arrays) == 1 else be.xp.concatenate(arrays, axis=-1)
        return [joined[k] for k in range(runs)]

