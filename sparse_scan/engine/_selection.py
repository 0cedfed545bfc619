"""Products with a selection operand (a max-pool JT): gathers over the live entries only.

A selection JT ``S`` (``jacobian_kind == "selection"``) has a fixed pattern (every input of every
pooling window) but, per sample, one live entry per column (the window's maximum holds 1, the other
window entries are explicit zeros). In ``C = S @ B`` (rows gathered) or ``C = A @ S`` (columns
gathered) a multiply-add with a dead ``S`` entry only ever adds zero. ``C`` keeps the full symbolic
pattern, so its entries that only dead entries reach are explicit zeros, but the numeric phase does
not pay for them: it finds the live ``S`` entries of each sample and runs only their multiply-adds,
grouped by ``S`` entry when the plan was built.

Layout: the multiply-adds of column ``j`` of ``S`` are laid out in ``L_j`` slots, ``L_j`` the most
any entry of the column carries, with one table row per window position ``k``: slot ``t`` of row
``k`` holds the ``C`` entry and the other operand's entry of the ``t``-th multiply-add of the
column's ``k``-th entry (or a dummy). Per sample, the live ``k`` of every column picks a row, so the
numeric phase is a few batched gathers over ``sum_j L_j`` slots with index arrays fixed by the plan.
That is also the static bound on live FLOPs reported per step (:func:`live_multiply_adds`; exact
when all of a column's entries carry as many multiply-adds, as for a pool on the left of a product).

These tables serve products whose ``C`` entries sum several multiply-adds, of which at most one is
live (any pool on the right of a product). A non-overlapping pool on the left gives every ``C`` entry
exactly one multiply-add: the plan then only counts the live ones, and every backend streams the
``general`` arrays (on the host that costs less than scattering the live entries). Overlapping
windows on the left keep the ``general`` method. The plan keeps the ``general`` arrays in every case,
for backends that run every multiply-add and skip the zero ones (the GPU kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._host_kernels import launch, parts, rows2d
from .._threads import workers_for
from .._types import Array
from ..csr import Pattern
from ._kernels import live_products

__all__ = ["SelectionGather", "live_multiply_adds", "multiply_live", "plan_selection_gather"]


@dataclass(frozen=True, eq=False)
class SelectionGather:
    """The live-entry layout of ``C = A @ B`` with a selection operand ``S``.

    Attributes
    ----------
    operand : {"a", "b"}
        Which operand is the selection.
    entries : ndarray, shape (window, columns)
        ``S``'s entry at window position ``k`` of every column (``valid`` says which exist).
    valid : ndarray of bool, shape (window, columns)
    column_of_slot : ndarray, shape (slots,)
        The column of ``S`` each slot belongs to.
    out_pos : ndarray, shape (window, slots)
        Per window position and slot: the ``C`` entry (``nnz_C`` for a dummy).
    other_pos : ndarray, shape (window, slots)
        ... and the other operand's entry (0 for a dummy).
    """

    operand: str
    entries: np.ndarray
    valid: np.ndarray
    column_of_slot: np.ndarray
    out_pos: np.ndarray
    other_pos: np.ndarray

    @property
    def live_multiply_adds(self) -> int:
        """Multiply-adds the numeric phase runs per sample (the slots)."""
        return int(self.column_of_slot.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the index tables."""
        arrays = (self.entries, self.valid, self.column_of_slot, self.out_pos, self.other_pos)
        return sum(int(a.nbytes) for a in arrays)


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """For sorted group labels, each element's position within its group."""
    starts = np.flatnonzero(np.concatenate(([True], groups[1:] != groups[:-1])))
    lengths = np.diff(np.append(starts, len(groups)))
    return np.arange(len(groups)) - np.repeat(starts, lengths)


def _slot_widths(selection: Pattern, selected: np.ndarray) -> np.ndarray:
    """Per column of ``S``: the most multiply-adds any of its entries carries (its slots)."""
    per_entry = np.bincount(selected, minlength=selection.nnz)
    width = np.zeros(selection.shape[1], dtype=np.int64)
    np.maximum.at(width, np.asarray(selection.indices, dtype=np.int64), per_entry)
    return width


def live_multiply_adds(selection: Pattern, selected: np.ndarray) -> int:
    """Multiply-adds a product needs per sample when only ``S``'s live entries (one per column)
    count: ``sum_j L_j`` over the columns (the static bound a ``gather`` reports).

    ``selected`` is ``S``'s entry of every multiply-add of the product.
    """
    return int(_slot_widths(selection, np.asarray(selected, dtype=np.int64)).sum())


