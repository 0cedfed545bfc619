"""The paper's recurrent classifier (§4.1): a recurrent layer, then softmax over a linear map of the
last hidden state (or of the mean of the hidden states over time), trained with cross-entropy; its
schedules and its training loop.

:class:`RecurrentClassifier` has the calls of a :class:`~sparse_scan.Sequential` (``forward``,
``backward`` returning the gradient w.r.t. every activation, ``parameter_gradients``, ``plan``,
``state_dict``/``load_state_dict``, ``shapes``), so :func:`sparse_scan.train.train`,
:func:`sparse_scan.train.evaluate` and :mod:`sparse_scan.optim` take it as they take a CNN; a model
spec whose first layer is recurrent loads as one (:func:`sparse_scan.load_model`).

Examples
--------
>>> import numpy as np
>>> from sparse_scan.optim import Adam
>>> from sparse_scan.recurrent import RNN, Bitstream
>>> model = RecurrentClassifier(RNN(1, 8, rng=0), classes=10, rng=1)
>>> sorted(model.state_dict())[:3]
['fc.bias', 'fc.weight', 'rnn.bias_hh_l0']
>>> records = train_recurrent(model, Bitstream(steps=30, samples=64), Adam(model, lr=1e-2), iterations=3,
...                           batch_size=16)
>>> [r["iteration"] for r in records]
[0, 1, 2]

The Sequential-like calls: the gradient w.r.t. the input, every hidden state of the top layer and
the logits, then the parameters'; ``plan`` states the schedule ``method="auto"`` runs.

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

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .. import backend as _backend
from .. import weights as _weights
from .._checks import integer, is_int
from .._types import Array
from ..engine.dense_plan import auto_levels, build_dense_plan
from ..engine.figures import critical_path
from ..engine.plan import Candidate, ScheduleChoice
from ..engine.schedule import SCHEDULES, checked_levels, depth, schedule_at_depth
from ..layers import Linear
from ..layers._weighted import RngLike
from ..loss import softmax_cross_entropy
from ..optim import check_built_on
from ._module import RecurrentModule

__all__ = ["REDUCTIONS", "RecurrentClassifier", "RecurrentPlan", "train_recurrent"]

AUTO_CRITERION = ("the least modelled time (a fixed cost per level plus its FLOPs over the device's "
                  "throughput)")


@dataclass(frozen=True)
class RecurrentPlan:
    """The schedule of a :class:`RecurrentClassifier`'s backward: every layer and direction of its
    recurrent layer is a scan of this schedule over its ``T`` time steps.

    Attributes
    ----------
    method : {"linear", "blelloch", "hybrid"}
    levels : int or None
        Up-sweep levels of ``hybrid``.
    steps : int
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
    """

    method: str
    levels: int | None
    steps: int
    state_size: int
    scans: tuple[str, ...]
    affine: tuple[bool, ...]
    device: str
    choice: ScheduleChoice | None = None

    def figures(self, method: str, levels: int | None) -> tuple[int, int, int]:
        """Critical-path FLOPs, work FLOPs (per sample) and sequential levels of every scan of
        ``method``/``levels``, one scan after another (the engine's convention on dense blocks)."""
        plan = build_dense_plan(self.steps, method, levels)
        sized = [plan.sized(self.state_size, affine) for affine in self.affine]
        return (sum(s.critical_flops for s in sized), sum(s.work_flops for s in sized),
                sum(s.critical_steps for s in sized))

    def factored(self) -> bool:
        """Whether the backward applies the blocks in factored form (the CPU's back-propagation)."""
        return self.device == "cpu" and (self.method == "linear" or self.levels == 0)

    def peak_bytes(self, batch: int, itemsize: int) -> int:
        """Peak bytes of one scan's live values (the scans run one after another): the blocks and
        the scan's results, or only the ``T + 1`` total gradients where the blocks stay factored."""
        if self.factored():
            return (self.steps + 1) * batch * self.state_size * itemsize
        plan = build_dense_plan(self.steps, self.method, self.levels)
        return max(plan.sized(self.state_size, affine).peak_bytes(batch, itemsize) for affine in self.affine)

    def explain(self, batch: int = 1, itemsize: int = 4) -> dict[str, Any]:
        """The schedule and why, with the keys of :meth:`sparse_scan.ScanPlan.explain`: ``method``,
        ``levels``, ``requested``, ``reason``, ``critical_flops``, ``work_flops``, ``critical_steps``,
        ``plan_bytes`` (0: dense blocks need no index structure), ``peak_bytes`` (for ``batch``
        samples of ``itemsize`` bytes), ``fill_flops`` (none: the blocks are filled from the cells'
        values) and, for a chosen schedule, the ``candidates`` considered."""
        critical, work, steps = self.figures(self.method, self.levels)
        out: dict[str, Any] = {
            "method": self.method, "levels": self.levels,
            "requested": self.method if self.choice is None else self.choice.requested,
            "reason": "as requested" if self.choice is None else self.choice.criterion,
            "critical_flops": critical, "work_flops": work, "critical_steps": steps, "plan_bytes": 0,
            "peak_bytes": self.peak_bytes(batch, itemsize), "fill_flops": {"critical": 0, "work": 0}}
        if self.choice is not None:
            out["candidates"] = [c.as_dict() for c in self.choice.candidates]
        return out

    def report(self, batch: int = 1, itemsize: int = 4) -> dict[str, Any]:
        """Per-step figures and totals in the form of :func:`sparse_scan.flops.analyse`'s report
        (JSON-friendly): ``method``, ``levels``, ``schedule`` (:meth:`explain`), ``layers[]`` (per
        scan, the ``T`` blocks it scans: ``name`` (the scan's), ``type`` ``"dense"``, ``shape``,
        ``nnz``, ``sparsity``, ``csr_bytes`` and ``dense_bytes`` of one block, ``blocks``),
        ``steps[]`` (every step of every scan, levels numbered on across the scans, which run one
        after another: a dense step's keys, its ``scan`` and whether it is ``critical``) and
        ``totals`` (``bp_flops``: back-propagation's ``T`` matrix-vector products per scan,
        ``critical_flops``, ``work_flops``, ``critical_steps``, ``peak_bytes``). FLOPs are per
        sample."""
        plan = build_dense_plan(self.steps, self.method, self.levels)
        linear = build_dense_plan(self.steps, "linear")
        steps, offset = [], 0
        for scan, affine in zip(self.scans, self.affine, strict=True):
            sized = plan.sized(self.state_size, affine)
            critical = set(critical_path(sized.steps))
            steps += [step.as_dict() | {"level": step.level + offset, "scan": scan,
                                        "critical": index in critical}
                      for index, step in enumerate(sized.steps)]
            offset += sized.critical_steps
        schedule = self.explain(batch, itemsize)
        bp = sum(linear.sized(self.state_size, affine).work_flops for affine in self.affine)
        size = self.state_size
        layers = [{"name": scan, "type": "dense", "shape": [size, size], "nnz": size * size, "sparsity": 0.0,
                   "csr_bytes": size * size * (itemsize + 4) + (size + 1) * 4,
                   "dense_bytes": size * size * itemsize, "blocks": self.steps} for scan in self.scans]
        return {"method": self.method, "levels": self.levels, "schedule": schedule, "layers": layers,
                "steps": steps,
                "totals": {"bp_flops": bp} | {key: schedule[key] for key in (
                    "critical_flops", "work_flops", "critical_steps", "peak_bytes")}}


REDUCTIONS = ("last", "mean")
"""How the head reads the recurrent layer's outputs: the last one (PyTorch's ``fc(out[:, -1])``) or their
mean over time (``fc(out.mean(dim=1))``)."""


class RecurrentClassifier:
    """``logits = fc(h_T)`` (or ``fc(mean_t h_t)``) after a recurrent layer ``rnn``; loss is softmax
    cross-entropy.

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
             levels: int | str | None = None, batch: int = 1, device: str = "cpu") -> RecurrentPlan:
        """The schedule :meth:`backward` runs for ``method``/``levels`` (cached).

        ``method="auto"`` and ``hybrid`` without ``levels`` (or ``levels="auto"``) choose the hybrid
        depth with the least modelled time for ``batch`` samples on ``device``
        (:func:`~sparse_scan.engine.dense_plan.auto_levels`: on a 2-core CPU usually
        back-propagation, whose blocks stay factored, on a GPU a deep scan); ``auto`` names depth 0
        ``linear`` and the deepest ``blelloch``.

        Parameters
        ----------
        in_shape : (int, int), optional
            ``(T, input_size)``; by default :attr:`input_shape`.
        method : {"auto", "linear", "blelloch", "hybrid"}
        levels : int or "auto", optional
        batch : int
            Samples per backward (the cost model's and the peak memory's).
        device : {"cpu", "gpu"}

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
        key = (steps, method, levels, batch if auto else None, device)
        if key not in self._plans:
            self._plans[key] = self._plan(steps, method, levels, batch, device, auto)
        return self._plans[key]

    def _plan(self, steps: int, method: str, levels: int | None, batch: int, device: str,
              auto: bool) -> RecurrentPlan:
        recurrent = self.recurrent
        order = [(layer, direction) for layer in reversed(range(recurrent.num_layers))
                 for direction in range(recurrent.num_directions)]
        scans = tuple(f"{recurrent.name}.l{layer}{'_reverse' if direction else ''}"
                      for layer, direction in order)
        every_state = self.reduction == "mean"
        affine = tuple(layer < recurrent.num_layers - 1 or direction == 1 or every_state
                       for layer, direction in order)
        plan = RecurrentPlan(method, levels, steps, recurrent.state_size, scans, affine, device)
        if not auto:
            return plan
        full = depth(steps)
        best = auto_levels(steps, batch, recurrent.state_size, device, factored=device == "cpu")
        chosen = schedule_at_depth(method, best, full)
        depths = range(full + 1) if method == "hybrid" else range(max(full, 1))  # blelloch once
        candidates = []
        for k in depths:
            schedule = schedule_at_depth(method, k, full)
            critical, work, _ = plan.figures(*schedule)
            candidates.append(Candidate(*schedule, critical, work, 0, False,
                                        "chosen" if schedule == chosen else "more modelled time"))
        criterion = AUTO_CRITERION + (", back-propagation's blocks left factored" if device == "cpu" else "")
        return RecurrentPlan(*chosen, steps, recurrent.state_size, scans, affine, device,
                             ScheduleChoice(method, criterion, tuple(candidates)))

    # backward ---------------------------------------------------------------------------------------
    def backward(self, grad_out: Array, method: str = "auto", levels: int | str | None = None) -> list[Array]:
        """Gradients w.r.t. the input, the recurrent layer's outputs and the logits, by a scan per
        layer and direction of the recurrent layer.

        Parameters
        ----------
        grad_out : ndarray, shape (B, classes)
            Gradient of the loss w.r.t. the logits of the last :meth:`forward`.
        method : {"auto", "linear", "blelloch", "hybrid"}
            The scans' schedule (``auto``: :meth:`plan`'s choice).
        levels : int or "auto", optional
            Up-sweep levels of ``hybrid`` (None: ``"auto"``).

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
        be = _backend.of(self._pooled)
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
        return grads

    def parameter_gradients(self, grads: Sequence[Array]) -> dict[str, Array]:
        """Every parameter's gradient by state_dict name, summed over the batch like PyTorch's: those
        of the last :meth:`backward` (the recurrent layer's come out of its scans), whose result
        ``grads`` must be."""
        if self._gradients is None or grads is not self._gradients[0]:
            raise ValueError("RecurrentClassifier: parameter_gradients takes the list the last backward "
                             "returned")
        return dict(self._gradients[1])

    def loss_and_gradients(self, x: Array, labels: Array, method: str = "blelloch",
                           levels: int | str | None = None) -> tuple[float, dict[str, Array]]:
        """Forward, loss and every parameter's gradient (the hidden-state chain by the scan).

        Returns
        -------
        loss : float
            Mean cross-entropy over the batch.
        grads : dict
            By state_dict name, summed like PyTorch's (the loss is a mean).
        """
        logits = self.forward(x)
        be = _backend.of(logits)
        loss, grad_logits = softmax_cross_entropy(be.to_host(logits), be.to_host(labels))
        return loss, self.parameter_gradients(self.backward(be.asarray(grad_logits), method, levels))


def train_recurrent(model: RecurrentClassifier, data: Any, optimizer: Any, iterations: int, batch_size: int,
                    method: str = "blelloch", levels: int | str | None = None, seed: int = 0,
                    device: str = "cpu",
                    progress: Callable[[int, int, float], None] | None = None) -> list[dict[str, Any]]:
    """Mini-batch training; one record per iteration.

    Parameters
    ----------
    model : RecurrentClassifier
    data : Bitstream or any object with ``len(data)`` and ``data.batch(indices) -> (x, labels)``
    optimizer : sparse_scan.optim.Optimizer
        Built on ``model``.
    iterations, batch_size : int
    method, levels
        Of the scan (``linear`` is back-propagation through time).
    seed : int
        Batch order (a permutation per pass over the data): the same seed gives the same batches.
    device : {"cpu", "gpu", "auto"}
        Where the forward and the scan run (parameters stay NumPy arrays for the optimizer).
    progress : callable, optional
        ``progress(iteration, iterations, loss)`` after each iteration.

    Returns
    -------
    list of dict
        ``{"iteration", "loss"}`` per iteration (the batch's loss before the update).
    """
    integer(iterations, "iterations", 0)
    integer(batch_size, "batch_size", 1, len(data), note=" (the data's samples)")
    check_built_on(optimizer, model)
    be = _backend.get(device)
    order = np.random.default_rng(seed)
    permutation, position, records = order.permutation(len(data)), 0, []
    for iteration in range(iterations):
        if position + batch_size > len(permutation):
            permutation, position = order.permutation(len(data)), 0
        x, labels = data.batch(permutation[position:position + batch_size])
        position += batch_size
        loss, grads = model.loss_and_gradients(be.asarray(x), labels, method=method, levels=levels)
        optimizer.step({key: be.to_host(value) for key, value in grads.items()})
        records.append({"iteration": iteration, "loss": loss})
        if progress is not None:
            progress(iteration + 1, iterations, loss)
    return records
