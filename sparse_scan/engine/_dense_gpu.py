"""GPU numeric phase of a :class:`~sparse_scan.engine.dense_plan.DenseScanPlan`: a RawKernel launch per level
(one per chain of matrix-vector levels).

The steps of a level are independent. Each becomes a descriptor (a row of ``FIELDS`` int64s: kind,
first work item, samples, items per sample, ``H``, the affine flag, device pointers of its operand
rows and their sample strides; layout in ``rawkernels/dense_scan.cu``) in one host table for the whole
plan, and a level runs as one launch of ``dense_scan_level<T>`` over its rows: a work item is one
output element of one step and sample, so any ``H`` runs with the same launch shape. From
``TILED_MIN_SIZE`` on, a level with block products runs ``dense_scan_tiled<T>`` instead: a thread
block per ``16×16`` output tile, staging slabs of both operands in shared memory (each loaded value
serves 16 multiply-adds instead of one). A run of chained levels
(:attr:`~sparse_scan.engine.dense_plan.DenseScanPlan.chains`: back-propagation, the linear middle of a
hybrid) is one launch of ``dense_scan_chain<T>``: a thread block per sample walks the run's rows with
a barrier between steps, so back-propagation over T steps takes two launches, not T + 1. One more
launch of ``dense_scan_level<T>`` (copy rows) gathers the outputs, wherever the levels left them, into
one array.

What depends only on the plan, the batch size, ``H``, the value dtype and whether the scan is affine is
built once and cached in a :class:`_Workspace`: the descriptor table (uploaded once), the vector input
(``d_0 = 0`` and the direct gradients), every group's result buffer (a buffer's memory is reused from
the level after its last read) and the gathered outputs. Per call only the pointer of the caller's
blocks changes: it is patched into the table, which goes to the device in one copy queued on the
current stream before the level loop, and only when that pointer moved (:mod:`sparse_scan.engine._tables`,
shared with the sparse scan). The level loop only launches kernels: a warm call never synchronises the
host. The caller gets a copy of the gathered outputs, so results of earlier calls stay valid.

CuPy is imported lazily: this module imports on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _gpu_kernels
from .._types import Array
from ._tables import DescriptorTable, Level, Patch, TableBuilder, allocate, cached_workspace, value_dtype
from .dense_plan import INPUT, DenseGroup, DenseScanPlan, Location

__all__ = ["TILED_MIN_SIZE", "chain_threads", "launch_count", "run_dense_plan"]

KERNEL_FILE = "dense_scan.cu"
FIELDS = 18
MM, MV, COPY = 0, 1, 2
WARP = 32
MAX_THREADS = 1024
TILE = 16  # DENSE_TILE of rawkernels/dense_scan.cu
TILE_THREADS = TILE * TILE
TILED_MIN_SIZE = 64
"""Blocks from this size on multiply as tiles (``dense_scan_tiled``); smaller ones one entry per thread,
where a tile would leave most of its threads idle (at H = 20 a 32×32 cover computes 400 of 1024
entries). A reasoned threshold, not yet timed on a GPU."""


# --- the workspace ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shape:
    """What a workspace depends on besides the plan."""

    batch: int
    size: int
    dtype: np.dtype
    affine: bool

    @property
    def block(self) -> int:
        """Elements of one row of a block buffer ``(rows, B, H, H)``."""
        return self.batch * self.size * self.size

    @property
    def vector(self) -> int:
        """Elements of one row of a vector buffer ``(rows, B, H)``."""
        return self.batch * self.size


def chain_threads(size: int) -> int:
    """Threads per block of ``dense_scan_chain`` for blocks of ``size``: the step's ``size`` entries in
    whole warps, at most 1024 (larger blocks loop)."""
    return min(MAX_THREADS, -(-int(size) // WARP) * WARP)


def launch_count(plan: DenseScanPlan) -> int:
    """Kernel launches of one numeric phase: one per level, one per chain of levels instead of its
    levels, and the gather."""
    chained = sum(stop - start for start, stop in plan.chains.items())
    return plan.critical_steps - chained + len(plan.chains) + 1


@dataclass(eq=False)
class _Level(Level):
    """One launch, of ``kernel`` (``level``: a scan level or the gather of the outputs; ``tiled``: a
    level of large blocks; ``chain``: a chain of levels); its ``items`` are work items, units of a
    thread block each, or samples."""

    kernel: str = "level"


@dataclass(eq=False)
class _Workspace:
    """Everything one (plan, batch, H, value dtype, affine) needs on the device, built once.

    Attributes
    ----------
    shape : _Shape
    inputs : array, shape (n + 1, B, H)
        The vector input: row 0 is ``d_0 = 0``; rows ``1..n`` the direct gradients (affine), or row
        ``n`` the gradient w.r.t. ``h_n`` and zeros elsewhere.
    blocks, vectors : dict of int to array
        Every group's results (``(rows, B, H, H)`` and ``(rows, B, H)``) by buffer id.
    result : array, shape (n + 1, B, H)
        The outputs, gathered by the last launch.
    table : DescriptorTable
        Descriptors of every level and of the gather; per call it receives the pointer of the caller's
        blocks (slot 0, offset by the operand's row).
    levels : list of _Level
        The launches: the plan's levels (a chain of levels as one), then the gather.
    """

    shape: _Shape
    inputs: Array
    blocks: dict[int, Array]
    vectors: dict[int, Array]
    result: Array
    table: DescriptorTable
    levels: list[_Level]

    def bind(self, blocks: Array, direct: Array) -> None:
        """Point the table at ``blocks`` (one upload, only when it moved) and copy ``direct`` in."""
        if self.shape.affine:
            self.inputs[1:] = direct
        else:
            self.inputs[-1] = direct
        self.table.bind([_gpu_kernels.device_pointer(blocks)])

    def outputs(self) -> Array:
        """The total gradients ``(n + 1, B, H)`` (a copy: the workspace's array is reused)."""
        return self.result.copy()


def _allocate(plan: DenseScanPlan, shape: _Shape) -> tuple[dict[int, Array], dict[int, Array]]:
    """Result buffers of every group by buffer id, blocks ``(rows, B, H, H)`` and vectors
    ``(rows, B, H)``; memory is reused from the level after a buffer's last read."""
    levels = []
    for groups, released in zip(plan.levels_of_groups, plan.level_releases, strict=True):
        computed = []
        for group in groups:
            rows = (len(group.ops), shape.batch, shape.size)
            if group.kind == "mm":
                computed.append(((group.buffer, "mm"), rows + (shape.size,)))
            if group.kind == "mv" or shape.affine:
                computed.append(((group.buffer, "mv"), rows))
        levels.append((computed, [(buffer, kind) for buffer in released for kind in ("mm", "mv")]))
    buffers = allocate(levels, shape.dtype)
    blocks = {buffer: array for (buffer, kind), array in buffers.items() if kind == "mm"}
    return blocks, {buffer: array for (buffer, kind), array in buffers.items() if kind == "mv"}


class _Descriptors:
    """The rows of the dense scan's table (layout in ``rawkernels/dense_scan.cu``); an operand in the
    caller's blocks is bound at every call (slot 0 of the table's
    :class:`~sparse_scan.engine._tables.Patch` fields)."""

    def __init__(self, shape: _Shape, inputs: Array, blocks: dict[int, Array],
                 vectors: dict[int, Array]) -> None:
        self.shape, self.inputs, self.blocks, self.vectors = shape, inputs, blocks, vectors
        self.itemsize = shape.dtype.itemsize
        self.table = TableBuilder(FIELDS)

    def block(self, location: Location) -> int | Patch:
        """The address of a block row (a row of the caller's blocks: bound at every call)."""
        offset = location.row * self.shape.block * self.itemsize
        if location.buffer == INPUT:
            return Patch(0, offset)
        return _gpu_kernels.device_pointer(self.blocks[location.buffer]) + offset

    def vector(self, location: Location) -> int:
        """The address of a vector row."""
        array = self.inputs if location.buffer == INPUT else self.vectors[location.buffer]
        return _gpu_kernels.device_pointer(array) + location.row * self.shape.vector * self.itemsize

    def add_group(self, group: DenseGroup, first: int, first_unit: int) -> tuple[int, int]:
        """Append one descriptor per step of ``group``, work items from ``first`` and tiled units from
        ``first_unit``; return the next of both."""
        shape = self.shape
        size, affine = shape.size, int(shape.affine)
        block_stride, vector_stride = size * size, size
        chunks = -(-size // TILE_THREADS)  # vector entries, a block of threads each
        for row, op in enumerate(group.ops):
            if group.kind == "mm":
                per = size * size + size * affine
                units = (-(-size // TILE)) ** 2 + chunks * affine
                left = [self.block(op.left), block_stride,
                        self.vector(op.left) if affine else 0, vector_stride * affine]
                out = [_gpu_kernels.device_pointer(self.blocks[group.buffer])
                       + row * shape.block * self.itemsize,
                       self.vector(Location(group.buffer, row)) if affine else 0]
            else:
                per, units = size, chunks
                left = [0, 0, self.vector(op.left), vector_stride]
                out = [0, self.vector(Location(group.buffer, row))]
            right = [self.block(op.right), block_stride,
                     self.vector(op.right) if affine else 0, vector_stride * affine]
            kind = MM if group.kind == "mm" else MV
            self.table.add([kind, first, shape.batch, per, size, affine, *right, *left, *out,
                            first_unit, units])
            first += shape.batch * per
            first_unit += shape.batch * units
        return first, first_unit

    def add_copies(self, sources: list[Location], result: Array) -> int:
        """Append one copy per source vector row into the rows of ``result``; return the work items."""
        shape, first = self.shape, 0
        for position, source in enumerate(sources):
            out = _gpu_kernels.device_pointer(result) + position * shape.vector * self.itemsize
            self.table.add([COPY, first, shape.batch, shape.size, shape.size, 0, 0, 0, 0, 0, 0, 0,
                            self.vector(source), shape.size, 0, out, 0, 0])
            first += shape.vector
        return first


def _build_workspace(plan: DenseScanPlan, shape: _Shape) -> _Workspace:
    """Allocate the buffers and build the descriptor tables of every level."""
    xp = _gpu_kernels.cupy_module()
    inputs = xp.zeros((plan.n + 1, shape.batch, shape.size), dtype=shape.dtype)
    result = xp.empty_like(inputs)
    blocks, vectors = _allocate(plan, shape)
    rows = _Descriptors(shape, inputs, blocks, vectors)
    bounds: list[tuple[int, int, int, str]] = []
    chain_end = 0
    for index, groups in enumerate(plan.levels_of_groups):
        first, items, units = len(rows.table), 0, 0
        for group in groups:
            items, units = rows.add_group(group, items, units)
        if index < chain_end:  # one more row of the chain launch (each level of a chain is one row)
            start, steps, _, _ = bounds.pop()
            bounds.append((start, steps + 1, shape.batch, "chain"))
            continue
        chain_end = plan.chains.get(index, 0)
        steps = len(rows.table) - first
        if chain_end:
            bounds.append((first, steps, shape.batch, "chain"))
        elif shape.size >= TILED_MIN_SIZE and any(group.kind == "mm" for group in groups):
            bounds.append((first, steps, units, "tiled"))
        else:
            bounds.append((first, steps, items, "level"))
    first = len(rows.table)
    bounds.append((first, plan.n + 1, rows.add_copies(plan.outputs, result), "level"))
    table = rows.table.build()
    levels = [_Level(table.rows(first, steps), steps, items, kernel)
              for first, steps, items, kernel in bounds]
    return _Workspace(shape, inputs, blocks, vectors, result, table, levels)


# --- the numeric phase ------------------------------------------------------------------------------
def run_dense_plan(plan: DenseScanPlan, blocks: Array, direct: Array) -> Array:
    """Numeric phase of ``plan`` on the GPU (the contract of :func:`sparse_scan.engine.run.dense_scan`).

    Parameters
    ----------
    plan : DenseScanPlan
    blocks : cupy.ndarray, shape (T, B, H, H)
        ``blocks[t - 1]`` is ``(dh_t/dh_{t-1})^T`` per sample, float32 or float64.
    direct : cupy.ndarray, shape (T, B, H) or (B, H)
        Direct gradients of every ``h_t`` (an affine scan), or of ``h_T`` alone.

    Returns
    -------
    cupy.ndarray, shape (T + 1, B, H)
        The total gradient w.r.t. every ``h_t``, in the dtype of ``blocks``.
    """
    dtype = value_dtype("the GPU dense scan", blocks.dtype)
    if blocks.ndim != 4 or blocks.shape[0] != plan.n:
        raise ValueError(f"the plan needs blocks of shape ({plan.n}, B, H, H); got {tuple(blocks.shape)}")
    blocks = _gpu_kernels.cupy_module().ascontiguousarray(blocks)
    shape = _Shape(int(blocks.shape[1]), int(blocks.shape[2]), dtype, direct.ndim == 3)
    workspace = cached_workspace(plan, shape, lambda: _build_workspace(plan, shape))
    workspace.bind(blocks, direct)
    kernels = {name: _gpu_kernels.function(KERNEL_FILE, f"dense_scan_{name}", dtype)
               for name in sorted({level.kernel for level in workspace.levels})}
    for level in workspace.levels:
        kernel = kernels[level.kernel]
        if level.kernel == "chain":
            _gpu_kernels.launch_blocks(kernel, level.items, chain_threads(shape.size), level.arguments[:2])
        elif level.kernel == "tiled":
            _gpu_kernels.launch_blocks(kernel, level.items, TILE_THREADS, level.arguments)
        else:
            _gpu_kernels.launch(kernel, level.items, level.arguments)
    return workspace.outputs()