def plan_selection_gather(selection: Pattern, operand: str, out_nnz: int, a_pos: np.ndarray,
                          b_pos: np.ndarray, starts: np.ndarray) -> SelectionGather | None:
    """The live-entry layout from a ``general`` plan (multiply-adds grouped by ``C`` entry).

    Parameters
    ----------
    selection : Pattern
        The selection operand's pattern.
    operand : {"a", "b"}
        Which operand of ``A @ B`` it is.
    out_nnz : int
        Entries of ``C``.
    a_pos, b_pos, starts : ndarray
        The ``general`` plan: operand entries of every multiply-add, and the first multiply-add of
        every ``C`` entry (a plan with one multiply-add per entry needs no tables).

    Returns
    -------
    SelectionGather or None
        None when a ``C`` entry can receive live multiply-adds from two columns of ``S`` (two
        windows sharing their maximum): those products keep the ``general`` method.
    """
    total = len(a_pos)
    out_of_product = np.repeat(np.arange(out_nnz, dtype=np.int64),
                               np.diff(np.append(np.asarray(starts, np.int64), total)))
    selected, other = (a_pos, b_pos) if operand == "a" else (b_pos, a_pos)
    selected = np.asarray(selected, dtype=np.int64)
    column = np.asarray(selection.indices, dtype=np.int64)
    columns = selection.shape[1]
    # multiply-adds are grouped by C entry: two columns within one group can both be live
    column_of_product = column[selected]
    if np.any((out_of_product[1:] == out_of_product[:-1])
              & (column_of_product[1:] != column_of_product[:-1])):
        return None
    # window position of every S entry: its rank among its column's entries
    by_column = np.argsort(column, kind="stable")
    window_pos = np.empty(selection.nnz, dtype=np.int64)
    window_pos[by_column] = _rank_within(column[by_column])
    window = int(window_pos.max()) + 1 if selection.nnz else 1
    entries = np.zeros((window, columns), dtype=np.int64)
    valid = np.zeros((window, columns), dtype=bool)
    entries[window_pos, column] = np.arange(selection.nnz)
    valid[window_pos, column] = True
    # slots: the t-th multiply-add of an entry goes to slot t of its column
    order = np.argsort(selected, kind="stable")
    rank = _rank_within(selected[order])
    width = _slot_widths(selection, selected)
    first_slot = np.cumsum(width) - width
    slot = first_slot[column_of_product[order]] + rank
    slots = int(width.sum())
    dtype = a_pos.dtype
    out_pos = np.full((window, slots), out_nnz, dtype=dtype)
    other_pos = np.zeros((window, slots), dtype=dtype)
    row = window_pos[selected[order]]
    out_pos[row, slot] = out_of_product[order]
    other_pos[row, slot] = np.asarray(other)[order]
    column_of_slot = np.repeat(np.arange(columns), width).astype(dtype)
    return SelectionGather(operand, entries.astype(dtype), valid, column_of_slot, out_pos, other_pos)


def multiply_live(gather: SelectionGather, out_nnz: int, a_data: Array, b_data: Array,
                  out: Array | None = None) -> Array:
    """Values of ``C`` (host arrays): zeros, then the live entries' multiply-adds.

    The selection's data is ``(B, nnz_S)``; the other operand's ``(nnz,)`` (shared) or ``(B, nnz)``.
    Returns ``(B, nnz_C)`` (into ``out`` when given: C-contiguous, that shape and the operands'
    result dtype). Compiled (:func:`sparse_scan.engine._kernels.live_products`): per sample,
    each column's live window position (its first non-zero entry, else the first) picks a row of the
    slot tables, and each slot writes one product (exact: the live weight times the other operand's
    entry). Large batches run one run of samples per core.
    """
    selection, other = (a_data, b_data) if gather.operand == "a" else (b_data, a_data)
    dtype = np.result_type(a_data, b_data)
    batch = selection.shape[0]
    if out is None:
        out = np.empty((batch, out_nnz), dtype=dtype)
    work = batch * (out_nnz + gather.live_multiply_adds)
    pieces = [(s0, s1) for s0, s1, _, _ in parts(batch, 1, workers_for(work))]
    launch(live_products,
           (rows2d(selection, dtype), rows2d(other, dtype), gather.entries, gather.valid,
            gather.column_of_slot, gather.out_pos, gather.other_pos, out), pieces)
    return out
