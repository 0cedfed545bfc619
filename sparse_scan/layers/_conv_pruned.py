"""Pruned weights, sparse in the whole iteration: the forward, the input gradient and the weight
gradient of a pruned :class:`~sparse_scan.layers.Conv2d` or :class:`~sparse_scan.layers.Linear` cost
in proportion to its kept weights, on the host and on the GPU.

A layer with ``prune_pattern=True`` keeps, per zero set, one :class:`PrunedWeights`: its kept
weights by output channel (CSR rows ``co``, entries in flat weight order, each the flat position of
a kept weight), and what is derived from them once (the transposed weights' CSR matrix, per input
geometry the tables of the direct convolution). Their values are gathered from the weights once per
version of the weights. A :class:`~sparse_scan.layers.Linear` is the 1x1 convolution of 1x1 planes
(:func:`linear_geometry`), so one set of kernels serves both. Where the weights keep more than a
crossover share of their entries, the dense path (one GEMM) is faster and stays:

* **forward** (:func:`direct_forward`, at most :data:`DIRECT_MAX_DENSITY` kept): a direct sparse
  convolution over the kept taps, no im2col. On the host the input is laid out once as zero-padded
  phase planes (:func:`~sparse_scan.layers._kernels.to_planes`, one per input channel and stride
  phase, the batch innermost), so that a kept weight's multiply-adds over the whole batch are one
  contiguous run at a constant shift
  (:func:`~sparse_scan.layers._kernels.direct_conv`); on the GPU one thread per output sums its
  channel's kept taps (``rawkernels/conv.cu``).
* **input gradient** ``JT @ g`` (the scan's): the pattern leaves the pruned weights out; through the
  weights on the host, ``W^T`` as CSR and a compiled transposed convolution over its non-zeros
  (:func:`pruned_transposed_convolution`, at most :data:`TRANSPOSED_MAX_DENSITY` kept).
* **weight gradient** (:func:`sampled_weight_gradient`, at most :data:`SAMPLED_MAX_DENSITY` kept): a
  sampled dense-dense product (SDDMM): each kept weight's gradient is one dot product of its output
  channel's gradient with its tap of the input, summed over the batch and the output pixels; the
  pruned weights' gradients are exactly zero, what autograd's gradient of ``weight_orig`` gives through
  ``weight_orig * weight_mask``. On the host a compiled dot product per kept weight over the same
  phase planes (:func:`~sparse_scan.layers._kernels.sampled_conv_weights`); on the GPU a thread block
  per kept weight.

IEEE semantics stay PyTorch's: a dense convolution multiplies the pruned (zero) weights too, so an
infinite or NaN input or gradient makes NaN outputs and gradients that the sparse products would not
(``0 * inf``). Where the input (or the gradient) holds one, both functions return None and the caller
runs the dense path (the host's planes note it while they are copied; the GPU checks the batch, one
synchronisation per call).
"""

from __future__ import annotations

import math
import sys
import sysconfig
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _gpu_kernels
from .. import backend as _backend
from .._host_kernels import launch
from .._threads import even_parts, workers_for
from .._types import Array
from ..csr import choose_index_dtype
from ._geometry import ConvGeometry
from ._kernels import (
    direct_conv,
    gather,
    sampled_conv_weights,
    to_planes,
    transposed_conv,
    transposed_conv_taps,
)

if TYPE_CHECKING:  # SciPy loads on first use (0.14 s of import): planning needs none
    import scipy.sparse

__all__ = ["CSR_PATH_MAX_PADDED_SHARE", "DIRECT_MAX_DENSITY", "DIRECT_MIN_WIDTH", "LINEAR_DIRECT_MAX_DENSITY",
           "RUN_ENTRY_WORK", "SAMPLED_MAX_DENSITY", "TAP_ENTRY_WORK", "TRANSPOSED_MAX_DENSITY",
           "PrunedWeights", "direct_forward", "linear_geometry", "pruned_transposed_convolution",
           "sampled_weight_gradient", "transposed_weights_csr"]

