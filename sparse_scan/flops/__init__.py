"""FLOP analysis of a model's backward pass: static (patterns and the scan plan, no values) and live.

The symbolic half of the engine reports itself: per JT its figures (paper Table 1, :func:`layer_stats`),
per scan step its level, phase, kind, ``m·n·k`` and FLOPs (docs/design.md's FLOP counting) and whether
it is on the critical path (the costliest step of its level), and in total back-propagation's FLOPs (one
SpMV per JT), BPPSA's critical-path FLOPs and work, and peak memory. Any
:class:`~sparse_scan.model.Model` is analysed the same way: the scan's figures are its plan's own (the
plan protocol, :class:`~sparse_scan.engine.figures.ScanPlanLike`), the JTs' come from the model's
:meth:`~sparse_scan.model.Model.jacobian_sizes` (a layer counts its pattern's entries from the shapes
alone where it can, so no pattern is built: VGG-11's would take seconds; a recurrent scan's ``T``
dense blocks count every entry).

Examples
--------
>>> import numpy as np
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU
>>> model = Sequential(Conv2d(1, 2, 3, rng=0), ReLU(), Flatten(), Linear(32, 3, rng=1),
...                    input_shape=(1, 6, 6))
>>> report = analyse(model, "blelloch")
>>> sorted(report["totals"])
['bp_flops', 'critical_flops', 'critical_steps', 'peak_bytes', 'work_flops']
>>> report["totals"]["bp_flops"] == sum(2 * layer["nnz"] for layer in report["layers"])
True

:func:`live` counts the same steps on the non-zeros of a batch (the paper's Fig. 10 measure): a ReLU's
off units and a max-pool's non-maximum entries are dropped from every product, per sample (a model
whose JTs are dense blocks has no zeros to drop: it refuses).

>>> x = np.random.default_rng(0).standard_normal((3, 1, 6, 6)).astype(np.float32)
>>> figures = live(model, x, "blelloch")
>>> figures["convention"], figures["samples"], len(figures["steps"]) == len(report["steps"])
('ours', 3, True)
>>> critical = figures["totals"]["critical_flops"]
>>> critical["static"] == report["totals"]["critical_flops"], critical["live"]["max"] <= critical["static"]
(True, True)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from ..csr import choose_index_dtype
from ..engine.figures import ScanPlanLike, critical_path
from ..layers import Layer
from ..model import JacobianSize, Model
from ._live import CONVENTIONS, LiveCounts, live_counts

__all__ = ["CONVENTIONS", "analyse", "layer_stats", "live"]

LAYER_KEYS = ("name", "type", "shape", "nnz", "sparsity", "csr_bytes", "dense_bytes")
"""The keys of a report's ``layers[]`` row (a recurrent scan's adds ``blocks``, its count of JTs)."""
STEP_KEYS = ("level", "phase", "kind", "method", "mnk", "flops", "flops_live", "out_nnz")


def layer_stats(layer: Layer, in_shape: Sequence[int], dtype: Any = np.float32,
                name: str | None = None) -> dict[str, Any]:
    """Figures of one layer's transposed Jacobian for one sample of ``in_shape``.

    Parameters
    ----------
    layer : Layer
    in_shape : sequence of int
        Per-sample input shape (no batch axis).
    dtype : numpy dtype
        Value dtype assumed for the byte counts.
    name : str, optional
        Name to report (defaults to ``layer.name`` or the class name).

    Returns
    -------
    dict
        ``name, type, in_shape, out_shape, shape, nnz, sparsity, csr_bytes, dense_bytes,
        sample_independent, kind``. ``csr_bytes`` counts ``indptr + indices + data`` of one
        sample; ``dense_bytes`` is the same matrix stored dense.

    Examples
    --------
    >>> from sparse_scan.layers import Conv2d, MaxPool2d, ReLU
    >>> shape, rows = (3, 32, 32), []
    >>> for layer in (Conv2d(3, 64, 3, padding=1, rng=0), ReLU(), MaxPool2d(2)):
    ...     rows.append(layer_stats(layer, shape))
    ...     shape = layer.output_shape(shape)
    >>> [(r["type"], r["nnz"], round(r["sparsity"], 5)) for r in rows]
    [('Conv2d', 1696512, 0.99157), ('ReLU', 65536, 0.99998), ('MaxPool2d', 65536, 0.99994)]
    """
    in_shape = tuple(int(s) for s in in_shape)
    out_shape = tuple(layer.output_shape(in_shape))
    size = JacobianSize(name or layer.name or type(layer).__name__, type(layer).__name__,
                        (math.prod(in_shape), math.prod(out_shape)), layer.pattern_nnz(in_shape))
    return {**_jacobian_row(size, dtype), "in_shape": list(in_shape), "out_shape": list(out_shape),
            "sample_independent": layer.sample_independent, "kind": layer.jacobian_kind}


def _jacobian_row(size: JacobianSize, dtype: Any) -> dict[str, Any]:
    """A ``layers[]`` row of one JT (:data:`LAYER_KEYS`): ``csr_bytes`` counts ``indptr + indices +
    data``, ``dense_bytes`` the matrix stored dense; ``blocks`` where the row stands for several."""
    itemsize = np.dtype(dtype).itemsize
    (rows, cols), nnz = size.shape, size.nnz
    index_bytes = choose_index_dtype(nnz, cols).itemsize * (rows + 1 + nnz)  # indptr + indices
    return {"name": size.name, "type": size.type, "shape": [rows, cols], "nnz": nnz,
            "sparsity": 1.0 - nnz / (rows * cols), "csr_bytes": index_bytes + nnz * itemsize,
            "dense_bytes": rows * cols * itemsize} | ({"blocks": size.blocks} if size.blocks != 1 else {})


def _plan_figures(plan: ScanPlanLike, batch: int, itemsize: int) -> tuple[list[dict[str, Any]],
                                                                           dict[str, int]]:
    """The step rows (each marked ``critical`` or not) and the totals of any plan kind."""
    on_path = set(critical_path(plan.steps))
    rows = plan.report(batch, itemsize)["steps"]  # a recurrent plan's rows name their scan too
    steps = [{key: row[key] for key in STEP_KEYS} | {key: row[key] for key in ("scan",) if key in row}
             | {"critical": index in on_path} for index, row in enumerate(rows)]
    totals = {"critical_flops": plan.critical_flops, "work_flops": plan.work_flops,
              "critical_steps": plan.critical_steps, "peak_bytes": plan.peak_bytes(batch, itemsize)}
    return steps, totals


def analyse(model: Model, method: str = "auto", levels: int | str | None = None,
            batch: int = 1, dtype: Any = np.float32, max_step_flops: int | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """FLOP and memory figures of ``model``'s backward pass under a scan schedule.

    Parameters
    ----------
    model : Model
        A :class:`~sparse_scan.model.Model` with ``input_shape`` set (a loaded spec has it). A
        recurrent classifier's rows are its scans' dense blocks (``blocks`` of them each).
    method, levels
        The schedule (as in the model's ``backward``; ``auto`` chooses one, for ``batch``).
    batch : int
        Samples assumed for ``peak_bytes``.
    dtype : numpy dtype
        Value dtype assumed for byte counts.
    max_step_flops : int, optional
        Give up (:class:`~sparse_scan.engine.plan.ScanCostError`) before planning a costlier product.
    progress : callable, optional
        ``progress(phase, done, total)`` while the plan is built.

    Returns
    -------
    dict
        ``layers[]`` (``name, type, shape, nnz, sparsity, csr_bytes, dense_bytes``, and ``blocks``
        where a row stands for several JTs), ``steps[]`` (``level, phase, kind, method, mnk, flops,
        flops_live, out_nnz, critical``, and the ``scan`` of a recurrent model's step), ``totals``
        (``bp_flops, critical_flops, work_flops, critical_steps, peak_bytes``), ``method`` and
        ``levels`` (the schedule planned: the one chosen for ``"auto"``), ``schedule``
        (:meth:`~sparse_scan.engine.plan.ScanPlan.explain`: the schedule, why, and the others
        considered).
    """
    if model.input_shape is None:
        raise ValueError("the model has no input_shape: build it with input_shape=... or load it from a spec")
    itemsize = np.dtype(dtype).itemsize
    sizes = model.jacobian_sizes(model.input_shape)
    layers = [_jacobian_row(size, dtype) for size in sizes]
    plan = model.plan(model.input_shape, method, levels, batch=batch, max_step_flops=max_step_flops,
                      progress=progress)
    steps, totals = _plan_figures(plan, batch, itemsize)
    totals["bp_flops"] = sum(2 * size.nnz * size.blocks for size in sizes)
    return {"method": plan.method, "levels": plan.levels, "layers": layers, "steps": steps,
            "totals": {key: totals[key] for key in sorted(totals)},
            "schedule": plan.explain(batch, itemsize)}


def _spread(values: np.ndarray) -> dict[str, Any]:
    """``mean``, ``min``, ``max`` and ``samples`` (each sample's figure) of per-sample figures."""
    values = np.asarray(values, dtype=np.int64)
    return {"mean": float(values.mean()), "min": int(values.min()), "max": int(values.max()),
            "samples": [int(value) for value in values]}


def _live_report(counts: LiveCounts, model: Model, in_shape: tuple[int, ...],
                 fill_flops: tuple[int, int]) -> dict[str, Any]:
    """The JSON-friendly report of :func:`live` (its Returns); ``fill_flops`` (the plan's JT fills,
    counted over their patterns) join the critical path and the work, static and live."""
    costliest: dict[int, tuple[int, int]] = {}  # level -> (index of static maximum, of mean live maximum)
    for index, row in enumerate(counts.rows):
        by_static, by_live = costliest.get(row.level, (index, index))
        costliest[row.level] = (index if row.static > counts.rows[by_static].static else by_static,
                                index if row.live.mean() > counts.rows[by_live].live.mean() else by_live)
    steps = [{"level": row.level, "phase": row.phase, "kind": row.kind, "mnk": list(row.mnk),
              "left": [row.left.lo, row.left.hi], "right": [row.right.lo, row.right.hi],
              "in_plan": row.in_plan, "static": row.static, "live": _spread(row.live),
              "critical": costliest[row.level][0] == index, "critical_live": costliest[row.level][1] == index}
             for index, row in enumerate(counts.rows)]
    shapes = model.shapes(in_shape)
    bp = [{"name": layer.name or type(layer).__name__, "type": type(layer).__name__,
           "shape": [math.prod(shapes[index]), math.prod(shapes[index + 1])],
           "static": int(static), "live": _spread(per_sample)}
          for index, (layer, static, per_sample) in enumerate(zip(model.layers, counts.bp_static,
                                                                  counts.bp_live, strict=True))]
    critical, work = fill_flops
    totals = {"critical_flops": {"static": counts.critical_static() + critical,
                                 "live": _spread(counts.critical_live() + critical)},
              "work_flops": {"static": sum(row.static for row in counts.rows) + work,
                             "live": _spread(counts.work_live() + work)},
              "bp_flops": {"static": int(counts.bp_static.sum()),
                           "live": _spread(counts.bp_live.sum(axis=0))},
              "critical_steps": len(costliest)}
    return {"convention": counts.convention, "steps": steps, "bp": bp, "totals": totals}


def live(model: Model, x: np.ndarray, method: str = "auto", levels: int | str | None = None,
         convention: str = "ours", max_step_flops: int | None = None,
         progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """FLOPs of ``model``'s backward pass on the live entries of the batch ``x``, per step and sample.

    Runs ``model.forward(x)`` and takes every layer's JT for the batch; for each sample, the zeros of
    the JTs (a ReLU's off units, a max-pool's non-maximum window entries) are dropped and the rest
    propagated through the plan's steps as a zero-dropping SpGEMM would (a product's live pattern is
    the boolean product of its operands' live patterns; the output gradient counts as dense). The
    count is structural: an exact numerical cancellation stays live. Next to each figure, the static
    one (every stored entry live) in the same convention.

    Parameters
    ----------
    model : Model
        A :class:`~sparse_scan.model.Model` whose JTs are sparse (a recurrent one's are dense blocks:
        its :meth:`~sparse_scan.model.Model.transposed_jacobians` refuses, and so does this).
    x : ndarray, shape (B, *input_shape)
        The batch (host array).
    method, levels
        The schedule (as in the model's ``backward``; ``auto`` chooses one from static figures).
    convention : {"ours", "paper"}
        ``ours``: docs/design.md's, as the plan's static ``flops`` (an mv and an mm 2 per
        multiply-add, a scaling by a diagonal 1 per entry; back-propagation is the mv chain on the
        live entries). ``paper``: the paper's artifact's (2 per multiply-add, scalings too; no step
        for ``dL/dx_0``; the up-sweep products nothing reads counted; BP by its baseline's formula,
        per layer ``2·nnz``, ``rows + live entries`` for a diagonal JT, ``rows + cols`` for a
        max-pool's).
    max_step_flops : int, optional
        Give up (:class:`~sparse_scan.engine.plan.ScanCostError`) before planning a costlier product.
    progress : callable, optional
        ``progress(phase, done, total)`` while the plan is built and (phase ``"live"``) after each
        sample is counted.

    Raises
    ------
    ScanMemoryError
        The JTs' values and indices for the batch would not fit the model's memory budget: refused
        before any is built (:meth:`~sparse_scan.Sequential.transposed_jacobians`).

    Returns
    -------
    dict
        ``convention``, ``method``, ``levels``, ``samples`` (B); ``steps[]`` (``level, phase, kind,
        mnk, left, right``, ``in_plan`` (false for a step only ``paper`` counts), ``static``,
        ``live``, ``critical`` (the level's costliest statically), ``critical_live`` (... by mean live
        FLOPs)); ``bp[]`` per layer (``name, type, shape, static, live``); ``totals``
        (``critical_flops``, ``work_flops``, ``bp_flops``: each ``static`` and ``live``;
        ``critical_steps``). Every ``live`` is ``{mean, min, max, samples}`` over the batch, a live
        critical path being each sample's own (each level's costliest step for that sample). The
        totals hold the plan's JT fills (a residual block's own products, ``ScanPlan.fill_flops``)
        counted over their patterns.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}; got {convention!r}")
    if not isinstance(x, np.ndarray) or x.ndim < 1 or not len(x):
        raise ValueError("x: expected a NumPy array (B, *input_shape) of one sample or more")
    in_shape = tuple(int(s) for s in x.shape[1:])
    if model.input_shape is not None and in_shape != tuple(model.input_shape):
        raise ValueError(f"x: samples of shape {list(in_shape)}, the model takes {list(model.input_shape)}")
    plan = model.plan(in_shape, method, levels, batch=len(x), max_step_flops=max_step_flops,
                      progress=progress)
    model.forward(x)
    jacobians = model.transposed_jacobians()[::-1]  # scan element j is the JT of layer n - j
    kinds = [layer.jacobian_kind for layer in reversed(model.layers)]
    counts = live_counts(plan, jacobians, kinds, len(x), convention, progress)
    return {"method": plan.method, "levels": plan.levels, "samples": len(x),
            **_live_report(counts, model, in_shape, plan.fill_flops)}
