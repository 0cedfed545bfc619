"""The transposed convolution over pruned weights, compiled (numba). Import through
:func:`sparse_scan._host_kernels.conv_kernels`.

``JT @ g`` of a :class:`~sparse_scan.layers.Conv2d` whose weights are heavily pruned, straight from
the weights' non-zeros, without JT values, the dense GEMM or a taps array between im2col's adjoint and
a GEMM: for each input channel ``ci`` and kernel offset ``(a, b)``, every non-zero ``w = weight[co, ci,
a, b]`` adds ``w * g[co]`` into the input gradient's plane ``ci`` at the tap's shift. That is the
pruned share of the dense transposed convolution's multiply-adds (3 % on the 97 %-pruned VGG-11).

The weights come as the CSR matrix ``W^T`` of rows ``(ci, a, b)`` (global input channel) and columns
``co`` (global output channel: a group's block-diagonal part only). Each call computes the input
channels ``[first, last)`` of every sample, so pieces of channels run on the kernel pool's threads
without sharing a written byte. Two forms, both with their innermost loop along a contiguous axis:

* :func:`transposed_conv_taps`: per CSR row, the weighted sum of whole output planes of every sample
  (four non-zeros per pass), then one shifted add into the input gradient. The form for small
  planes, where a loop per output row would run a few values long (VGG-11's 2x2 to 16x16 planes);
* :func:`transposed_conv`: each non-zero straight into the input gradient, one output row at a time
  (wide rows: VGG-11's 32-wide conv1).

Measured on the 97 %-pruned VGG-11's eight convolutions (2 cores, float32), all in ms: taps 2.1 /
4.3 / 13.0 at batch 1 / 4 / 16; per-row 6.6 / 29.5 / 89 (loops of 2-16 values); a per-row form on a
batch-last gradient (``(cout, ho, wo, B)``: runs of ``wo * B`` values, after a transpose) 6.2 / 8.8 /
14.5; SciPy's ``W^T @ g`` plus col2im, before, 2.6 / 8.0 / - (at batch 16 JT's values and an SpMV,
about 36).

Like :mod:`sparse_scan._numba_kernels`: GIL released, no bounds checked, no fastmath (sums run over a
CSR row's non-zeros in order, four at a time in :func:`transposed_conv_taps` as ``((w0 x0 + w1 x1) +
(w2 x2 + w3 x3))``, then over the kernel offsets in order).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")


@njit(**_OPTIONS)
def _span(offset, stride, size, out_size):
    """Output positions ``[lo, hi)`` whose tap ``o * stride + offset`` falls inside ``[0, size)``."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    hi = (size - offset + stride - 1) // stride
    return lo, min(hi, out_size)


@njit(**_OPTIONS)
def _axpy(w, x, src, y, dst, count, step):
    """``y[dst + i * step] += w * x[src + i]`` for ``i < count``. Unsigned offsets: an index computed
    from a signed one keeps numba's negative-index wrap-around in the loop, which stops its
    vectorisation (slices instead cost a reference count per call: 0.24 Gmadd/s on runs of 8 against
    2.9 this way, 3.5 against 13 on runs of 128, one core)."""
    if step == 1:
        for i in range(count):
            y[dst + i] += w * x[src + i]
    else:
        for i in range(count):
            y[dst + i * step] += w * x[src + i]


