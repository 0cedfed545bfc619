"""Live FLOPs: what each scan step costs on the non-zeros of one batch (issue 21, the paper's Fig. 10).

The static analysis counts every stored entry of the fixed patterns (a plan's ``flops``). A batch's
JTs hold zeros there: a ReLU's off units, a max-pool's non-maximum window entries (kept as explicit
zeros so that the pattern, and the plan, never change). The live count drops, for each sample, every
zero of every layer's JT and propagates the rest through the scan's steps as a zero-dropping SpGEMM
would: the live pattern of a product is the boolean product of its operands' live patterns, that of
a vector ``A·v`` the rows of ``A`` with a live entry in a live column of ``v``. The output gradient
``g_n`` counts as dense (every entry live). A step's live FLOPs are its multiply-adds over live
operand entries (``sum_k nnzcol_A(k)·nnzrow_B(k)`` on the live patterns), weighted by the convention.

The count is structural: a sum of live products that cancels to exactly 0 stays live. SciPy's ``A @ B``
(the paper's artifact multiplies with it) also drops such entries, and its count of the cancelled
entries' multiply-adds with them; with real-valued data that needs an exact tie of rounded sums,
which the brute-force comparison of the tests never met. Counting structurally keeps the figure a
function of the live operand patterns, as the artifact's intent is.

Each sample's patterns are multiplied with SciPy on boolean matrices (``OR`` of ``AND``: no value,
no cancellation); products whose operands are shared by the batch (convolutions and linear layers
only) are multiplied once. On the 97 %-pruned VGG-11, hybrid 2, that takes about 0.6 s per sample on
2 cores (the costliest product 0.27 s): the live patterns are about 10x sparser than the static ones,
so this costs far less than filtering the plan's stored multiply-adds (2.3 s for that product alone).

Conventions (:data:`CONVENTIONS`):

``ours``
    docs/design.md's, as the plan counts its static ``flops``: an mv costs 2 per multiply-add (the
    vector's live entries only), an mm 2 per multiply-add, except a product with a diagonal operand
    (a scaling), 1 per entry. Every step of the plan. BP: back-propagation's mv chain on the live
    entries, 2 per multiply-add (statically ``2·nnz`` per layer).
``paper``
    The FLOP analysis of the paper's artifact (UofT-EcoSystem/BPPSA-open, ``pruned_vgg11_analysis.py``):
    2 per multiply-add everywhere, scalings included; its exclusive scan stops at the gradient
    w.r.t. the first layer's output, so the plan's ``final`` step (``dL/dx_0``) is left out, and its
    up-sweep forms every pair's product, so the up-sweep products whose result nothing reads (e.g.
    ``conv1·relu1`` on VGG-11) are counted, on their level. BP: its baseline's formula, per layer
    ``2·nnz`` for a general JT, ``rows + live entries`` for a diagonal one (zero the gradient, pass
    the live entries), ``rows + cols`` for a selection; the gradient vectors' zeros do not count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import scipy.sparse as sp

from ..csr import BatchedCSR, Pattern
from ..engine.plan import ScanPlan, Step
from ..engine.schedule import Element, schedule

__all__ = ["CONVENTIONS", "LiveCounts", "LiveRow", "live_counts"]

CONVENTIONS = ("ours", "paper")
"""The FLOP conventions of the live count (module docstring)."""


@dataclass(frozen=True)
class LiveRow:
    """One step of the live count.

    Attributes
    ----------
    level, phase, kind
        As in :class:`~sparse_scan.engine.plan.Step` (``paper`` renumbers levels over its own steps).
    left, right : Element
        The operands: ``out = right · left``.
    mnk : tuple of int
        ``(m, k, n)`` of ``right (m×k) · left (k×n)``; ``n`` is 1 for a vector.
    static : int
        FLOPs over the patterns, in the convention.
    live : ndarray of int64, shape (B,)
        FLOPs over each sample's live entries, in the convention.
    in_plan : bool
        A step of the plan (``False``: an unused up-sweep product the ``paper`` convention adds).
    """

    level: int
    phase: str
    kind: str
    left: Element
    right: Element
    mnk: tuple[int, int, int]
    static: int
    live: np.ndarray
    in_plan: bool


@dataclass(frozen=True)
class LiveCounts:
    """The live count of a plan for one batch.

    Attributes
    ----------
    convention : str
    rows : list of LiveRow
        In an order where every operand comes from an earlier row.
    bp_static : ndarray of int64, shape (n,)
        Back-propagation's FLOPs per layer (layer order) over the patterns.
    bp_live : ndarray of int64, shape (n, B)
        ... and over each sample's live entries.
    """

    convention: str
    rows: list[LiveRow]
    bp_static: np.ndarray
    bp_live: np.ndarray

    def critical_static(self) -> int:
        """The static critical path: each level's costliest step."""
        static = np.array([row.static for row in self.rows], dtype=np.int64).reshape(len(self.rows), 1)
        return int(self._critical(static)[0])

    def critical_live(self) -> np.ndarray:
        """Per sample, the live critical path: each level's costliest step for that sample."""
        return self._critical(self._live())

    def work_live(self) -> np.ndarray:
        """Per sample, the live FLOPs of every step."""
        return self._live().sum(axis=0)

    def _live(self) -> np.ndarray:
        """The rows' live FLOPs, shape (rows, B)."""
        return np.array([row.live for row in self.rows], dtype=np.int64).reshape(-1, self.bp_live.shape[1])

    def _critical(self, figures: np.ndarray) -> np.ndarray:
        """Per column of ``figures`` (one row per step), the sum over levels of the level's maximum."""
        costliest: dict[int, np.ndarray] = {}
        for row, values in zip(self.rows, figures, strict=True):
            costliest[row.level] = np.maximum(costliest.get(row.level, 0), values)
        return sum(costliest.values(), np.zeros(figures.shape[1], dtype=np.int64))


