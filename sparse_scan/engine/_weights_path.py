"""Through the weights: a layer's JT applied to vectors from the layer's weights, without JT's values.

A layer whose JT is made of its weights (:class:`~sparse_scan.layers.Conv2d`,
:class:`~sparse_scan.layers.Linear`) can compute ``JT @ g`` for a batch of vectors without JT's
values: the transposed convolution (or ``g W``) is one GEMM over the weights, or a product with the
weights as CSR where they are heavily pruned. This module is the one home of that idea:

- what a layer offers, :class:`WeightsPath` (``Layer.weights_path``): the GEMM's multiply-adds and
  whether its weights multiply as CSR. The model puts it in the planner's
  :class:`~sparse_scan.engine.plan.ChainInfo`;
- when it pays, two rules. At planning: an mv step by a JT whose pattern holds at least
  :data:`DENSE_MATVEC_MIN_DENSITY` of the GEMM's multiply-adds runs as that GEMM (:func:`gemm_pays`;
  the plan marks such steps ``dense``). A JT that only mv steps read and whose layer holds CSR
  weights goes through them at every batch (the compiled sparse transposed convolution of
  :mod:`sparse_scan.layers._conv_pruned`);
- what a plan does with it, :class:`WeightsPlan` (``ScanPlan.weights``): for a batch, the JTs whose
  mv steps a host run applies through their weights (:meth:`WeightsPlan.through`) and those of them
  it needs no values of (:meth:`WeightsPlan.valueless`).

A backward on the host asks :func:`sparse_scan.engine.run.through_weights` (the dispatch: the GPU
scan runs every mv as an SpMV in its level launch) which JTs go through their weights, fills the
values of the others, binds those layers' operators (``Layer.weights_matvec``) on its own thread,
and hands both to the executor, which applies a bound operator wherever an mv step reads its JT.

Examples
--------
>>> path = WeightsPath(multiply_adds=1000, csr=False)
>>> gemm_pays(150, path), gemm_pays(50, path), gemm_pays(150, None), gemm_pays(50, path, fill_flops=800)
(True, False, False, True)
>>> plan = weights_plan(gemm=[1], mv=[3, 4], products=[4], paths=[path, None, WeightsPath(80, True), path])
>>> sorted(plan.through(batch=4)), sorted(plan.through(batch=16))
([1, 3], [1, 3])
>>> sorted(plan.valueless(plan.through(batch=4))), sorted(plan.gemm_only)
([1, 3], [1])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["DENSE_MATVEC_MIN_DENSITY", "FILL_FLOPS_PER_ENTRY", "WeightsPath", "WeightsPlan", "gemm_pays",
           "weights_plan"]

DENSE_MATVEC_MIN_DENSITY = 0.1
"""An mv by a JT runs as a dense GEMM over its layer's weights when the JT's pattern holds at least
this share of the GEMM's multiply-adds. Measured on VGG-11's convolutions (2-core CPU, float32, batch
4 and 16): SciPy's CSR SpMV costs 3.4-5.3 ns per stored entry, the GEMM plus the column scatter
0.08-0.5 ns per multiply-add, so the GEMM wins from a density of 0.02-0.1; unpruned layers (0.44-0.96)
take the GEMM, 97%-pruned ones (0.013-0.029) keep the SpMV."""

@dataclass(frozen=True)
class WeightsPath:
    """How a layer can apply its JT to vectors through its weights (``Layer.weights_path``).

    Attributes
    ----------
    multiply_adds : int
        Of the dense GEMM over the weights, per sample.
    csr : bool
        The weights are pruned heavily enough to multiply as CSR on the host (the operator then
        skips the pruned multiply-adds).
    calls : int
        Operators one application runs (a residual block: one per inner and shortcut layer and the
        sum): the cost model's fixed cost per call.
    weights : int
        Weight entries one application reads (once for the batch): the cost model's memory traffic
        of a GEMM (a convolution's are far fewer than its multiply-adds, a linear layer's as many).
    taps : int
        Per sample, the values a transposed convolution's taps add into place after its GEMM
        (``col2im``: input channels × kernel taps × output pixels; none for a linear layer or
        through CSR weights): the cost model's ``mv_taps``.
    """

    multiply_adds: int
    csr: bool = False
    calls: int = 1
    weights: int = 0
    taps: int = 0


FILL_FLOPS_PER_ENTRY = 8
"""FLOPs of a JT's fill (the products that make a block's JT, ``Layer.jacobian_fill_flops``) that cost
about what one stored entry's SpMV does: the CPU cost model's ``fill_flops`` (1.2e-10 s) against
``mv_spmv``'s 1.1e-9 s per entry."""


