"""The recurrent cells' host kernels: their backward's loops (compiled by numba on first call,
:func:`sparse_scan._host_kernels.compiled`; callers :mod:`sparse_scan.recurrent._base`, ``_rnn``,
``_gru``, ``_lstm``).

Back-propagation through time with the blocks in factored form and the parameter gradients' sums over
every step and sample, one run of samples per pool thread. At the recurrent sizes (``H`` of tens, one
vector per sample and step) NumPy pays per call more than the arithmetic costs: the factored chain
was two ufunc/BLAS calls per step (T=1000, B=16, H=20: 3.7 ms for 6.4 M multiply-adds), and the sums
over ``T·B`` rows of a few columns ran at 0.3-1 GFLOP/s (``sum(axis=0)`` of a ``(16000, 20)`` array
0.7-1.1 ms, ``(20, 16000) @ (16000, 20)`` 1.0-1.5 ms).

:func:`elman_backward`, :func:`gru_backward` and :func:`lstm_backward` are each cell's whole
back-propagation in one pass: per step and sample the gate gradients from the saved forward values
and the total, the next total through ``W_hh``, the input's gradient through ``W_ih`` and the
parameter gradients' sums, so no ``(T, B, ·)`` temporary is written and read back. Their shared
arguments: ``weight_ih`` ``(R, I)`` and ``weight_hh`` ``(R, H_out)`` (``R`` gate rows), ``x``
``(T, B, I)`` and ``h_prev`` ``(T, B, H_out)`` time-major, ``direct`` ``(T, B, S)`` or ``(1, B, S)``
(the last state's only), the outputs ``totals`` ``(T + 1, B, S)``, ``grad_x`` ``(T, B, I)`` and
``reached`` ``(B,)`` (the steps each sample ran: fewer than ``T`` where a last-state gradient
vanished and the kernel stopped, the rest being zeros),
float64 accumulators of the thread's sums ``weight_ih_sum``, ``weight_hh_sum``, ``bias_ih_sum`` and
``bias_hh_sum`` (overwritten), and the samples ``s0:s1``. The totals follow :func:`chain_factors`'s
two exceptions to IEEE arithmetic; a zero gate gradient is skipped where its partner (a weight row,
an input row) is finite, its products being zeros.

Products are IEEE products in the arrays' dtype; sums run in the order stated per kernel.
"""

from __future__ import annotations

import numpy as np

from .._host_kernels import compiled


@compiled
def _finite(values):
    """Whether every entry of the 1-D ``values`` is finite (``x - x`` is NaN for inf and NaN)."""
    for i in range(values.shape[0]):
        if values[i] - values[i] != 0:
            return False
    return True


@compiled
def _finite_rows(values):
    """:func:`_finite` of every row of the 2-D ``values`` (no copy: ``ravel`` allocated per call)."""
    for r in range(values.shape[0]):
        if not _finite(values[r]):
            return False
    return True


