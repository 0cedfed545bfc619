"""Plans of scans over sparse transposed Jacobians: the schedule with every product's symbolic work done.

:func:`build_plan` turns a schedule (:mod:`sparse_scan.engine.schedule`) into a :class:`ScanPlan`: a
list of steps whose symbolic work (the pattern of every product and the index structure of its numeric
phase, :mod:`sparse_scan.engine.products`) is done once; steps whose result nothing uses are dropped.
The executors (:mod:`sparse_scan.engine.run`) run its numeric phase for every batch.

:func:`estimate_plan` walks the same schedule with estimated figures only (shapes and ``nnz`` of the
layers' JTs, no pattern arrays, no product): it lets a caller choose a schedule (``method="auto"`` of
:meth:`sparse_scan.Sequential.plan`) before building anything costly.

Both read one frozen record of the chain, :class:`ChainInfo` (plain data, no callback): its patterns
are those of :func:`operands_needing_patterns`, a pure function of the schedule, so that a caller
builds a layer's pattern only where a product needs it. Which mv steps go through a layer's weights
instead of its JT's values follows the rules of the weights path
(:mod:`sparse_scan.engine._weights_path`: :class:`WeightsPath`, :class:`WeightsPlan`).

This module imports no executor: plans are plain data the CPU and GPU executors both read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..csr import Pattern
from ._chain import ChainInfo, ElementInfo
from ._weights_path import WeightsPath, WeightsPlan, gemm_pays, weights_plan
from .cost import CostModel, current, sparse_features
from .products import PRODUCT_PLAN_BYTES, PlanBudgetError, ProductPlan, count_multiply_adds, plan_product
from .schedule import Element, checked_levels, live_schedule, scan_outputs

if TYPE_CHECKING:
    from .subnormals import Subnormals

__all__ = ["Candidate", "ChainInfo", "ElementInfo", "ScanCostError", "ScanMemoryError", "ScanPlan",
           "ScheduleChoice", "Step", "WeightsPath", "WeightsPlan", "build_plan", "estimate_plan",
           "operands_needing_patterns"]


class ScanMemoryError(MemoryError):
    """A scan step cannot be planned within the memory budget, even with the lean method."""


class ScanCostError(RuntimeError):
    """A scan step would cost more FLOPs than the plan's ``max_step_flops`` allows.

    Raised before the step's symbolic product is built (counting its multiply-adds is cheap,
    expanding them is not), so a search over schedules can give up on one early.
    """


@dataclass
class Step:
    """One operation of a plan: ``out = right · left`` (``left ◇ right``), or a move.

    Attributes
    ----------
    level : int
        Position on the critical path: steps of one level are independent.
    phase : {"up", "linear", "down", "final"}
    kind : {"mm", "mv"}
        Matrix-matrix (SpGEMM or scaling) or matrix-vector product.
    left, right, out : Element
        Operands and result, as segments of the scan input.
    shape : tuple of int
        ``(m, k, n)`` of ``right (m×k) · left (k×n)``; ``n`` is 1 for a vector.
    flops : int
        Over the pattern (docs/design.md's FLOP counting).
    flops_live : int
        Over the live entries only (selections count one entry per output, scalings one multiply).
    out_nnz : int
        Stored entries of the result (the vector length for mv).
    plan_bytes : int
        Index structure the numeric phase keeps for this step.
    dense : bool
        An mv by one layer's JT that the CPU runs as a dense GEMM over the layer's weights
        (``gemm_pays`` of the weights path; ``Layer.weights_matvec``) instead of a CSR SpMV; the GPU
        scan runs it as an SpMV in its level launch.
    """

    level: int
    phase: str
    kind: str
    left: Element
    right: Element
    out: Element
    shape: tuple[int, int, int] = (0, 0, 0)
    flops: int = 0
    flops_live: int = 0
    out_nnz: int = 0
    plan_bytes: int = 0
    product: ProductPlan | None = None
    scaling: bool = False
    dense: bool = False

    @property
    def method(self) -> str:
        """How the numeric phase computes it: ``scale`` (mv by a diagonal), ``gemm`` (mv through a
        layer's dense weights), ``spmv`` or the product plan's method."""
        if self.product is not None:
            return self.product.method
        if self.kind == "mm":  # a step of an estimate (:func:`estimate_plan`): no product planned
            return "scale (estimate)" if self.scaling else "estimate"
        return "scale" if self.scaling else "gemm" if self.dense else "spmv"

    def as_dict(self) -> dict[str, Any]:
        """The step's report fields (JSON-friendly)."""
        return {"level": self.level, "phase": self.phase, "kind": self.kind, "method": self.method,
                "left": [self.left.lo, self.left.hi], "right": [self.right.lo, self.right.hi],
                "mnk": list(self.shape), "flops": self.flops, "flops_live": self.flops_live,
                "out_nnz": self.out_nnz, "plan_bytes": self.plan_bytes}


@dataclass(frozen=True)
class Candidate:
    """One schedule ``method="auto"`` considered, with its figures and the verdict on it.

    Attributes
    ----------
    method : str
    levels : int or None
    critical_flops, work_flops, plan_bytes : int
        The built plan's figures, or :func:`estimate_plan`'s where ``estimated``.
    estimated : bool
        Not built: the figures are estimates.
    verdict : str
        ``"chosen"``, or why not.
    predicted_s : float or None
        The cost model's predicted seconds of a backward (:mod:`sparse_scan.engine.cost`) for the
        batch the choice was made for.
    """

    method: str
    levels: int | None
    critical_flops: int
    work_flops: int
    plan_bytes: int
    estimated: bool
    verdict: str
    predicted_s: float | None = None

    @property
    def label(self) -> str:
        """``linear``, ``blelloch`` or ``hybrid N``."""
        return self.method if self.levels is None else f"{self.method} {self.levels}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields."""
        return {"method": self.method, "levels": self.levels, "critical_flops": self.critical_flops,
                "work_flops": self.work_flops, "plan_bytes": self.plan_bytes, "estimated": self.estimated,
                "predicted_s": self.predicted_s, "verdict": self.verdict}


@dataclass(frozen=True)
class ScheduleChoice:
    """How a schedule was chosen (``method="auto"``, or ``hybrid`` with ``levels="auto"``).

    Attributes
    ----------
    requested : str
        ``"auto"`` or ``"hybrid"`` (depth only).
    criterion : str
        What was minimised, in words.
    candidates : tuple of Candidate
        In the order considered; exactly one is ``chosen``.
    """

    requested: str
    criterion: str
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        """The candidate chosen."""
        return next(c for c in self.candidates if c.verdict == "chosen")

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields."""
        return {"requested": self.requested, "criterion": self.criterion,
                "candidates": [c.as_dict() for c in self.candidates]}


@dataclass
class ScanPlan:
    """A schedule with the symbolic work of every step done.

    Attributes
    ----------
    method : str
    levels : int or None
        Up-sweep levels of a ``hybrid`` plan.
    n : int
        Number of layers (JTs) in the chain.
    steps : list of Step
    outputs : list of Element
        ``outputs[i]`` holds the gradient w.r.t. ``x_i`` (``i = 0..n``).
    element_bytes : dict
        Per scan value, its entries ``(shared, per sample)``.
    estimated : bool
        Figures of :func:`estimate_plan` (no product planned): not runnable.
    symbolic_work : int
        An estimate's symbolic work: the JT pattern entries and the general products' multiply-adds
        that building the plan would enumerate (0 for a built plan).
    choice : ScheduleChoice, optional
        How ``method="auto"`` (or hybrid ``levels="auto"``) chose this plan.
    weights : WeightsPlan
        Which layer JTs a host run may apply through their layers' weights.
    fill_flops : tuple of int
        ``(critical, work)``: FLOPs per sample of filling the values of the JTs the plan's products
        read where those values are themselves products (residual blocks: ``ElementInfo.fill_flops``).
        The fills precede the products and are independent of each other, so the critical path
        holds the costliest and the work all of them; both are in :attr:`critical_flops` and
        :attr:`work_flops`. An mv step applies such a layer through its chains (no fill).
    subnormals : callable, optional
        Returns the subnormal values its model's gradients were last seen to hold
        (:class:`~sparse_scan.engine.subnormals.Subnormals`, or None: none counted), which
        :meth:`features` weighs; set by the model that caches the plan
        (:class:`~sparse_scan.engine.subnormals.SubnormalWatch`).
    """

    method: str
    levels: int | None
    n: int
    steps: list[Step]
    outputs: list[Element]
    element_bytes: dict[Element, tuple[int, int]] = field(default_factory=dict)
    estimated: bool = False
    symbolic_work: int = 0
    choice: ScheduleChoice | None = None
    weights: WeightsPlan = field(default_factory=WeightsPlan)
    fill_flops: tuple[int, int] = (0, 0)
    subnormals: Callable[[], Subnormals | None] | None = field(default=None, compare=False, repr=False)

    @property
    def critical_flops(self) -> int:
        """Sum over levels of the most expensive step of the level, and the costliest JT fill
        (:attr:`fill_flops`)."""
        by_level: dict[int, int] = {}
        for step in self.steps:
            by_level[step.level] = max(by_level.get(step.level, 0), step.flops)
        return sum(by_level.values()) + self.fill_flops[0]

    @property
    def work_flops(self) -> int:
        """FLOPs of every step and of every JT fill (:attr:`fill_flops`)."""
        return sum(step.flops for step in self.steps) + self.fill_flops[1]

    @property
    def plan_bytes(self) -> int:
        """Index structure held for the numeric phase."""
        return sum(step.plan_bytes for step in self.steps)

    @property
    def critical_steps(self) -> int:
        """Number of levels (sequential steps) on the critical path."""
        return len({step.level for step in self.steps})

    @functools.cached_property
    def releases(self) -> list[list[Element]]:
        """Per step, the values whose last use it is (outputs are kept to the end)."""
        last_use: dict[Element, int] = {}
        for index, step in enumerate(self.steps):
            last_use[step.left] = index
            last_use[step.right] = index
        kept = set(self.outputs)
        released: list[list[Element]] = [[] for _ in self.steps]
        for element, index in last_use.items():
            if element not in kept:
                released[index].append(element)
        return released

    def needed_steps(self, outputs: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The steps that the gradients w.r.t. ``x_i`` for ``i`` in ``outputs`` need, and the scan
        elements ``j`` (the layer JTs) none of those steps reads (cached per set): a run that wants
        fewer than every gradient (a training step never reads the model input's) skips the rest, as
        autograd skips what no input requires."""
        known = self._needed.get(outputs)
        if known is None:
            wanted = {self.outputs[i] for i in outputs}
            steps: set[int] = set()
            for index in range(len(self.steps) - 1, -1, -1):  # producers come before their readers
                step = self.steps[index]
                if step.out in wanted:
                    steps.add(index)
                    wanted.update((step.left, step.right))
            unread = frozenset(j for j in range(1, self.n + 1) if Element(j, j) not in wanted)
            known = self._needed[outputs] = (frozenset(steps), unread)
        return known

    @functools.cached_property
    def _needed(self) -> dict[frozenset[int], tuple[frozenset[int], frozenset[int]]]:
        return {}

    @functools.cached_property
    def levels_of_steps(self) -> list[list[int]]:
        """Indices of the steps of every level, in level order."""
        levels: dict[int, list[int]] = {}
        for index, step in enumerate(self.steps):
            levels.setdefault(step.level, []).append(index)
        return [levels[level] for level in sorted(levels)]

    def features(self, batch: int, threads: int) -> dict[str, float]:
        """The cost model's features of a run for ``batch`` samples, a level's steps spread over
        ``threads`` (:func:`~sparse_scan.engine.cost.sparse_features`), with the subnormal values
        last observed (:attr:`subnormals`)."""
        return sparse_features(self, batch, threads, self.subnormals() if self.subnormals else None)

    def predicted_seconds(self, batch: int = 1, model: CostModel | str = "cpu") -> float:
        """Predicted seconds of a backward's scan for ``batch`` samples: ``model``'s
        (:class:`~sparse_scan.engine.cost.CostModel`, or a device whose current model to use,
        :func:`~sparse_scan.engine.cost.current`) weighing of :meth:`features`."""
        model = current(model) if isinstance(model, str) else model
        return model.predict(self.features(batch, model.threads))

    def peak_bytes(self, batch: int, itemsize: int, device: str = "cpu") -> int:
        """Peak bytes of live scan values for ``batch`` samples of ``itemsize``-byte values.

        The inputs (``g_n`` and every JT) are live from the start; the results of a level from that
        level (its steps may run at once); every value until the end of the level of its last use,
        and the gradients to the end. On the CPU the JTs that only GEMMs over their layers' weights
        read (``weights.gemm_only``) hold no values; the GPU (``device="gpu"``) holds them.
        """
        valueless = self.weights.gemm_only if device == "cpu" else frozenset()

        def size(element: Element) -> int:
            if element.lo == element.hi and element.lo in valueless:
                return 0
            shared, per_sample = self.element_bytes[element]
            return (shared + per_sample * batch) * itemsize

        live = sum(size(Element(j, j)) for j in range(self.n + 1))
        peak = live
        for level in self.levels_of_steps:
            live += sum(size(self.steps[index].out) for index in level)
            peak = max(peak, live)
            live -= sum(size(element) for index in level for element in self.releases[index])
        return peak

    def explain(self, batch: int = 1, itemsize: int = 4, device: str = "cpu") -> dict[str, Any]:
        """The schedule and why (JSON-friendly): ``method``, ``levels``, ``requested`` (``"auto"``,
        ``"hybrid"`` for a chosen depth, or the method itself), ``reason`` (one line),
        ``critical_flops``, ``work_flops``, ``critical_steps``, ``plan_bytes``, ``peak_bytes`` (for
        ``batch`` samples of ``itemsize`` bytes on ``device``), ``predicted_s`` (the backward's
        predicted seconds for ``batch`` samples on ``device``, :meth:`predicted_seconds`),
        ``fill_flops`` (``critical`` and ``work``: the JT fills inside the two FLOP figures,
        :attr:`fill_flops`) and, for a chosen schedule, the ``candidates`` considered
        (:class:`Candidate`)."""
        out: dict[str, Any] = {
            "method": self.method, "levels": self.levels,
            "requested": self.method if self.choice is None else self.choice.requested,
            "reason": "as requested" if self.choice is None else self.choice.criterion,
            "critical_flops": self.critical_flops, "work_flops": self.work_flops,
            "critical_steps": self.critical_steps, "plan_bytes": self.plan_bytes,
            "peak_bytes": self.peak_bytes(batch, itemsize, device),
            "predicted_s": self.predicted_seconds(batch, device),
            "fill_flops": {"critical": self.fill_flops[0], "work": self.fill_flops[1]}}
        if self.choice is not None:
            out["candidates"] = [c.as_dict() for c in self.choice.candidates]
        return out

    def report(self, batch: int = 1, itemsize: int = 4, device: str = "cpu") -> dict[str, Any]:
        """Per-step figures and totals (JSON-friendly); ``peak_bytes`` for ``device``."""
        return {
            "method": self.method, "levels": self.levels, "n": self.n,
            "steps": [step.as_dict() for step in self.steps],
            "totals": {"critical_flops": self.critical_flops, "work_flops": self.work_flops,
                       "critical_steps": self.critical_steps, "plan_bytes": self.plan_bytes,
                       "peak_bytes": self.peak_bytes(batch, itemsize, device)},
        }


def operands_needing_patterns(n: int, method: str, levels: int | None) -> tuple[int, ...]:
    """The scan elements (layer JTs ``j``) whose patterns a plan of this schedule reads: the operands
    of its products (an mv needs an element's shape and ``nnz`` alone, so a chain of mvs reads none).

    Examples
    --------
    >>> operands_needing_patterns(4, "linear", None)
    ()
    >>> operands_needing_patterns(4, "blelloch", None)   # the product JT_2 · JT_3 (g_4 · JT_1 is an mv)
    (2, 3)
    """
    levels = checked_levels(n, method, levels)
    return tuple(sorted({element.lo for _, _, left, right in live_schedule(n, method, levels)
                         if not left.is_vector for element in (left, right) if element.lo == element.hi}))


def _element_bytes(chain: ChainInfo) -> dict[Element, tuple[int, int]]:
    """``(shared, per sample)`` entries of ``g_n`` and of every JT."""
    element_bytes: dict[Element, tuple[int, int]] = {Element(0, 0): (0, chain.vector_sizes[0])}
    for j, info in enumerate(chain.elements, start=1):
        element_bytes[Element(j, j)] = (info.nnz, 0) if info.shared else (0, info.nnz)
    return element_bytes


def build_plan(
    chain: ChainInfo,
    method: str,
    levels: int | None,
    product_cache: dict[tuple[Element, Element], ProductPlan],
    budget_bytes: int | None = None,
    max_step_flops: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> ScanPlan:
    """Plan a scan over a chain of JTs: schedule, dead-step elimination, symbolic products.

    Parameters
    ----------
    chain : ChainInfo
        The chain, with the patterns of :func:`operands_needing_patterns` for this schedule.
    method : {"linear", "blelloch", "hybrid"}
    levels : int or None
        Up-sweep levels for ``hybrid`` (0 .. ``depth(n)``).
    product_cache : dict
        Symbolic products shared between plans of one chain (keyed by operand segments).
    budget_bytes : int, optional
        Memory one product's plan may hold; past it the lean ``rowwise`` method is used, and a
        :class:`ScanMemoryError` names the step when even that does not fit.
    max_step_flops : int, optional
        Give up with :class:`ScanCostError` before planning a product of more FLOPs (over the
        pattern) than this: deep levels of large networks can need billions of multiply-adds.
    progress : callable, optional
        ``progress("steps", done, total)`` before the first step and after each step is planned, and
        ``progress("product rows",
        done, rows)`` after each chunk of rows of a scalar symbolic product
        (:func:`~sparse_scan.engine.products.plan_product`'s ``progress``): long plan builds can show
        progress, one product of minutes included.

    Products of dense channel blocks run as batched GEMMs (``chain.vector_channels``,
    :mod:`sparse_scan.engine._blocks`); an mv by a JT whose layer's weights make it a cheaper GEMM
    (``chain.weights``, :func:`~sparse_scan.engine._weights_path.gemm_pays`) is marked ``dense``, and
    the plan's :attr:`ScanPlan.weights` says which JTs a host run may apply through their weights.
    """
    report = progress if progress is not None else (lambda phase, done, total: None)
    n = chain.n
    levels = checked_levels(n, method, levels)
    kept = live_schedule(n, method, levels)
    missing = sorted(set(operands_needing_patterns(n, method, levels)) - set(chain.patterns))
    if missing:
        raise ValueError(f"build_plan: the chain lacks the patterns of elements {missing}, operands of the "
                         "schedule's products (operands_needing_patterns)")

    info = {Element(j, j): element for j, element in enumerate(chain.elements, start=1)}
    patterns: dict[Element, Pattern] = {Element(j, j): pattern for j, pattern in chain.patterns.items()}
    element_bytes = _element_bytes(chain)
    reads: dict[str, set[int]] = {"gemm": set(), "mv": set(), "products": set()}
    steps = []

    def rows_done(done: int, rows: int) -> None:
        report("product rows", done, rows)

    report("steps", 0, len(kept))
    for lvl, phase, left, right in kept:
        out = Element(left.lo, right.hi)
        right_info = info[right]
        right_kind = right_info.kind
        m, k = right_info.shape
        step = Step(lvl, phase, "mv" if left.is_vector else "mm", left, right, out)
        if left.is_vector:
            step.scaling = right_kind == "diagonal"
            step.dense = (not step.scaling and right.lo == right.hi
                          and gemm_pays(right_info.nnz, chain.weights[right.lo - 1], right_info.fill_flops))
            step.shape = (m, k, 1)
            step.flops = 2 * right_info.nnz
            step.flops_live = right_info.nnz if right_kind == "diagonal" else (
                2 * k if right_kind == "selection" else step.flops)
            step.out_nnz = m
            element_bytes[out] = (0, m)
            if right.lo == right.hi:
                reads["gemm" if step.dense else "mv"].add(right.lo)
        else:
            step.product = _planned_product(chain, step, patterns, info, product_cache, budget_bytes,
                                            max_step_flops, rows_done)
            product = step.product
            step.shape = (m, k, patterns[left].shape[1])
            step.flops = product.flops
            step.flops_live = product.flops_live
            step.out_nnz = product.out.nnz
            step.plan_bytes = product.nbytes
            kind = "diagonal" if right_kind == info[left].kind == "diagonal" else "general"
            shared = right_info.shared and info[left].shared
            patterns[out] = product.out
            info[out] = ElementInfo(tuple(product.out.shape), product.out.nnz, kind, shared)
            element_bytes[out] = (product.out.nnz, 0) if shared else (0, product.out.nnz)
            reads["products"].update(element.lo for element in (left, right) if element.lo == element.hi)
        steps.append(step)
        report("steps", len(steps), len(kept))
    return ScanPlan(method, levels, n, steps, scan_outputs(n), element_bytes,
                    weights=weights_plan(reads["gemm"], reads["mv"], reads["products"], chain.weights),
                    fill_flops=_fill_flops(chain, method, levels))


def _fill_flops(chain: ChainInfo, method: str, levels: int | None) -> tuple[int, int]:
    """``(critical, work)`` FLOPs of filling the JTs the schedule's products read (ScanPlan.fill_flops)."""
    fills = [chain.elements[j - 1].fill_flops for j in operands_needing_patterns(chain.n, method, levels)]
    return max(fills, default=0), sum(fills)


def _planned_product(chain: ChainInfo, step: Step, patterns: dict[Element, Pattern],
                     info: dict[Element, ElementInfo],
                     product_cache: dict[tuple[Element, Element], ProductPlan], budget_bytes: int | None,
                     max_step_flops: int | None,
                     progress: Callable[[int, int], None]) -> ProductPlan:
    """The symbolic product of an mm step (from the cache shared by the chain's plans, or planned)."""
    left, right = step.left, step.right
    key = (left, right)
    product = product_cache.get(key)
    if product is not None:
        return product
    right_pattern, left_pattern = patterns[right], patterns[left]
    right_kind, left_kind = info[right].kind, info[left].kind
    where = chain.describe_step(step)
    if max_step_flops is not None and "diagonal" not in (right_kind, left_kind):
        flops = 2 * count_multiply_adds(right_pattern, left_pattern)
        if flops > max_step_flops:
            raise ScanCostError(f"{where}, needs {flops} FLOPs, over the limit of {max_step_flops}")
    channels = (chain.vector_channels[right.hi], chain.vector_channels[left.hi],
                chain.vector_channels[left.lo - 1])
    try:
        product = plan_product(right_pattern, left_pattern, right_kind, left_kind,
                               budget_bytes=budget_bytes, channels=channels, progress=progress)
    except PlanBudgetError as error:
        raise ScanMemoryError(
            f"{where}: its result alone needs more than {error.needed} bytes, over the memory budget of "
            f"{error.budget} bytes (raise it with memory_budget= or SPARSE_SCAN_MEMORY_BUDGET, or use "
            "method='linear' or a hybrid with fewer levels)"
        ) from None
    product_cache[key] = product
    return product


def estimate_plan(chain: ChainInfo, method: str, levels: int | None) -> ScanPlan:
    """The figures of :func:`build_plan`'s plan, estimated from the JTs' shapes and ``nnz`` alone.

    Nothing is built: no pattern (``chain.patterns`` is not read), no product. Each product's
    multiply-adds are estimated as if its operands' entries were spread evenly over their rows and
    columns (``nnz_A · nnz_B / k`` for ``A (m×k) · B (k×n)``; exact for diagonals, max-pool
    selections, dense blocks and most of a convolution's rows) and its result's ``nnz`` as
    ``min(m·n, multiply-adds)`` (every multiply-add a new entry until the result is dense): deep
    products of convolutions, whose multiply-adds mostly land on shared entries, are over-estimated,
    so a choice from these figures leans towards shallower schedules. A product with a diagonal is a
    scaling (one multiply per entry), as in the built plan.

    Returns
    -------
    ScanPlan
        ``estimated=True``, with steps (``product`` None), ``critical_flops``, ``work_flops``,
        ``plan_bytes`` (estimated index bytes), ``peak_bytes(...)`` and ``symbolic_work``: the
        pattern entries and multiply-adds that :func:`build_plan` would enumerate for it.
    """
    n = chain.n
    levels = checked_levels(n, method, levels)
    kept = live_schedule(n, method, levels)
    info = {Element(j, j): element for j, element in enumerate(chain.elements, start=1)}
    element_bytes = _element_bytes(chain)
    work = sum(info[Element(j, j)].nnz for j in operands_needing_patterns(n, method, levels))
    reads: dict[str, set[int]] = {"gemm": set(), "mv": set(), "products": set()}
    steps = []
    for lvl, phase, left, right in kept:
        out = Element(left.lo, right.hi)
        right_info = info[right]
        m, k = right_info.shape
        step = Step(lvl, phase, "mv" if left.is_vector else "mm", left, right, out)
        if left.is_vector:
            step.scaling = right_info.kind == "diagonal"
            step.dense = (not step.scaling and right.lo == right.hi
                          and gemm_pays(right_info.nnz, chain.weights[right.lo - 1], right_info.fill_flops))
            step.shape = (m, k, 1)
            step.flops = step.flops_live = 2 * right_info.nnz
            step.out_nnz = m
            element_bytes[out] = (0, m)
            if right.lo == right.hi:
                reads["gemm" if step.dense else "mv"].add(right.lo)
        else:
            reads["products"].update(element.lo for element in (left, right) if element.lo == element.hi)
            left_info = info[left]
            cols = left_info.shape[1]
            step.scaling = "diagonal" in (right_info.kind, left_info.kind)
            if step.scaling:
                nnz = left_info.nnz if right_info.kind == "diagonal" else right_info.nnz
                step.flops = nnz
                step.plan_bytes = PRODUCT_PLAN_BYTES * nnz
            else:
                multiply_adds = math.ceil(right_info.nnz * left_info.nnz / max(k, 1))
                nnz = min(m * cols, multiply_adds)
                step.flops = 2 * multiply_adds
                step.plan_bytes = PRODUCT_PLAN_BYTES * multiply_adds
                work += multiply_adds
            step.flops_live = step.flops
            step.shape = (m, k, cols)
            step.out_nnz = nnz
            kind = "diagonal" if right_info.kind == left_info.kind == "diagonal" else "general"
            shared = right_info.shared and left_info.shared
            info[out] = ElementInfo((m, cols), nnz, kind, shared)
            element_bytes[out] = (nnz, 0) if shared else (0, nnz)
        steps.append(step)
    return ScanPlan(method, levels, n, steps, scan_outputs(n), element_bytes, estimated=True,
                    symbolic_work=work, fill_flops=_fill_flops(chain, method, levels),
                    weights=weights_plan(reads["gemm"], reads["mv"], reads["products"], chain.weights))
