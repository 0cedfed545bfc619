"""The layers' host kernels: values fills, columns and matrix-free JT operators of the layers
(compiled by numba on first call, :func:`sparse_scan._host_kernels.compiled`).

* Convolution (:mod:`sparse_scan.layers._conv_columns`): :func:`im2col` (the forward's columns) and
  its adjoint :func:`col2im` / :func:`col2im_pairs` (the transposed convolution through the
  weights); and (:mod:`sparse_scan.layers._conv_pruned`) the transposed convolution over pruned
  weights, :func:`transposed_conv` and :func:`transposed_conv_taps`, straight from the weights'
  non-zeros, without JT values, the dense GEMM or a taps array: for each input channel ``ci`` and
  kernel offset ``(a, b)``, every non-zero ``w = weight[co, ci, a, b]`` adds ``w * g[co]`` into the
  input gradient's plane ``ci`` at the tap's shift, the pruned share of the dense transposed
  convolution's multiply-adds (3 % on the 97 %-pruned VGG-11). Its weights come as the CSR matrix
  ``W^T`` of rows ``(ci, a, b)`` (global input channel) and columns ``co`` (global output channel: a
  group's block-diagonal part only); each call computes the input channels ``[first, last)`` of every
  sample, so pieces of channels run on the kernel pool's threads without sharing a written byte.
  :func:`transposed_conv_taps` is the form for small planes (per CSR row, the weighted sum of whole
  output planes of every sample, four non-zeros per pass, then one shifted add), :func:`transposed_conv`
  the one for wide rows (each non-zero straight into the input gradient, one output row at a time).
  Measured on the 97 %-pruned VGG-11's eight convolutions (2 cores, float32), all in ms: taps 2.1 /
  4.3 / 13.0 at batch 1 / 4 / 16; per-row 6.6 / 29.5 / 89 (loops of 2-16 values); a per-row form on a
  batch-last gradient (``(cout, ho, wo, B)``: runs of ``wo * B`` values, after a transpose) 6.2 / 8.8 /
  14.5; SciPy's ``W^T @ g`` plus col2im, before, 2.6 / 8.0 / - (at batch 16 JT's values and an SpMV,
  about 36). Sums run over a CSR row's non-zeros in order, four at a time in
  :func:`transposed_conv_taps` as ``((w0 x0 + w1 x1) + (w2 x2 + w3 x3))``, then over the kernel offsets
  in order.
* Max pooling (:mod:`sparse_scan.layers._pooling_jt`): the values of 2x2 windows of stride 2
  (:func:`max_pool_2x2`, which given the gradient is the pool's ``JT(x) @ g`` too) and of any window
  geometry (:func:`max_pool_windows`, the window loop of ``rawkernels/pooling.cu``).
* ReLU (:mod:`sparse_scan.layers._activation`): :func:`relu_forward`, and :func:`relu_backward`,
  ``JT(x) @ g`` from the input.

A ReLU's or a 2x2 max-pool's JT costs as much to fill as to apply: its values are a mask of the input,
and applying them is one more pass. Where only matrix-vector steps read such a JT (every one in
back-propagation's schedule), the operators compute the product straight from the input in one pass
(:meth:`sparse_scan.layers.Layer.input_matvec`), bit for bit what the values path computes: each
result is ``value * g`` with the JT value (0 or 1) in the result dtype, so a zero value times an
infinite or NaN gradient gives NaN as the SpMV does.
"""

from __future__ import annotations

import numpy as np

from .._host_kernels import compiled, u

uint64 = np.uint64
"""Offsets of the transposed convolution: unsigned, so that numba's loops over them vectorise."""


@compiled(inline="always")
def _inside(out_size, size, stride, shift):
    """The outputs ``o`` of ``0:out_size`` whose input ``o * stride + shift`` lies in ``0:size``, as
    ``(first, stop)``."""
    first = 0
    while first < out_size and first * stride + shift < 0:
        first += 1
    stop = out_size
    while stop > first and (stop - 1) * stride + shift >= size:
        stop -= 1
    return first, stop