@compiled
def chain_factors(stacked, coefficients, diagonal, direct, totals, s0, s1):
    """Back-propagation through factored blocks for samples ``s0:s1`` (see
    :func:`sparse_scan.recurrent.chain_through_factors`).

    ``totals[T, s] = direct[-1, s]``; then for ``t = T .. 1``: ``totals[t-1, s, i] = Σ_k Σ_j
    coefficients[t-1, s, k, j] · totals[t, s, j] · stacked[k·H + j, i]`` summed over ``(k, j)`` in
    order, ``+ diagonal[t-1, s, i] · totals[t, s, i]`` when ``diagonal`` has steps, ``+ direct[t-2,
    s, i]`` when ``direct`` has more than one step (``t > 1``). ``stacked`` is ``(K·H, H)``: row
    ``k·H + j`` is column ``j`` of ``weights_t[k]``, so the innermost loop runs along contiguous rows
    (it vectorises without reassociating any sum).

    Two exceptions to IEEE arithmetic, both for the vanishing gradients of long chains (the paper's
    RNN at T=1000 with the loss on the last state: after about 170 steps a sample's totals are
    subnormal, then zero):

    * a total below the dtype's smallest normal number is stored as zero, as the CUDA twins compiled
      with ``-ftz`` do: each multiply-add on a subnormal operand costs the x86 core a microcode assist
      (that chain ran 3.3 ms with gradual underflow, 0.9 ms flushed, on one core);
    * a step from all-zero totals is not computed (its products are zeros: exact, unless a factor is
      not finite, when the step runs and gives NaN as IEEE arithmetic does).
    """
    steps, _, terms, size = coefficients.shape
    with_diagonal = diagonal.shape[0] > 0
    affine = direct.shape[0] > 1
    weights_finite = _finite_rows(stacked)
    tiny = np.finfo(totals.dtype).tiny
    acc = np.empty(size, dtype=totals.dtype)
    for s in range(s0, s1):
        last = direct[direct.shape[0] - 1, s]
        for i in range(size):
            totals[steps, s, i] = last[i]
        for t in range(steps, 0, -1):
            g = totals[t, s]
            c = coefficients[t - 1, s]
            acc[:] = 0
            skip = weights_finite and _finite_rows(c) and (not with_diagonal or _finite(diagonal[t - 1, s]))
            for i in range(size):
                skip = skip and g[i] == 0
            if not skip:
                for k in range(terms):
                    for j in range(size):
                        v = c[k, j] * g[j]
                        row = stacked[k * size + j]
                        for i in range(size):
                            acc[i] += v * row[i]
                if with_diagonal:
                    d = diagonal[t - 1, s]
                    for i in range(size):
                        acc[i] += d[i] * g[i]
            if affine and t > 1:
                e = direct[t - 2, s]
                for i in range(size):
                    acc[i] += e[i]
            out = totals[t - 1, s]
            for i in range(size):
                out[i] = acc[i] if abs(acc[i]) >= tiny or acc[i] != acc[i] else 0


@compiled
def gradient_sums(a, b, products, sums, n0, n1):
    """``products[r, c] = Σ_n a[n, r] · b[n, c]`` and ``sums[r] = Σ_n a[n, r]`` over rows ``n0:n1``,
    in row order, accumulated in the outputs' dtype (float64: the parameter gradients sum ``T·B``
    terms). A row of ``a`` that is all zeros adds nothing and is skipped (exact while its row of
    ``b`` is finite: the gradients of a long chain's early steps vanish)."""
    products[:] = 0
    sums[:] = 0
    rows, columns = a.shape[1], b.shape[1]
    for n in range(n0, n1):
        an, bn = a[n], b[n]
        zero = True
        for r in range(rows):
            zero = zero and an[r] == 0
        if zero and _finite(bn):
            continue
        for r in range(rows):
            v = np.float64(an[r])
            sums[r] += v
            p = products[r]
            for c in range(columns):
                p[c] += v * bn[c]


@compiled(inline="always")
def _all_finite(values):
    """Whether every entry of the 1-D ``values`` is finite, without an early exit (the loop
    vectorises: a vanished step checks its rows in a few instructions)."""
    bad = False
    for i in range(values.shape[0]):
        bad |= values[i] - values[i] != 0
    return not bad


@compiled(inline="always")
def _all_zero(values):
    """Whether every entry of the 1-D ``values`` is zero (NaN is not), vectorised as :func:`_all_finite`."""
    nonzero = False
    for i in range(values.shape[0]):
        nonzero |= values[i] != 0
    return not nonzero


@compiled(inline="always")
def _add_product(gates, weights, finite_weights, out):
    """``out[i] += Σ_r gates[r] · weights[r, i]`` over ``r`` in order (the innermost loop along a
    contiguous row); a zero gate is skipped when ``finite_weights``."""
    for r in range(gates.shape[0]):
        v = gates[r]
        if v == 0 and finite_weights:
            continue
        row = weights[r]
        for i in range(out.shape[0]):
            out[i] += v * row[i]