KERNEL_FILE = "conv.cu"

DIRECT_MAX_DENSITY = 0.12
"""Pruned weights keeping at most this share of their entries run the forward as a direct sparse
convolution (:func:`direct_forward`), denser ones the dense GEMM. ``bench/pruned.py`` on VGG-11's eight
convolutions (``bench/results/pruned-2core-cpu.json``: 2-core AMD EPYC, float32, each product timed
alone), the median over the eight of dense over sparse at batch 1 / 4 / 16: 1.37 / 2.15 / 3.11 at 3 %
kept, 1.17 / 1.62 / 2.20 at 5 %, 0.76 / 1.02 / 1.56 at 10 %, 0.57 / 1.01 / 1.07 at 15 %. Timed
alone the dense GEMM wins at batch 1 from 10 %; in a training iteration it does not: the dense path
also reads every weight (a layer pruned through masks multiplies them into its dense weights once per
version), and the direct forward's planes serve the weight gradient. The bridge's Adam iteration on the
90 %-pruned VGG-11 (10 % kept), forward plus backward, with the dense forward (0.08 here) against the
direct one (back-to-back processes, medians of 7): 31.9 against 23.7 ms at batch 1, 113.3 against
61.0 ms at batch 16."""

LINEAR_DIRECT_MAX_DENSITY = 0.03
"""A pruned :class:`~sparse_scan.layers.Linear` layer's :data:`DIRECT_MAX_DENSITY`: its direct forward
is the 1x1 convolution of 1x1 planes, a run of one value per sample, so the dense product (a GEMV at
batch 1) wins from lower densities. The 512x512 Linear layer of ``bench/pruned.py``, dense over
sparse at batch 1 / 4 / 16: 0.43 / 1.60 / 1.38 at 1 %, 0.42 / 1.30 / 1.18 at 3 %, 0.35 / 1.03 / 0.95
at 5 %, 0.25 / 0.73 / 0.58 at 10 % (at batch 1 the dense GEMV takes 25 us: the sparse one's cost is
its launch)."""

SAMPLED_MAX_DENSITY = 0.15
"""Pruned weights keeping at most this share of their entries compute their weight gradient as a
sampled product (:func:`sampled_weight_gradient`), denser ones the dense GEMM, masked. Measured as
:data:`DIRECT_MAX_DENSITY`: 2.18 / 2.59 / 2.81 at 5 %, 1.51 / 1.80 / 1.85 at 10 %, 1.12 / 1.42 / 1.36 at
15 %, 0.91 / 1.18 / 1.05 at 20 %, 0.73 / 0.88 / 0.85 at 30 %."""

TRANSPOSED_MAX_DENSITY = 0.15
"""Pruned convolution weights keeping at most this share of their entries run ``JT @ g`` through the
weights as the compiled transposed convolution over their CSR ``W^T``
(:func:`pruned_transposed_convolution`), denser ones the dense GEMM (or JT's SpMV, as the planner
decides). Measured as :data:`DIRECT_MAX_DENSITY` against the dense GEMM: 1.58 / 2.20 / 2.53 at 5 %,
1.17 / 1.42 / 1.60 at 10 %, 0.84 / 1.17 / 1.16 at 15 %, 0.47 / 0.55 / 0.67 at 30 %; JT's SpMV, the
planner's other choice below ``DENSE_MATVEC_MIN_DENSITY``, is slower still (the 90 %-pruned VGG-11's
backward at batch 16 spent 120 ms in SpMVs)."""

