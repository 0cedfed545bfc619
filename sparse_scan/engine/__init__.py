"""The scan engine, in data-flow order.

================================  =================================================================
:mod:`.schedule`                  which products a scan computes, level by level (pure, no arrays)
:mod:`.products`                  the symbolic phase of one sparse product (``plan_product``)
:mod:`.plan`                      :class:`ScanPlan`: a schedule over sparse JTs with every product
                                  planned (``build_plan``, ``estimate_plan``)
:mod:`.dense_plan`                :class:`DenseScanPlan`: the schedule over dense blocks (recurrent)
:mod:`.cost`                      the cost model: a plan's predicted time on a backend (``CostModel``,
                                  its defaults and this machine's calibration, ``current``)
:mod:`.subnormals`                what a host run's gradients tell the cost model: their subnormal
                                  values, which slow the products that read them (``SubnormalWatch``)
:mod:`.figures`                   :class:`ScanPlanLike`: the figures both plan kinds report, in the
                                  same names and units (what ``sparse_scan.flops`` reads)
:mod:`.run`                       the numeric phase on the CPU or the GPU: the engine's one
                                  dispatch (``run_plan``, ``multiply``, ``dense_scan``)
================================  =================================================================

Plans never import an executor; the executors (private: ``_cpu``, ``_dense_cpu`` on the host,
``_gpu``, ``_dense_gpu`` on CuPy, sharing ``_tables``) import plan types only; :mod:`.run` alone sees
both. Most users never come here: :class:`sparse_scan.Sequential` and :mod:`sparse_scan.recurrent`
plan and run scans for them.

The names below load on first use, so ``from sparse_scan.engine import SCHEDULES`` imports no NumPy.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

__all__ = ["METHODS", "SCHEDULES", "ChainInfo", "DenseScanPlan", "Element", "ElementInfo",
           "PlanBudgetError", "ProductPlan", "ScanCostError", "ScanMemoryError", "ScanPlan", "ScanPlanLike",
           "SizedDenseScanPlan", "Step", "WeightsPath", "WeightsPlan", "auto_levels", "build_dense_plan",
           "build_plan", "checked_levels", "count_multiply_adds", "critical_path", "dense_scan", "depth",
           "estimate_plan", "live_schedule", "multiply", "operands_needing_patterns", "plan_product",
           "run_plan", "through_inputs", "through_weights"]

_HOMES = {
    "schedule": ("METHODS", "SCHEDULES", "Element", "checked_levels", "depth", "live_schedule"),
    "products": ("PlanBudgetError", "ProductPlan", "count_multiply_adds", "plan_product"),
    "plan": ("ChainInfo", "ElementInfo", "ScanCostError", "ScanMemoryError", "ScanPlan", "Step",
             "WeightsPath", "WeightsPlan", "build_plan", "estimate_plan", "operands_needing_patterns"),
    "dense_plan": ("DenseScanPlan", "SizedDenseScanPlan", "auto_levels", "build_dense_plan"),
    "figures": ("ScanPlanLike", "critical_path"),
    "run": ("dense_scan", "multiply", "run_plan", "through_inputs", "through_weights"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _MODULE_OF)
