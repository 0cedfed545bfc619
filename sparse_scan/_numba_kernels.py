"""The host engine's compiled loops (numba). Import through :func:`sparse_scan._host_kernels.kernels`.

Every kernel reads operands as ``(rows, n)`` arrays, ``rows`` being 1 for an operand shared by the
batch (row 0 serves every sample) or the batch size, and fills samples ``s0:s1`` (and, where it
takes them, items ``e0:e1``) of a preallocated output, so callers cut the work over threads. They
release the GIL, check no bounds (the plans' indices are valid by construction) and keep NumPy's
floating-point semantics (no fastmath): products are exact IEEE products in the output dtype, and
sums run in the order stated per kernel. The CUDA sources in ``rawkernels/`` are their GPU twins.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")

u = np.uintp
"""Indices read through ``u(...)``: unsigned, so numba adds no negative-index wrap-around to every
read (1.4x on the scaling kernel: the loop unrolls)."""


@njit(**_OPTIONS)
def scale_gather(values, values_index, gathered, table, index, out, s0, s1, e0, e1, block):
    """``out[s, e] = values[s, values_index[e] if gathered else e] * table[s, index[e]]``, in blocks
    of ``block`` entries run through every sample (a block's indices stay in cache)."""
    shared_values, shared_table = values.shape[0] == 1, table.shape[0] == 1
    for b0 in range(e0, e1, block):
        b1 = min(b0 + block, e1)
        for s in range(s0, s1):
            v = values[0] if shared_values else values[s]
            t = table[0] if shared_table else table[s]
            o = out[s]
            if gathered:
                for e in range(b0, b1):
                    o[e] = v[u(values_index[e])] * t[u(index[e])]
            else:
                for e in range(b0, b1):
                    o[e] = v[e] * t[u(index[e])]


@njit(**_OPTIONS)
def stored_products(a, b, a_pos, b_pos, starts, total, out, s0, s1, e0, e1, block):
    """``out[s, e] = sum over m in starts[e]:starts[e + 1] of a[s, a_pos[m]] * b[s, b_pos[m]]``
    (``total`` ends the last entry), summed from zero in the plan's order (SciPy's CSR order), in
    blocks of ``block`` entries run through every sample."""
    shared_a, shared_b = a.shape[0] == 1, b.shape[0] == 1
    n = starts.shape[0]
    zero = out.dtype.type(0)
    for b0 in range(e0, e1, block):
        b1 = min(b0 + block, e1)
        for s in range(s0, s1):
            av = a[0] if shared_a else a[s]
            bv = b[0] if shared_b else b[s]
            o = out[s]
            for e in range(b0, b1):
                stop = starts[e + 1] if e + 1 < n else total
                acc = zero
                for m in range(starts[e], stop):
                    acc += av[u(a_pos[m])] * bv[u(b_pos[m])]
                o[e] = acc


@njit(**_OPTIONS)
def rowwise_products(a_indptr, a_indices, b_indptr, b_indices, c_indptr, c_indices, columns,
                     a, b, out, s0, s1, r0, r1):
    """Rows ``r0:r1`` of ``C = A @ B`` into ``C``'s stored pattern: every entry summed from zero over
    its products in the order (A entry, B entry), for samples ``s0:s1``."""
    shared_a, shared_b = a.shape[0] == 1, b.shape[0] == 1
    where = np.empty(columns, dtype=np.int64)  # column -> C entry, for the current row
    zero = out.dtype.type(0)
    for i in range(r0, r1):
        c0, c1 = c_indptr[i], c_indptr[i + 1]
        for p in range(c0, c1):
            where[u(c_indices[p])] = p
        for s in range(s0, s1):
            av = a[0] if shared_a else a[s]
            bv = b[0] if shared_b else b[s]
            o = out[s]
            for p in range(c0, c1):
                o[p] = zero
            for ka in range(a_indptr[i], a_indptr[i + 1]):
                k = u(a_indices[ka])
                x = av[ka]
                for kb in range(b_indptr[k], b_indptr[k + 1]):
                    o[u(where[u(b_indices[kb])])] += x * bv[kb]


@njit(**_OPTIONS)
def live_products(selection, other, entries, valid, column_of_slot, out_pos, other_pos, out,
                  s0, s1):
    """A selection gather (:func:`sparse_scan.selection.multiply_live`) for samples ``s0:s1``.

    Per column of the selection: its live window position is the first whose value (times
    ``valid``) is non-zero, else 0; each of the column's slots then writes
    ``other[other_pos[live, t]] * weight`` to ``C`` entry ``out_pos[live, t]`` (dummies point past
    the end) of a zeroed row.
    """
    window = entries.shape[0]
    slots = column_of_slot.shape[0]
    out_nnz = out.shape[1]
    shared_other = other.shape[0] == 1
    zero, one = out.dtype.type(0), out.dtype.type(1)
    for s in range(s0, s1):
        sel = selection[s]
        ov = other[0] if shared_other else other[s]
        o = out[s]
        for p in range(out_nnz):
            o[p] = zero
        column, live, weight = -1, 0, zero
        for t in range(slots):
            j = column_of_slot[t]
            if j != column:
                column, live = j, 0
                weight = sel[u(entries[0, j])] * (one if valid[0, j] else zero)
                for k in range(window):
                    value = sel[u(entries[k, j])] * (one if valid[k, j] else zero)
                    if value != 0:
                        live, weight = k, value
                        break
            p = out_pos[live, t]
            if p < out_nnz:
                o[p] = ov[u(other_pos[live, t])] * weight


@njit(**_OPTIONS, inline="always")
def _max_pool_window(x, top, bottom, out, top_out, bottom_out):
    """One 2x2 window: inputs ``x[top:top + 2]`` over ``x[bottom:bottom + 2]``, values likewise in
    ``out``. The first maximum in PyTorch's order (a, b / p, q) as selects on a column-first
    comparison: the left column's winner (p only if p > a), the right column's (q only if q > b),
    then the right one if it is greater, or equal while it is on top and the left one is not.
    Returns the window's NaN count."""
    a, b = x[u(top)], x[u(top + 1)]
    p, q = x[u(bottom)], x[u(bottom + 1)]
    bottom_left = p > a
    bottom_right = q > b
    left = max(p, a)
    right = max(q, b)
    take_right = (right > left) | ((right == left) & (not bottom_right) & bottom_left)
    out[u(top_out)] = (not take_right) & (not bottom_left)
    out[u(top_out + 1)] = take_right & (not bottom_right)
    out[u(bottom_out)] = (not take_right) & bottom_left
    out[u(bottom_out + 1)] = take_right & bottom_right
    return (a != a) + (b != b) + (p != p) + (q != q)


@njit(**_OPTIONS, inline="always")
def _max_pool_row_pair(x, top, bottom, out, top_out, bottom_out, windows):
    """One row of 2x2 windows (flat arrays and offsets: views would cost reference counting per
    row), eight windows at a time with a constant trip count (rows are short: a loop vectoriser
    would leave them to its scalar remainder; unrolled, the SLP vectoriser packs them)."""
    nans = 0
    w = 0
    while w + 8 <= windows:
        for k in range(8):
            nans += _max_pool_window(x, top + 2 * (w + k), bottom + 2 * (w + k), out,
                                     top_out + 2 * (w + k), bottom_out + 2 * (w + k))
        w += 8
    for k in range(w, windows):
        nans += _max_pool_window(x, top + 2 * k, bottom + 2 * k, out, top_out + 2 * k, bottom_out + 2 * k)
    return nans


@njit(**_OPTIONS)
def max_pool_2x2(x, out, planes, height, width, out_height, out_width, p0, p1):
    """Max-pool values of 2x2 windows of stride 2 without padding, every window full, for the
    (sample, channel) planes ``p0:p1``: ``x`` is the flat ``(B, C, H, W)`` input, ``out`` the flat
    ``(B, C, 2 Ho, 2 Wo)`` values (the JT's entries in input order), 1 at each window's first maximum
    and 0 elsewhere. Returns whether a window holds a NaN. Branch-free per window (a generic loop
    over window offsets does not vectorise)."""
    nans = 0
    row, row_out = width, 2 * out_width
    for plane in range(p0, p1):
        base, base_out = plane * height * width, plane * 4 * out_height * out_width
        for oh in range(out_height):
            top, top_out = base + 2 * oh * row, base_out + 2 * oh * row_out
            nans += _max_pool_row_pair(x, top, top + row, out, top_out, top_out + row_out, out_width)
    return nans > 0