@compiled(inline="always")
def _add_outer(gates, row, products):
    """``products[r, c] += gates[r] · row[c]`` in float64 (zero gates skipped when ``row`` is finite)."""
    finite_row = _all_finite(row)
    for r in range(gates.shape[0]):
        v = np.float64(gates[r])
        if v == 0 and finite_row:
            continue
        p = products[r]
        for c in range(row.shape[0]):
            p[c] += v * row[c]


@compiled(inline="always")
def _add_sums(gates, sums):
    for r in range(gates.shape[0]):
        sums[r] += np.float64(gates[r])


@compiled
def _through_gates(gates_ih, gates_hh, weight_ih, weight_hh, finite_ih, finite_hh, x_row, h_row,
                   grad_x_row, acc, weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum):
    """One step and sample after its gate gradients ``gates_ih``/``gates_hh`` ``(R,)``: ``acc +=
    gates_hh · W_hh``, ``grad_x_row = gates_ih · W_ih`` and the parameters' sums (not inlined: the
    callers' loops over vanished steps stay small, 60 ns a step instead of 230)."""
    grad_x_row[:] = 0
    _add_product(gates_hh, weight_hh, finite_hh, acc)
    _add_product(gates_ih, weight_ih, finite_ih, grad_x_row)
    _add_outer(gates_ih, x_row, weight_ih_sum)
    _add_outer(gates_hh, h_row, weight_hh_sum)
    _add_sums(gates_ih, bias_ih_sum)
    _add_sums(gates_hh, bias_hh_sum)


@compiled(inline="always")
def _rows_finite(values, t, s):
    """Whether the rows ``values[:t, s]`` are all finite (vectorised as :func:`_all_finite`)."""
    bad = False
    for u in range(t):
        row = values[u, s]
        for i in range(row.shape[0]):
            bad |= row[i] - row[i] != 0
    return not bad


@compiled(inline="always")
def _zero_rows(totals, grad_x, t, s):
    """The totals ``0 .. t-1`` and input gradients ``0 .. t-1`` of sample ``s`` are zeros."""
    totals[:t, s] = 0
    grad_x[:t, s] = 0


@compiled(inline="always")
def _vanished(gates_ih, gates_hh, finite_weights, x_row, h_row):
    """Whether a step adds nothing through the weights: its gate gradients are all zero (a vanished
    gradient) and the weights and its rows of ``x`` and ``h_prev`` are finite."""
    return (_all_zero(gates_ih) and _all_zero(gates_hh) and finite_weights and _all_finite(x_row)
            and _all_finite(h_row))


@compiled(inline="always")
def _store(acc, direct, t, s, out, tiny):
    """``out = acc (+ direct[t-2, s] when direct has steps and t > 1)``, totals below ``tiny`` (the
    smallest normal number) stored as zero."""
    if direct.shape[0] > 1 and t > 1:
        e = direct[t - 2, s]
        for i in range(acc.shape[0]):
            acc[i] += e[i]
    for i in range(acc.shape[0]):
        out[i] = acc[i] if abs(acc[i]) >= tiny or acc[i] != acc[i] else 0


@compiled(inline="always")
def _zero_sums(weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum):
    weight_ih_sum[:] = 0
    weight_hh_sum[:] = 0
    bias_ih_sum[:] = 0
    bias_hh_sum[:] = 0


