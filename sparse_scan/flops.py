"""Static FLOP analysis of a model's backward pass: from patterns and the scan plan, no values.

The symbolic half of the engine reports itself: per layer the JT's figures (paper Table 1), per scan
step its level, phase, kind, ``m·n·k`` and FLOPs (ARCHITECTURE.md convention) and whether it is on the
critical path (the costliest step of its level), and in total back-propagation's FLOPs (one SpMV per
layer), BPPSA's critical-path FLOPs and work, and peak memory.

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

from typing import Any, Callable

import numpy as np

from .jacobian_stats import chain_stats
from .model import Sequential

__all__ = ["analyse"]

LAYER_KEYS = ("name", "type", "shape", "nnz", "sparsity", "csr_bytes", "dense_bytes")


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
        Give up (:class:`~sparse_scan.scan.ScanCostError`) before planning a costlier product.
    progress : callable, optional
        ``progress(phase, done, total)`` while the plan is built.

    Returns
    -------
    dict
        ``layers[]`` (``name, type, shape, nnz, sparsity, csr_bytes, dense_bytes``), ``steps[]``
        (``level, phase, kind, method, mnk, flops, flops_live, out_nnz, critical``), ``totals``
        (``bp_flops, critical_flops, work_flops, critical_steps, peak_bytes``), ``method`` and
        ``levels`` (the schedule planned: the one chosen for ``"auto"``), ``schedule``
        (:meth:`~sparse_scan.scan.ScanPlan.explain`: the schedule, why, and the others considered).
    """
    if model.input_shape is None:
        raise ValueError("the model has no input_shape: build it with Sequential(..., input_shape=...) "
                         "or load it from a spec")
    itemsize = np.dtype(dtype).itemsize
    layers = [{key: row[key] for key in LAYER_KEYS}
              for row in chain_stats(model.layers, model.input_shape, dtype)]
    plan = model.plan(model.input_shape, method, levels, max_step_flops=max_step_flops, progress=progress)
    report = plan.report(batch, itemsize)
    costliest: dict[int, int] = {}
    for step in report["steps"]:
        costliest.setdefault(step["level"], step["flops"])
        costliest[step["level"]] = max(costliest[step["level"]], step["flops"])
    steps, marked = [], set()
    for step in report["steps"]:
        critical = step["level"] not in marked and step["flops"] == costliest[step["level"]]
        if critical:
            marked.add(step["level"])
        steps.append({"level": step["level"], "phase": step["phase"], "kind": step["kind"],
                      "method": step["method"], "mnk": step["mnk"], "flops": step["flops"],
                      "flops_live": step["flops_live"], "out_nnz": step["out_nnz"], "critical": critical})
    totals = dict(report["totals"])
    totals.pop("plan_bytes")
    totals["bp_flops"] = sum(2 * layer["nnz"] for layer in layers)
    return {"method": plan.method, "levels": plan.levels, "layers": layers, "steps": steps,
            "totals": {key: totals[key] for key in sorted(totals)},
            "schedule": plan.explain(batch, itemsize)}