def gemm_pays(nnz: int, path: WeightsPath | None, fill_flops: int = 0) -> bool:
    """Whether an mv by a JT of ``nnz`` stored entries runs faster through its layer's weights
    (``path``; None: the layer has none) than by its values: :data:`DENSE_MATVEC_MIN_DENSITY`, the
    values' cost being their SpMV and, for a JT whose values are products (a block's: ``fill_flops``
    per sample), those products (:data:`FILL_FLOPS_PER_ENTRY`). A squeeze-and-excitation block's dense
    JT, or a residual block's whose values cost 1e8 FLOPs per sample, goes through its branches."""
    if path is None:
        return False
    return nnz + fill_flops / FILL_FLOPS_PER_ENTRY >= DENSE_MATVEC_MIN_DENSITY * path.multiply_adds


@dataclass(frozen=True)
class WeightsPlan:
    """Which layer JTs (scan elements ``j``) of a plan a host run may apply through their weights.

    Attributes
    ----------
    gemm : frozenset of int
        JTs whose mv steps run as GEMMs over the weights at any batch (the steps marked ``dense``).
    mv_only : frozenset of int
        JTs that only mv steps read (every one in back-propagation's schedule).
    csr : frozenset of int
        Those of ``mv_only`` whose layers hold CSR weights: through them at every batch. Measured on
        VGG-11's eight 97%-pruned convolutions (2 cores, float32), the compiled transposed
        convolution against JT's values fill plus its SpMV: 12.9 ms against about 40 at batch 16
        (SciPy's ``W^T @ g`` plus col2im, before it, lost from batch 8 on: 0.74x at 16).
    paths : tuple of (int, WeightsPath)
        The path of each JT of :attr:`gemm` and :attr:`csr`, for the cost model: a GEMM over the
        weights does the dense layer's multiply-adds, pruned or not, not JT's ``nnz``.
    """

    gemm: frozenset[int] = frozenset()
    mv_only: frozenset[int] = frozenset()
    csr: frozenset[int] = frozenset()
    paths: tuple[tuple[int, WeightsPath], ...] = ()

    @property
    def gemm_only(self) -> frozenset[int]:
        """JTs that only GEMM steps read: a host run holds no values for them at any batch."""
        return self.gemm & self.mv_only

    def through(self, batch: int) -> frozenset[int]:
        """The JTs whose mv steps a host run of ``batch`` samples applies through their weights."""
        return self.gemm | self.csr

    def valueless(self, through: frozenset[int]) -> frozenset[int]:
        """Of the JTs a run applies ``through`` their weights, those it needs no values of (no product
        reads them)."""
        return through & self.mv_only


def weights_plan(gemm: Iterable[int], mv: Iterable[int], products: Iterable[int],
                 paths: Sequence[WeightsPath | None]) -> WeightsPlan:
    """The :class:`WeightsPlan` of a plan's steps.

    Parameters
    ----------
    gemm, mv, products : iterable of int
        The layer JTs (scan elements ``j >= 1``) read by an mv step marked ``dense``, by another mv
        step, and by a product.
    paths : sequence of WeightsPath or None
        ``paths[j - 1]``: element ``j``'s layer's path through its weights
        (:attr:`ChainInfo.weights <sparse_scan.engine.plan.ChainInfo.weights>`).
    """
    gemm, mv, products = frozenset(gemm), frozenset(mv), frozenset(products)
    mv_only = (gemm | mv) - products
    csr = frozenset(j for j in mv_only if paths[j - 1] is not None and paths[j - 1].csr)
    used = tuple((j, paths[j - 1]) for j in sorted(gemm | csr) if paths[j - 1] is not None)
    return WeightsPlan(gemm, mv_only, csr, used)
