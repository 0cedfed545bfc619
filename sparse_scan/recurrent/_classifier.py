"""The paper's recurrent classifier (§4.1): a recurrent layer, then softmax over a linear map of the
last hidden state (or of the mean of the hidden states over time), trained with cross-entropy; and its
schedules.

:class:`RecurrentClassifier` is a :class:`~sparse_scan.model.Model`, as a
:class:`~sparse_scan.Sequential` is (``forward``, ``backward`` returning the gradient w.r.t. every
activation, ``parameter_gradients``, ``plan``, ``state_dict``/``load_state_dict``, ``shapes``,
``train``/``eval``), so the command line, :mod:`sparse_scan.train`, :mod:`sparse_scan.flops` and
:mod:`sparse_scan.optim` take it as they take a CNN; a model spec whose first layer is recurrent loads
as one (:func:`sparse_scan.load_model`).

Examples
--------
>>> import numpy as np
>>> from sparse_scan.optim import Adam
>>> from sparse_scan.recurrent import RNN, Bitstream
>>> from sparse_scan.train import train_iterations
>>> model = RecurrentClassifier(RNN(1, 8, rng=0), classes=10, rng=1)
>>> sorted(model.state_dict())[:3]
['fc.bias', 'fc.weight', 'rnn.bias_hh_l0']
>>> records = train_iterations(model, Bitstream(steps=30, samples=64), Adam(model, lr=1e-2),
...                            iterations=3, batch_size=16)
>>> [r["iteration"] for r in records]
[0, 1, 2]

The model's calls: the gradient w.r.t. the input, every hidden state of the top layer and the
logits, then the parameters'; ``plan`` states the schedule ``method="auto"`` runs.

>>> x = Bitstream(steps=30, samples=4).batch(range(4))[0]
>>> logits = model.forward(x)
>>> grads = model.backward(np.ones_like(logits), method="blelloch")
>>> [g.shape for g in grads], sorted(model.parameter_gradients(grads))[:2]
([(4, 30, 1), (4, 30, 8), (4, 10)], ['fc.bias', 'fc.weight'])
>>> plan = model.plan((30, 1), "auto", batch=4)
>>> plan.method, plan.explain(batch=4)["requested"]
('linear', 'auto')
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .. import backend as _backend
from .. import weights as _weights
from .._checks import integer, is_int
from .._types import Array, RngLike
from ..engine.cost import CostModel, current
from ..engine.dense_plan import (
    DenseStep,
    SizedDenseScanPlan,
    build_dense_plan,
    dense_shape,
    scan_features,
)
from ..engine.figures import totals
from ..engine.plan import Candidate, ScanCostError, ScheduleChoice
from ..engine.schedule import SCHEDULES, checked_levels, depth, schedule_at_depth
from ..layers import Linear
from ..model import JacobianSize
from ._base import Horizon
from ._module import RecurrentModule

__all__ = ["REDUCTIONS", "RecurrentClassifier", "RecurrentPlan"]

AUTO_CRITERION = ("the least predicted time (a fixed cost per level plus its FLOPs over the device's "
                  "throughput)")


@dataclass(frozen=True)
class RecurrentPlan:
    """The schedule of a :class:`RecurrentClassifier`'s backward: every layer and direction of its
    recurrent layer is a scan of this schedule over its ``T`` time steps, one scan after another.

    A :class:`~sparse_scan.engine.figures.ScanPlanLike` (and so a
    :class:`~sparse_scan.model.ModelPlan`): its ``steps`` are every scan's, levels numbered on across
    the scans, and its figures their sums (the engine's convention on dense blocks).

    Attributes
    ----------
    method : {"linear", "blelloch", "hybrid"}
    levels : int or None
        Up-sweep levels of ``hybrid``.
    time_steps : int
        Time steps ``T``.
    state_size : int
        Size ``S`` of the ``S×S`` blocks.
    scans : tuple of str
        The scans in the order they run, layer by layer from the top, each direction:
        ``"rnn.l1"``, ``"rnn.l1_reverse"``, ``"rnn.l0"``, ... (the recurrent layer's name and
        PyTorch's parameter suffixes).
    affine : tuple of bool
        Per scan, whether the loss reaches every state (the scan carries direct gradients) or, for
        the top layer's forward direction under the classifier's head, its last state only.
    device : {"cpu", "gpu"}
        On the CPU, back-propagation's schedule applies the blocks in factored form (none filled).
    choice : ScheduleChoice or None
        How the schedule was chosen (``method="auto"``, or ``hybrid`` without levels), else None.
    cell_flops : tuple of int
        Per scan, the FLOPs per step and sample of the gate and parameter gradients from its totals
        (the cost model's ``cell_flops``; none given, none counted).
    horizon : callable, optional
        Returns the :class:`~sparse_scan.recurrent.Horizon` last seen (or None): where the model's
        last back-propagation on the CPU from its last state alone stopped, its gradient vanished.
        The predicted time of that back-propagation (a scan without direct gradients, blocks left
        factored) reads it when it is called: until a first backward, every step is predicted to
        run.
    """

    method: str
    levels: int | None
    time_steps: int
    state_size: int
    scans: tuple[str, ...]
    affine: tuple[bool, ...]
    device: str
    choice: ScheduleChoice | None = None
    cell_flops: tuple[int, ...] = ()
    horizon: Callable[[], Horizon | None] | None = dataclasses.field(default=None, compare=False,
                                                                      repr=False)

    def figures(self, method: str, levels: int | None) -> tuple[int, int, int]:
        """Critical-path FLOPs, work FLOPs (per sample) and sequential levels of every scan of
        ``method``/``levels``, one scan after another (the engine's convention on dense blocks)."""
        shape = dense_shape(self.time_steps, method, levels)
        return (sum(shape.critical_flops(self.state_size, affine) for affine in self.affine),
                sum(sum(shape.level_flops(self.state_size, affine)) for affine in self.affine),
                len(shape.counts) * len(self.affine))

    def sized(self, method: str | None = None, levels: int | None = None) -> list[SizedDenseScanPlan]:
        """Every scan's dense plan with its block size, in order, for ``method``/``levels`` (by default
        the plan's own)."""
        if method is None:
            method, levels = self.method, self.levels
        plan = build_dense_plan(self.time_steps, method, levels)
        return [plan.sized(self.state_size, affine) for affine in self.affine]

    @property
    def n(self) -> int:
        """Elements of each scan's chain: the time steps ``T``."""
        return self.time_steps

    @functools.cached_property
    def steps(self) -> tuple[DenseStep, ...]:
        """Every step of every scan, in the order the scans run, levels numbered on across them."""
        steps, offset = [], 0
        for sized in self.sized():
            steps += [dataclasses.replace(step, level=step.level + offset) for step in sized.steps]
            offset += sized.critical_steps
        return tuple(steps)

    @property
    def critical_flops(self) -> int:
        """FLOPs on the critical path (one sample): every scan's, one after another."""
        return self.figures(self.method, self.levels)[0]

    @property
    def work_flops(self) -> int:
        """FLOPs of every step of every scan (one sample)."""
        return self.figures(self.method, self.levels)[1]

    @property
    def critical_steps(self) -> int:
        """Levels of every scan, one after another."""
        return self.figures(self.method, self.levels)[2]

    @property
    def plan_bytes(self) -> int:
        """0: dense blocks need no index structure."""
        return 0

    def factored(self, device: str | None = None) -> bool:
        """Whether the backward applies the blocks in factored form (the CPU's back-propagation) on
        ``device`` (by default the one planned for)."""
        return (device or self.device) == "cpu" and (self.method == "linear" or self.levels == 0)

    def features(self, batch: int, threads: int = 1, method: str | None = None,
                 levels: int | None = None) -> dict[str, float]:
        """The cost model's features (:func:`~sparse_scan.engine.cost.dense_features`) of every scan of
        ``method``/``levels`` (by default the plan's own) for ``batch`` samples, one scan after
        another (the levels' block products are batched). With the blocks left factored
        (:meth:`factored`), back-propagation fills none, runs its samples on ``threads`` threads, and
        from the last state alone runs as far as the :attr:`horizon` last seen."""
        if method is None:
            method, levels = self.method, self.levels
        features: dict[str, float] = {"call": 1}
        shape = dense_shape(self.time_steps, method, levels)
        factored = self.device == "cpu"
        cells = self.cell_flops or (0,) * len(self.affine)
        horizon = self.horizon() if factored and self.horizon is not None else None
        for affine, cell_flops in zip(self.affine, cells, strict=True):
            reach, exit_values = None, 0.0
            if horizon is not None and not affine:
                reach = horizon.steps_over(self.time_steps)
                exit_values = (self.time_steps - reach) * horizon.row_values
            for name, count in scan_features(shape, batch, self.state_size, factored, affine, cell_flops,
                                             reach, exit_values, threads).items():
                features[name] = features.get(name, 0.0) + count
        return features

    def predicted_seconds(self, batch: int = 1, model: CostModel | str | None = None,
                          method: str | None = None, levels: int | None = None) -> float:
        """Predicted seconds of the backward's scans for ``batch`` samples: ``model``'s
        (:class:`~sparse_scan.engine.cost.CostModel`, or a device whose current model to use; by
        default the planned device's) weighing of :meth:`features`."""
        model = current(model or self.device) if model is None or isinstance(model, str) else model
        return model.predict(self.features(batch, model.threads, method, levels))

    def peak_bytes(self, batch: int, itemsize: int, device: str | None = None) -> int:
        """Peak bytes of one scan's live values on ``device`` (by default the one planned for; the
        scans run one after another): the blocks and the scan's results, or only the ``T + 1`` total
        gradients where the blocks stay factored."""
        if self.factored(device):
            return (self.time_steps + 1) * batch * self.state_size * itemsize
        return max(sized.peak_bytes(batch, itemsize) for sized in self.sized())

    def explain(self, batch: int = 1, itemsize: int = 4, device: str | None = None) -> dict[str, Any]:
        """The schedule and why, with the keys of :meth:`sparse_scan.ScanPlan.explain`: ``method``,
        ``levels``, ``requested``, ``reason``, ``critical_flops``, ``work_flops``, ``critical_steps``,
        ``plan_bytes`` (0: dense blocks need no index structure), ``peak_bytes`` (for ``batch``
        samples of ``itemsize`` bytes on ``device``, by default the one planned for), ``predicted_s``
        (:meth:`predicted_seconds` for ``batch`` samples on the device planned for), ``fill_flops``
        (none: the blocks are filled from the cells' values) and, for a chosen schedule, the
        ``candidates`` considered."""
        critical, work, steps = self.figures(self.method, self.levels)
        out: dict[str, Any] = {
            "method": self.method, "levels": self.levels,
            "requested": self.method if self.choice is None else self.choice.requested,
            "reason": "as requested" if self.choice is None else self.choice.criterion,
            "critical_flops": critical, "work_flops": work, "critical_steps": steps, "plan_bytes": 0,
            "peak_bytes": self.peak_bytes(batch, itemsize, device),
            "predicted_s": self.predicted_seconds(batch),
            "fill_flops": {"critical": 0, "work": 0}}
        if self.choice is not None:
            out["candidates"] = [c.as_dict() for c in self.choice.candidates]
        return out

    def report(self, batch: int = 1, itemsize: int = 4, device: str | None = None) -> dict[str, Any]:
        """Per-step figures and totals (JSON-friendly), as a sparse plan's: ``method``, ``levels``,
        ``n``, ``steps`` (a dense step's keys and its ``scan``) and ``totals``
        (:func:`~sparse_scan.engine.figures.totals`, ``peak_bytes`` on ``device``). FLOPs are per
        sample."""
        steps = self.steps
        per_scan = len(steps) // len(self.scans)
        return {"method": self.method, "levels": self.levels, "n": self.n,
                "steps": [step.as_dict() | {"scan": self.scans[index // per_scan]}
                          for index, step in enumerate(steps)],
                "totals": totals(self, batch, itemsize) | {"peak_bytes": self.peak_bytes(batch, itemsize,
                                                                                         device)}}


REDUCTIONS = ("last", "mean")
"""How the head reads the recurrent layer's outputs: the last one (PyTorch's ``fc(out[:, -1])``) or their
mean over time (``fc(out.mean(dim=1))``)."""


class RecurrentClassifier:
    """``logits = fc(h_T)`` (or ``fc(mean_t h_t)``) after a recurrent layer ``rnn``; loss is softmax
    cross-entropy. A :class:`~sparse_scan.model.Model`.

    Parameters
    ----------
    recurrent : RNN, GRU or LSTM
        Named ``"rnn"`` in the state_dict unless it has a name; run in its layer form (batch-first),
        the head reads the top layer's last output (both directions of a bidirectional one): PyTorch's
        ``fc(output[:, -1])`` (``output[-1]`` without ``batch_first``).
    classes : int, optional
        Outputs of a new head ``fc`` (``Linear``, PyTorch's initialisation from ``rng``).
    rng : numpy.random.Generator or int, optional
        Initialisation of the new head.
    head : sparse_scan.layers.Linear, optional
        The head itself, instead of ``classes`` and ``rng`` (named ``"fc"`` unless it has a name):
        its ``in_features`` must be the recurrent layer's output width and its dtype the layer's.
    input_shape : (int, int), optional
        One sample's shape ``(T, input_size)`` (a loaded spec sets it): :meth:`plan` and the command
        line read ``T`` from it.
    reduction : {"last", "mean"}
        What the head reads: the top layer's last output (``fc(output[:, -1])``), or the mean of its
        outputs over time (``fc(output.mean(dim=1))``: every time step then receives ``1 / T`` of the
        head's gradient, and every state's scan carries direct gradients).

    Attributes
    ----------
    layers : list
        ``[recurrent, fc]``: what :mod:`sparse_scan.optim` and :mod:`sparse_scan.weights` walk.
    classes : int
    input_shape : (int, int) or None
    plan_builds : int
        How many plans were built (a cached one serves every later request for it).
    """

    def __init__(self, recurrent: RecurrentModule, classes: int | None = None, rng: RngLike = None, *,
                 head: Linear | None = None, input_shape: Sequence[int] | None = None,
                 reduction: str = "last") -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"RecurrentClassifier: reduction: must be one of {', '.join(REDUCTIONS)}, got "
                             f"{reduction!r}")
        self.reduction = reduction
        recurrent.name = recurrent.name or "rnn"
        width = recurrent.num_directions * recurrent.output_size
        if head is None:
            classes = integer(classes, "RecurrentClassifier: classes", 1)
            head = Linear(width, classes, dtype=recurrent.dtype, rng=rng)
        else:
            if not isinstance(head, Linear) or head.in_features != width or head.dtype != recurrent.dtype:
                raise ValueError(f"RecurrentClassifier: head: expected a Linear({width}, ...) of "
                                 f"{np.dtype(recurrent.dtype).name} (the recurrent layer's output), "
                                 f"got {head!r}")
            if rng is not None or classes not in (None, head.out_features):
                raise ValueError("RecurrentClassifier: give either classes and rng (a new head) or head")
        head.name = head.name or "fc"
        self.recurrent, self.fc, self.classes = recurrent, head, head.out_features
        self.layers = [recurrent, head]
        self.input_shape = None if input_shape is None else self._checked_shape(input_shape, "input_shape")
        self._pooled: Array | None = None  # what the head read at the last forward
        self._steps = 0
        self._logits: Array | None = None
        self._gradients: tuple[list[Array], dict[str, Array]] | None = None
        self._plans: dict[tuple[Any, ...], RecurrentPlan] = {}
        self.plan_builds = 0

    def _checked_shape(self, shape: Sequence[int], label: str) -> tuple[int, int]:
        values = tuple(shape)
        if len(values) != 2 or not all(is_int(v) and v > 0 for v in values) \
                or values[1] != self.recurrent.input_size:
            raise ValueError(f"RecurrentClassifier: {label}: expected (time steps, "
                             f"{self.recurrent.input_size}), got {shape!r}")
        return int(values[0]), int(values[1])

    # parameters -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Array]:
        """Every parameter by ``"<layer>.<name>"`` (not copies)."""
        return _weights.state_dict(self)

    def load_state_dict(self, state: dict[str, Array], strict: bool = True) -> None:
        """Copy parameters in by :meth:`state_dict` name (:func:`sparse_scan.weights.load_state_dict`:
        a ``ValueError`` names the first bad key and changes nothing)."""
        _weights.load_state_dict(self, state, strict)

    # mode (PyTorch's train/eval) --------------------------------------------------------------------
    def train(self, mode: bool = True) -> "RecurrentClassifier":
        """Both layers in training mode (``mode=True``: the recurrent layer's dropout between its
        layers applies) or eval mode, like PyTorch's ``module.train(mode)``; return self."""
        for layer in self.layers:
            layer.train(mode)
        return self

    def eval(self) -> "RecurrentClassifier":
        """Both layers in eval mode (no dropout); return self."""
        return self.train(False)

    # forward ----------------------------------------------------------------------------------------
    def shapes(self, in_shape: Sequence[int]) -> list[tuple[int, ...]]:
        """Per-sample shapes of the input ``(T, input_size)``, the top layer's outputs
        ``(T, D * H_out)`` and the logits ``(classes,)``."""
        steps, size = self._checked_shape(in_shape, "in_shape")
        return [(steps, size), (steps, self.fc.in_features), (self.classes,)]

    def forward(self, x: Array) -> Array:
        """The logits ``(B, classes)`` of a batch-first ``x`` ``(B, T, input_size)`` (NumPy: CPU, CuPy:
        GPU); keeps what :meth:`backward` needs."""
        hidden = self.recurrent.forward(x)
        self._steps = int(hidden.shape[1])
        self._pooled = hidden[:, -1] if self.reduction == "last" else hidden.mean(axis=1)
        self._logits = self.fc.forward(self._pooled)
        self._gradients = None
        return self._logits

    __call__ = forward

    def non_finite_output(self) -> str | None:
        """The name of the first layer whose output at the last :meth:`forward` holds NaN or Inf (the
        recurrent layer's output the head reads, then the logits), or None when both are finite."""
        if self._pooled is None or self._logits is None:
            raise RuntimeError("RecurrentClassifier: call forward(x) first")
        for layer, output in zip(self.layers, (self._pooled, self._logits), strict=True):
            xp = _backend.of(output).xp
            if not bool(xp.all(xp.isfinite(output))):
                return layer.name
        return None

    # schedules --------------------------------------------------------------------------------------
    def plan(self, in_shape: Sequence[int] | None = None, method: str = "auto",
             levels: int | str | None = None, *, batch: int = 1, device: str = "cpu",
             max_step_flops: int | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> RecurrentPlan:
        """The schedule :meth:`backward` runs for ``method``/``levels`` (cached).

        ``method="auto"`` and ``hybrid`` without ``levels`` (or ``levels="auto"``) choose the hybrid
        depth with the least predicted time for ``batch`` samples on ``device``
        (:meth:`RecurrentPlan.predicted_seconds` of every depth's scans, nothing built: on a 2-core
        CPU usually back-propagation, whose blocks stay factored, on a GPU a deep scan); ``auto``
        names depth 0 ``linear`` and the deepest ``blelloch``. On the CPU, once a back-propagation
        from the last state has been seen to stop early (the recurrent layer's ``horizon``), the
        choice is made again with it whenever the steps it predicts move by a quarter of an octave.

        Parameters
        ----------
        in_shape : (int, int), optional
            ``(T, input_size)``; by default :attr:`input_shape`.
        method : {"auto", "linear", "blelloch", "hybrid"}
        levels : int or "auto", optional
        batch : int
            Samples per backward (the cost model's and the peak memory's).
        device : {"cpu", "gpu"}
        max_step_flops : int, optional
            Refuse (:class:`~sparse_scan.ScanCostError`) a schedule with a step of more FLOPs (per
            sample; a block product of ``S×S`` blocks is ``2S³``, plus ``2S²`` where it is affine).
        progress : callable, optional
            The protocol's planning progress; a recurrent plan is built at once, without calling it.

        Returns
        -------
        RecurrentPlan
        """
        if in_shape is None:
            if self.input_shape is None:
                raise ValueError("RecurrentClassifier: plan: give in_shape (the model has no input_shape)")
            in_shape = self.input_shape
        steps, _ = self._checked_shape(in_shape, "in_shape")
        integer(batch, "RecurrentClassifier: batch", 1)
        if method not in SCHEDULES:
            raise ValueError(f"method must be one of {', '.join(SCHEDULES)}; got {method!r}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"RecurrentClassifier: device: must be 'cpu' or 'gpu', got {device!r}")
        if method == "hybrid" and levels is None:
            levels = "auto"
        if method == "auto" and levels is not None:
            raise ValueError(f"levels applies to method='hybrid' only; got levels={levels!r} with "
                             "method='auto'")
        auto = method == "auto" or (method == "hybrid" and levels == "auto")
        if not auto:
            levels = checked_levels(steps, method, levels, unit="time steps")
        key = (steps, method, levels, (batch, self._horizon_key(steps, device)) if auto else None, device)
        if key not in self._plans:
            self._plans[key] = self._plan(steps, method, levels, batch, device, auto)
            self.plan_builds += 1
        plan = self._plans[key]
        if max_step_flops is not None:
            costliest = max((step.flops for sized in plan.sized() for step in sized.steps), default=0)
            if costliest > max_step_flops:
                raise ScanCostError(f"RecurrentClassifier: a step of the {plan.method} scans needs "
                                    f"{costliest:,} FLOPs, over the limit of {max_step_flops}")
        return plan

    def _scans(self) -> tuple[tuple[str, ...], tuple[bool, ...]]:
        """The backward's scans in the order they run (layer by layer from the top, each direction),
        and whether each carries direct gradients (:class:`RecurrentPlan`'s ``scans`` and ``affine``)."""
        recurrent = self.recurrent
        order = [(layer, direction) for layer in reversed(range(recurrent.num_layers))
                 for direction in range(recurrent.num_directions)]
        scans = tuple(f"{recurrent.name}.l{layer}{'_reverse' if direction else ''}"
                      for layer, direction in order)
        every_state = self.reduction == "mean"
        affine = tuple(layer < recurrent.num_layers - 1 or direction == 1 or every_state
                       for layer, direction in order)
        return scans, affine

    def _horizon(self) -> Horizon | None:
        """The recurrent layer's :attr:`~sparse_scan.recurrent.RNN.horizon` where the head reads the
        last state alone (else no back-propagation stops early)."""
        return self.recurrent.horizon if self.reduction == "last" else None

    def _horizon_key(self, steps: int, device: str) -> int | None:
        """What of the horizon an ``auto`` choice for ``steps`` depends on: the steps it predicts, to
        a quarter of an octave (a choice is made again when they move further), on the CPU only."""
        horizon = self._horizon() if device == "cpu" else None
        if horizon is None or horizon.steps_over(steps) >= steps:
            return None
        return round(4 * math.log2(max(horizon.steps_over(steps), 1.0)))

    def _plan(self, steps: int, method: str, levels: int | None, batch: int, device: str,
              auto: bool) -> RecurrentPlan:
        recurrent = self.recurrent
        scans, affine = self._scans()
        cells = self.recurrent.scan_cell_flops()
        plan = RecurrentPlan(method, levels, steps, recurrent.state_size, scans, affine, device,
                             cell_flops=cells, horizon=self._horizon)
        if not auto:
            return plan
        full = depth(steps)
        model = current(device)
        depths = range(full + 1) if method == "hybrid" else range(max(full, 1))  # blelloch once
        schedules = [schedule_at_depth(method, k, full) for k in depths]
        predicted = [plan.predicted_seconds(batch, model, *schedule) for schedule in schedules]
        chosen = schedules[predicted.index(min(predicted))]  # the shallowest of equals
        candidates = []
        for schedule, seconds in zip(schedules, predicted, strict=True):
            critical, work, _ = plan.figures(*schedule)
            candidates.append(Candidate(*schedule, critical, work, 0, False,
                                        "chosen" if schedule == chosen else "more predicted time", seconds))
        criterion = (f"{AUTO_CRITERION}, for batch {batch} (cost model: {model.source})"
                     + (", back-propagation's blocks left factored" if device == "cpu" else ""))
        return RecurrentPlan(*chosen, steps, recurrent.state_size, scans, affine, device,
                             ScheduleChoice(method, criterion, tuple(candidates)), cells, self._horizon)

    # backward ---------------------------------------------------------------------------------------
    def backward(self, grad_out: Array, method: str = "auto", levels: int | str | None = None,
                 device: str | None = None, timings: dict[str, float] | None = None,
                 input_gradient: bool = True, parameters_beside: bool = False) -> list[Array]:
        """Gradients w.r.t. the input, the recurrent layer's outputs and the logits, by a scan per
        layer and direction of the recurrent layer; every parameter's gradient comes out of the same
        scans (:meth:`parameter_gradients`).

        Parameters
        ----------
        grad_out : ndarray, shape (B, classes)
            Gradient of the loss w.r.t. the logits of the last :meth:`forward`.
        method : {"auto", "linear", "blelloch", "hybrid"}
            The scans' schedule (``auto``: :meth:`plan`'s choice).
        levels : int or "auto", optional
            Up-sweep levels of ``hybrid`` (None: ``"auto"``).
        device : {"cpu", "gpu", "auto"}, optional
            Where the forward ran (the scans read what it kept there), the default; another device
            is an error.
        timings : dict, optional
            Receives ``backward_s``: the seconds of the whole backward, parameter gradients included
            (on the GPU up to a synchronisation).
        input_gradient : bool, optional
            Accepted for :class:`~sparse_scan.model.Model`'s contract; the recurrent scans compute the
            input's gradient with the hidden states' whatever it says (its share is an input
            projection per step).
        parameters_beside : bool, optional
            Accepted for :class:`~sparse_scan.model.Model`'s contract: the parameter gradients come
            out of the same scans.

        Returns
        -------
        list of ndarray
            ``[grad wrt x (B, T, input_size), grad wrt every top-layer output h_t (B, T, D * H_out),
            grad_out]``, batch first: the second is the total gradient w.r.t. each hidden state (the
            scan's outputs: through the chain, not only the head's direct one at ``T``).
            :meth:`parameter_gradients` takes this list.
        """
        if self._pooled is None:
            raise RuntimeError("RecurrentClassifier: call forward(x) before backward")
        start = time.perf_counter()
        be = _backend.of(self._pooled)
        if device is not None and _backend.get(device).name != be.name:
            raise ValueError(f"RecurrentClassifier: device: the forward ran on the {be.name}, where its "
                             f"saved values are; got device={device!r}")
        grad = be.asarray(grad_out)
        if tuple(grad.shape) != tuple(self._logits.shape) or grad.dtype.kind != "f":
            raise ValueError(f"grad_out: expected floats of shape {tuple(self._logits.shape)} (the logits), "
                             f"got {tuple(grad.shape)} of {grad.dtype}")
        grad = grad.astype(self.recurrent.dtype, copy=False)
        if method == "auto" or (method == "hybrid" and levels in (None, "auto")):
            plan = self.plan((self._steps, self.recurrent.input_size), method, levels,
                             batch=int(grad.shape[0]), device=be.name)
            method, levels = plan.method, plan.levels
        weight = be.asarray(self.fc.weight)
        head = grad @ weight
        if self.reduction == "mean":  # every output h_t receives 1/T of the pooled output's gradient
            head = be.xp.ascontiguousarray(be.xp.broadcast_to(
                (head / head.dtype.type(self._steps))[:, None, :],
                (head.shape[0], self._steps, head.shape[1])))
        result = self.recurrent.backward(head, method=method, levels=levels)
        parameters = {f"{self.fc.name}.weight": grad.T @ self._pooled}
        if self.fc.bias is not None:
            parameters[f"{self.fc.name}.bias"] = grad.sum(axis=0)
        for key in self.recurrent.parameter_names:
            parameters[f"{self.recurrent.name}.{key}"] = result[self.recurrent.layer_form_key(key)]
        grads = [result["x"], result["h"], grad]
        self._gradients = (grads, parameters)
        if timings is not None:
            be.synchronize()
            timings["backward_s"] = time.perf_counter() - start
        return grads

    def parameter_gradients(self, grads: Sequence[Array],
                            timings: dict[str, float] | None = None) -> dict[str, Array]:
        """Every parameter's gradient by state_dict name, summed over the batch like PyTorch's: those
        of the last :meth:`backward` (the recurrent layer's come out of its scans), whose result
        ``grads`` must be. ``timings`` receives nothing: their time is the backward's."""
        if self._gradients is None or grads is not self._gradients[0]:
            raise ValueError("RecurrentClassifier: parameter_gradients takes the list the last backward "
                             "returned")
        return dict(self._gradients[1])

    def check_reference(self, method: str) -> str:
        """What ``sparse-scan run --check`` compares the schedule ``method``'s gradients with:
        ``linear``, back-propagation through time, or where ``method`` is back-propagation,
        ``blelloch``."""
        return "blelloch" if method == "linear" else "linear"

    def check_backward(self, grad_out: Array, method: str) -> list[Array]:
        """:meth:`backward`'s gradients by :meth:`check_reference` of ``method``;
        :meth:`parameter_gradients` then gives that scan's parameter gradients."""
        return self.backward(grad_out, self.check_reference(method))

    # the scans' Jacobians ---------------------------------------------------------------------------
    def jacobian_sizes(self, in_shape: Sequence[int] | None = None) -> list[JacobianSize]:
        """The blocks of every scan for ``in_shape`` (by default :attr:`input_shape`): per layer and
        direction of the recurrent layer (:class:`RecurrentPlan`'s ``scans``), ``T`` dense ``S×S``
        transposed Jacobians of the state (type ``dense``)."""
        if in_shape is None:
            if self.input_shape is None:
                raise ValueError("RecurrentClassifier: give in_shape (the model has no input_shape)")
            in_shape = self.input_shape
        steps, _ = self._checked_shape(in_shape, "in_shape")
        size = self.recurrent.state_size
        return [JacobianSize(scan, "dense", (size, size), size * size, steps) for scan in self._scans()[0]]

    def transposed_jacobians(self) -> list[Any]:
        """Refused (ValueError): the blocks are dense, built inside the scans from the cells' values
        (:meth:`jacobian_sizes` gives their sizes; every entry is live)."""
        raise ValueError("RecurrentClassifier: its transposed Jacobians are dense blocks built inside its "
                         "scans, not sparse JTs per layer; live counts drop the zeros of sparse JTs, and a "
                         "recurrent model's blocks are dense (its static figures are its live ones)")