@compiled
def _column_bounds(out_width, width, kw, sw, pl, dw):
    """Per column offset ``j`` of a window: :func:`_inside` of its outputs, as two arrays."""
    first = np.empty(kw, dtype=np.int64)
    stop = np.empty(kw, dtype=np.int64)
    for j in range(kw):
        first[j], stop[j] = _inside(out_width, width, sw, j * dw - pl)
    return first, stop


@compiled
def im2col(x, geometry, columns, c0, c1):
    """A convolution's columns for the channels ``c0:c1``: ``columns[(c kh + i) kw + j, b, oh, ow]``
    is the input ``x[b, c, oh sh - pt + i dh, ow sw - pl + j dw]``, 0 in the padding. ``x`` is
    ``(B, C, H, W)``, ``columns`` ``(C kh kw, B, Ho, Wo)`` (groups are runs of channels), ``geometry``
    the tuple ``(C, H, W, Ho, Wo, kh, kw, sh, sw, pt, pl, dh, dw)``. Flat offsets, bounds per column
    offset computed once: rows are short (2-32 outputs on VGG-11)."""
    channels, height, width, out_height, out_width, kh, kw, sh, sw, pt, pl, dh, dw = geometry
    batch = x.shape[0]
    zero = columns.dtype.type(0)
    first, stop = _column_bounds(out_width, width, kw, sw, pl, dw)
    flat_x, flat_columns = x.reshape(-1), columns.reshape(-1)
    plane_in, plane_out = height * width, out_height * out_width
    for c in range(c0, c1):
        for i in range(kh):
            for j in range(kw):
                shift, f, s = j * dw - pl, first[j], stop[j]
                for b in range(batch):
                    source = (b * channels + c) * plane_in + shift
                    target = (((c * kh + i) * kw + j) * batch + b) * plane_out
                    for oh in range(out_height):
                        ih = oh * sh - pt + i * dh
                        line = target + oh * out_width
                        if ih < 0 or ih >= height:
                            for ow in range(out_width):
                                flat_columns[u(line + ow)] = zero
                            continue
                        row = source + ih * width
                        for ow in range(f):
                            flat_columns[u(line + ow)] = zero
                        for ow in range(f, s):
                            flat_columns[u(line + ow)] = flat_x[u(row + ow * sw)]
                        for ow in range(s, out_width):
                            flat_columns[u(line + ow)] = zero


@compiled
def col2im(taps, geometry, out, p0, p1):
    """The adjoint of :func:`im2col` for the (sample, channel) planes ``p0:p1`` (``b C + c``):
    ``out[b, c, ih, iw]`` is the sum of ``taps[(c kh + i) kw + j, b, oh, ow]`` over the window offsets
    reaching it, added from zero in the order (i, j) (the NumPy formulation's order: equal bit for
    bit). ``taps`` is ``(C kh kw, B, Ho, Wo)``, ``out`` ``(B, C, H, W)``."""
    channels, height, width, out_height, out_width, kh, kw, sh, sw, pt, pl, dh, dw = geometry
    batch = out.shape[0]
    zero = out.dtype.type(0)
    first, stop = _column_bounds(out_width, width, kw, sw, pl, dw)
    flat_taps, flat_out = taps.reshape(-1), out.reshape(-1)
    plane_in, plane_out = height * width, out_height * out_width
    for p in range(p0, p1):
        b, c = p // channels, p % channels
        base = p * plane_in
        for e in range(base, base + plane_in):
            flat_out[u(e)] = zero
        for i in range(kh):
            for j in range(kw):
                shift, f, s = j * dw - pl, first[j], stop[j]
                source = (((c * kh + i) * kw + j) * batch + b) * plane_out
                for oh in range(out_height):
                    ih = oh * sh - pt + i * dh
                    if ih < 0 or ih >= height:
                        continue
                    row, line = base + ih * width + shift, source + oh * out_width
                    for ow in range(f, s):
                        flat_out[u(row + ow * sw)] += flat_taps[u(line + ow)]


