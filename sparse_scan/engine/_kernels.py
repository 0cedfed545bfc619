"""The engine's host kernels: the numeric products of a plan on the host (compiled by numba on first
call, :func:`sparse_scan._host_kernels.compiled`).

Every kernel reads operands as ``(rows, n)`` arrays, ``rows`` being 1 for an operand shared by the
batch (row 0 serves every sample) or the batch size, and fills samples ``s0:s1`` (and, where it
takes them, items ``e0:e1``) of a preallocated output, so callers cut the work over threads
(:func:`~sparse_scan._host_kernels.parts`, :func:`~sparse_scan._host_kernels.launch`). Products are
exact IEEE products in the output dtype, and sums run in the order stated per kernel. Callers:
:mod:`sparse_scan.engine._cpu` (the host executor), :mod:`sparse_scan.engine._scaled_gather`
(scalings by a diagonal), :mod:`sparse_scan.engine._selection` (max-pool gathers),
:mod:`sparse_scan.engine._blocks` (dense channel blocks) and :mod:`sparse_scan.engine.subnormals`
(counting a run's subnormal gradient values, which reads and writes nothing else). The CUDA sources
in ``rawkernels/`` are the products' GPU twins.
"""

from __future__ import annotations

import numpy as np

from .._host_kernels import compiled, u


@compiled
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


@compiled
def scale_runs(values, table, run_starts, run_values, run_table, out, s0, s1, r0, r1, block):
    """:func:`scale_gather` over runs: run ``r`` writes ``out[s, o + j] = values[s, run_values[r] + j]
    * table[s, run_table[r]]`` for ``o = run_starts[r] + j`` up to ``run_starts[r + 1]`` (a scaled
    contiguous copy: no index read per entry, the loop vectorised), for runs ``r0:r1``, in blocks of
    at least ``block`` entries run through every sample."""
    shared_values, shared_table = values.shape[0] == 1, table.shape[0] == 1
    q0 = r0
    while q0 < r1:
        q1 = q0 + 1
        while q1 < r1 and run_starts[q1] - run_starts[q0] < block:
            q1 += 1
        for s in range(s0, s1):
            v = values[0] if shared_values else values[s]
            t = table[0] if shared_table else table[s]
            o = out[s]
            for r in range(q0, q1):
                x = t[u(run_table[r])]
                first, shift = run_starts[r], run_values[r] - run_starts[r]
                for e in range(first, run_starts[r + 1]):
                    o[u(e)] = v[u(e + shift)] * x
        q0 = q1


@compiled
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


@compiled
def csr_products(indptr, indices, data, vectors, out, s0, s1, r0, r1):
    """``out[s, r] = sum over m in indptr[r]:indptr[r + 1] of data[s, m] * vectors[s, indices[m]]``
    (``data`` row 0 for every sample where it is shared) for samples ``s0:s1`` and rows ``r0:r1``:
    a CSR matrix times a vector, summed from zero in the row's order in the output dtype, as SciPy's
    ``csr_matvec`` and ``csr_matvecs`` sum (so the values equal theirs bit for bit)."""
    shared = data.shape[0] == 1
    zero = out.dtype.type(0)
    for s in range(s0, s1):
        d = data[0] if shared else data[s]
        v = vectors[s]
        o = out[s]
        for r in range(r0, r1):
            acc = zero
            for m in range(indptr[r], indptr[r + 1]):
                acc += d[m] * v[u(indices[m])]
            o[r] = acc


@compiled
def subnormal_count(values, tiny):
    """How many entries of the 2-D array ``values`` are subnormal: ``0 < |v| < tiny``, ``tiny`` the
    smallest normal number of their dtype (read-only: the cost model's observation,
    :mod:`sparse_scan.engine.subnormals`)."""
    count = 0
    for s in range(values.shape[0]):
        row = values[s]
        for e in range(values.shape[1]):
            magnitude = abs(row[e])
            if magnitude < tiny and magnitude > 0:
                count += 1
    return count


@compiled
def first_term_products(a, b, a_pos, b_pos, starts, total, out, s0, s1, e0, e1, block):
    """:func:`stored_products` for plans whose entries mostly hold one multiply-add: per block of
    ``block`` entries, every entry's first term is streamed (``0 + a * b``, a loop with no branch
    on the entry's length), then the entries with more terms (listed once per block, for every
    sample) add theirs. Each entry is the same sum from zero in the plan's order, so the values
    equal :func:`stored_products`' bit for bit (``0 + p`` is the first step of its sum too)."""
    shared_a, shared_b = a.shape[0] == 1, b.shape[0] == 1
    n = starts.shape[0]
    zero = out.dtype.type(0)
    longer = np.empty(block, dtype=np.int64)  # the block's entries of more than one term
    for b0 in range(e0, e1, block):
        b1 = min(b0 + block, e1)
        count = 0
        for e in range(b0, b1):
            stop = starts[e + 1] if e + 1 < n else total
            longer[count] = e
            count += stop - starts[e] > 1
        for s in range(s0, s1):
            av = a[0] if shared_a else a[s]
            bv = b[0] if shared_b else b[s]
            o = out[s]
            for e in range(b0, b1):
                m = u(starts[e])
                o[e] = zero + av[u(a_pos[m])] * bv[u(b_pos[m])]
            for k in range(count):
                e = longer[k]
                stop = starts[e + 1] if e + 1 < n else total
                acc = o[e]
                for m in range(starts[e] + 1, stop):
                    acc += av[u(a_pos[m])] * bv[u(b_pos[m])]
                o[e] = acc


