"""Sequential models whose backward pass is a planned scan over sparse transposed Jacobians.

Examples
--------
>>> import numpy as np
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU
>>> model = Sequential(Conv2d(1, 2, 3, dtype=np.float64, rng=0), ReLU(), Flatten(),
...                    Linear(2 * 4 * 4, 3, dtype=np.float64, rng=1))
>>> x = np.random.default_rng(0).standard_normal((5, 1, 6, 6))
>>> y = model.forward(x)
>>> grads = model.backward(np.ones_like(y), method="blelloch")
>>> [g.shape for g in grads]
[(5, 1, 6, 6), (5, 2, 4, 4), (5, 2, 4, 4), (5, 32), (5, 3)]
>>> linear = model.backward(np.ones_like(y), method="linear")
>>> all(np.allclose(a, b) for a, b in zip(grads, linear))
True
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from concurrent.futures import Future
from typing import Callable, Hashable, Sequence

from . import _environment
from . import backend as _backend
from . import weights as _weights
from ._layerwise import layerwise_backward
from ._threads import submit_beside
from ._types import Array
from .csr import BatchedCSR, Pattern
from .engine.cost import PLAN_SECONDS_VARIABLE, CostModel, current, max_plan_seconds, predicted_plan_seconds
from .engine.figures import size_text
from .engine.plan import (
    Candidate,
    ChainInfo,
    ElementInfo,
    ScanCostError,
    ScanMemoryError,
    ScanPlan,
    ScheduleChoice,
    Step,
    build_plan,
    estimate_plan,
    operands_needing_patterns,
)
from .engine.products import ProductPlan
from .engine.run import run_plan, through_inputs, through_weights
from .engine.schedule import SCHEDULES, Element, checked_levels, depth, schedule_at_depth
from .engine.subnormals import SubnormalWatch
from .layers import Layer
from .model import JacobianSize

__all__ = ["AUTO_ESTIMATE_SLACK", "AUTO_PLAN_SECONDS", "MEMORY_BUDGET_VARIABLE", "Sequential",
           "default_memory_budget"]

AUTO_PLAN_SECONDS = 1.0
"""The most predicted planning time (:func:`~sparse_scan.engine.cost.predicted_plan_seconds` of an
estimate's symbolic work: JT pattern entries plus general products' multiply-adds) that
``method="auto"`` spends on a deeper schedule, so that choosing stays fast."""

AUTO_ESTIMATE_SLACK = 2.0
"""``method="auto"`` builds no depth whose estimated predicted time exceeds the best built one's by this
factor, and deepens no further past an estimated product whose time alone does (deeper plans repeat
it); an explicit schedule with an estimated product this much over ``max_step_flops`` is refused
before anything is built (estimates of products of layer pairs are within a few percent on the
bundled models, ResNet-20-pruned's costliest 7.12e9 FLOPs against 7.65e9 counted; deeper ones are
over-estimates)."""

Shape = tuple[int, ...]


MEMORY_BUDGET_VARIABLE = _environment.MEMORY_BUDGET.name
"""Environment variable: the memory budget where a model sets none (:func:`default_memory_budget`), in
bytes or with a binary unit (``512M``, ``12GiB``); the command line's way to raise it."""

RESULT_ENTRY_BYTES = 8
"""What the lean product method stores per entry of a product's result at least: its column index and
one float32 value (:func:`~sparse_scan.engine.products.plan_product`'s budget check)."""


def default_memory_budget(fraction: float = 0.5) -> int:
    """:data:`MEMORY_BUDGET_VARIABLE` where it is set, else ``fraction`` of the memory available now
    (Linux ``MemAvailable``; 4 GiB if unknown)."""
    setting = _environment.MEMORY_BUDGET.read()
    if setting is not None:
        return setting
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * fraction)
    except OSError:
        pass
    return int(4 * 2**30 * fraction)


def _costliest_product(plan: ScanPlan) -> Step | None:
    """The general product (no scaling) of the most FLOPs, or None."""
    return max((step for step in plan.steps if step.kind == "mm" and not step.scaling),
               key=lambda step: step.flops, default=None)


def _step_seconds(step: Step, plan: ScanPlan, batch: int, model: CostModel) -> float:
    """Predicted seconds of one step of ``plan`` alone, spread over every thread."""
    alone = dataclasses.replace(plan, steps=[dataclasses.replace(step, level=0)], n=0, fill_flops=(0, 0))
    features = alone.features(batch, 1)
    return model.predict({name: features.get(name, 0.0) for name in _WORK}) / model.threads


_WORK = ("mv_spmv", "mv_gemm", "mv_scale", "mm_scale", "mm_gather", "mm_block", "mm_general")


