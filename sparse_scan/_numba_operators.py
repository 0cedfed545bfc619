"""Compiled matrix-free JT operators (numba): ``JT(x) @ g`` from a layer's input ``x``, without JT's values.

A ReLU's or a 2x2 max-pool's JT costs as much to fill as to apply: its values are a mask of the input,
and applying them is one more pass (the pool's, a SciPy SpMV per sample). Where only matrix-vector
steps read such a JT (every one in back-propagation's schedule), these kernels compute the product
straight from the input in one pass: :meth:`sparse_scan.layers.Layer.input_matvec`. Import through
:func:`sparse_scan._host_kernels.operator_kernels`. (The 2x2 max-pool's operator shares its values
fill's passes: :func:`sparse_scan._numba_kernels.max_pool_2x2` given the gradient.) Kernels follow
:mod:`sparse_scan._numba_kernels`' conventions (GIL released, no bounds checks, NumPy's
floating-point semantics) and compute what the values path computes bit for bit: each result is
``value * g`` with the JT value (0 or 1) in the result dtype, so a zero value times an infinite or NaN
gradient gives NaN as the SpMV does.
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