@compiled
def rowwise_products(a_indptr, a_indices, b_indptr, b_indices, c_indptr, c_indices, columns,
                     a, b, out, s0, s1, r0, r1):
    """Rows ``r0:r1`` of ``C = A @ B`` into ``C``'s stored pattern: every entry summed from zero over
    its products in the order (A entry, B entry), for samples ``s0:s1``.

    An ``A`` entry that is exactly zero (a ReLU's off unit, a max-pool's non-maximum, carried through
    earlier products) skips its whole row of ``B``: its terms are zeros, and adding a zero to a sum
    that starts at +0.0 changes no bit (for finite ``B``), so the row's entries equal those of
    :func:`stored_products` bit for bit (both sum an entry's terms in ``A``-entry order). Dead
    entries of ``C`` stay the exact zeros they are reset to. One test per ``A`` entry, not per term
(VGG-11-pruned's products at batch 1 / 16): also testing ``B``'s entries here measured 1.1-1.4x
slower, and a per-term test in :func:`stored_products` 1.7-4.0x slower on conv3·relu4 and
conv1·pool2 (a mispredicted branch per multiply-add; 1.5x faster only on pool1·pool2)."""
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
                x = av[ka]
                if x == zero:
                    continue
                k = u(a_indices[ka])
                for kb in range(b_indptr[k], b_indptr[k + 1]):
                    o[u(where[u(b_indices[kb])])] += x * bv[kb]


@compiled
def live_products(selection, other, entries, valid, column_of_slot, out_pos, other_pos, out,
                  s0, s1):
    """A selection gather (:func:`sparse_scan.engine._selection.multiply_live`) for samples ``s0:s1``.

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


@compiled(inline="always")
def _pack_block(values, gather, packed):
    """``packed[i, j] = values[gather[i, j]]``: one block copied out of CSR order."""
    for i in range(gather.shape[0]):
        for j in range(gather.shape[1]):
            packed[i, j] = values[u(gather[i, j])]


@compiled
def block_products(a, b, a_gather, b_gather, b_rows, b_row_of, pair_starts, pair_a, pair_b, scatter,
                   chunk, out, s0, s1, e0, e1):
    """``C``'s blocks ``e0:e1`` of a block product, for samples ``s0:s1``, straight into ``out`` in
    ``C``'s CSR order: per ``C`` block ``c``, ``sum over m in pair_starts[c]:pair_starts[c + 1] of
    A_block(pair_a[m]) @ B_block(pair_b[m])``, the blocks' elements being ``a[s, a_gather[block, i,
    j]]`` and ``b[s, b_gather[block, j, k]]`` and ``C``'s going to ``out[s, scatter[c, i, k]]``.

    A block's elements lie one per cache line or so in CSR order, and a block meets about as many
    ``C`` blocks as its pixel has neighbours: each block is copied into a contiguous tile of a
    per-thread buffer the first time a sample needs it (once for all samples when the operand is
    shared). Columns ``k`` of ``C``'s block run in chunks of ``chunk``; per pair, rows of the
    accumulator are updated four at a time from one row of the ``B`` tile, the innermost loop over
    ``k`` (vectorised). Each entry is summed from zero in the order (pair, ``j``), in the output
    dtype."""
    shared_a, shared_b = a.shape[0] == 1, b.shape[0] == 1
    c1, c2, c3 = a_gather.shape[1], a_gather.shape[2], b_gather.shape[2]
    width = min(chunk, c3)
    a_tiles = np.empty(a_gather.shape, dtype=out.dtype)
    b_tiles = np.empty(b_gather.shape, dtype=out.dtype)
    a_ready = np.zeros(a_gather.shape[0], dtype=np.bool_)
    b_ready = np.zeros(b_rows.shape[0] - 1, dtype=np.bool_)
    acc = np.empty((c1, width), dtype=out.dtype)
    zero = out.dtype.type(0)
    for s in range(s0, s1):
        av = a[0] if shared_a else a[s]
        bv = b[0] if shared_b else b[s]
        o = out[s]
        if s > s0 and not shared_a:
            a_ready[:] = False
        if s > s0 and not shared_b:
            b_ready[:] = False
        for c in range(e0, e1):
            for k0 in range(0, c3, width):
                w = min(width, c3 - k0)
                for i in range(c1):
                    for k in range(w):
                        acc[i, k] = zero
                for m in range(pair_starts[c], pair_starts[c + 1]):
                    ab, bb = u(pair_a[m]), u(pair_b[m])
                    if not a_ready[ab]:
                        _pack_block(av, a_gather[ab], a_tiles[ab])
                        a_ready[ab] = True
                    q = u(b_row_of[bb])
                    if not b_ready[q]:
                        for block in range(b_rows[q], b_rows[q + 1]):
                            _pack_block(bv, b_gather[block], b_tiles[block])
                        b_ready[q] = True
                    x, t = a_tiles[ab], b_tiles[bb]
                    quad = c1 - c1 % 4
                    for i in range(0, quad, 4):
                        r0, r1, r2, r3 = acc[i], acc[i + 1], acc[i + 2], acc[i + 3]
                        for j in range(c2):
                            x0, x1, x2, x3 = x[i, j], x[i + 1, j], x[i + 2, j], x[i + 3, j]
                            row = t[j, k0:k0 + w]
                            for k in range(w):
                                y = row[k]
                                r0[k] += x0 * y
                                r1[k] += x1 * y
                                r2[k] += x2 * y
                                r3[k] += x3 * y
                    for i in range(quad, c1):
                        r0 = acc[i]
                        for j in range(c2):
                            x0 = x[i, j]
                            row = t[j, k0:k0 + w]
                            for k in range(w):
                                r0[k] += x0 * row[k]
                gc = scatter[u(c)]
                for i in range(c1):
                    for k in range(w):
                        o[u(gc[i, k0 + k])] = acc[i, k]
