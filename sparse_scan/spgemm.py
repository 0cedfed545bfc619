"""Deprecated: sparse products moved to :mod:`sparse_scan.engine` (removed in the next release).

``sparse_scan.spgemm`` re-exports the symbolic phase from :mod:`sparse_scan.engine.products` and the
numeric one from :mod:`sparse_scan.engine.run` (``multiply``, on the operands' device) and the host
executor (``matvec``).
"""

from __future__ import annotations

import warnings

from .engine._cpu import matvec
from .engine.products import PlanBudgetError, ProductPlan, count_multiply_adds, plan_product
from .engine.run import multiply

__all__ = ["PlanBudgetError", "ProductPlan", "count_multiply_adds", "matvec", "multiply",
           "plan_product"]

warnings.warn("sparse_scan.spgemm is deprecated: import from sparse_scan.engine "
              "(sparse_scan.engine.products, sparse_scan.engine.run)", DeprecationWarning, stacklevel=2)
