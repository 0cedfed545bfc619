"""The host executor of dense-block scan plans (:class:`~sparse_scan.engine.dense_plan.DenseScanPlan`).

Each level of the plan runs as a few batched NumPy ``matmul`` calls over all its pairs and samples,
split over a pool of threads when large; chains of one matrix-vector product per level (the linear
middle of a hybrid, back-propagation) run in a tight loop. Callers go through
:func:`sparse_scan.engine.run.dense_scan`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from .._threads import even_parts, run_parts, thread_count, worker_pool
from .._types import Array
from .dense_plan import INPUT, DenseGroup, DenseScanPlan

__all__ = ["run_dense_plan"]


@dataclass(frozen=True)
class _Threads:
    """CPU threads that share a level's products."""

    pool: ThreadPoolExecutor
    count: int


SPLIT_MIN_VALUES = 2**20
"""A level's block products are split over the CPU threads from this many operand values: NumPy's
stacked matmul of small blocks gains little from a second thread (measured on 2 cores, H=20, T=1000:
slower at B=2, even at B=16, 4-15% faster at B=64..256)."""


def _matmul(xp: ModuleType, right: Array, left: Array, pool: _Threads | None) -> Array:
    """``right @ left`` over stacks ``(N, B, r, c)``; split over the pool's threads when large."""
    if pool is None or right.size < SPLIT_MIN_VALUES:
        return xp.matmul(right, left)
    out = xp.empty(right.shape[:-1] + left.shape[-1:], dtype=right.dtype)
    axis = 0 if right.shape[0] >= right.shape[1] else 1

    def run(first: int, last: int) -> None:
        part = (slice(None),) * axis + (slice(first, last),)
        xp.matmul(right[part], left[part], out=out[part])

    run_parts(pool.pool, run, even_parts(right.shape[axis], pool.count))
    return out


def _run_level(xp: ModuleType, groups: list[DenseGroup], blocks: dict[int, Array], vectors: dict[int, Array],
               pool: _Threads | None, affine: bool) -> None:
    """One level: every group's products; without direct gradients (``affine=False``) blocks carry
    no vector part, so products of blocks skip it."""
    for group in groups:
        right = group.right.read(xp, blocks)
        if group.kind == "mm":
            blocks[group.buffer] = _matmul(xp, right, group.left.read(xp, blocks), pool)
            if not affine:
                continue
        product = _matmul(xp, right, group.left.read(xp, vectors)[..., None], pool)[..., 0]
        if affine:
            product += group.right.read(xp, vectors)
        vectors[group.buffer] = product


def _scan_arrays(xp: ModuleType, plan: DenseScanPlan, blocks: Array, direct: Array,
                 pool: _Threads | None) -> Array:
    affine = direct.ndim == 3
    n, (batch, size) = plan.n, direct.shape[-2:]
    inputs = xp.zeros((n + 1, batch, size), dtype=blocks.dtype)  # row 0: d_0 = 0
    if affine:
        inputs[1:] = direct
    else:
        inputs[n] = direct
    block_values, vector_values = {INPUT: blocks}, {INPUT: inputs}
    index = 0
    while index < len(plan.levels_of_groups):
        end = plan.chains.get(index)
        if end is None:
            _run_level(xp, plan.levels_of_groups[index], block_values, vector_values, pool, affine)
            end = index + 1
        else:
            _run_chain(xp, plan.levels_of_groups[index:end], block_values, vector_values, affine)
        for level in range(index, end):
            for buffer in plan.level_releases[level]:
                block_values.pop(buffer, None)
                vector_values.pop(buffer, None)
        index = end
    return plan.output_reader.read(xp, vector_values)


def _run_chain(xp: ModuleType, levels: list[list[DenseGroup]], blocks: dict[int, Array],
               vectors: dict[int, Array], affine: bool) -> None:
    """Levels of one matrix-vector product each, in a tight loop (results are rows of one array)."""
    first = levels[0][0].ops[0].left
    vector = vectors[first.buffer][first.row]
    out = xp.empty((len(levels),) + vector.shape, dtype=vector.dtype)
    for step, (group,) in enumerate(levels):
        right = group.ops[0].right
        xp.matmul(blocks[right.buffer][right.row], vector[:, :, None], out=out[step, :, :, None])
        vector = out[step]
        if affine:
            vector += vectors[right.buffer][right.row]
        vectors[group.buffer] = out[step:step + 1]


def run_dense_plan(plan: DenseScanPlan, blocks: Array, direct: Array, threads: int | None = None) -> Array:
    """Numeric phase of ``plan`` on the host: the contract of :func:`sparse_scan.engine.run.dense_scan`
    (``direct`` already in the blocks' dtype), with ``threads`` CPU threads per level."""
    workers = thread_count(threads)
    with worker_pool(workers) as pool:  # shared: a pool per call costs about 0.4 ms
        return _scan_arrays(np, plan, blocks, direct, None if pool is None else _Threads(pool, workers))