@compiled
def col2im_pairs(taps, sources, targets, out, p0, p1):
    """:func:`col2im` through a table, for narrow planes (whose rows are too short to run as loops):
    ``out[b, c].flat[targets[t]] += taps.flat[first(b, c) + sources[t]]`` for every pair ``t`` of the
    geometry, from zero, ``first(b, c)`` being the offset of the plane's first tap ``(c kh kw, b)``.
    The pairs run tap by tap in the order (i, j): each input element sums its taps in :func:`col2im`'s
    order (equal bit for bit)."""
    batch, channels = out.shape[0], out.shape[1]
    plane_in = out.shape[2] * out.shape[3]
    per_tap = taps.shape[1] * taps.shape[2] * taps.shape[3]
    taps_per_channel = taps.shape[0] // channels
    flat_taps, flat_out = taps.reshape(-1), out.reshape(-1)
    zero = out.dtype.type(0)
    for p in range(p0, p1):
        b, c = p // channels, p % channels
        base = p * plane_in
        for e in range(base, base + plane_in):
            flat_out[u(e)] = zero
        first = c * taps_per_channel * per_tap + b * (per_tap // batch)
        for t in range(sources.size):
            flat_out[u(base + targets[t])] += flat_taps[u(first + sources[t])]


@compiled
def _span(offset, stride, size, out_size):
    """Output positions ``[lo, hi)`` whose tap ``o * stride + offset`` falls inside ``[0, size)``."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    hi = (size - offset + stride - 1) // stride
    return lo, min(hi, out_size)


@compiled
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


@compiled
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


@compiled
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


@compiled
def gather(source, positions, out, e0, e1):
    """``out[e] = source[positions[e]]`` for ``e`` in ``e0:e1``, cut over the kernel pool's threads: a
    pruned layer's kept weights read from its weights (increasing positions, so the reads stream), and
    ``W^T``'s values permuted from the kept ones."""
    for e in range(e0, e1):
        out[u(e)] = source[u(positions[e])]


@compiled
def to_planes(x, geometry, out, nonfinite, c0, c1):
    """The channels ``c0:c1`` of a batch ``x`` (``(B, C, H, W)``) as zero-padded phase planes for the
    direct sparse convolution (:mod:`sparse_scan.layers._conv_pruned`), the batch innermost:
    ``out[((c sh + py) sw + px), i, j, b]`` is ``x[b, c, i sh + py - pt, j sw + px - pl]``, 0 outside
    the input, for ``i < Hq``, ``j < Wq``; ``geometry`` is ``(C, H, W, sh, sw, pt, pl, Hq, Wq)``. A
    stride's phases make every kernel tap a constant shift of one plane, and with the batch innermost
    a tap's multiply-adds over every sample and output are one contiguous run that stops at the last
    output (:func:`direct_conv`): only the rows' ``Wq - Wo`` padding columns are computed for no output
    (a sample after the other would also compute the ``Hq - Ho`` padding rows of every sample: 4x the
    outputs on 2x2 planes, 2.25x on 4x4). ``nonfinite[c]`` is set where channel ``c`` copied a value
    that is not finite (an infinity or a NaN read through a tap that is not an output's would poison a
    sampled sum: the callers then take the dense path, whose IEEE results are PyTorch's)."""
    channels, height, width, sh, sw, pt, pl, hq, wq = geometry
    batch = x.shape[0]
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    zero = out.dtype.type(0)
    plane, line_size = hq * wq * batch, wq * batch
    for c in range(c0, c1):
        finite = True
        for py in range(sh):
            for px in range(sw):
                base = ((c * sh + py) * sw + px) * plane
                j0, j1 = _inside(wq, width, sw, px - pl)
                for i in range(hq):
                    line = u(base + i * line_size)
                    ih = i * sh + py - pt
                    if ih < 0 or ih >= height:
                        for k in range(u(line_size)):
                            flat_out[line + k] = zero
                        continue
                    for k in range(u(j0 * batch)):
                        flat_out[line + k] = zero
                    for k in range(u(j1 * batch), u(line_size)):
                        flat_out[line + k] = zero
                    for b in range(batch):
                        row = (b * channels + c) * height * width + ih * width + px - pl
                        for j in range(j0, j1):
                            value = flat_x[u(row + j * sw)]
                            finite &= (value - value) == 0
                            flat_out[line + u(j * batch + b)] = value
        nonfinite[c] = not finite


@compiled(inline="always")
def run_start(runs, e, batch):
    """Where entry ``e``'s run starts in :func:`to_planes`' planes: ``runs[e]`` (its input plane times
    the plane's ``Hq Wq`` plus the tap's shift ``row Wq + column``, :meth:`~sparse_scan.layers.
    _conv_pruned.PrunedWeights.tables`) times the batch. The run of the largest shift ends at its
    plane's end: the planes need no tail."""
    return u(runs[e]) * u(batch)


@compiled(inline="always")
def run_starts(runs, e, batch):
    """:func:`run_start` of the four entries ``e:e + 4``."""
    return (run_start(runs, e, batch), run_start(runs, e + 1, batch), run_start(runs, e + 2, batch),
            run_start(runs, e + 3, batch))


@compiled
def direct_conv(indptr, runs, values, source, sizes, bias, out, c0, c1):
    """The output channels ``c0:c1`` of a convolution by pruned weights, straight from their non-zeros:
    per output channel ``co``, ``sum_e values[e] * run(e)`` over its entries ``indptr[co]:indptr[co +
    1]``, in order, the first alone (it starts the sum), then eight per pass (then four, then one), plus
    ``bias[co]`` (``bias`` empty: none);
    ``run(e)`` is the ``m = ((Ho - 1) Wq + Wo) B`` values of :func:`to_planes`' planes (``source``) from
    :func:`run_start`. ``sizes`` is ``(B, Hq, Wq, Ho, Wo)``; ``out`` the ``(B, Cout, Ho, Wo)`` output,
    flat. A run's positions in a row's padding columns sum taps that belong to no output: computed (one
    vectorised loop per eight weights instead of one per output row), then dropped when the output is
    written. Eight weights per pass instead of four: the 90 %-pruned VGG-11's convolutions at batch 16
    1.2-1.5x faster (one pass over the accumulator per eight runs read)."""
    batch, hq, wq, ho, wo = sizes
    channels = out.size // (batch * ho * wo)
    m = u(((ho - 1) * wq + wo) * batch)
    rows = max(1, 4096 // (wq * batch))  # output rows whose acc values (4096: 16 KiB of float32) stay in L1
    acc = np.empty(m, dtype=out.dtype)
    for co in range(c0, c1):
        e, end = indptr[co], indptr[co + 1]
        if e == end:
            for j in range(m):
                acc[j] = 0
        else:  # the first run starts the sum: no pass of zeros
            w, s = values[e], run_start(runs, e, batch)
            for j in range(m):
                acc[j] = w * source[s + j]
            e += 1
        while e + 8 <= end:
            w0, w1, w2, w3 = values[e], values[e + 1], values[e + 2], values[e + 3]
            w4, w5, w6, w7 = values[e + 4], values[e + 5], values[e + 6], values[e + 7]
            s0, s1, s2, s3 = run_starts(runs, e, batch)
            s4, s5, s6, s7 = run_starts(runs, e + 4, batch)
            for j in range(m):
                acc[j] += (((w0 * source[s0 + j] + w1 * source[s1 + j])
                            + (w2 * source[s2 + j] + w3 * source[s3 + j]))
                           + ((w4 * source[s4 + j] + w5 * source[s5 + j])
                              + (w6 * source[s6 + j] + w7 * source[s7 + j])))
            e += 8
        while e + 4 <= end:
            w0, w1, w2, w3 = values[e], values[e + 1], values[e + 2], values[e + 3]
            s0, s1, s2, s3 = run_starts(runs, e, batch)
            for j in range(m):
                acc[j] += ((w0 * source[s0 + j] + w1 * source[s1 + j])
                           + (w2 * source[s2 + j] + w3 * source[s3 + j]))
            e += 4
        for rest in range(e, end):
            w, s = values[rest], run_start(runs, rest, batch)
            for j in range(m):
                acc[j] += w * source[s + j]
        shift = bias[co] if bias.size else out.dtype.type(0)
        for first in range(0, ho, rows):  # rows of acc that stay in L1 while every sample reads them
            for b in range(batch):
                dst = u((b * channels + co) * ho) * u(wo)
                for oh in range(first, min(first + rows, ho)):  # unsigned indices: no wrap-around test
                    src, row = u(oh * wq * batch + b), dst + u(oh * wo)  # (1.2x the kernel at batch 16)
                    for ow in range(wo):
                        out[row + u(ow)] = acc[src + u(ow * batch)] + shift


@compiled(fastmath={"reassoc"})
def sampled_conv_weights(indptr, runs, columns, grad, source, sizes, width, out, kept, c0, c1):
    """The weight gradient of a convolution at its kept weights only (a sampled dense-dense product): the
    output channels ``c0:c1``'s weights (``width`` each, ``out[co * width:(co + 1) * width]``) are zeroed,
    here, by the thread that writes them (no separate pass over the whole weight), then for every entry ``e``
    of those channels ``out[co * width + columns[e]]`` (its place in its channel's weights) is the dot product
    of the output gradient's plane ``co`` (``grad``: :func:`to_planes` of the gradient into ``Ho x Wq``
    planes, zero where no output is) with :func:`direct_conv`'s run of ``source`` for that entry: the sum over
    the batch and the output pixels of ``g[b, co, oh, ow] * x[b, ci, tap(oh, ow)]``, what the dense GEMM
    computes for that weight, also written to ``kept[e]`` (the kept weights' gradient in their order, for
    an optimizer's step over them). ``sizes`` as :func:`direct_conv`'s. Eight entries per pass over the
    gradient's run (then four, then one); the sums are reassociated (``fastmath={"reassoc"}`` alone:
    vector lanes, no change to infinities or NaNs), so they round differently from a GEMM's, within the
    dtype's epsilon times the terms' magnitudes."""
    batch, hq, wq, ho, wo = sizes
    m = u(((ho - 1) * wq + wo) * batch)
    zero = out.dtype.type(0)
    for co in range(c0, c1):
        row = u(co) * u(width)
        for position in range(row, row + u(width)):
            out[position] = zero
        base = u(co) * u(ho * wq * batch)
        e, end = indptr[co], indptr[co + 1]
        while e + 8 <= end:
            s0, s1, s2, s3 = run_starts(runs, e, batch)
            s4, s5, s6, s7 = run_starts(runs, e + 4, batch)
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
            for j in range(m):
                g = grad[base + j]
                a0 += g * source[s0 + j]
                a1 += g * source[s1 + j]
                a2 += g * source[s2 + j]
                a3 += g * source[s3 + j]
                a4 += g * source[s4 + j]
                a5 += g * source[s5 + j]
                a6 += g * source[s6 + j]
                a7 += g * source[s7 + j]
            for k, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
                out[row + u(columns[e + k])] = a
                kept[e + k] = a
            e += 8
        while e + 4 <= end:
            s0, s1, s2, s3 = run_starts(runs, e, batch)
            a0 = a1 = a2 = a3 = zero
            for j in range(m):
                g = grad[base + j]
                a0 += g * source[s0 + j]
                a1 += g * source[s1 + j]
                a2 += g * source[s2 + j]
                a3 += g * source[s3 + j]
            for k, a in enumerate((a0, a1, a2, a3)):
                out[row + u(columns[e + k])] = a
                kept[e + k] = a
            e += 4
        for rest in range(e, end):
            s = run_start(runs, rest, batch)
            a = zero
            for j in range(m):
                a += grad[base + j] * source[s + j]
            out[row + u(columns[rest])] = a
            kept[rest] = a


@compiled
def max_pool_2x2(x, g, out, out_width, j0, j1, chunk):
    """Max-pool values of 2x2 windows of stride 2 that tile the input exactly (``H = 2 Ho``,
    ``W = 2 Wo``, no padding or dilation): 1 at each window's selected input (PyTorch's choice in the
    order a, b / p, q: the last NaN, else the first maximum), 0 elsewhere; or, given the gradient ``g``
    (flat ``(B, C, Ho, Wo)``), ``JT @ g`` without the values: each input gets its value times its
    window's gradient (bit for bit what the values' SpMV gives; :meth:`sparse_scan.layers.MaxPool2d.
    input_matvec`). Both are the input's shape, so ``x`` and ``out`` are flat ``(B, C, H, W)`` arrays
    read as horizontal pairs ``(x[2j], x[2j + 1])``; the kernel fills the pairs ``j0:j1`` (whole rows of
    windows: multiples of ``2 out_width``). ``g`` is None for the values: numba compiles that case
    apart, without the gradient's reads.

    Two vectorised passes per ``chunk`` pairs (no per-window branch, no short row loops): each pair's
    selected value and whether its right element is selected (strictly greater, or NaN: ties keep the
    left), then per pair whether it holds its window's selection (the top pair unless the pair below
    is strictly greater or NaN), read off a pattern of top/bottom pairs, period ``2 out_width``.
    PyTorch scans a, b, p, q keeping the running choice unless an element is strictly greater or NaN;
    the bottom pair's choice replaces the top pair's exactly when it is strictly greater or NaN, so
    this is PyTorch's choice."""
    wo = out_width
    period = 2 * wo
    size = period * max(1, chunk // period)
    top = np.empty(size, dtype=np.bool_)
    for r in range(0, size, period):
        for i in range(wo):
            top[r + i] = True
            top[r + wo + i] = False
    pair_grad = np.empty(size, dtype=out.dtype)  # pair i's window's gradient
    pair_max = np.zeros(size + 2 * wo, dtype=x.dtype)  # pair i at wo + i: the pair above is at i
    right = np.empty(size, dtype=out.dtype)
    for c in range(j0, j1, size):
        n = min(size, j1 - c)
        base = 2 * c
        for i in range(n):
            a = x[u(base + 2 * i)]
            b = x[u(base + 2 * i + 1)]
            wins = (b > a) | (b != b)
            pair_max[u(wo + i)] = b if wins else a
            right[u(i)] = wins
        if g is not None:  # spread to the pairs by rows of windows: the next pass reads it in order
            first = c // 2  # windows before pair c: c // period rows of wo windows
            for r in range(0, n, period):
                for i in range(wo):
                    value = out.dtype.type(g[u(first + r // 2 + i)])
                    pair_grad[u(r + i)] = value
                    pair_grad[u(r + wo + i)] = value
        for i in range(n):
            mine = pair_max[u(wo + i)]
            below = pair_max[u(wo + i + wo)]  # read for both, chosen below: no branch
            top_holds = not ((below > mine) | (below != below))
            bottom_holds = (mine > pair_max[u(i)]) | (mine != mine)
            holds = out.dtype.type(top_holds if top[u(i)] else bottom_holds)
            on_right = right[u(i)] * holds
            if g is None:
                out[u(base + 2 * i + 1)] = on_right
                out[u(base + 2 * i)] = holds - on_right
            else:
                grad = pair_grad[u(i)]
                out[u(base + 2 * i + 1)] = on_right * grad
                out[u(base + 2 * i)] = (holds - on_right) * grad


@compiled
def max_pool_2x2_values(x, sizes, out, p0, p1):
    """The forward's max of 2x2 windows of stride 2 (no padding or dilation; an odd last row or column,
    in no window, is not read) for the (sample, channel) planes ``p0:p1`` of the flat ``(B, C, H, W)``
    input ``x`` into the flat ``(B, C, Ho, Wo)`` ``out``; ``sizes`` is ``(H, W, Ho, Wo)``. PyTorch's
    value: over a, b, p, q in order a later element wins if strictly greater or NaN (the last NaN, else
    the first maximum: ``-0.0`` before ``0.0``), computed as :func:`max_pool_2x2` selects: each pair's
    choice, then the bottom pair's replaces the top pair's exactly when strictly greater or NaN. One
    pass over the input: 4-6x NumPy's four strided maxima on VGG-11's pools (one thread)."""
    height, width, ho, wo = sizes
    for plane in range(p0, p1):
        for i in range(ho):
            top = u((plane * height + 2 * i) * width)
            bottom = top + u(width)
            dst = u((plane * ho + i) * wo)
            for j in range(wo):
                a, b = x[top + u(2 * j)], x[top + u(2 * j + 1)]
                upper = b if (b > a) | (b != b) else a
                c, d = x[bottom + u(2 * j)], x[bottom + u(2 * j + 1)]
                lower = d if (d > c) | (d != d) else c
                out[dst + u(j)] = lower if (lower > upper) | (lower != lower) else upper


@compiled
def max_pool_windows(x, slot, geometry, out, p0, p1):
    """Max-pool values of any window geometry for the (sample, channel) planes ``p0:p1``: per output,
    PyTorch's choice over its window's real elements in window order (a later element wins if strictly
    greater or NaN: the last NaN, else the first maximum), 1 at its JT entry ``slot[offset, output]``
    of a zeroed run of the channel's entries, as ``rawkernels/pooling.cu``'s ``maxpool_values``
    computes it. ``x`` is the flat ``(B, C, H, W)`` input, ``out`` the ``(B, nnz)`` values,
    ``geometry`` the tuple of the 13 ints of :meth:`sparse_scan.layers._pooling.PoolGeometry.as_array`.

    A row of outputs at a time, window offset by offset, each offset updating the whole row (the
    outputs' running maxima are independent: one window at a time would wait on each compare)."""
    channels, height, width, out_height, out_width, kh, kw, sh, sw, ph, pw, dh, dw = geometry
    per_channel = out.shape[1] // channels
    zero, one = out.dtype.type(0), out.dtype.type(1)
    inside_from, inside_to = _column_bounds(out_width, width, kw, sw, pw, dw)
    best = np.empty(out_width, dtype=x.dtype)
    best_k = np.empty(out_width, dtype=np.int64)
    for plane in range(p0, p1):
        sample, channel = plane // channels, plane % channels
        values = out[sample]
        for e in range(channel * per_channel, (channel + 1) * per_channel):
            values[u(e)] = zero
        for oh in range(out_height):
            for ow in range(out_width):
                best_k[u(ow)] = -1
            for i in range(kh):
                ih = oh * sh - ph + i * dh
                if ih < 0 or ih >= height:
                    continue
                for j in range(kw):
                    k = i * kw + j
                    start = (plane * height + ih) * width + j * dw - pw
                    for ow in range(inside_from[u(j)], inside_to[u(j)]):
                        v, b, c = x[u(start + ow * sw)], best[u(ow)], best_k[u(ow)]
                        take = (c < 0) | (v > b) | (v != v)
                        best[u(ow)] = v if take else b
                        best_k[u(ow)] = k if take else c
            row = (channel * out_height + oh) * out_width
            for ow in range(out_width):
                if best_k[u(ow)] >= 0:  # (PyTorch's output sizes leave no window in the padding)
                    values[u(slot[u(best_k[u(ow)]), u(row + ow)])] = one


@compiled(fastmath={"reassoc"})
def channel_sums(grad, sizes, out, c0, c1):
    """``out[c] = sum over b, p of grad[b, c, p]`` for the channels ``c0:c1`` of the flat ``(B, C, P)``
    ``grad``, ``sizes`` ``(B, C, P)``: a layer's bias gradient, summed in float64 whatever the dtype
    (reassociated into vector lanes), then rounded once to ``out``'s. NumPy's ``sum(axis=(0, 2))`` of
    the same costs 4 ns a value on short planes (VGG-11's batch-16 gradients: 0.11-0.18 ms a layer)."""
    batch, channels, plane = sizes
    for c in range(c0, c1):
        total = 0.0
        for b in range(batch):
            base = u((b * channels + c) * plane)
            for p in range(plane):
                total += np.float64(grad[base + u(p)])
        out[u(c)] = total


@compiled
def relu_forward(x, out, i0, i1):
    """``out[i] = 0 if x[i] < 0 else x[i]`` for the flat positions ``i0:i1``: PyTorch's ReLU, whose
    zero is +0.0 for a negative input, -0.0 for -0.0, and whose NaN stays NaN (a select, no
    ``x * (x > 0)``: ``-inf * 0`` would be NaN)."""
    zero = out.dtype.type(0)
    for i in range(i0, i1):
        value = x[u(i)]
        out[u(i)] = zero if value < 0 else value


@compiled
def relu_backward(x, g, out, i0, i1):
    """``out[i] = g[i] * (0 if x[i] <= 0 else 1)`` for the flat positions ``i0:i1`` (ReLU's derivative,
    PyTorch's: 1 at NaN)."""
    one, zero = out.dtype.type(1), out.dtype.type(0)
    for i in range(i0, i1):
        out[u(i)] = g[u(i)] * (zero if x[u(i)] <= 0 else one)
