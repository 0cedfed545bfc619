"""The host executor of sparse scan plans: the numeric phase of a :class:`~sparse_scan.engine.plan.ScanPlan`
on NumPy arrays, and the host numeric products it is made of.

Products run the plan's symbolic structure (:mod:`sparse_scan.engine.products`) through compiled host
kernels (:mod:`sparse_scan._host_kernels`); matrix-vector products run a compiled CSR kernel that
sums as SciPy's does and keeps explicit zeros. The steps of a scan level are independent and run on a
pool of threads (NumPy's and numba's kernels release the GIL). Callers go through
:mod:`sparse_scan.engine.run`, the engine's one CPU/GPU dispatch.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Mapping, Sequence

import numpy as np

from .._host_kernels import BLOCK_ENTRIES, launch, parts, rows2d
from .._threads import cpu_threads, step_pool, thread_count, workers_for
from .._types import Array
from ..csr import BatchedCSR, Pattern
from ._blocks import multiply_blocks_host
from ._kernels import csr_products, first_term_products, rowwise_products, stored_products
from ._scaled_gather import Runs, find_runs, scaled_gather
from ._selection import multiply_live
from .plan import ScanPlan, Step
from .products import ProductPlan
from .schedule import Element

__all__ = ["matvec", "multiply", "run_plan"]


def multiply(plan: ProductPlan, a_data: Array, b_data: Array, out: Array | None = None) -> Array:
    """Numeric phase of ``A @ B``: values of ``C`` in ``plan.out``'s entry order.

    ``a_data``/``b_data`` are ``(nnz,)`` (shared by the batch) or ``(B, nnz)``; the result is
    ``(nnz_C,)`` when both are shared, else ``(B, nnz_C)``, in their result dtype: written into
    ``out`` when it is given (C-contiguous, that shape and dtype; not for ``block`` products, which
    return their own). A diagonal operand's data holds its diagonal. On the host, scalings, gathers
    and scalar products run compiled kernels (:mod:`sparse_scan._host_kernels`) with no temporaries;
    ``block`` products run a compiled kernel that needs no temporaries. Dead work is
    skipped where that was measured to pay: selection gathers run only their live entries
    (:func:`~sparse_scan.engine._selection.multiply_live`), summed products with a per-sample ``A``
    skip its zero entries' rows of ``B`` (:func:`_skips_dead_rows`); dead entries of ``C`` are
    written as exact zeros, the pattern is the plan's, and the values are those of running every
    multiply-add, bit for bit. Scalings and one-multiply-add products stream every entry: a test
    per entry measured 3.7-7.6x slower than the vectorised stream on VGG-11's ReLU scalings.
    """
    if plan.method == "block":
        batch = max(a_data.shape[0] if a_data.ndim == 2 else 1, b_data.shape[0] if b_data.ndim == 2 else 1)
        return multiply_blocks_host(plan.blocks, a_data, b_data, workers_for(plan.multiply_adds * batch))
    if plan.method == "scale_columns":
        return scaled_gather(a_data, b_data, plan.b_pos, out=out, runs=_runs(plan, plan.b_pos))
    if plan.method == "scale_rows":
        return scaled_gather(b_data, a_data, plan.a_pos, out=out, runs=_runs(plan, plan.a_pos))
    if plan.method in ("general", "gather") and plan.starts is None:
        return _single_products(plan, a_data, b_data, out)
    if plan.selection is not None and (a_data if plan.selection.operand == "a" else b_data).ndim == 2:
        return multiply_live(plan.selection, plan.out.nnz, a_data, b_data, out)
    if out is None:
        out = np.empty(_product_shape(plan, a_data, b_data), dtype=np.result_type(a_data, b_data))
    if out.size:
        rows = out.reshape(-1, plan.out.nnz)
        a, b = rows2d(a_data, out.dtype), rows2d(b_data, out.dtype)
        if plan.method == "rowwise" or _skips_dead_rows(plan, a_data):
            _multiply_rowwise(plan, a, b, rows)
        else:
            _multiply_stored(plan, a, b, rows)
    return out


LIVE_ROWS_MIN_FANOUT = 2
"""A summed product with a per-sample ``A`` runs row by row, skipping ``A``'s zeros, when its ``A``
entries carry at least this many multiply-adds each on average (``B``'s rows this long).

Measured on VGG-11-pruned's up-sweep products at batch 1 / 16, one thread, against the stored
multiply-adds: conv3·relu4 (29 M multiply-adds, 51 % of ``A`` live) 148 -> 55 ms / 3360 -> 759 ms,
conv1·pool2 (fan-out 30) 5.1 -> 2.8 ms / 70 -> 55 ms; pool1·pool2 (fan-out 1: a skipped ``A`` entry
saves one multiply-add) 7.5 -> 7.3 ms / 126 -> 102 ms, within the noise of the shared machine, so
fan-out 1 keeps the stored method."""


def _skips_dead_rows(plan: ProductPlan, a_data: Array) -> bool:
    """Whether a ``general``/``gather`` product runs row by row over ``A``'s live entries
    (:func:`sparse_scan.engine._kernels.rowwise_products`) instead of its stored multiply-adds.

    Only a per-sample ``A`` carries the input's zeros (ReLU's off units, max-pool's non-maxima, and
    products of them); each skipped ``A`` entry skips its whole row of ``B``. Both kernels sum an
    entry's terms from zero in ``A``-entry order, so the choice changes no bit of the result.
    """
    return (plan.operands is not None and plan.starts is not None and a_data.ndim == 2
            and plan.multiply_adds >= LIVE_ROWS_MIN_FANOUT * plan.operands[0].nnz)


def _product_shape(plan: ProductPlan, a_data: Array, b_data: Array) -> tuple[int, ...]:
    """The shape of :func:`multiply`'s result: ``(nnz_C,)``, or ``(B, nnz_C)`` when an operand is
    per sample."""
    return np.broadcast_shapes(a_data.shape[:-1], b_data.shape[:-1]) + (plan.out.nnz,)


def _single_products(plan: ProductPlan, a_data: Array, b_data: Array, out: Array | None) -> Array:
    """``C`` entries with one multiply-add each: a stream of scalings (no sums, no scatter).

    Both operands are gathered into ``C``'s entry order piece by piece by :func:`scaled_gather`, the
    per-sample one from its cached rows, as scaled contiguous copies where the entries come in long
    runs (:func:`_runs`: a pool gathering rows of a convolution's JT). A ``gather`` plan of this
    shape (a non-overlapping pool on the left) runs its dead multiply-adds too: on the host a
    streamed product of every ``C`` entry costs less than scattering the live ones (3-4x at
    batch 16 on VGG-11's pool·conv products).
    """
    if b_data.ndim == 2 and a_data.ndim == 1:
        return scaled_gather(a_data, b_data, plan.b_pos, values_index=plan.a_pos, out=out,
                             runs=_runs(plan, plan.b_pos, plan.a_pos))
    return scaled_gather(b_data, a_data, plan.a_pos, values_index=plan.b_pos, out=out,
                         runs=_runs(plan, plan.a_pos, plan.b_pos))


_RUNS: dict[tuple[int, int], Runs | None] = {}
""":func:`_runs` per plan (by identity, dropped with the plan) and index array."""


def _runs(plan: ProductPlan, index: np.ndarray, values_index: np.ndarray | None = None) -> Runs | None:
    """``find_runs(index, values_index)`` of a scaling or one-multiply-add product, found on the
    plan's first run and kept while the plan lives (one pass over its index arrays)."""
    key = (id(plan), id(index))
    if key not in _RUNS:
        weakref.finalize(plan, _RUNS.pop, key, None)
        _RUNS[key] = find_runs(index, values_index)
    return _RUNS[key]


def _balanced_cuts(offsets: np.ndarray, total: int, pieces: int, count: int) -> np.ndarray:
    """Bounds ``0 = c_0 <= ... <= c_pieces = count`` of ``pieces`` runs of items of about equal work,
    ``offsets`` being the items' cumulative work (an ``indptr`` or a plan's ``starts``)."""
    targets = np.linspace(0, total, pieces + 1)[1:-1].astype(offsets.dtype)  # same dtype: no copy
    return np.concatenate(([0], np.searchsorted(offsets, targets), [count])).astype(np.int64)


FIRST_TERM_MAX_TERMS = 2
"""Stored products with at most this many multiply-adds per ``C`` entry on average stream every
entry's first term, then add the longer entries' other terms
(:func:`sparse_scan.engine._kernels.first_term_products`); longer sums loop per entry
(:func:`~sparse_scan.engine._kernels.stored_products`). Measured (float32, 2 threads, batch 1 / 16,
first-term over per-entry loop): VGG-11-pruned's pool1·pool2 (1.03 terms) 2.8-5.8 / 50-53 ms
against 7.8-9.0 / 125-152 ms; random products of 1.05 and 1.51 terms 1.6-2.9x faster; of 4.1
terms 1.62-1.97 against 1.54-1.86 ms / 11-15 against 19 ms; of 12 terms 1.15x slower at batch 1."""


def _multiply_stored(plan: ProductPlan, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """The stored multiply-adds, summed per ``C`` entry (compiled:
    :func:`sparse_scan.engine._kernels.stored_products`, or
    :func:`~sparse_scan.engine._kernels.first_term_products` for short sums:
    :data:`FIRST_TERM_MAX_TERMS`).

    ``a``/``b`` are ``(1 or B, nnz)``, ``out`` ``(B, nnz_C)``. Each entry is summed from zero in the
    plan's order, as SciPy's CSR kernels sum a row, so the values equal those of the former SciPy
    matrix-vector formulation bit for bit. Batches run one run of samples per core; one sample (or
    operands shared by the batch) runs of ``C`` entries of about equal multiply-adds.
    """
    starts, total = plan.starts, plan.multiply_adds
    batch, nnz = out.shape
    pieces = parts(batch, nnz, workers_for(total * batch))
    if len(pieces) > 1 and batch < len(pieces):  # cut by multiply-adds, not by entries
        cuts = _balanced_cuts(starts, total, len(pieces), nnz)
        pieces = [(0, batch, int(e0), int(e1)) for e0, e1 in zip(cuts[:-1], cuts[1:], strict=True)
                  if e1 > e0]
    if total <= FIRST_TERM_MAX_TERMS * nnz:
        kernel, block = first_term_products, BLOCK_ENTRIES
    else:
        kernel, block = stored_products, nnz
    launch(kernel, (a, b, plan.a_pos, plan.b_pos, starts, total, out), [piece + (block,) for piece in pieces])


def _multiply_rowwise(plan: ProductPlan, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """Every row of ``C`` expanded from the operands' patterns and summed into its stored entries,
    skipping ``A``'s zero entries (compiled: :func:`sparse_scan.engine._kernels.rowwise_products`):
    the lean method, which stores nothing per multiply-add, and the live one of summed products
    with a per-sample ``A`` (:func:`_skips_dead_rows`). Batches run one run of samples per core; one
    sample runs of rows."""
    pa, pb = plan.operands
    c = plan.out
    batch = out.shape[0]
    rows = c.shape[0]
    pieces = parts(batch, rows, workers_for(plan.multiply_adds * batch))
    if len(pieces) > 1 and batch < len(pieces):  # cut rows by C entries
        cuts = _balanced_cuts(np.asarray(c.indptr), c.nnz, len(pieces), rows)
        pieces = [(0, batch, int(r0), int(r1)) for r0, r1 in zip(cuts[:-1], cuts[1:], strict=True)
                  if r1 > r0]
    launch(rowwise_products,
           (np.asarray(pa.indptr), np.asarray(pa.indices), np.asarray(pb.indptr), np.asarray(pb.indices),
            np.asarray(c.indptr), np.asarray(c.indices), c.shape[1], a, b, out), pieces)


MATVEC_THREAD_MIN = 2**21
"""Host SpMVs with this many multiply-adds (non-zeros times vectors) run on every core. Measured on 2
cores with SciPy's kernels, VGG-11's 97%-pruned convolution JTs: 1.2-1.5x faster from about 3M, 1.7x
slower at 0.5M."""


def matvec(pattern: Pattern, data: Array, vectors: Array) -> Array:
    """``A @ v`` for a batch of vectors ``(B, cols)`` on the host: returns ``(B, rows)``.

    ``data`` is ``(nnz,)`` (one matrix for the batch) or ``(B, nnz)`` (one matrix per sample). A
    compiled kernel (:func:`sparse_scan.engine._kernels.csr_products`) sums every row from zero in
    its order in the result dtype, as SciPy's CSR kernels do (explicit zeros kept; the values are
    SciPy's bit for bit), without building a SciPy matrix per call (60-90 µs each, measured: most of
    a small model's backward). From :data:`MATVEC_THREAD_MIN` multiply-adds on, the work is cut over
    the cores: the samples, or runs of rows of about equal non-zeros.
    """
    rows, batch = pattern.shape[0], vectors.shape[0]
    out = np.empty((batch, rows), dtype=np.result_type(data, vectors))
    indptr = np.asarray(pattern.indptr)
    pieces = parts(batch, rows, cpu_threads() if pattern.nnz * batch >= MATVEC_THREAD_MIN else 1)
    if len(pieces) > 1 and batch < len(pieces):  # cut rows by non-zeros, not by rows
        cuts = _balanced_cuts(indptr, pattern.nnz, len(pieces), rows)
        pieces = [(0, batch, int(r0), int(r1)) for r0, r1 in zip(cuts[:-1], cuts[1:], strict=True) if r1 > r0]
    launch(csr_products, (indptr, np.asarray(pattern.indices), rows2d(data, data.dtype),
                          np.ascontiguousarray(vectors), out), pieces)
    return out


def run_plan(plan: ScanPlan, grad_out: Array, jacobians: Sequence[BatchedCSR | None],
             threads: int | None = None,
             weights_matvecs: Mapping[int, Callable[[Array], Array]] | None = None,
             outputs: frozenset[int] | None = None,
             ready: Callable[[int, Array], None] | None = None) -> list[Array | None]:
    """Numeric phase: execute ``plan`` for one batch.

    The steps of a level are independent: with ``threads > 1`` they run concurrently (NumPy's and
    SciPy's kernels release the GIL), which is the scan's parallelism on a multi-core CPU. Values
    are released at the end of the level of their last use.

    Parameters
    ----------
    plan : ScanPlan
    grad_out : ndarray, shape (B, size of x_n)
        ``g_n``, flattened per sample.
    jacobians : sequence of BatchedCSR or None
        ``jacobians[j - 1]`` is scan element ``j`` (the JT of layer ``n - j + 1``); their patterns
        are the ones the plan was built from. None for a JT that only mv steps read and that
        ``weights_matvecs`` applies (``plan.weights.valueless``).
    threads : int, optional
        Worker threads per level (default: the cores this process may use).
    weights_matvecs : mapping, optional
        ``weights_matvecs[j](g)`` computes ``JT_j @ g`` from layer weights (``(B, cols) -> (B, rows)``,
        ``Layer.weights_matvec``, bound by the caller): every mv step by JT ``j`` uses it. Without it
        mv steps run as SpMVs.
    outputs : frozenset of int, optional
        The gradients wanted (``i`` of ``x_i``; None: every one): only the steps they need run
        (:meth:`~sparse_scan.engine.plan.ScanPlan.needed_steps`), and ``jacobians`` may hold None for
        the JTs no such step reads.
    ready : callable, optional
        ``ready(i, grad)`` on this thread as soon as the wanted gradient w.r.t. ``x_i`` is computed
        (``g_n`` first, then at the end of each level its results), for work that may start from it
        while the scan goes on.

    Returns
    -------
    list of ndarray
        ``grads[i]`` of shape ``(B, size of x_i)``, ``i = 0..n`` (None for one not in ``outputs``).
    """
    if plan.estimated:
        raise ValueError("an estimated plan (estimate_plan) has no products to run: build_plan it")
    values: dict[Element, Array] = {Element(0, 0): grad_out}
    patterns: dict[Element, Pattern] = {}
    for j, jt in enumerate(jacobians, start=1):
        if jt is not None:
            values[Element(j, j)] = jt.data
            patterns[Element(j, j)] = jt.pattern
    through = {Element(j, j): matvec for j, matvec in (weights_matvecs or {}).items()}

    buffers = _ProductBuffers(plan)

    def output(step: Step) -> Array | None:
        """A kept buffer for a product's values (taken on this thread, before the level runs)."""
        if step.product is None or step.product.method == "block":
            return None
        right, left = values[step.right], values[step.left]
        return buffers.take(_product_shape(step.product, right, left), np.result_type(right, left))

    def compute(step: Step, out: Array | None) -> Array:
        if step.kind == "mv" and step.right in through:
            return through[step.right](values[step.left])
        right = values[step.right]
        if step.scaling:  # a diagonal JT holds its whole diagonal, in order
            return right * values[step.left]
        if step.kind == "mv":
            return matvec(patterns[step.right], right, values[step.left])
        return multiply(step.product, right, values[step.left], out=out)

    workers = thread_count(threads)
    concurrent = workers > 1 and any(len(level) > 1 for level in plan.levels_of_steps)
    with step_pool(workers) if concurrent else contextlib.nullcontext() as pool:
        live = None if outputs is None else plan.needed_steps(outputs)[0]
        wanted = {} if ready is None else {element: i for i, element in enumerate(plan.outputs)
                                           if outputs is None or i in outputs}
        if Element(0, 0) in wanted:
            ready(wanted[Element(0, 0)], grad_out)
        for level in plan.levels_of_steps:
            steps = [plan.steps[index] for index in level if live is None or index in live]
            outs = [output(step) for step in steps]
            run = pool.map if pool is not None and len(steps) > 1 else map
            for step, result in zip(steps, list(run(compute, steps, outs)), strict=True):
                values[step.out] = result
                if step.product is not None:
                    patterns[step.out] = step.product.out
                if step.out in wanted:
                    ready(wanted[step.out], result)
            for index in level:
                for element in plan.releases[index]:
                    buffers.give_back(values.pop(element, None))
    grads = [values[element] if outputs is None or i in outputs else None
             for i, element in enumerate(plan.outputs)]
    buffers.keep(grads)
    return grads


_KEPT: dict[int, dict[tuple, list[np.ndarray]]] = {}
"""The arrays kept by :class:`_ProductBuffers` per plan (by identity, dropped with the plan)."""


class _ProductBuffers:
    """The arrays a run of a plan writes its products into, kept for the plan's next run.

    Products at batch 16 write tens of MB each (394 MB per backward for hybrid 1 over the pruned
    VGG-11), and fresh memory costs its page faults on every run: reusing the arrays measured 16 %
    off that backward (266-276 -> 225-227 ms, 2 cores). A run takes the plan's kept arrays (a run of
    the same plan on another thread meanwhile allocates its own), reuses an array of the same shape
    and dtype released by an earlier level or run, and finally keeps the arrays it used, no others:
    what is kept between runs is at most one run's worth, of the last batch size.
    """

    def __init__(self, plan: ScanPlan) -> None:
        self._plan = id(plan)
        if self._plan not in _KEPT:
            weakref.finalize(plan, _KEPT.pop, self._plan, None)
        self._free = _KEPT.pop(self._plan, {})
        self._used: dict[int, np.ndarray] = {}

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A free array of ``shape`` and ``dtype`` (new if there is none)."""
        free = self._free.get((shape, np.dtype(dtype)))
        array = free.pop() if free else np.empty(shape, dtype=dtype)
        self._used[id(array)] = array
        return array

    def give_back(self, value: Array | None) -> None:
        """``value`` is read no more: free if it is one of the arrays taken."""
        if value is not None and self._used.get(id(value)) is value:
            self._free.setdefault((value.shape, value.dtype), []).append(value)

    def keep(self, results: Sequence[Array]) -> None:
        """Keep the arrays this run used, but any of ``results``, for the plan's next run."""
        returned = {id(result) for result in results}
        kept: dict[tuple, list[np.ndarray]] = {}
        for key, array in self._used.items():
            if key not in returned:
                kept.setdefault((array.shape, array.dtype), []).append(array)
        _KEPT[self._plan] = kept