@compiled
def elman_backward(weight_ih, weight_hh, x, h_prev, direct, totals, grad_x, reached, slope,
                   weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum, s0, s1):
    """The Elman RNN's back-propagation (see the module docstring): per step the gate gradient
    ``slope[t-1, s] ⊙ totals[t, s]`` (both sides' pre-activations), ``totals[t-1, s] = W_hh^T``
    times it (+ direct)."""
    _zero_sums(weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum)
    steps, _, size = slope.shape
    finite_ih, finite_hh = _finite_rows(weight_ih), _finite_rows(weight_hh)
    tiny = np.finfo(totals.dtype).tiny
    last_only = direct.shape[0] == 1 and finite_ih and finite_hh
    acc = np.empty(size, dtype=totals.dtype)
    gates = np.empty(size, dtype=totals.dtype)
    for s in range(s0, s1):
        totals[steps, s] = direct[direct.shape[0] - 1, s]
        reached[s] = steps
        for t in range(steps, 0, -1):
            g, c = totals[t, s], slope[t - 1, s]
            if (last_only and _all_zero(g) and _rows_finite(slope, t, s) and _rows_finite(x, t, s)
                    and _rows_finite(h_prev, t, s)):
                _zero_rows(totals, grad_x, t, s)
                reached[s] = steps - t
                break
            for i in range(size):
                gates[i] = c[i] * g[i]
            acc[:] = 0
            if _vanished(gates, gates, finite_ih and finite_hh, x[t - 1, s], h_prev[t - 1, s]):
                grad_x[t - 1, s] = 0
            else:
                _through_gates(gates, gates, weight_ih, weight_hh, finite_ih, finite_hh, x[t - 1, s],
                               h_prev[t - 1, s], grad_x[t - 1, s], acc, weight_ih_sum, weight_hh_sum,
                               bias_ih_sum, bias_hh_sum)
            _store(acc, direct, t, s, totals[t - 1, s], tiny)


@compiled
def gru_backward(weight_ih, weight_hh, x, h_prev, direct, totals, grad_x, reached, r, z, n, m,
                 weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum, s0, s1):
    """The GRU's back-propagation (see :mod:`sparse_scan.recurrent._gru`): per step, with ``g`` the
    total and ``q = (1-z)(1-n²)``, the gate gradients ``(q m r(1-r) g, (h_prev - n) z(1-z) g, q r
    g)`` on the hidden side and ``(…, …, q g)`` on the input side, ``totals[t-1, s] = W_hh^T`` times
    the first ``+ z ⊙ g`` (+ direct)."""
    _zero_sums(weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum)
    steps, _, size = z.shape
    finite_ih, finite_hh = _finite_rows(weight_ih), _finite_rows(weight_hh)
    tiny, one = np.finfo(totals.dtype).tiny, totals.dtype.type(1)  # float32 stays float32
    last_only = direct.shape[0] == 1 and finite_ih and finite_hh
    acc = np.empty(size, dtype=totals.dtype)
    gates_ih = np.empty(3 * size, dtype=totals.dtype)
    gates_hh = np.empty(3 * size, dtype=totals.dtype)
    for s in range(s0, s1):
        totals[steps, s] = direct[direct.shape[0] - 1, s]
        reached[s] = steps
        for t in range(steps, 0, -1):
            g, h = totals[t, s], h_prev[t - 1, s]
            if (last_only and _all_zero(g) and _rows_finite(r, t, s) and _rows_finite(z, t, s)
                    and _rows_finite(n, t, s) and _rows_finite(m, t, s) and _rows_finite(x, t, s)
                    and _rows_finite(h_prev, t, s)):
                _zero_rows(totals, grad_x, t, s)
                reached[s] = steps - t
                break
            rt, zt, nt, mt = r[t - 1, s], z[t - 1, s], n[t - 1, s], m[t - 1, s]
            for i in range(size):
                gate_n = (one - zt[i]) * (one - nt[i] * nt[i])
                reset = gate_n * mt[i] * rt[i] * (one - rt[i]) * g[i]
                update = (h[i] - nt[i]) * zt[i] * (one - zt[i]) * g[i]
                gates_ih[i] = gates_hh[i] = reset
                gates_ih[size + i] = gates_hh[size + i] = update
                gates_ih[2 * size + i] = gate_n * g[i]
                gates_hh[2 * size + i] = gate_n * rt[i] * g[i]
                acc[i] = 0
            if _vanished(gates_ih, gates_hh, finite_ih and finite_hh, x[t - 1, s], h):
                grad_x[t - 1, s] = 0
            else:
                _through_gates(gates_ih, gates_hh, weight_ih, weight_hh, finite_ih, finite_hh, x[t - 1, s], h,
                               grad_x[t - 1, s], acc, weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum)
            for i in range(size):
                acc[i] += zt[i] * g[i]
            _store(acc, direct, t, s, totals[t - 1, s], tiny)


