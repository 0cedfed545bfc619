"""The recurrent backward's compiled loops (numba). Import through
:func:`sparse_scan._host_kernels.dense_kernels`.

Back-propagation through time with the blocks in factored form and the parameter gradients' sums over
every step and sample, one run of samples per pool thread. At the recurrent sizes (``H`` of tens, one
vector per sample and step) NumPy pays per call more than the arithmetic costs: the factored chain
was two ufunc/BLAS calls per step (T=1000, B=16, H=20: 3.7 ms for 6.4 M multiply-adds), and the sums
over ``T·B`` rows of a few columns ran at 0.3-1 GFLOP/s (``sum(axis=0)`` of a ``(16000, 20)`` array
0.7-1.1 ms, ``(20, 16000) @ (16000, 20)`` 1.0-1.5 ms).

Like :mod:`sparse_scan._numba_kernels`: GIL released, no bounds checked, no fastmath (products are
IEEE products in the arrays' dtype; sums run in the order stated per kernel).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")


@njit(**_OPTIONS)
def _finite(values):
    """Whether every entry of the 1-D ``values`` is finite (``x - x`` is NaN for inf and NaN)."""
    for i in range(values.shape[0]):
        if values[i] - values[i] != 0:
            return False
    return True


@njit(**_OPTIONS)
def _finite_rows(values):
    """:func:`_finite` of every row of the 2-D ``values`` (no copy: ``ravel`` allocated per call)."""
    for r in range(values.shape[0]):
        if not _finite(values[r]):
            return False
    return True


@njit(**_OPTIONS)
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


@njit(**_OPTIONS)
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