CSR_PATH_MAX_PADDED_SHARE = 2.5
"""The compiled sparse transposed convolution runs every tap of every non-zero weight over whole output
planes, padded ones included; JT's SpMV only the taps inside (JT's stored entries), but it reads JT's
values, which a training iteration fills anew for every version of the weights. Through the CSR
weights while their taps are at most this many times JT's entries, else the SpMV. VGG-11's 2x2 planes
(3x3, padding 1) have 2.25x the entries: timed alone with fixed weights (2 cores, float32, batch 1 / 4
/ 16) the CSR kernels take 260 / 557 / 996 us against the SpMV's 115 / 392 / 914, and 4x4 planes
(1.44x) 192 / 431 / 1149 against 292 / 1141 / 2047; in the bridge's Adam iteration (weights updated
every step; back-to-back processes, medians of 15) the CSR kernels on the 2x2 layers took 67.1 ->
63.9 ms (90 % pruned, batch 16), 43.6 -> 40.1 (97 %, 16), 19.9 -> 19.3 (97 %, 1) and 26.0 -> 25.7
(90 %, 1). The direct convolution of the gradient by the flipped kept weights (the forward's kernel)
was slower still: 2x the CSR kernels' time at batch 1, 1.4x at 4, even at 16."""

DIRECT_MIN_WIDTH = 32
"""Output rows at least this wide take :func:`sparse_scan.layers._kernels.transposed_conv` (per output row),
narrower ones :func:`~sparse_scan.layers._kernels.transposed_conv_taps` (per whole plane). Measured on the
pruned VGG-11 at batch 16: conv1 (32 wide) 0.42 ms against 0.75, conv2 (16 wide) 5.2 against 1.7."""

RUN_ENTRY_WORK = 16
"""A kept weight's fixed cost in the direct convolution and the sampled gradient (its tables read, its
pass set up), in multiply-adds of its run: part of the work that sets their threads
(:func:`~sparse_scan._threads.workers_for`), whose run counts ``B Hq Wq`` values. At batch 1 on VGG-11's
2x2 planes that is 16 and an entry costs 4-5 ns on one thread (the 97 %-pruned layers' 70 K entries
about 0.3 ms), on 4x4 ones 36 and 5 ns: the per-entry cost is worth about 16 of a run's values."""

TAP_ENTRY_WORK = 32
""":data:`RUN_ENTRY_WORK` of the transposed convolutions (one ``W^T`` entry's taps over an output plane,
their bounds set per entry): 4.2-4.4 ns an entry on VGG-11's 2x2 planes at batch 1, worth about 32
of a plane's values."""

REFCOUNTS_EXACT = (sys.implementation.name == "cpython" and sys.version_info < (3, 14)
                   and not sysconfig.get_config_var("Py_GIL_DISABLED"))
"""Whether ``sys.getrefcount`` counts every reference, the one :meth:`PrunedWeights.reused` reads to know
that nothing holds an array any more: CPython 3.10-3.13 with the GIL. Elsewhere (3.14 may skip the
count of a reference on the stack; a free-threaded build defers counts) nothing is reused: a new array
every time."""

SAMPLED_BLOCK_THREADS = 128
"""Threads of the GPU's sampled weight gradient (``PRUNED_BLOCK_THREADS`` of ``rawkernels/conv.cu``):
one block per kept weight, a tree sum in shared memory."""


def linear_geometry(in_features: int, out_features: int) -> ConvGeometry:
    """A Linear layer as the 1x1 convolution of 1x1 planes it is (its weight ``(out, in)`` is the
    convolution's ``(out, in, 1, 1)``): the geometry the pruned kernels take.

    Examples
    --------
    >>> linear_geometry(4, 3).shape
    (4, 3)
    """
    return ConvGeometry(in_features, 1, 1, out_features, 1, 1, (1, 1), (1, 1), 0, 0, (1, 1), 1)