@compiled
def lstm_backward(weight_ih, weight_hh, x, h_prev, direct, totals, grad_x, reached, weight_hr, i, f, g, o,
                  tanh_c, c_prev, h_cell, weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum,
                  weight_hr_sum, s0, s1):
    """The LSTM's back-propagation (see :mod:`sparse_scan.recurrent._lstm`): per step, from the total
    ``(g_h, g_c)``, ``g̃ = W_hr^T g_h`` (``g_h`` when ``weight_hr`` is ``(0, 0)``: no projection; then
    ``h_cell`` and ``weight_hr_sum`` are empty too), ``g_c' = g_c + o(1 - tanh² c) g̃``, the gate
    gradients ``(g i(1-i) g_c', c_prev f(1-f) g_c', i(1-g²) g_c', tanh(c) o(1-o) g̃)``, the total
    at ``t-1`` as ``(W_hh^T`` times them``, f g_c')`` (+ direct) and ``weight_hr_sum += g_h ⊗
    h_cell``."""
    _zero_sums(weight_ih_sum, weight_hh_sum, bias_ih_sum, bias_hh_sum)
    weight_hr_sum[:] = 0
    steps, _, size = f.shape
    rows = weight_hh.shape[1]
    projected = weight_hr.shape[0] > 0
    finite_ih, finite_hh = _finite_rows(weight_ih), _finite_rows(weight_hh)
    finite_hr = _finite_rows(weight_hr)
    tiny, one = np.finfo(totals.dtype).tiny, totals.dtype.type(1)  # float32 stays float32
    last_only = direct.shape[0] == 1 and finite_ih and finite_hh and finite_hr
    acc = np.empty(rows + size, dtype=totals.dtype)
    cell = np.empty(size, dtype=totals.dtype)
    gates = np.empty(4 * size, dtype=totals.dtype)
    for s in range(s0, s1):
        totals[steps, s] = direct[direct.shape[0] - 1, s]
        reached[s] = steps
        for t in range(steps, 0, -1):
            if (last_only and _all_zero(totals[t, s]) and _rows_finite(i, t, s) and _rows_finite(f, t, s)
                    and _rows_finite(g, t, s) and _rows_finite(o, t, s) and _rows_finite(tanh_c, t, s)
                    and _rows_finite(c_prev, t, s) and _rows_finite(x, t, s) and _rows_finite(h_prev, t, s)
                    and (not projected or _rows_finite(h_cell, t, s))):
                _zero_rows(totals, grad_x, t, s)
                reached[s] = steps - t
                break
            grad_h, grad_c = totals[t, s, :rows], totals[t, s, rows:]
            if projected:
                cell[:] = 0
                _add_product(grad_h, weight_hr, finite_hr, cell)
                _add_outer(grad_h, h_cell[t - 1, s], weight_hr_sum)
            else:
                cell[:] = grad_h
            it, ft, gt, ot = i[t - 1, s], f[t - 1, s], g[t - 1, s], o[t - 1, s]
            tc, cp = tanh_c[t - 1, s], c_prev[t - 1, s]
            for j in range(size):
                total_c = grad_c[j] + ot[j] * (one - tc[j] * tc[j]) * cell[j]
                gates[j] = gt[j] * it[j] * (one - it[j]) * total_c
                gates[size + j] = cp[j] * ft[j] * (one - ft[j]) * total_c
                gates[2 * size + j] = it[j] * (one - gt[j] * gt[j]) * total_c
                gates[3 * size + j] = tc[j] * ot[j] * (one - ot[j]) * cell[j]
                acc[rows + j] = ft[j] * total_c
            acc[:rows] = 0
            if _vanished(gates, gates, finite_ih and finite_hh, x[t - 1, s], h_prev[t - 1, s]):
                grad_x[t - 1, s] = 0
            else:
                _through_gates(gates, gates, weight_ih, weight_hh, finite_ih, finite_hh, x[t - 1, s],
                               h_prev[t - 1, s], grad_x[t - 1, s], acc[:rows], weight_ih_sum, weight_hh_sum,
                               bias_ih_sum, bias_hh_sum)
            _store(acc, direct, t, s, totals[t - 1, s], tiny)