def _auto_verdict(estimate: ScanPlan, best_s: float, batch: int, model: CostModel, max_step_flops: int | None,
                  budget: int) -> tuple[str | None, bool]:
    """Whether ``method="auto"`` sets a deeper schedule aside from its estimate: ``(why, stops)``,
    ``why`` None to build it; ``stops`` when no deeper schedule should be built either (they repeat
    its up-sweep products)."""
    costliest = _costliest_product(estimate)
    if costliest is not None:
        if max_step_flops is not None and costliest.flops > AUTO_ESTIMATE_SLACK * max_step_flops:
            return (f"not built: a product of ~{costliest.flops:.3g} FLOPs, over --max-step-flops "
                    f"({max_step_flops:,} FLOPs)"), True
        alone = _step_seconds(costliest, estimate, batch, model)
        if alone > AUTO_ESTIMATE_SLACK * best_s:
            return (f"not built: a product of ~{1e3 * alone:.3g} ms predicted alone, over "
                    f"{AUTO_ESTIMATE_SLACK:g}x the best so far"), True
    planning = predicted_plan_seconds(estimate.symbolic_work, model)
    if planning > AUTO_PLAN_SECONDS:
        return (f"not built: building it would take ~{planning:.2g} s (~{estimate.symbolic_work:.2g} pattern "
                f"entries and multiply-adds), over auto's {AUTO_PLAN_SECONDS:g} s"), True
    if estimate.plan_bytes > budget:
        return (f"not built: its plan (~{estimate.plan_bytes / 2**20:,.0f} MiB) is over the memory "
                f"budget ({budget / 2**20:,.0f} MiB)"), True
    predicted = estimate.predicted_seconds(batch, model)
    if predicted > AUTO_ESTIMATE_SLACK * best_s:
        return (f"not built: its predicted time (~{1e3 * predicted:.3g} ms) is over {AUTO_ESTIMATE_SLACK:g}x "
                "the best so far"), False
    return None, False


def _refuse_by_estimate(chain: ChainInfo, method: str, levels: int | None, max_step_flops: int | None,
                        max_plan_seconds: float, model: CostModel, budget: int) -> None:
    """:class:`ScanCostError` for a schedule whose estimate (:func:`estimate_plan`, the JTs' shapes and
    ``nnz`` alone, nothing built) has a product over :data:`AUTO_ESTIMATE_SLACK` times
    ``max_step_flops``, or would take more than ``max_plan_seconds`` to build
    (:func:`~sparse_scan.engine.cost.predicted_plan_seconds`); :class:`ScanMemoryError` for one with a
    product whose result alone (:data:`RESULT_ENTRY_BYTES` per estimated entry) is over
    :data:`AUTO_ESTIMATE_SLACK` times the memory ``budget`` (the estimates of result entries are at
    most 1.8x the built ones' on the bundled models and never below them). :func:`build_plan` still
    counts every product exactly before building it, and refuses one over the budget on its own."""
    estimate = estimate_plan(chain, method, levels)
    label = f"{method}{'' if levels is None else f' {levels}'}"
    largest = max((step for step in estimate.steps if step.kind == "mm" and not step.scaling),
                  key=lambda step: step.out_nnz, default=None)
    if largest is not None and largest.out_nnz * RESULT_ENTRY_BYTES > AUTO_ESTIMATE_SLACK * budget:
        raise ScanMemoryError(
            f"planning {label}: {chain.describe_step(largest)}, has a result of ~{largest.out_nnz:.3g} "
            f"entries, ~{size_text(largest.out_nnz * RESULT_ENTRY_BYTES)} (estimated from the JTs' sizes "
            f"before building anything), over the memory budget of {size_text(budget)} (raise it with "
            f"memory_budget= or {MEMORY_BUDGET_VARIABLE}, or use method='linear' or a hybrid with fewer "
            "levels)")
    costliest = _costliest_product(estimate)
    if costliest is None:
        return
    if max_step_flops is not None and costliest.flops > AUTO_ESTIMATE_SLACK * max_step_flops:
        raise ScanCostError(f"{chain.describe_step(costliest)}, needs ~{costliest.flops:.3g} FLOPs "
                            "(estimated from the JTs' sizes, before building anything), over the limit of "
                            f"{max_step_flops}")
    planning = predicted_plan_seconds(estimate.symbolic_work, model)
    if planning > max_plan_seconds:
        raise ScanCostError(
            f"planning {label} would take ~{planning:,.0f} s "
            f"(~{estimate.symbolic_work:.2g} pattern entries and multiply-adds to enumerate, estimated from "
            f"the JTs' sizes before building anything; the costliest, {chain.describe_step(costliest)}, "
            f"~{costliest.flops / 2:.2g} multiply-adds), over the planning limit of {max_plan_seconds:g} s "
            f"(raise it with max_plan_seconds= or {PLAN_SECONDS_VARIABLE})")