class PrunedWeights:
    """A pruned layer's kept weights, derived once per zero set.

    Parameters
    ----------
    support : ndarray
        The weight's shape, non-zero where a weight is kept (the pattern mask, or the weights).
    groups : int
        The convolution's groups (1 for a Linear layer).

    Attributes
    ----------
    indptr : ndarray of int64, shape (out + 1,)
        Output channel ``co``'s kept weights are entries ``indptr[co]:indptr[co + 1]``.
    positions : ndarray of int64
        Each entry's flat position in the weight, increasing.
    columns : ndarray of int32 (int64 where a channel's weights do not fit)
        Each entry's position in its output channel's weights (``positions - co * per_output``).
    density : float
        The share of the weights kept.
    """

    def __init__(self, support: np.ndarray, groups: int) -> None:
        self.shape = tuple(support.shape)
        self.groups = int(groups)
        self.per_output = math.prod(self.shape[1:])
        self.positions = np.flatnonzero(support).astype(np.int64)
        counts = np.bincount(self.positions // max(1, self.per_output), minlength=self.shape[0])
        self.indptr = np.zeros(self.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=self.indptr[1:])
        self.columns = (self.positions - np.repeat(np.arange(self.shape[0]) * self.per_output, counts)
                        ).astype(choose_index_dtype(0, self.per_output))
        self.density = self.positions.size / max(1, support.size)
        self.per_tap = (np.count_nonzero(support, axis=(0, 1)) if support.ndim == 4 else None)
        self._values: dict[Any, tuple[int, Array]] = {}  # device -> (weights version, kept values)
        self._tables: dict[ConvGeometry, tuple[np.ndarray, int, int]] = {}
        self._device: dict[int, tuple[Array, Array]] = {}  # GPU id -> (indptr, positions) there
        self._transposed: tuple[scipy.sparse.csr_matrix, np.ndarray, list[Any]] | None = None
        self._forward_planes: tuple[weakref.ref, ConvGeometry, tuple[np.ndarray, bool]] | None = None
        self._reused: dict[tuple[str, int, np.dtype], np.ndarray] = {}  # (use, size, dtype) -> array

    @property
    def nnz(self) -> int:
        """The kept weights."""
        return int(self.positions.size)

    def values(self, be: _backend.Backend, weight: Array, version: int) -> Array:
        """The kept weights' values (``weight`` at :attr:`positions`) where ``be`` computes, gathered
        once per ``version`` of the weights."""
        key = be.name if be.name == "cpu" else _gpu_kernels.current_device()
        known = self._values.get(key)
        if known is None or known[0] != version:
            if be.name == "cpu":  # a compiled gather on the pool: the weights' memory is the cost
                values = np.empty(self.nnz, dtype=weight.dtype)
                launch(gather, (np.ascontiguousarray(weight).reshape(-1), self.positions, values),
                       even_parts(self.nnz, workers_for(self.nnz)))
            else:
                values = be.xp.take(be.xp.asarray(weight).ravel(), self.on_device()[1])
            known = self._values[key] = (version, values)
        return known[1]

    def reused(self, use: str, size: int, dtype: Any) -> np.ndarray:
        """A flat host array of ``size`` values of ``dtype`` for ``use`` (written whole by its user: a sampled
        gradient, the output gradient's planes): the one handed out last for that use where nothing holds it
        any more (no view, tensor or name: CPython's reference count says so), else a new one (always a new
        one where the count is not exact: :data:`REFCOUNTS_EXACT`). An array of a weight's size allocated per
        backward came from a thread's own malloc arena when the gradient ran beside the scan
        (:meth:`~sparse_scan.Sequential.backward`'s ``parameters_beside``), which returns freed memory to the
        system: 1647 page faults a backward on the 97 %-pruned VGG-11 at batch 1, 2x the backward's time."""
        key = (use, int(size), np.dtype(dtype))
        held = self._reused.get(key)
        # three references: the dict's, ``held``'s and the call's own
        if held is not None and REFCOUNTS_EXACT and sys.getrefcount(held) <= 3:
            return held
        held = self._reused[key] = np.empty(size, dtype=dtype)
        return held

    def on_device(self) -> tuple[Array, Array]:
        """:attr:`indptr` and :attr:`positions` on the current GPU (copied once per device)."""
        device = _gpu_kernels.current_device()
        known = self._device.get(device)
        if known is None:
            xp = _gpu_kernels.cupy_module()
            known = self._device[device] = (xp.asarray(self.indptr), xp.asarray(self.positions))
        return known

    def tables(self, g: ConvGeometry) -> tuple[np.ndarray, int, int]:
        """The host's direct convolution of geometry ``g``, once per geometry: per entry where its run
        starts in one sample's planes (:func:`~sparse_scan.layers._kernels.run_start`: its input plane,
        ``ci`` and the tap's stride phase, times ``Hq Wq``, plus the tap's shift ``row Wq + column``),
        int32 where that fits (four bytes an entry instead of two int64 tables: at batch 1 the table's
        reads weigh as much as a short run's multiply-adds; the 97 %-pruned VGG-11's direct
        convolutions at batch 1 took 1.2 ms instead of 1.7, its sampled gradients 3.1 instead of 3.5,
        one thread, caches cold, 2-core AMD EPYC); the planes' height and width ``(Hq, Wq)`` (the
        output's, plus the taps' reach)."""
        known = self._tables.get(g)
        if known is None:
            kh, kw = g.kernel
            (sh, sw), (dh, dw) = g.stride, g.dilation
            hq = g.out_height + (dh * (kh - 1)) // sh
            wq = g.out_width + (dw * (kw - 1)) // sw
            co, tap = np.divmod(self.positions, self.per_output)
            ci, offset = np.divmod(tap, kh * kw)
            a, b = np.divmod(offset, kw)
            channel = (co // g.cout_per_group) * g.cin_per_group + ci
            planes = (channel * sh + (a * dh) % sh) * sw + (b * dw) % sw
            runs = planes * (hq * wq) + (a * dh // sh) * wq + b * dw // sw
            planes_size = g.in_channels * sh * sw * hq * wq
            known = self._tables[g] = (runs.astype(choose_index_dtype(0, planes_size)), hq, wq)
        return known

    def transposed(self, source: np.ndarray, version: int) -> scipy.sparse.csr_matrix:
        """``W^T`` of every group as CSR (:func:`transposed_weights_csr`), its structure once per zero
        set, its values once per ``version`` of the weights, permuted from the kept values
        (:meth:`values` of ``source``: the weights are read once per version, not once per use)."""
        values = self.values(_backend.get("cpu"), source, version)
        if self._transposed is None:
            support = np.zeros(math.prod(self.shape), dtype=bool)
            support[self.positions] = True
            groups = support.reshape(self.groups, self.shape[0] // self.groups, -1)
            matrix, positions = transposed_weights_csr(groups, values.dtype)
            self._transposed = (matrix, np.searchsorted(self.positions, positions), [None])
        matrix, order, filled = self._transposed
        if matrix.dtype != values.dtype:
            matrix.data = matrix.data.astype(values.dtype)
            filled[0] = None
        if filled[0] != version:  # the compiled gather: 1.2-1.6x NumPy's take on one thread (no bounds
            # checks; take cost 0.73 ms a backward for the 97 %-pruned VGG-11 at batch 1)
            launch(gather, (values, order, matrix.data), even_parts(order.size, workers_for(order.size)))
            filled[0] = version
        return matrix


# --- the phase planes and the pieces of work (host) -------------------------------------------------
def _planes(x: np.ndarray, geometry: tuple[int, ...],
            reused: PrunedWeights | None = None) -> tuple[np.ndarray, bool]:
    """:func:`~sparse_scan.layers._kernels.to_planes` of the batch ``x`` (``(B, C, H, W)``) into one
    array (``reused``'s array for them where given: :meth:`PrunedWeights.reused`), its channels cut
    over the kernel pool's threads; and whether a value copied is not finite."""
    channels, sh, sw, hq, wq = geometry[0], geometry[3], geometry[4], geometry[7], geometry[8]
    size = channels * sh * sw * hq * wq * x.shape[0]
    out = np.empty(size, dtype=x.dtype) if reused is None else reused.reused("planes", size, x.dtype)
    nonfinite = np.zeros(channels, dtype=np.bool_)
    launch(to_planes, (np.ascontiguousarray(x), geometry, out, nonfinite),
           even_parts(channels, workers_for(out.size)))
    return out, bool(nonfinite.any())


def _channel_pieces(indptr: np.ndarray, run: int) -> list[tuple[int, int]]:
    """Runs of output channels of about equal kept weights, one per thread for the work of a run of
    ``run`` multiply-adds per entry (:data:`RUN_ENTRY_WORK` added)."""
    channels, nnz = indptr.size - 1, int(indptr[-1])
    workers = workers_for(nnz * (run + RUN_ENTRY_WORK))
    if workers <= 1 or nnz == 0:
        return [(0, channels)]
    cuts = np.searchsorted(indptr, np.arange(1, workers) * (nnz / workers))
    bounds = [0, *(min(int(c), channels) for c in cuts), channels]
    return [(first, last) for first, last in zip(bounds[:-1], bounds[1:], strict=True) if last > first]


def _input_planes(g: ConvGeometry, pruned: PrunedWeights, x: np.ndarray,
                  forward: bool) -> tuple[np.ndarray, bool]:
    """The input's phase planes and whether a value is not finite.

    The forward's are kept (one batch per layer, until its next forward), and the weight gradient of
    the same batch (``x`` the very array the forward took) reads them instead of copying the input
    again: the gradient at the forward's input, which is the gradient's definition (an array written
    in place after the forward is not read again, as a JT's values are not)."""
    _, hq, wq = pruned.tables(g)
    known = pruned._forward_planes
    if not forward and known is not None and known[0]() is x and known[1] == g:
        return known[2]
    geometry = (g.in_channels, g.height, g.width, *g.stride, g.pad_top, g.pad_left, hq, wq)
    planes = _planes(x.reshape(x.shape[0], g.in_channels, g.height, g.width), geometry)
    if forward:
        pruned._forward_planes = (weakref.ref(x), g, planes)
    return planes


# --- forward --------------------------------------------------------------------------------------
def _direct_forward_cpu(be: _backend.Backend, g: ConvGeometry, pruned: PrunedWeights, values: np.ndarray,
                        x: np.ndarray, bias: np.ndarray | None) -> np.ndarray | None:
    runs, hq, wq = pruned.tables(g)
    batch = x.shape[0]
    source, nonfinite = _input_planes(g, pruned, x, forward=True)
    if nonfinite:
        return None
    out = np.empty((batch, g.out_channels, g.out_height, g.out_width), dtype=x.dtype)
    shift = np.zeros(0, x.dtype) if bias is None else np.asarray(bias, dtype=x.dtype)
    sizes = (batch, hq, wq, g.out_height, g.out_width)
    launch(direct_conv, (pruned.indptr, runs, values.astype(x.dtype, copy=False), source, sizes,
                         shift, out.reshape(-1)),
           _channel_pieces(pruned.indptr, batch * hq * wq))
    return out


def _direct_forward_gpu(be: _backend.Backend, g: ConvGeometry, pruned: PrunedWeights, values: Array,
                        x: Array, bias: Array | None) -> Array | None:
    xp = be.xp
    if not bool(xp.isfinite(x).all()):  # sync: IEEE results need the dense path
        return None
    batch = x.shape[0]
    indptr, positions = pruned.on_device()
    out = xp.empty((batch, g.out_channels, g.out_height, g.out_width), dtype=x.dtype)
    shift = xp.zeros(0, x.dtype) if bias is None else xp.asarray(bias, dtype=x.dtype)
    kernel = _gpu_kernels.function(KERNEL_FILE, "pruned_conv_forward", x.dtype)
    _gpu_kernels.launch(kernel, out.size, g.kernel_args() + (
        np.int64(batch), indptr, positions, values.astype(x.dtype, copy=False), xp.ascontiguousarray(x),
        shift, np.int64(shift.size), out))
    return out


direct_forward = _backend.twin(cpu=_direct_forward_cpu, gpu=_direct_forward_gpu)
"""``direct_forward(be, g, pruned, values, x, bias)``: the convolution of the batch ``x`` by the kept
weights (values ``values``, :meth:`PrunedWeights.values`) plus ``bias`` (or None), ``(B, Cout, Ho,
Wo)``; None where ``x`` holds a value that is not finite."""


# --- the weight gradient ----------------------------------------------------------------------------
def _sampled_weight_gradient_cpu(be: _backend.Backend, g: ConvGeometry, pruned: PrunedWeights,
                                 x: np.ndarray, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    runs, hq, wq = pruned.tables(g)
    batch = x.shape[0]
    source, nonfinite = _input_planes(g, pruned, x, forward=False)
    grad_geometry = (g.out_channels, g.out_height, g.out_width, 1, 1, 0, 0, g.out_height, wq)
    dtype = np.result_type(x.dtype, grad_out.dtype)
    grad = np.asarray(grad_out, dtype=dtype).reshape(batch, g.out_channels, g.out_height, g.out_width)
    planes_of_grad, grad_nonfinite = _planes(grad, grad_geometry, reused=pruned)  # read here alone
    if nonfinite or grad_nonfinite:
        return None
    sizes = (batch, hq, wq, g.out_height, g.out_width)
    out = pruned.reused("gradient", math.prod(pruned.shape), dtype)  # every channel zeroed by its thread
    kept = pruned.reused("kept gradient", pruned.nnz, dtype)
    launch(sampled_conv_weights, (pruned.indptr, runs, pruned.columns, planes_of_grad,
                                  source.astype(dtype, copy=False), sizes, pruned.per_output, out, kept),
           _channel_pieces(pruned.indptr, batch * hq * wq))
    return out.reshape(pruned.shape), kept


def _sampled_weight_gradient_gpu(be: _backend.Backend, g: ConvGeometry, pruned: PrunedWeights, x: Array,
                                 grad_out: Array) -> tuple[Array, Array] | None:
    xp = be.xp
    batch = x.shape[0]
    dtype = np.result_type(x.dtype, grad_out.dtype)
    grad = xp.ascontiguousarray(grad_out, dtype=dtype)
    source = xp.ascontiguousarray(x, dtype=dtype)
    if not bool(xp.isfinite(source).all() & xp.isfinite(grad).all()):  # sync: IEEE needs the dense path
        return None
    indptr, positions = pruned.on_device()
    out = xp.zeros(math.prod(pruned.shape), dtype=dtype)
    kept = xp.empty(pruned.nnz, dtype=dtype)
    kernel = _gpu_kernels.function(KERNEL_FILE, "pruned_conv_weight_grad", dtype)
    _gpu_kernels.launch_blocks(kernel, pruned.nnz, SAMPLED_BLOCK_THREADS,
                               g.kernel_args() + (np.int64(batch), np.int64(pruned.nnz), indptr, positions,
                                                  source, grad, out, kept))
    return out.reshape(pruned.shape), kept


sampled_weight_gradient = _backend.twin(cpu=_sampled_weight_gradient_cpu, gpu=_sampled_weight_gradient_gpu)
"""``sampled_weight_gradient(be, g, pruned, x, grad_out)``: the weight gradient summed over the batch
at the kept weights (exactly zero elsewhere), the weight's shape, and the same values at the kept
weights alone in their order (:class:`PrunedWeights`' ``positions``); None where ``x`` or ``grad_out`` holds
a value that is not finite."""


# --- the input gradient through the weights (host) ---------------------------------------------------
def weights_as_csr(weights: np.ndarray, offset: int, row_stride: int, column_stride: int,
                   dtype: Any) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """A CSR matrix of ``dtype`` over the non-zeros of ``weights`` (a 2-D view of a layer's kept
    weights; the values are refilled at every use) and the flat weight position of each stored value:
    ``offset + row * row_stride + column * column_stride``."""
    import scipy.sparse  # noqa: PLC0415 - on first use: planning needs none

    matrix = scipy.sparse.csr_matrix(weights != 0, dtype=dtype)
    rows = np.repeat(np.arange(weights.shape[0]), np.diff(matrix.indptr))
    positions = (offset + rows * row_stride + matrix.indices * column_stride).astype(np.intp)
    return matrix, positions


def transposed_weights_csr(groups: np.ndarray, dtype: Any) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """``W^T`` of every group as one CSR matrix, rows ``(ci, kh, kw)`` (global input channel), columns
    ``co`` (global output channel; block-diagonal over the groups), with the weights' flat position of
    each stored value (:func:`weights_as_csr`). ``groups``: the weights (or their support) as
    ``(groups, cout / groups, taps)``."""
    count, cout, taps = groups.shape
    parts = [weights_as_csr(group.T, index * group.size, 1, taps, dtype)
             for index, group in enumerate(groups)]
    nnz = np.cumsum([0] + [matrix.nnz for matrix, _ in parts])
    indptr = np.concatenate([[0]] + [matrix.indptr[1:] + offset
                                     for (matrix, _), offset in zip(parts, nnz[:-1], strict=True)])
    indices = np.concatenate([matrix.indices + index * cout for index, (matrix, _) in enumerate(parts)])
    data = np.concatenate([matrix.data for matrix, _ in parts])
    dtype = choose_index_dtype(int(nnz[-1]), count * cout, None)
    import scipy.sparse  # noqa: PLC0415 - on first use: planning needs none

    matrix = scipy.sparse.csr_matrix((data, indices.astype(dtype), indptr.astype(dtype)),
                                     shape=(count * taps, count * cout), copy=False)
    return matrix, np.concatenate([positions for _, positions in parts])


def pruned_transposed_convolution(g: ConvGeometry, weights: scipy.sparse.csr_matrix,
                                  grad_out: np.ndarray) -> np.ndarray:
    """``JT @ grad_out`` (``(B, out size) -> (B, in size)``) through pruned weights ``W^T``
    (:func:`transposed_weights_csr`): :mod:`sparse_scan.layers._kernels`' transposed convolutions,
    runs of input channels of about equal non-zeros on the kernel pool's threads."""
    batch = grad_out.shape[0]
    dtype = np.result_type(weights.dtype, grad_out.dtype)
    data = weights.data.astype(dtype, copy=False)
    grad = np.ascontiguousarray(grad_out, dtype=dtype).reshape(batch, -1)
    out_plane = g.out_height * g.out_width
    taps = g.out_width < DIRECT_MIN_WIDTH
    if taps and batch > 1:  # channel-major: each output plane of every sample one run
        grad = np.ascontiguousarray(grad.reshape(batch, g.out_channels, out_plane).transpose(1, 0, 2))
    out = np.empty((batch, g.in_channels, g.height * g.width), dtype=dtype)
    geometry = (g.in_channels, g.height, g.width, g.out_channels, g.out_height, g.out_width, *g.kernel,
                *g.stride, g.pad_top, g.pad_left, *g.dilation, batch)
    work = weights.nnz * (out_plane * batch + TAP_ENTRY_WORK)
    workers = workers_for(work)
    per_channel = weights.indptr[::g.kernel[0] * g.kernel[1]]
    cuts = np.searchsorted(per_channel, np.arange(1, workers) * (weights.nnz / workers))
    bounds = [0, *(int(c) for c in cuts), g.in_channels]
    pieces = [(first, last) for first, last in zip(bounds[:-1], bounds[1:], strict=True) if last > first]
    common = (weights.indptr, weights.indices, data, grad.reshape(-1), geometry)
    launch(transposed_conv_taps if taps else transposed_conv, (*common, out), pieces)
    return out.reshape(batch, -1)
