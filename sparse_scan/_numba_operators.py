"""Compiled matrix-free JT operators (numba): ``JT(x) @ g`` from a layer's input ``x``, without JT's values.

A ReLU's or a 2x2 max-pool's JT costs as much to fill as to apply: its values are a mask of the input,
and applying them is one more pass (the pool's, a SciPy SpMV per sample). Where only matrix-vector
steps read such a JT (every one in back-propagation's schedule), these kernels compute the product
straight from the input in one pass: :meth:`sparse_scan.layers.Layer.input_matvec`. Import through
:func:`sparse_scan._host_kernels.operator_kernels`. Kernels follow :mod:`sparse_scan._numba_kernels`'
conventions (GIL released, no bounds checks, NumPy's floating-point semantics) and compute what the
values path computes bit for bit: each result is ``value * g`` with the JT value (0 or 1) in the
result dtype, so a zero value times an infinite or NaN gradient gives NaN as the SpMV does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")

u = np.uintp
"""Indices read through ``u(...)``: no negative-index wrap-around in the loops (they vectorise)."""


@njit(**_OPTIONS)
def relu_backward(x, g, out, i0, i1):
    """``out[i] = g[i] * (x[i] > 0)`` for the flat positions ``i0:i1`` (ReLU's derivative is 1 where
    the input is positive, 0 elsewhere and at NaN)."""
    one, zero = out.dtype.type(1), out.dtype.type(0)
    for i in range(i0, i1):
        out[u(i)] = g[u(i)] * (one if x[u(i)] > 0 else zero)


@njit(**_OPTIONS)
def max_pool_2x2_backward(x, g, out, out_width, j0, j1, chunk):
    """``JT @ g`` of 2x2 max-pool windows of stride 2 that tile the input exactly, for the horizontal
    input pairs ``j0:j1`` (whole rows of windows: multiples of ``2 out_width``); ``x`` and ``out`` are
    flat ``(B, C, H, W)``, ``g`` flat ``(B, C, H / 2, W / 2)``. Each input element gets its window's
    gradient times its JT value: 1 at the window's first maximum (PyTorch's order), else 0. Returns
    whether one of those inputs is NaN.

    The passes of :func:`sparse_scan._numba_kernels.max_pool_2x2` (pair maxima, then which pair holds
    its window's maximum), the values multiplied by the window's gradient as they are written."""
    wo = out_width
    period = 2 * wo
    size = period * max(1, chunk // period)
    top = np.empty(size, dtype=np.bool_)
    window = np.empty(size, dtype=np.int64)  # pair i's window, counted from the chunk's first one
    for r in range(0, size, period):
        for i in range(wo):
            top[r + i] = True
            top[r + wo + i] = False
            window[r + i] = r // 2 + i
            window[r + wo + i] = r // 2 + i
    pair_max = np.zeros(size + 2 * wo, dtype=x.dtype)  # pair i at wo + i: the pair above is at i
    right = np.empty(size, dtype=out.dtype)
    nan = False
    for c in range(j0, j1, size):
        n = min(size, j1 - c)
        base = 2 * c
        first = c // 2  # windows before pair c: c // period rows of wo windows
        for i in range(n):
            a = x[u(base + 2 * i)]
            b = x[u(base + 2 * i + 1)]
            wins = b > a
            pair_max[u(wo + i)] = b if wins else a
            right[u(i)] = wins
            nan |= (a != a) | (b != b)
        for i in range(n):
            mine = pair_max[u(wo + i)]
            top_holds = not (pair_max[u(wo + i + wo)] > mine)
            bottom_holds = mine > pair_max[u(i)]
            holds = out.dtype.type(top_holds if top[u(i)] else bottom_holds)
            on_right = right[u(i)] * holds
            grad = out.dtype.type(g[u(first + window[u(i)])])
            out[u(base + 2 * i + 1)] = on_right * grad
            out[u(base + 2 * i)] = (holds - on_right) * grad
    return nan
