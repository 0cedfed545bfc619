"""The product of a slice of layers' transposed Jacobians, planned once and computed per batch.

A process holding layers ``a+1 .. b`` of a chain contributes one matrix to a scan across processes:
``S = JT_{a+1} · JT_{a+2} ··· JT_b`` (so that ``g_a = S g_b``). It is reduced by a balanced tree of
planned sparse products (:func:`sparse_scan.engine.products.plan_product`: scalings, gathers, dense
channel blocks or general products, as in the scan), ``ceil(log2 m)`` levels for ``m`` layers,
computed through the engine's dispatch (:func:`sparse_scan.engine.run.multiply`), on the device of the
JTs' values: NumPy arrays on the host, CuPy arrays on a GPU. A slice matrix applied to a batch of
vectors (:func:`apply`) is one more planned product, with the vectors as a column's values.

Examples
--------
>>> import numpy as np
>>> from sparse_scan.layers import Linear, ReLU
>>> from sparse_scan import Sequential
>>> model = Sequential(Linear(4, 3, dtype=np.float64, rng=0), ReLU(), Linear(3, 2, dtype=np.float64, rng=1))
>>> product = SliceProduct(model.layers, (4,))
>>> y = model.forward(np.random.default_rng(0).standard_normal((5, 4)))
>>> matrix = product.compute(model.transposed_jacobians())
>>> matrix.shape, matrix.kind, product.flops > 0
((4, 2), 'general', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .. import backend
from .._types import Array
from ..csr import BatchedCSR, Pattern
from ..engine.plan import ScanCostError
from ..engine.products import ProductPlan, count_multiply_adds, plan_product
from ..engine.run import multiply
from ..layers import Layer

__all__ = ["SliceMatrix", "SliceProduct", "apply", "combine"]


@dataclass(frozen=True, eq=False)
class SliceMatrix:
    """A batched sparse matrix with its kind: ``data`` is ``(nnz,)`` (shared) or ``(B, nnz)``."""

    pattern: Pattern
    kind: str
    data: Array

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)``."""
        return tuple(self.pattern.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of values and index structure (what a message carries)."""
        return int(self.data.nbytes) + self.pattern.nbytes


def _product_kind(a_kind: str, b_kind: str) -> str:
    return "diagonal" if a_kind == b_kind == "diagonal" else "general"


def combine(a: SliceMatrix, b: SliceMatrix, channels: tuple[int, int, int] | None = None) -> SliceMatrix:
    """``a @ b``, planned on the spot (for products formed once, e.g. across processes)."""
    plan = plan_product(a.pattern, b.pattern, a.kind, b.kind, channels=channels)
    return SliceMatrix(plan.out, _product_kind(a.kind, b.kind), multiply(plan, a.data, b.data))


def apply(matrix: SliceMatrix, vectors: Array) -> Array:
    """``matrix @ v`` for a batch of vectors ``(B, cols)``; returns ``(B, rows)`` on their device.

    The product of ``matrix`` with a dense column (the vectors as its values, ``(B, cols)``), planned
    on the spot (``O(nnz)`` on the host) and computed through the engine's dispatch; rows of the
    matrix without entries are zeros.
    """
    rows, cols = matrix.shape
    column = Pattern(np.arange(cols + 1), np.zeros(cols, dtype=matrix.pattern.indices.dtype), (cols, 1))
    plan = plan_product(matrix.pattern, column, matrix.kind, "general")
    values = multiply(plan, matrix.data, vectors)
    filled = np.flatnonzero(np.diff(np.asarray(plan.out.indptr)))
    if filled.size == rows:
        return values
    be = backend.of(values)
    out = be.xp.zeros((values.shape[0], rows), dtype=values.dtype)
    out[:, be.asarray(filled)] = values
    return out


class SliceProduct:
    """The planned product of the JTs of consecutive ``layers`` for a per-sample input shape.

    Parameters
    ----------
    layers : sequence of Layer
        The slice, in forward order.
    in_shape : tuple of int
        Per-sample shape of the slice's input.
    budget_bytes : int, optional
        Memory one product's plan may hold (as :func:`~sparse_scan.engine.products.plan_product`).
    max_flops : int, optional
        Give up with :class:`~sparse_scan.ScanCostError` before planning a product that would
        take the reduction past this many FLOPs (counting multiply-adds is cheap, expanding them is
        not).

    Attributes
    ----------
    flops : int
        FLOPs of every product of the reduction (over the pattern).
    levels : int
        Sequential product levels (``ceil(log2 m)``).
    nnz : int
        Stored entries of the result.
    """

    def __init__(self, layers: Sequence[Layer], in_shape: Sequence[int],
                 budget_bytes: int | None = None, max_flops: int | None = None) -> None:
        shapes = [tuple(int(s) for s in in_shape)]
        for layer in layers:
            shapes.append(tuple(layer.output_shape(shapes[-1])))
        # a node: (pattern, kind, channels of its rows, channels of its columns)
        nodes = [(layer.pattern(shape), layer.jacobian_kind, shape[0], out[0])
                 for layer, shape, out in zip(layers, shapes[:-1], shapes[1:], strict=True)]
        self._levels: list[list[ProductPlan]] = []
        self.flops = 0
        while len(nodes) > 1:
            plans, merged = [], []
            for (a, a_kind, a_rows, a_cols), (b, b_kind, _, b_cols) in zip(nodes[::2], nodes[1::2],
                                                                             strict=False):
                if max_flops is not None and "diagonal" not in (a_kind, b_kind):
                    needed = self.flops + 2 * count_multiply_adds(a, b)
                    if needed > max_flops:
                        raise ScanCostError(f"the slice product needs more than {needed} FLOPs, over the "
                                            f"limit of {max_flops}")
                plan = plan_product(a, b, a_kind, b_kind, budget_bytes=budget_bytes,
                                    channels=(a_rows, a_cols, b_cols))
                plans.append(plan)
                self.flops += plan.flops
                merged.append((plan.out, _product_kind(a_kind, b_kind), a_rows, b_cols))
            self._levels.append(plans)
            nodes = merged + nodes[len(nodes) // 2 * 2:]
        self.pattern, self.kind = nodes[0][0], nodes[0][1]
        self.levels = len(self._levels)
        self.nnz = self.pattern.nnz

    def compute(self, jacobians: Sequence[BatchedCSR]) -> SliceMatrix:
        """The product's values for a batch.

        Parameters
        ----------
        jacobians : sequence of BatchedCSR
            The slice's JTs for the batch (:meth:`Sequential.transposed_jacobians`), in layer order.

        Returns
        -------
        SliceMatrix
        """
        values = [jt.data for jt in jacobians]
        for plans in self._levels:
            pairs = zip(plans, values[::2], values[1::2], strict=False)
            merged = [multiply(plan, a, b) for plan, a, b in pairs]
            values = merged + values[len(values) // 2 * 2:]
        return SliceMatrix(self.pattern, self.kind, values[0])