@njit(**_OPTIONS)
def transposed_conv(indptr, indices, data, grad, geometry, out, first, last):
    """Input channels ``[first, last)`` of ``out = JT @ grad`` for every sample, directly: each
    non-zero adds into the rows of the input gradient its taps reach, one output row at a time (the
    form for wide rows: VGG-11's conv1 at 32 wide, 1.8x :func:`transposed_conv_taps` at batch 16).

    Parameters
    ----------
    indptr, indices, data : ndarray
        ``W^T`` as CSR: row ``(ci * kh + a) * kw + b``, column ``co``, value ``weight[co, ci % cin
        per group, a, b]``.
    grad : ndarray
        The output gradient, ``(B, cout, ho, wo)`` flat.
    geometry : tuple of int
        ``(C, H, W, Cout, Ho, Wo, kh, kw, sh, sw, pt, pl, dh, dw, B)``.
    out : ndarray, shape (B, C, H * W)
        Written for channels ``[first, last)``.
    first, last : int
    """
    _, height, width, out_c, out_h, out_w, kh, kw, sh, sw, pt, pl, dh, dw, batch = geometry
    for ci in range(first, last):
        out[:, ci, :] = 0
        for a in range(kh):
            off_h = a * dh - pt
            oh0, oh1 = _span(off_h, sh, height, out_h)
            for b in range(kw):
                off_w = b * dw - pl
                ow0, ow1 = _span(off_w, sw, width, out_w)
                if oh1 <= oh0 or ow1 <= ow0:
                    continue
                row = (ci * kh + a) * kw + b
                run, step = uint64(ow1 - ow0), uint64(sw)
                for e in range(indptr[row], indptr[row + 1]):
                    co, w = indices[e], data[e]
                    for s in range(batch):
                        target = out[s, ci]
                        for oh in range(oh0, oh1):
                            src = uint64(((s * out_c + co) * out_h + oh) * out_w + ow0)
                            dst = uint64((oh * sh + off_h) * width + ow0 * sw + off_w)
                            _axpy(w, grad, src, target, dst, run, step)


@njit(**_OPTIONS)
def transposed_conv_taps(indptr, indices, data, grad, geometry, out, first, last):
    """:func:`transposed_conv` by whole planes: per input channel and kernel offset, the sum of
    ``w * g[co]`` over the CSR row's non-zeros on the output gradient's full planes (one contiguous run
    of ``B * ho * wo`` values per non-zero), then added into the input gradient at the offset's shift
    (its share inside the input). That computes the taps falling into the padding too (16 of 36 kept
    on a 2x2 plane with a 3x3 kernel, 484 of 576 on 8x8), but pays one short loop per non-zero instead
    of one per output row: the form for small planes and batches.

    ``grad`` is channel-major, ``(cout, B, ho, wo)`` flat (one block copy away from the engine's
    sample-major layout; the same at batch 1); the other arguments are :func:`transposed_conv`'s.
    """
    _, height, width, out_c, out_h, out_w, kh, kw, sh, sw, pt, pl, dh, dw, batch = geometry
    out_plane = out_h * out_w
    count = uint64(batch * out_plane)
    taps = np.empty(batch * out_plane, dtype=out.dtype)
    zero, one = uint64(0), uint64(1)
    for ci in range(first, last):
        out[:, ci, :] = 0
        for a in range(kh):
            off_h = a * dh - pt
            oh0, oh1 = _span(off_h, sh, height, out_h)
            for b in range(kw):
                off_w = b * dw - pl
                ow0, ow1 = _span(off_w, sw, width, out_w)
                row = (ci * kh + a) * kw + b
                if oh1 <= oh0 or ow1 <= ow0 or indptr[row] == indptr[row + 1]:
                    continue
                taps[:] = 0
                e, end = indptr[row], indptr[row + 1]
                while e + 4 <= end:  # four non-zeros per pass over the run: a quarter of its loads
                    w0, w1, w2, w3 = data[e], data[e + 1], data[e + 2], data[e + 3]
                    x0, x1 = uint64(indices[e]) * count, uint64(indices[e + 1]) * count
                    x2, x3 = uint64(indices[e + 2]) * count, uint64(indices[e + 3]) * count
                    for i in range(count):
                        taps[i] += (w0 * grad[x0 + i] + w1 * grad[x1 + i]) + (w2 * grad[x2 + i]
                                                                              + w3 * grad[x3 + i])
                    e += 4
                for rest in range(e, end):
                    _axpy(data[rest], grad, uint64(indices[rest]) * count, taps, zero, count, one)
                run, step = uint64(ow1 - ow0), uint64(sw)
                for s in range(batch):
                    target = out[s, ci]
                    for oh in range(oh0, oh1):
                        src = uint64((s * out_h + oh) * out_w + ow0)
                        dst = uint64((oh * sh + off_h) * width + ow0 * sw + off_w)
                        for i in range(run):
                            target[dst + i * step] += taps[src + i]