def _matrix(pattern: Pattern, keep: np.ndarray | None = None) -> sp.csr_matrix:
    """A boolean CSR matrix of ``pattern``'s entries (those where ``keep`` is true)."""
    indptr = np.asarray(pattern.indptr, dtype=np.int64)
    indices = np.asarray(pattern.indices)
    if keep is not None:
        kept = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))
        indptr, indices = kept[indptr], indices[keep]
    return sp.csr_matrix((np.ones(len(indices), dtype=bool), indices, indptr), shape=pattern.shape)


def _live_matrix(jacobian: BatchedCSR, sample: int) -> sp.csr_matrix:
    """The entries of one sample's JT that are not zero, as a boolean CSR matrix."""
    values = jacobian.data if jacobian.shared else jacobian.data[sample]
    return _matrix(jacobian.pattern, np.asarray(values) != 0)


def _multiply(right: sp.csr_matrix, left: Any) -> tuple[int, Any]:
    """Multiply-adds of ``right @ left`` over the patterns, and the result's pattern (a boolean
    vector when ``left`` is one)."""
    if isinstance(left, np.ndarray):
        entry_live = np.concatenate(([0], np.cumsum(left[right.indices], dtype=np.int64)))
        per_row = np.diff(entry_live[right.indptr])
        return int(entry_live[-1]), per_row > 0
    columns = np.bincount(right.indices, minlength=right.shape[1]).astype(np.int64)
    multiply_adds = int(columns @ np.diff(left.indptr).astype(np.int64))
    return multiply_adds, (right @ left).tocsr()


def _rows_of(plan: ScanPlan, convention: str) -> list[tuple[int, str, Element, Element, Step | None]]:
    """``(level, phase, left, right, plan step or None)`` of every step the convention counts."""
    if convention == "ours":
        return [(step.level, step.phase, step.left, step.right, step) for step in plan.steps]
    steps = {(step.phase, step.left, step.right): step for step in plan.steps if step.phase != "final"}
    whole = Element(0, plan.n)
    rows = []
    for level, phase, left, right, _ in schedule(plan.n, plan.method, plan.levels):
        step = steps.pop((phase, left, right), None)
        # the artifact's up-sweep forms every pair's product, and stops below the root (the whole chain)
        if step is not None or (phase == "up" and Element(left.lo, right.hi) != whole):
            rows.append((level, phase, left, right, step))
    dense = {level: rank for rank, level in enumerate(sorted({row[0] for row in rows}))}
    return [(dense[level], phase, left, right, step) for level, phase, left, right, step in rows]