class Sequential:
    """A chain of layers ``x_0 -> x_1 -> ... -> x_n``; backward is a scan of their JTs (a
    :class:`~sparse_scan.model.Model`).

    Parameters
    ----------
    *layers : Layer
        Applied in order. Unnamed layers are named by position (``"0"``, ``"1"``, ...), like PyTorch.

    Attributes
    ----------
    input_shape : tuple of int or None
        The per-sample input shape, when known (set by :func:`sparse_scan.load_model`).
    plan_builds : int
        How many scan plans were built (symbolic work); a cached plan is reused for every batch and
        batch size with the same per-sample input shape, method and levels.
    memory_budget : int or None
        Bytes one product's plan may hold (None: :data:`MEMORY_BUDGET_VARIABLE`, else half the memory
        available when planning); a schedule with a product whose result alone is estimated far over
        it is refused before anything is built.
    max_plan_seconds : float or None
        The longest predicted planning time of an explicit schedule
        (:func:`~sparse_scan.engine.cost.max_plan_seconds`: None for ``SPARSE_SCAN_MAX_PLAN_SECONDS``
        or 60 s); a costlier one is refused before anything is built.
    subnormals : SubnormalWatch
        The subnormal values the host backward's gradients were last seen to hold
        (:mod:`sparse_scan.engine.subnormals`): the cost model weighs the products they slow down.
    """

    def __init__(self, *layers: Layer, memory_budget: int | None = None,
                 input_shape: Sequence[int] | None = None, max_plan_seconds: float | None = None) -> None:
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        for position, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layer {position} is a {type(layer).__name__}, not a sparse_scan Layer")
            if layer.name is None:
                layer.name = str(position)
        # parameters and their gradients are keyed "<layer name>.<parameter>"
        names = [layer.name for layer in layers if hasattr(layer, "weight")]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"layers with parameters need unique names: {repeated[0]!r} names "
                             f"{names.count(repeated[0])} of them")
        self.layers: list[Layer] = list(layers)
        self.memory_budget = memory_budget
        self.max_plan_seconds = max_plan_seconds
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.plan_builds = 0
        self._subnormals = SubnormalWatch()
        self._plans: dict[Hashable, ScanPlan] = {}
        self._products: dict[Hashable, dict[tuple[Element, Element], ProductPlan]] = {}
        self._activations: list[Array] | None = None
        # the gradients a backward returned and their layers' parameter gradients started beside it
        self._beside: tuple[list[Array | None], dict[int, Future]] | None = None

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def subnormals(self) -> SubnormalWatch:
        """The watch over the host backward's subnormal gradient values (the one object the model's
        plans read: set its ``every``, not the attribute)."""
        return self._subnormals

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({layer.name}): {layer!r}" for layer in self.layers)
        return f"Sequential(\n{inner}\n)"

    # --- mode (PyTorch's train/eval) -------------------------------------------------------------
    def train(self, mode: bool = True) -> "Sequential":
        """Set every layer, nested ones included, to training mode (``mode=True``) or eval mode, like
        PyTorch's ``module.train(mode)``; return self.

        A layer's mode matters only to :class:`~sparse_scan.layers.Dropout` (masks in training mode)
        and :class:`~sparse_scan.layers.BatchNorm2d` (which refuses training mode). Specs load in eval
        mode unless they say ``training: true``.
        """
        for layer in self.layers:
            layer.train(mode)
        return self

    def eval(self) -> "Sequential":
        """Every layer in eval mode (PyTorch's ``module.eval()``): dropout is the identity; return
        self."""
        return self.train(False)

    # --- shapes and forward ------------------------------------------------------------------
    def shapes(self, in_shape: Sequence[int]) -> list[Shape]:
        """Per-sample shapes of ``x_0 .. x_n`` for a per-sample input shape."""
        shapes = [tuple(int(s) for s in in_shape)]
        for layer in self.layers:
            shapes.append(tuple(layer.output_shape(shapes[-1])))
        return shapes

    def forward(self, x: Array) -> Array:
        """Apply every layer to the batch ``x``; keep each layer's input for its Jacobian."""
        self._settle_beside()
        activations = [x]
        for layer in self.layers:
            activations.append(layer.forward(activations[-1]))
        self._activations = activations
        return activations[-1]

    __call__ = forward

    def transposed_jacobians(self) -> list[BatchedCSR]:
        """The batched JT of every layer at the last :meth:`forward` (layer order).

        Raises
        ------
        ScanMemoryError
            Their values and column indices for the batch would not fit the memory budget
            (:meth:`_check_jacobians_fit`).
        """
        activations = self._require_forward()
        entries = {}
        for index, (layer, x) in enumerate(zip(self.layers, activations, strict=False)):
            nnz = layer.pattern_nnz(tuple(x.shape[1:]))
            entries[index] = (nnz, 0) if layer.sample_independent else (0, nnz)
        self._check_jacobians_fit(entries, activations[0].shape[0], activations[0].dtype.itemsize,
                                  "the JTs of every layer")
        return [layer.transposed_jacobian(x) for layer, x in zip(self.layers, activations, strict=False)]

    def _check_jacobians_fit(self, entries: dict[int, tuple[int, int]], batch: int, itemsize: int,
                             what: str) -> None:
        """Refuse (:class:`~sparse_scan.engine.plan.ScanMemoryError`), before any is built, the JTs of
        the layers of ``entries`` (layer index -> ``(shared, per sample)`` entries, as
        :attr:`ScanPlan.element_bytes <sparse_scan.engine.plan.ScanPlan.element_bytes>` counts them)
        for ``batch`` samples where their values and column indices would not fit the memory budget
        (:attr:`memory_budget`, else :func:`default_memory_budget`); the message names ``what`` and the
        largest (a squeeze-and-excitation block's JT is dense: 1.6e11 entries for EfficientNet-B0's
        first at 224x224)."""
        if not entries:
            return
        nbytes = sum(shared * (itemsize + 8) + each * (batch * itemsize + 8)
                     for shared, each in entries.values())
        largest = max(entries, key=lambda i: sum(entries[i]))
        budget = self.memory_budget if self.memory_budget is not None else default_memory_budget()
        problem = _weights.budget_problem(
            nbytes, f"{what} for a batch of {batch} (the largest, layer '{self.layers[largest].name}' "
            f"({type(self.layers[largest]).__name__}), {sum(entries[largest]):,} entries)", budget)
        if problem is not None:
            raise ScanMemoryError(problem)

    def non_finite_output(self) -> str | None:
        """The name of the first layer whose output at the last :meth:`forward` holds NaN or Inf (a
        float overflow, say), or None when every output is finite."""
        activations = self._require_forward()
        for layer, output in zip(self.layers, activations[1:], strict=True):
            xp = _backend.of(output).xp
            if not bool(xp.all(xp.isfinite(output))):
                return layer.name
        return None

    def _shape_or_input(self, in_shape: Sequence[int] | None) -> Sequence[int]:
        """``in_shape``, or the model's :attr:`input_shape` for None."""
        if in_shape is not None:
            return in_shape
        if self.input_shape is None:
            raise ValueError("Sequential: give in_shape (the model has no input_shape)")
        return self.input_shape

    def _require_forward(self) -> list[Array]:
        if self._activations is None:
            raise RuntimeError("call forward(x) before backward/transposed_jacobians")
        return self._activations

    # --- planning ------------------------------------------------------------------------------
    def plan(self, in_shape: Sequence[int] | None = None, method: str = "auto",
             levels: int | str | None = None, *, batch: int = 1, device: str = "cpu",
             max_step_flops: int | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> ScanPlan:
        """The cached :class:`~sparse_scan.engine.plan.ScanPlan` for ``in_shape`` (by default
        :attr:`input_shape`), method and levels. A built plan serves every batch size and device;
        ``method="auto"`` chooses for ``batch`` samples on ``device``.

        ``method="auto"`` chooses among back-propagation (``linear``), the hybrids and ``blelloch``
        (hybrid depths ``0 .. depth(n) - 1``, whose schedules those are); ``hybrid`` with
        ``levels="auto"`` (or None) chooses the depth ``0 .. depth(n)``. The choice is the least
        predicted time of a backward's scan for ``batch`` samples on ``device``
        (:meth:`~sparse_scan.engine.plan.ScanPlan.predicted_seconds`: the cost model of
        :mod:`sparse_scan.engine.cost`, calibrated for this machine or its defaults) among the plans
        it builds, and it builds a plan only where cheap estimates allow
        (:func:`~sparse_scan.engine.plan.estimate_plan`: shapes and ``nnz`` of the JTs, nothing
        built): depths are tried shallow to deep, and deepening stops at the first depth whose
        building is predicted to take over :data:`AUTO_PLAN_SECONDS`, whose estimated plan exceeds
        the memory budget, or which has a product whose predicted time alone is over
        :data:`AUTO_ESTIMATE_SLACK` times the best so far (deeper plans repeat that depth's up-sweep
        products); a depth whose estimated time is over that factor is not built. Depth 0 builds no
        product, so the choice never fails. The returned plan's ``method``/``levels`` are the chosen
        schedule's and its ``choice`` (:class:`~sparse_scan.engine.plan.ScheduleChoice`) says why,
        with every candidate's predicted time. On the host the prediction weighs the subnormal
        gradient values last observed (:attr:`subnormals`): the choice is made again when their
        count per sample moves by an octave (:meth:`~sparse_scan.engine.subnormals.Subnormals.bucket`).

        An explicit schedule is refused with :class:`~sparse_scan.engine.plan.ScanCostError` before
        any pattern or product is built where its estimate says building it would take over
        :attr:`max_plan_seconds`, or has a product over :data:`AUTO_ESTIMATE_SLACK` times
        ``max_step_flops``; past that, a product whose exact count is over ``max_step_flops`` (a
        cached plan is returned whatever its cost; ``auto`` sets such schedules aside instead).
        ``progress(phase, done, total)`` is called while a plan is built: ``"sizes"`` and
        ``"patterns"`` (:meth:`chain_info`), ``"steps"`` and ``"product rows"``
        (:func:`~sparse_scan.engine.plan.build_plan`).
        """
        shape = tuple(int(s) for s in self._shape_or_input(in_shape))
        if method not in SCHEDULES:
            raise ValueError(f"method must be one of {', '.join(SCHEDULES)}; got {method!r}")
        if method == "hybrid" and levels is None:
            levels = "auto"
        auto = method == "auto" or (method == "hybrid" and levels == "auto")
        if method == "auto" and levels is not None:
            raise ValueError(f"levels applies to method='hybrid' only; got levels={levels!r} with "
                             "method='auto'")
        if not auto:
            checked_levels(len(self.layers), method, levels)
        structure = tuple(layer._structure_key() for layer in self.layers)
        # the auto choice depends on the limit, the batch, the device and on the host the subnormal
        # values last seen (abandoned depths are not cached plans)
        seen = self.subnormals.last if device == "cpu" else None
        key = (shape, method, levels, self.memory_budget, structure) + (
            (max_step_flops, int(batch), device, 0 if seen is None else seen.bucket()) if auto else ())
        plan = self._plans.get(key)
        if plan is None:
            plan = (self._auto_plan(shape, method, max_step_flops, progress, int(batch), device) if auto
                    else self._build_plan(shape, method, levels, max_step_flops, progress))
            self._plans[key] = plan
        return plan

    def estimate(self, in_shape: Sequence[int], method: str, levels: int | None = None) -> ScanPlan:
        """:func:`~sparse_scan.engine.plan.estimate_plan` of a schedule for ``in_shape``: its figures
        estimated from the JTs' shapes and ``nnz``, nothing built (not cached, not runnable)."""
        estimate = estimate_plan(self.chain_info(in_shape), method, levels)
        estimate.subnormals = self.subnormals
        return estimate

    def _auto_plan(self, shape: Shape, method: str, max_step_flops: int | None,
                   progress: Callable[[str, int, int], None] | None, batch: int, device: str) -> ScanPlan:
        full = depth(len(self.layers))
        model = current("gpu" if device == "gpu" else "cpu")

        def schedule_of(k: int) -> tuple[str, int | None]:
            return schedule_at_depth(method, k, full)

        budget = self.memory_budget if self.memory_budget is not None else default_memory_budget()
        # hybrid at depth(n) - 1 and at depth(n) is the same schedule as blelloch: build it once
        depths = range(max(full, 1))
        # depth 0 is back-propagation: no product, it never fails
        best = self.plan(shape, *schedule_of(0), max_step_flops=max_step_flops, progress=progress)
        best_s = best.predicted_seconds(batch, model)
        figures: list[ScanPlan] = [best]
        verdicts = ["built"]
        stop: str | None = None
        chain = self.chain_info(shape) if full > 1 else None
        # a product is counted exactly before it is built: none over auto's planning time
        unit = model.seconds["plan_unit"]
        limit = int(2 * AUTO_PLAN_SECONDS / unit) if unit > 0 else None
        why_limit = f"auto's {AUTO_PLAN_SECONDS:g} s of planning"
        if max_step_flops is not None and (limit is None or max_step_flops < limit):
            limit, why_limit = max_step_flops, "--max-step-flops"
        for k in depths[1:]:
            estimate = estimate_plan(chain, *schedule_of(k))
            estimate.subnormals = self.subnormals
            verdict, stops = stop, True
            if stop is None:
                verdict, stops = _auto_verdict(estimate, best_s, batch, model, max_step_flops, budget)
            if verdict is None:
                try:
                    plan = self.plan(shape, *schedule_of(k), max_step_flops=limit, progress=progress)
                except ScanCostError:
                    verdict = f"abandoned: a product costs more than {limit:,} FLOPs ({why_limit})"
                except ScanMemoryError:
                    verdict = "abandoned: a product's plan is over the memory budget"
                else:
                    verdict, stops, estimate = "built", False, plan
                    predicted = plan.predicted_seconds(batch, model)
                    if predicted < best_s:
                        best, best_s = plan, predicted
            if stops and stop is None:  # deeper plans repeat this depth's up-sweep products
                method_k, levels_k = schedule_of(k)
                stop = f"not built: deeper than {method_k}{'' if levels_k is None else f' {levels_k}'}"
            figures.append(estimate)
            verdicts.append(verdict)
        candidates = tuple(
            Candidate(*schedule_of(k), plan.critical_flops, plan.work_flops, plan.plan_bytes,
                      plan.estimated, "chosen" if plan is best else verdict,
                      plan.predicted_seconds(batch, model))
            for k, plan, verdict in zip(depths, figures, verdicts, strict=True))
        criterion = (f"the least predicted time for batch {batch} on the {model.device} (cost model: "
                     f"{model.source}) of the schedules built")
        return dataclasses.replace(best, choice=ScheduleChoice(method, criterion, candidates))

    def chain_info(self, in_shape: Sequence[int], patterns_of: Sequence[int] = (),
                   progress: Callable[[str, int, int], None] | None = None, *,
                   sized: ChainInfo | None = None) -> ChainInfo:
        """The chain of JTs for ``in_shape`` as the planner sees it: plain data read from the layers
        once (:class:`~sparse_scan.engine.plan.ChainInfo`; scan element ``j`` is the JT of layer
        ``n - j``), which :func:`~sparse_scan.engine.plan.build_plan` and
        :func:`~sparse_scan.engine.plan.estimate_plan` read instead of asking the layers.

        Parameters
        ----------
        in_shape : sequence of int
            Per-sample input shape.
        patterns_of : sequence of int
            The elements whose patterns to include (built now, the costly part:
            :func:`~sparse_scan.engine.plan.operands_needing_patterns` of a schedule); none for an
            estimate.
        progress : callable, optional
            ``progress("sizes", done, n)`` after each JT's ``nnz`` (a residual block's needs its
            pattern: seconds each), ``progress("patterns", done, total)`` after each pattern built.
        sized : ChainInfo, optional
            This chain's record without patterns, already read (its sizes are not read again).
        """
        n = len(self.layers)
        shapes = self.shapes(in_shape)
        # (layer, its input shape, its output shape) of scan element j at [j - 1]
        elements = [(self.layers[n - j], shapes[n - j], shapes[n - j + 1]) for j in range(1, n + 1)]
        if sized is not None:
            infos = list(sized.elements)
        else:
            infos = []
            for done, (layer, layer_in, layer_out) in enumerate(elements, start=1):
                infos.append(ElementInfo((math.prod(layer_in), math.prod(layer_out)),
                                         layer.pattern_nnz(layer_in), layer.jacobian_kind,
                                         layer.sample_independent, layer.jacobian_fill_flops(layer_in)))
                if progress is not None:
                    progress("sizes", done, n)
        patterns: dict[int, Pattern] = {}
        for done, j in enumerate(patterns_of, start=1):
            layer, layer_in, _ = elements[j - 1]
            patterns[j] = layer.pattern(layer_in)
            if progress is not None:
                progress("patterns", done, len(patterns_of))
        inputs = shapes[::-1]  # vector j is the gradient w.r.t. x_{n - j}
        return ChainInfo(
            elements=tuple(infos),
            vector_sizes=tuple(math.prod(shape) for shape in inputs),
            vector_channels=tuple(int(shape[0]) if shape else 1 for shape in inputs),  # a scalar: one
            names=tuple(str(layer.name) for layer, _, _ in elements),
            weights=tuple(layer.weights_path(layer_in) for layer, layer_in, _ in elements),
            patterns=patterns)

    def _build_plan(self, shape: Shape, method: str, levels: int | None, max_step_flops: int | None,
                    progress: Callable[[str, int, int], None] | None) -> ScanPlan:
        structure = tuple(layer._structure_key() for layer in self.layers)
        products = self._products.setdefault((shape, structure, self.memory_budget), {})
        budget = self.memory_budget if self.memory_budget is not None else default_memory_budget()
        sized = self.chain_info(shape, progress=progress)
        if method != "linear":  # refused at once, from the JTs' sizes, rather than after hours
            _refuse_by_estimate(sized, method, levels, max_step_flops,
                                max_plan_seconds(self.max_plan_seconds), current("cpu"), budget)
        self.plan_builds += 1
        chain = self.chain_info(shape, operands_needing_patterns(len(self.layers), method, levels), progress,
                                sized=sized)
        plan = build_plan(chain, method, levels, products, budget, max_step_flops, progress)
        plan.subnormals = self.subnormals  # what its predictions weigh of the gradients' values
        return plan

    # --- parameters ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Array]:
        """``"<layer>.<parameter>"`` -> the parameter array (the array itself, not a copy), named like
        PyTorch's ``state_dict()`` of the same ``nn.Sequential``."""
        return _weights.state_dict(self)

    def load_state_dict(self, state: dict[str, Array], strict: bool = True) -> None:
        """Copy parameters in by :meth:`state_dict` name (PyTorch's ``load_state_dict``: cast to each
        parameter's dtype; ``strict`` requires every parameter). A ``ValueError`` names the first bad
        key and changes nothing (:func:`sparse_scan.weights.load_state_dict`)."""
        _weights.load_state_dict(self, state, strict)

    # --- parameter gradients ---------------------------------------------------------------------
    def parameter_gradients(self, grads: Sequence[Array],
                            timings: dict[str, float] | None = None) -> dict[str, Array]:
        """Gradients of every weight and bias (paper Eq. 2), summed over the batch like PyTorch.

        Parameters
        ----------
        grads : sequence of ndarray
            :meth:`backward`'s result for the last :meth:`forward`: ``grads[i + 1]`` is the gradient
            w.r.t. layer ``i``'s output.
        timings : dict, optional
            Receives ``parameter_grads_s``, the seconds they took (on the GPU up to a synchronisation).

        Returns
        -------
        dict
            ``"<layer>.weight"`` and ``"<layer>.bias"`` (state_dict names) for layers with parameters.
        """
        activations = self._require_forward()
        if len(grads) != len(activations):
            raise ValueError(f"expected {len(activations)} gradients (x_0 .. x_n), got {len(grads)}")
        start = time.perf_counter()
        started = self._settle_beside(grads)
        out = {}
        for index, layer in enumerate(self.layers):
            if hasattr(layer, "parameter_gradients"):
                job = started.get(index)
                if job is not None and not job.cancel():  # running or done beside the scan
                    values = job.result()
                else:  # not started beside (the queue's last first: it runs from the last layer back)
                    values = layer.parameter_gradients(activations[index], grads[index + 1])
                for name, value in values.items():
                    out[_weights.scoped_name(str(layer.name), layer, name)] = value
        if timings is not None:
            _backend.of(activations[0]).synchronize()
            timings["parameter_grads_s"] = time.perf_counter() - start
        return out

    def check_reference(self, method: str) -> str:
        """What ``sparse-scan run --check`` compares the schedule ``method``'s gradients with:
        ``linear``, back-propagation by the linear scan, or where ``method`` is the linear scan,
        ``layerwise``, back-propagation outside the engine (:meth:`reference_backward`)."""
        return "layerwise" if method == "linear" else "linear"

    def check_backward(self, grad_out: Array, method: str) -> list[Array]:
        """:meth:`backward`'s gradients by :meth:`check_reference` of ``method``, on the forward's
        device."""
        if self.check_reference(method) == "linear":
            return self.backward(grad_out, "linear")
        be = _backend.of(self._require_forward()[0])
        return [be.asarray(g) for g in self.reference_backward(grad_out)]

    def jacobian_sizes(self, in_shape: Sequence[int] | None = None) -> list[JacobianSize]:
        """Every layer's JT for one sample of ``in_shape`` (by default :attr:`input_shape`): its name,
        class name, shape ``(in_size, out_size)`` and stored entries, counted without building a
        pattern where the layer can (:meth:`~sparse_scan.layers.Layer.pattern_nnz`)."""
        shapes = self.shapes(self._shape_or_input(in_shape))
        return [JacobianSize(str(layer.name), type(layer).__name__,
                             (math.prod(shapes[index]), math.prod(shapes[index + 1])),
                             layer.pattern_nnz(shapes[index]))
                for index, layer in enumerate(self.layers)]

    # --- backward ------------------------------------------------------------------------------
    def reference_backward(self, grad_out: Array) -> list[Array]:
        """:meth:`backward`'s gradients computed outside the scan engine, to check a scan against
        (``sparse-scan run --check``): back-propagation layer by layer, each layer's JT values at the
        last :meth:`forward` applied by SciPy on the host (:mod:`sparse_scan._layerwise`). Host
        arrays, shaped like the activations."""
        flat = layerwise_backward(self, grad_out)
        return [g.reshape(x.shape) for g, x in zip(flat, self._require_forward(), strict=True)]

    def _settle_beside(self, grads: Sequence[Array | None] | None = None) -> dict[int, Future]:
        """The parameter gradients started beside the backward that returned ``grads`` (by layer
        index); any others are waited for and dropped (a forward, a backward or another list of
        gradients comes first: nothing runs beside them)."""
        beside, self._beside = self._beside, None
        if beside is None:
            return {}
        made_for, jobs = beside
        if grads is not None and grads is made_for:
            return jobs
        for job in jobs.values():  # the ones not started never run
            job.cancel()
        concurrent.futures.wait(list(jobs.values()))
        return {}

    def backward(self, grad_out: Array, method: str = "auto", levels: int | str | None = None,
                 device: str | None = None, timings: dict[str, float] | None = None,
                 input_gradient: bool = True, parameters_beside: bool = False) -> list[Array | None]:
        """Gradients w.r.t. every activation, by a scan over the layers' transposed Jacobians.

        Parameters
        ----------
        grad_out : ndarray, shape (B, *out_shape)
            Gradient of the loss w.r.t. the model output ``x_n``.
        method : {"auto", "linear", "blelloch", "hybrid"}
            The scan's schedule; ``auto`` chooses one (:meth:`plan`).
        levels : int or "auto", optional
            Up-sweep levels of ``hybrid`` (None: ``"auto"``).
        device : {"cpu", "gpu", "auto"}, optional
            Where to run; by default where the forward's arrays live.
        timings : dict, optional
            Receives the seconds of each phase: ``plan_s`` (a cache hit costs ~0), ``values_s``
            (the JTs' values for this batch) and ``scan_s`` (the numeric scan; on the GPU it ends
            with a synchronisation so that the time is the kernels').
        input_gradient : bool, optional
            False: the gradient w.r.t. the model input ``x_0`` is not wanted (a training step's
            parameter gradients never read it): None in its place, and the host skips the steps and
            the JT values only it needs (the first layer's transposed product; autograd skips it
            too when the input requires no gradient).
        parameters_beside : bool, optional
            True: on the host, each layer whose parameter gradients may run beside the scan
            (``WeightedLayer.parameters_beside_scan``: a pruned layer's sampled product) starts them
            on a second thread as soon as the scan has its output's gradient, and
            :meth:`parameter_gradients` of the list returned collects them, running itself the ones
            not started yet (the same values: the same kernels on the same arrays). For a caller that
            asks for the parameter gradients next (a training step); the next :meth:`forward` or
            :meth:`backward` drops any left (waiting for the ones running).

        Returns
        -------
        list of ndarray
            ``[grad wrt x_0, ..., grad wrt x_n]``, each shaped like that activation, batch first
            (the first None where ``input_gradient`` is False).

        Raises
        ------
        ScanMemoryError
            The JT values the run fills (those not applied through their layers' weights or inputs:
            on the GPU every one its steps read) would not fit the memory budget, refused before any
            is filled (:meth:`_check_jacobians_fit`).
        """
        activations = self._require_forward()
        self._settle_beside()
        be = _backend.of(activations[0]) if device is None else _backend.get(device)
        shapes = [tuple(a.shape[1:]) for a in activations]
        grad_out = be.asarray(grad_out)
        if grad_out.dtype.kind not in "fiu":
            raise ValueError(f"grad_out: expected real numbers, got {grad_out.dtype}")
        output_dtype = activations[-1].dtype
        if grad_out.dtype.kind == "f" and grad_out.dtype != output_dtype:
            raise ValueError(f"grad_out: dtype {grad_out.dtype} does not match the output's {output_dtype}; "
                             f"convert it (grad_out.astype({output_dtype.name!r}))")
        if tuple(grad_out.shape) != tuple(activations[-1].shape):
            raise ValueError(f"grad_out has shape {tuple(grad_out.shape)}; the output has "
                             f"{tuple(activations[-1].shape)}")
        clock = [time.perf_counter()]

        def lap(name: str) -> None:
            clock.append(time.perf_counter())
            if timings is not None:
                timings[name] = clock[-1] - clock[-2]

        plan = self.plan(shapes[0], method, levels, batch=grad_out.shape[0], device=be.name)
        lap("plan_s")
        n = len(self.layers)  # scan element j is the JT of layer n - j
        batch = grad_out.shape[0]
        outputs = None if input_gradient else frozenset(range(1, n + 1))
        through = through_weights(be, plan, batch)  # JTs applied through their layers' weights
        # bound here, on this thread, run on the scan's threads
        matvecs = {j: self.layers[n - j].weights_matvec(shapes[n - j], be.name) for j in through}
        operators = {j: self.layers[n - j].input_matvec(activations[n - j])
                     for j in through_inputs(plan) - through}  # ... or from their layers' inputs
        operators = {j: operator for j, operator in operators.items() if operator is not None}
        matvecs.update(operators)
        valueless = plan.weights.valueless(through) | operators.keys()
        if outputs is not None and be.name == "cpu":  # the GPU's level launches read every JT
            valueless |= plan.needed_steps(outputs)[1]
        self._check_jacobians_fit({index: plan.element_bytes[Element(n - index, n - index)]
                                   for index in range(n) if n - index not in valueless},
                                  batch, activations[0].dtype.itemsize, "the JT values this backward fills")
        jacobians = [None if n - index in valueless else layer.transposed_jacobian(be.asarray(x))
                     for index, (layer, x) in enumerate(zip(self.layers, activations, strict=False))]
        if timings is not None:
            be.synchronize()  # the fills are asynchronous on a GPU
        lap("values_s")
        jobs: dict[int, Future] = {}
        ready = None
        if parameters_beside and be.name == "cpu":
            last = 0 if input_gradient else 1  # the scan's last gradient: nothing left to run beside

            def ready(i: int, grad: Array) -> None:  # the output gradient of layer i - 1
                layer = self.layers[i - 1] if i > last else None
                beside = getattr(layer, "parameters_beside_scan", None)
                if beside is not None and beside(activations[i - 1]):
                    jobs[i - 1] = submit_beside(layer.parameter_gradients, activations[i - 1],
                                                grad.reshape((batch,) + shapes[i]))
        try:
            flat = run_plan(be, plan, grad_out.reshape(batch, -1), jacobians[::-1], weights_matvecs=matvecs,
                            outputs=outputs, ready=ready)
        except BaseException:  # nothing left running beside a failed scan
            concurrent.futures.wait(list(jobs.values()))
            raise
        if timings is not None:
            be.synchronize()
        lap("scan_s")
        if be.name == "cpu":  # a GPU runs subnormals at full speed
            self.subnormals.observe([g for g in flat if g is not None])
        grads = [None if g is None else g.reshape((batch,) + shape)
                 for g, shape in zip(flat, shapes, strict=True)]
        if jobs:
            self._beside = (grads, jobs)
        return grads
