"""Plans of scans over dense blocks: the recurrent element kind of the scan engine.

A recurrent network's backward pass is the chain ``G_t = d_t + A_{t+1} G_{t+1}`` over ``T`` steps,
``A_t = (dh_t/dh_{t-1})^T`` a dense ``H×H`` block per sample and ``d_t`` the loss's direct gradient
w.r.t. ``h_t``. Each step is an *affine* map ``x -> A x + d``, so the chain is the exclusive scan of
``[d_T, F_1, ..., F_T]`` (``F_j: x -> A_{T-j+1} x + d_{T-j}``, ``d_0 = 0``) under "apply the left
operand, then the right one", the operator ``◇`` of :mod:`sparse_scan.engine.schedule` with affine elements:

``(M_r, v_r) ∘ (M_l, v_l) = (M_r M_l, M_r v_l + v_r)``, and on a vector ``v_l``: ``M_r v_l + v_r``.

When only the last hidden state has a loss (the paper's RNN), every ``v`` of a block is zero and this
is the paper's scan of plain products. The schedules are exactly the sparse engine's
(:func:`sparse_scan.engine.schedule.live_schedule`): ``linear`` (BP: ``T`` sequential matrix-vector products),
``blelloch`` (Algorithm 1) and ``hybrid`` (paper §5.3).

A :class:`DenseScanPlan` depends on ``T``, the method and the levels only (not on ``H`` or the batch)
and is cached. It groups the steps of every level by kind and output buffer, so that the numeric
phase runs each level as a few batched array operations over all its pairs and samples: one
``matmul`` for all of a level's block products, instead of one call per step. Operands are read
through strided views where the schedule is regular (the up- and down-sweeps of a power-of-two chain)
and gathered otherwise. The executors (:func:`sparse_scan.engine.run.dense_scan`) run it on NumPy or
CuPy arrays; this module imports neither executor.

Its figures depend on the block size: :meth:`DenseScanPlan.sized` gives a
:class:`SizedDenseScanPlan`, whose figures have the names and units of the sparse engine's
:class:`~sparse_scan.engine.plan.ScanPlan` (the plan protocol,
:class:`~sparse_scan.engine.figures.ScanPlanLike`).

Examples
--------
The numeric scan of such a plan: :func:`sparse_scan.engine.run.dense_scan` (its example).

>>> figures = build_dense_plan(5, "blelloch").sized(3)       # for 3x3 blocks
>>> figures.critical_steps, figures.critical_flops, figures.work_flops
(4, 126, 162)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import numpy as np

from .._types import Array
from .cost import CostModel, current, dense_features
from .figures import totals
from .schedule import Element, Segment, checked_levels, depth, live_schedule, live_segments, scan_outputs

__all__ = ["DenseGroup", "DenseOp", "DenseScanPlan", "DenseShape", "DenseStep", "Location",
           "SizedDenseScanPlan", "auto_levels", "build_dense_plan", "dense_shape", "scan_features"]

INPUT = 0  # buffer id of the scan input: blocks (T, B, H, H) and direct vectors (T + 1, B, H)


@dataclass(frozen=True)
class Location:
    """Where a scan value lives: a row of a buffer (``INPUT`` or a level group's result)."""

    buffer: int
    row: int


@dataclass(frozen=True)
class DenseOp:
    """One step ``out = right ∘ left``: ``mm`` (left is a block) or ``mv`` (left is a vector).

    Attributes
    ----------
    phase : {"up", "linear", "down", "final"}
    left, right : Location
        Where the operands are read.
    segments : tuple of Element
        The operands ``(left, right)`` as segments of the scan input.
    """

    phase: str
    left: Location
    right: Location
    segments: tuple[Element, Element]


class _Reader:
    """Reads the rows of one operand side of a group: a strided view where the rows are regular."""

    def __init__(self, locations: Sequence[Location]) -> None:
        self.count = len(locations)
        by_buffer: dict[int, tuple[list[int], list[int]]] = {}
        for position, location in enumerate(locations):
            positions, rows = by_buffer.setdefault(location.buffer, ([], []))
            positions.append(position)
            rows.append(location.row)
        self.pieces = [(buffer, _compact(positions), _compact(rows))
                       for buffer, (positions, rows) in by_buffer.items()]
        self.buffers = tuple(by_buffer)

    def read(self, xp: ModuleType, arrays: dict[int, Array]) -> Array:
        """The operand stack ``(count, ...)``: a view when one regular piece covers it."""
        if len(self.pieces) == 1:
            buffer, _, rows = self.pieces[0]
            return arrays[buffer][rows]
        first = arrays[self.pieces[0][0]]
        out = xp.empty((self.count,) + first.shape[1:], dtype=first.dtype)
        for buffer, positions, rows in self.pieces:
            out[positions] = arrays[buffer][rows]
        return out


def _compact(values: Sequence[int]) -> slice | np.ndarray:
    """An arithmetic progression as a slice (so indexing gives a view), anything else as indices."""
    if len(values) == 1:
        return slice(values[0], values[0] + 1)
    step = values[1] - values[0]
    if step != 0 and all(b - a == step for a, b in zip(values, values[1:], strict=False)):
        stop = values[-1] + step
        return slice(values[0], None if stop < 0 else stop, step)
    return np.asarray(values, dtype=np.intp)


@dataclass(frozen=True)
class DenseShape:
    """The level structure of a dense-block scan, without its groups: what figures and the cost model
    read (:func:`dense_shape`, cheap and cached; :class:`DenseScanPlan` is what executors run).

    Attributes
    ----------
    method : str
    levels : int or None
    n : int
    counts : tuple of (int, int)
        Per level (in order), its block products and its matrix-vector products.
    chains : dict
        Runs of at least four levels that are one matrix-vector product each, every one on the
        previous one's result (BP, and the linear middle of a hybrid): first level -> the level after
        the run. The numeric phase runs them as a tight loop.
    """

    method: str
    levels: int | None
    n: int
    counts: tuple[tuple[int, int], ...]
    chains: dict[int, int]

    def step_flops(self, size: int, affine: bool) -> tuple[int, int]:
        """FLOPs of one block product and of one matrix-vector product for one sample
        (:class:`SizedDenseScanPlan`'s counting)."""
        return 2 * size**3 + (2 * size**2 if affine else 0), 2 * size**2

    def level_flops(self, size: int, affine: bool = True) -> list[int]:
        """Per level, the FLOPs of all its steps (one sample)."""
        mm, mv = self.step_flops(size, affine)
        return [products * mm + vectors * mv for products, vectors in self.counts]

    def critical_flops(self, size: int, affine: bool = True) -> int:
        """The costliest step of every level, summed (:func:`~sparse_scan.engine.figures.critical_path`)."""
        mm, mv = self.step_flops(size, affine)
        return sum(mm if products else mv for products, _ in self.counts)


def _is_vector(segment: Segment) -> bool:
    """Whether a segment's value is a vector (it holds the output gradient: :attr:`Element.is_vector`)."""
    return segment[0] == 0 and segment[0] <= segment[1]


@functools.lru_cache(maxsize=256)
def dense_shape(n: int, method: str = "blelloch", levels: int | None = None) -> DenseShape:
    """The :class:`DenseShape` of :func:`build_dense_plan`'s plan, counted from the live schedule's
    segments alone (cached per ``n``, method and levels)."""
    by_level: dict[int, list[tuple[Segment, Segment]]] = {}
    for level, _, left, right in live_segments(n, method, levels):
        by_level.setdefault(level, []).append((left, right))
    counts = tuple((sum(not _is_vector(left) for left, _ in pairs),
                    sum(_is_vector(left) for left, _ in pairs)) for _, pairs in sorted(by_level.items()))
    runs: dict[int, int] = {}
    start, previous = None, None  # a run's first level, and the previous level's lone mv's result
    for index in range(len(counts) + 1):
        pairs = by_level.get(index, [])
        single = len(pairs) == 1 and _is_vector(pairs[0][0])
        if start is not None and not (single and pairs[0][0] == previous):
            if index - start >= 4:
                runs[start] = index
            start = None
        if single and start is None:
            start = index
        previous = (pairs[0][0][0], pairs[0][1][1]) if single else None
    return DenseShape(method, levels, n, counts, runs)


@dataclass
class DenseGroup:
    """Steps of one level and one kind, written to rows ``0..len(ops)-1`` of buffer ``buffer``."""

    kind: str
    buffer: int
    ops: list[DenseOp]

    def __post_init__(self) -> None:
        self.left = _Reader([op.left for op in self.ops])
        self.right = _Reader([op.right for op in self.ops])


@dataclass
class DenseScanPlan:
    """The schedule of a dense-block scan over ``n`` steps, grouped for batched numeric work.

    What the executors run, for blocks of any size; :meth:`sized` gives its figures for one size.

    Attributes
    ----------
    method : str
    levels : int or None
        Up-sweep levels of a ``hybrid`` plan.
    n : int
        Number of blocks (time steps).
    levels_of_groups : list of list of DenseGroup
        Per level (in order), its groups; groups of one level are independent.
    outputs : list of Location
        ``outputs[i]`` holds the total gradient w.r.t. ``h_i`` (``i = 0..n``).
    """

    method: str
    levels: int | None
    n: int
    levels_of_groups: list[list[DenseGroup]]
    outputs: list[Location]

    @functools.cached_property
    def output_reader(self) -> _Reader:
        return _Reader(self.outputs)

    @functools.cached_property
    def last_level(self) -> dict[int, int]:
        """Per buffer, the last level that reads it (outputs are read after the last level)."""
        last: dict[int, int] = {}
        for index, groups in enumerate(self.levels_of_groups):
            for group in groups:
                for buffer in group.left.buffers + group.right.buffers:
                    last[buffer] = index
        for buffer in self.output_reader.buffers:
            last[buffer] = len(self.levels_of_groups)
        return last

    @functools.cached_property
    def level_releases(self) -> list[list[int]]:
        """Per level, the buffers read for the last time there (a sparse plan's ``releases`` are per
        step: a dense plan's buffers hold the results of a whole group)."""
        released: list[list[int]] = [[] for _ in self.levels_of_groups]
        for buffer, last in self.last_level.items():
            if last < len(released):
                released[last].append(buffer)
        return released

    @property
    def chains(self) -> dict[int, int]:
        """Runs of levels that are one matrix-vector product each (:attr:`DenseShape.chains`)."""
        return dense_shape(self.n, self.method, self.levels).chains

    @property
    def critical_steps(self) -> int:
        """Sequential levels."""
        return len(self.levels_of_groups)

    def sized(self, size: int, affine: bool = True) -> SizedDenseScanPlan:
        """The plan for blocks of ``size×size``: its figures, as a sparse plan gives them.

        Parameters
        ----------
        size : int
            ``H`` of the blocks.
        affine : bool
            Whether the scan carries direct gradients (``direct`` of shape ``(T, B, H)``): a product
            of blocks then also applies its right block to the left one's vector part. False for a
            gradient w.r.t. the last state alone, a chain of plain block products like a sparse one.

        Returns
        -------
        SizedDenseScanPlan
            A view: nothing is copied, and figures are computed on first use.
        """
        return SizedDenseScanPlan(self, int(size), bool(affine))


@dataclass(frozen=True)
class DenseStep:
    """One step of a :class:`SizedDenseScanPlan`, with the figures of a sparse plan's
    :class:`~sparse_scan.engine.plan.Step`.

    Attributes
    ----------
    level : int
    phase : {"up", "linear", "down", "final"}
    kind : {"mm", "mv"}
    left, right : Element
        The operands, as segments of the scan input.
    shape : tuple of int
        ``(m, k, n)`` of ``right (m×k) · left (k×n)``: ``(H, H, H)``, or ``n = 1`` for a vector.
    flops : int
        For one sample; every entry of a dense block is live.
    out_nnz : int
        Entries of the result.
    """

    level: int
    phase: str
    kind: str
    left: Element
    right: Element
    shape: tuple[int, int, int]
    flops: int
    out_nnz: int

    def as_dict(self) -> dict[str, Any]:
        """The step's report fields, the keys of a sparse step's (JSON-friendly): a dense step is
        ``method="dense"``, holds no index structure and counts every entry as live."""
        return {"level": self.level, "phase": self.phase, "kind": self.kind, "method": "dense",
                "left": [self.left.lo, self.left.hi], "right": [self.right.lo, self.right.hi],
                "mnk": list(self.shape), "flops": self.flops, "flops_live": self.flops,
                "out_nnz": self.out_nnz, "plan_bytes": 0}


@dataclass(frozen=True)
class SizedDenseScanPlan:
    """A :class:`DenseScanPlan` for blocks of one size: its figures under the plan protocol
    (:class:`~sparse_scan.engine.figures.ScanPlanLike`), in the units of a sparse plan.

    FLOPs are per sample (docs/design.md's FLOP counting on dense ``H×H`` blocks: a block product is
    ``2H³``, plus ``2H²`` for its vector part when ``affine``; a matrix-vector product ``2H²``; the
    additions of direct gradients, ``H`` per step as in BP, are not counted); bytes are for a batch.
    Built by :meth:`DenseScanPlan.sized`.

    Attributes
    ----------
    plan : DenseScanPlan
    size : int
        ``H`` of the blocks.
    affine : bool
        Whether the scan carries direct gradients (:meth:`DenseScanPlan.sized`).
    """

    plan: DenseScanPlan
    size: int
    affine: bool = True

    @property
    def method(self) -> str:
        """The schedule: ``linear``, ``blelloch`` or ``hybrid``."""
        return self.plan.method

    @property
    def levels(self) -> int | None:
        """Up-sweep levels of a ``hybrid`` plan, else None."""
        return self.plan.levels

    @property
    def n(self) -> int:
        """Number of blocks (time steps)."""
        return self.plan.n

    @property
    def critical_steps(self) -> int:
        """Sequential levels."""
        return self.plan.critical_steps

    @property
    def plan_bytes(self) -> int:
        """0: products of dense blocks need no index structure."""
        return 0

    @functools.cached_property
    def shape(self) -> DenseShape:
        """The plan's level structure (:func:`dense_shape`), which its figures count."""
        return dense_shape(self.plan.n, self.plan.method, self.plan.levels)

    def _step_flops(self, kind: str) -> int:
        """FLOPs of one step of ``kind`` for one sample."""
        mm, mv = self.shape.step_flops(self.size, self.affine)
        return mv if kind == "mv" else mm

    @functools.cached_property
    def steps(self) -> list[DenseStep]:
        """Every step, level by level (a level's block products first)."""
        size = self.size
        out_nnz = {"mm": size * size + (size if self.affine else 0), "mv": size}
        return [DenseStep(index, op.phase, group.kind, *op.segments,
                          (size, size, size if group.kind == "mm" else 1), self._step_flops(group.kind),
                          out_nnz[group.kind])
                for index, groups in enumerate(self.plan.levels_of_groups)
                for group in groups for op in group.ops]

    @functools.cached_property
    def level_flops(self) -> list[int]:
        """Per level, the FLOPs of all its steps (one sample)."""
        return self.shape.level_flops(self.size, self.affine)

    @property
    def critical_flops(self) -> int:
        """The FLOPs of the critical path (:func:`~sparse_scan.engine.figures.critical_path`, one
        sample: every level's costliest step)."""
        return self.shape.critical_flops(self.size, self.affine)

    @property
    def work_flops(self) -> int:
        """FLOPs of every step (one sample)."""
        return sum(self.level_flops)

    def peak_bytes(self, batch: int, itemsize: int) -> int:
        """Peak bytes of live scan values: the input from the start, every group's result from its
        level to the end of the level of its last read, the outputs to the end (as the executors
        hold them)."""
        block, vector = self.size * self.size * batch * itemsize, self.size * batch * itemsize
        plan = self.plan
        live = plan.n * block + (plan.n + 1) * vector
        sizes = {INPUT: live}
        peak = live
        for index, groups in enumerate(plan.levels_of_groups):
            for group in groups:
                mm = group.kind == "mm"
                sizes[group.buffer] = len(group.ops) * ((block if mm else 0)
                                                       + (vector if self.affine or not mm else 0))
                live += sizes[group.buffer]
            peak = max(peak, live)
            live -= sum(sizes[buffer] for buffer in plan.level_releases[index])
        return peak

    def report(self, batch: int = 1, itemsize: int = 4) -> dict[str, Any]:
        """Per-step figures and totals (JSON-friendly), the keys of a sparse plan's report."""
        return {"method": self.method, "levels": self.levels, "n": self.n,
                "steps": [step.as_dict() for step in self.steps],
                "totals": totals(self, batch, itemsize)}


@functools.lru_cache(maxsize=64)
def build_dense_plan(n: int, method: str = "blelloch", levels: int | None = None) -> DenseScanPlan:
    """Plan a dense-block scan over ``n`` steps (cached per ``n``, method and levels).

    Parameters
    ----------
    n : int
        Number of blocks (time steps), at least 1.
    method : {"linear", "blelloch", "hybrid"}
    levels : int, optional
        Up-sweep levels of ``hybrid`` (0 .. ``depth(n)``).
    """
    if n < 1:
        raise ValueError(f"a dense scan needs at least one step; got n={n}")
    levels = checked_levels(n, method, levels)
    where: dict[Element, Location] = {Element(j, j): Location(INPUT, n - j) for j in range(n + 1)}
    by_level: dict[int, list[tuple[str, Element, Element]]] = {}
    for level, phase, left, right in live_schedule(n, method, levels):
        by_level.setdefault(level, []).append((phase, left, right))
    levels_of_groups: list[list[DenseGroup]] = []
    buffer = INPUT
    for level in sorted(by_level):  # operands come from earlier levels: place results per level
        groups, placed = [], {}
        for kind in ("mm", "mv"):
            entries = [(phase, left, right) for phase, left, right in by_level[level]
                       if (kind == "mv") == left.is_vector]
            if not entries:
                continue
            buffer += 1
            groups.append(DenseGroup(kind, buffer, [DenseOp(phase, where[left], where[right], (left, right))
                                                    for phase, left, right in entries]))
            for row, (_, left, right) in enumerate(entries):
                placed[Element(left.lo, right.hi)] = Location(buffer, row)
        where.update(placed)
        levels_of_groups.append(groups)
    return DenseScanPlan(method, levels, n, levels_of_groups, [where[e] for e in scan_outputs(n)])


def scan_features(plan: DenseShape, batch: int, size: int, factored: bool = False,
                  affine: bool = True, cell_flops: int = 0, reach: float | None = None,
                  exit_values: float = 0.0, threads: int = 1) -> dict[str, float]:
    """The cost model's features (:func:`~sparse_scan.engine.cost.dense_features`) of one scan of
    ``plan`` (:func:`dense_shape`) over ``size×size`` blocks for ``batch`` samples. ``factored``: the
    blocks are not filled yet and back-propagation (depth 0) would not need them (recurrent layers'
    back-propagation on the CPU applies each block in factored form): depth 0 costs a factored step
    per block, every other schedule also fills the ``n * batch * size²`` block values first. Every
    schedule passes over the ``n * batch * size`` state gradients (``step_values``); ``cell_flops``
    (per step and sample: the gate and parameter gradients from the scan's totals) are work of every
    schedule, after a scan (``cell_flops``) or, in factored back-propagation, inside the cell's
    kernel with the chain's own (``factored_flops``).

    ``reach`` and ``exit_values``: factored back-propagation from a loss on the last state alone stops
    where the gradient vanishes (:class:`sparse_scan.recurrent.Horizon`), after ``reach`` of the ``n``
    steps per sample (its factored features scale by ``reach / n``), passing over ``exit_values`` per
    sample to stop (the rows it checks and zeroes). Factored back-propagation runs the samples on
    ``threads`` threads, a run of samples each: its per-sample features count the longest run's
    ``ceil(batch / threads)`` samples."""
    level_flops = plan.level_flops(size, affine)
    values = {"step_values": plan.n * batch * size}
    if factored and plan.levels in (0, None) and plan.method != "blelloch":
        lane = -(-batch // max(1, threads))  # the samples of the longest run
        features = dense_features(level_flops, (), lane, factored_steps=plan.n) | values
        features["factored_flops"] += plan.n * lane * cell_flops
        if reach is not None and plan.n:
            for name in ("factored_step", "factored_sample", "factored_flops"):
                features[name] *= reach / plan.n
            features["exit_values"] = exit_values * lane
        return features
    chained = {index for start, stop in plan.chains.items() for index in range(start, stop)}
    return dense_features(level_flops, chained, batch,
                          filled_values=plan.n * batch * size * size if factored else 0) | values | {
        "cell_flops": plan.n * batch * cell_flops}


@functools.lru_cache(maxsize=256)
def auto_levels(n: int, batch: int, size: int, device: str = "cpu", factored: bool = False,
                model: CostModel | None = None, cell_flops: tuple[int, ...] = (0,)) -> int:
    """The hybrid depth (0 = BP .. ``depth(n)`` = Blelloch) with the least predicted time.

    The time is the cost model's (``model``, by default :func:`~sparse_scan.engine.cost.current` for
    ``device``) of :func:`scan_features` of one scan per entry of ``cell_flops`` (a recurrent layer's
    scans, each with its cell's gradients per step and sample; ``(0,)``: one scan of given blocks):
    each level costs a fixed overhead plus its FLOPs over the device's throughput; on a 2-core CPU the
    scan's extra work usually outweighs the shorter critical path, on a GPU it does not. ``factored``
    (:func:`scan_features`) is the CPU's only. The choice is cached per arguments.
    """
    if factored and device != "cpu":
        raise ValueError(f"factored back-propagation runs on the CPU only, not on {device!r}")
    model = current(device) if model is None else model
    best, best_cost = 0, None
    for levels in range(depth(n) + 1):
        shape = dense_shape(n, "hybrid", levels)
        cost = sum(model.predict(scan_features(shape, batch, size, factored, cell_flops=cells,
                                               threads=model.threads)) for cells in cell_flops)
        if best_cost is None or cost < best_cost:
            best, best_cost = levels, cost
    return best