def live_counts(plan: ScanPlan, jacobians: Sequence[BatchedCSR], kinds: Sequence[str], batch: int,
                convention: str = "ours",
                progress: Callable[[str, int, int], None] | None = None) -> LiveCounts:
    """Static and live FLOPs of every step of ``plan`` and of back-propagation, for one batch.

    Parameters
    ----------
    plan : ScanPlan
        A built plan (not an estimate) of the chain.
    jacobians : sequence of BatchedCSR
        ``jacobians[j - 1]``: the JT of scan element ``j`` for the batch (host arrays), values
        ``(B, nnz)`` or shared ``(nnz,)``.
    kinds : sequence of str
        ``kinds[j - 1]``: its layer's ``jacobian_kind``.
    batch : int
        Samples ``B``.
    convention : {"ours", "paper"}
    progress : callable, optional
        ``progress("live", done, batch)`` after each sample.

    Returns
    -------
    LiveCounts
        ``bp_*`` in layer order (scan element ``n`` first).
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}; got {convention!r}")
    if plan.estimated:
        raise ValueError("live FLOPs need a built plan, not an estimate")
    n = plan.n
    if len(jacobians) != n or len(kinds) != n:
        raise ValueError(f"the plan has {n} elements; got {len(jacobians)} JTs and {len(kinds)} kinds")
    rows = _rows_of(plan, convention)
    jt = {Element(j, j): jacobian for j, jacobian in enumerate(jacobians, start=1)}
    shared = {element for element, jacobian in jt.items() if jacobian.shared} | {Element(0, 0)}
    for _, _, left, right, _ in rows:
        if left in shared and right in shared:
            shared.add(Element(left.lo, right.hi))
    last_read = {element: index for index, (_, _, left, right, _) in enumerate(rows)
                 for element in (left, right)}
    static, weights = _static_figures(rows, jt, convention)
    live = np.zeros((len(rows), batch), dtype=np.int64)
    known: dict[Element, Any] = {Element(0, 0): np.ones(jacobians[0].shape[1], dtype=bool)}
    for sample in range(batch):
        values: dict[Element, Any] = {}

        def operand(element: Element, sample: int = sample, values: dict[Element, Any] = values) -> Any:
            store = known if element in shared else values
            if element not in store:  # a layer's JT: products are stored when made
                store[element] = _live_matrix(jt[element], sample)
            return store[element]

        for index, (_, _, left, right, _) in enumerate(rows):
            out = Element(left.lo, right.hi)
            if sample and out in shared:
                live[index, sample] = live[index, 0]
                continue
            multiply_adds, pattern = _multiply(operand(right), operand(left))
            live[index, sample] = weights[index] * multiply_adds
            (known if out in shared else values)[out] = pattern
            for element in (left, right):
                if last_read[element] == index and element not in shared:
                    values.pop(element, None)
        if progress is not None:
            progress("live", sample + 1, batch)
    live_rows = [LiveRow(level, phase, "mv" if left.is_vector else "mm", left, right,
                         _mnk(left, right, jt), static[index], live[index], step is not None)
                 for index, (level, phase, left, right, step) in enumerate(rows)]
    bp_static, bp_live = _bp_figures(jacobians, kinds, batch, convention)
    return LiveCounts(convention, live_rows, bp_static[::-1].copy(), bp_live[::-1].copy())


def _mnk(left: Element, right: Element, jt: dict[Element, BatchedCSR]) -> tuple[int, int, int]:
    """``(m, k, n)`` of ``right · left``: a product of elements ``lo..hi`` is ``JT_hi ··· JT_lo``."""
    m, k = jt[Element(right.hi, right.hi)].shape[0], jt[Element(right.lo, right.lo)].shape[1]
    return m, k, 1 if left.is_vector else jt[Element(left.lo, left.lo)].shape[1]


def _static_figures(rows: Sequence[tuple[int, str, Element, Element, Step | None]],
                    jt: dict[Element, BatchedCSR], convention: str) -> tuple[list[int], list[int]]:
    """Per row, its FLOPs over the patterns and its FLOPs per live multiply-add (1 or 2)."""
    planned = {step.out: step.product.out for *_, step in rows
               if step is not None and step.product is not None}
    patterns: dict[Element, sp.csr_matrix] = {}

    def pattern(element: Element) -> sp.csr_matrix:
        if element not in patterns:
            patterns[element] = _matrix(planned[element] if element in planned else jt[element].pattern)
        return patterns[element]

    static, weights = [], []
    for _, _, left, right, step in rows:
        scaling = step is not None and step.product is not None and step.product.method.startswith("scale")
        weights.append(1 if convention == "ours" and scaling else 2)
        if step is None:  # an unused up-sweep product (paper): its operands are JTs or up-sweep products
            multiply_adds, patterns[Element(left.lo, right.hi)] = _multiply(pattern(right), pattern(left))
            static.append(2 * multiply_adds)
        elif step.product is None or convention == "ours":
            static.append(step.flops)  # an mv: 2 per multiply-add in both conventions
        else:
            static.append(2 * step.product.multiply_adds)
    return static, weights


def _bp_figures(jacobians: Sequence[BatchedCSR], kinds: Sequence[str], batch: int,
                convention: str) -> tuple[np.ndarray, np.ndarray]:
    """Back-propagation's FLOPs per scan element (element order): over the patterns, and per sample
    over the live entries."""
    if convention == "paper":
        static = [_gradient_operator(jacobian.shape, jacobian.nnz, kind)
                  for jacobian, kind in zip(jacobians, kinds, strict=True)]
    else:
        static = [2 * jacobian.nnz for jacobian in jacobians]
    live = np.zeros((len(jacobians), batch), dtype=np.int64)
    shared = {index: _live_matrix(jacobian, 0) for index, jacobian in enumerate(jacobians) if jacobian.shared}
    for sample in range(batch):
        vector = np.ones(jacobians[0].shape[1], dtype=bool)
        for index, (jacobian, kind) in enumerate(zip(jacobians, kinds, strict=True)):
            matrix = shared[index] if index in shared else _live_matrix(jacobian, sample)
            if convention == "paper":
                live[index, sample] = _gradient_operator(jacobian.shape, matrix.nnz, kind)
            else:
                multiply_adds, vector = _multiply(matrix, vector)
                live[index, sample] = 2 * multiply_adds
    return np.array(static, dtype=np.int64), live


def _gradient_operator(shape: tuple[int, int], live: int, kind: str) -> int:
    """The artifact's FLOPs of one gradient operator of BP (``paper``), with ``live`` live JT entries."""
    rows, cols = shape
    return rows + live if kind == "diagonal" else rows + cols if kind == "selection" else 2 * live
