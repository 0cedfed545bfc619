"""Static FLOP analysis of a model's backward pass: from patterns and the scan plan, no values.

The symbolic half of the engine reports itself: per layer the JT's figures (paper Table 1,
:func:`layer_stats`), per scan step its level, phase, kind, ``m·n·k`` and FLOPs (ARCHITECTURE.md
convention) and whether it is on the critical path (the costliest step of its level), and in total
back-propagation's FLOPs (one SpMV per layer), BPPSA's critical-path FLOPs and work, and peak memory.
The scan's figures are the plan's own (the plan protocol,
:class:`~sparse_scan.engine.figures.ScanPlanLike`); the layers' come from each layer's count of its
pattern's entries (``Layer.pattern_nnz``) and the shapes alone, so no pattern is built where a layer
can count its entries without one (a convolution can; VGG-11's patterns would take seconds).

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
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from ._model import Sequential
from .csr import choose_index_dtype
from .engine.figures import ScanPlanLike, critical_path
from .layers import Layer

__all__ = ["analyse", "layer_stats"]

LAYER_KEYS = ("name", "type", "shape", "nnz", "sparsity", "csr_bytes", "dense_bytes")
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
    nnz = layer.pattern_nnz(in_shape)
    itemsize = np.dtype(dtype).itemsize
    rows, cols = math.prod(in_shape), math.prod(out_shape)
    index_bytes = choose_index_dtype(nnz, cols).itemsize * (rows + 1 + nnz)  # indptr + indices
    return {
        "name": name or layer.name or type(layer).__name__,
        "type": type(layer).__name__,
        "in_shape": list(in_shape),
        "out_shape": list(out_shape),
        "shape": [rows, cols],
        "nnz": nnz,
        "sparsity": 1.0 - nnz / (rows * cols),
        "csr_bytes": index_bytes + nnz * itemsize,
        "dense_bytes": rows * cols * itemsize,
        "sample_independent": layer.sample_independent,
        "kind": layer.jacobian_kind,
    }


def _plan_figures(plan: ScanPlanLike, batch: int, itemsize: int) -> tuple[list[dict[str, Any]],
                                                                           dict[str, int]]:
    """The step rows (each marked ``critical`` or not) and the totals of any plan kind."""
    on_path = set(critical_path(plan.steps))
    steps = [{**{key: row[key] for key in STEP_KEYS}, "critical": index in on_path}
             for index, row in enumerate(plan.report(batch, itemsize)["steps"])]
    totals = {"critical_flops": plan.critical_flops, "work_flops": plan.work_flops,
              "critical_steps": plan.critical_steps, "peak_bytes": plan.peak_bytes(batch, itemsize)}
    return steps, totals


def analyse(model: Sequential, method: str = "auto", levels: int | str | None = None,
            batch: int = 1, dtype: Any = np.float32, max_step_flops: int | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """FLOP and memory figures of ``model``'s backward pass under a scan schedule.

    Parameters
    ----------
    model : Sequential
        With ``input_shape`` set (a loaded spec has it).
    method, levels
        The schedule (as in :meth:`Sequential.backward`; ``auto`` chooses one).
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
        ``layers[]`` (``name, type, shape, nnz, sparsity, csr_bytes, dense_bytes``), ``steps[]``
        (``level, phase, kind, method, mnk, flops, flops_live, out_nnz, critical``), ``totals``
        (``bp_flops, critical_flops, work_flops, critical_steps, peak_bytes``), ``method`` and
        ``levels`` (the schedule planned: the one chosen for ``"auto"``), ``schedule``
        (:meth:`~sparse_scan.engine.plan.ScanPlan.explain`: the schedule, why, and the others
        considered).
    """
    if model.input_shape is None:
        raise ValueError("the model has no input_shape: build it with Sequential(..., input_shape=...) "
                         "or load it from a spec")
    itemsize = np.dtype(dtype).itemsize
    layers, shape = [], tuple(model.input_shape)
    for layer in model.layers:
        row = layer_stats(layer, shape, dtype)
        layers.append({key: row[key] for key in LAYER_KEYS})
        shape = layer.output_shape(shape)
    plan = model.plan(model.input_shape, method, levels, max_step_flops=max_step_flops, progress=progress)
    steps, totals = _plan_figures(plan, batch, itemsize)
    totals["bp_flops"] = sum(2 * layer["nnz"] for layer in layers)
    return {"method": plan.method, "levels": plan.levels, "layers": layers, "steps": steps,
            "totals": {key: totals[key] for key in sorted(totals)},
            "schedule": plan.explain(batch, itemsize)}
