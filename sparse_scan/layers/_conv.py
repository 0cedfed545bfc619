"""2-D convolution with an analytic CSR transposed Jacobian, general in every PyTorch argument.

The transposed Jacobian has one row per input element ``(ci, ih, iw)`` and one column per output
element ``(co, oh, ow)``. Entry ``(ci, ih, iw) -> (co, oh, ow)`` exists when ``co`` is in ``ci``'s group
and the input pixel is tapped by kernel offset ``(kh, kw)`` of that output pixel; its value is
``weight[co, ci % cin_per_group, kh, kw]``. The offset is unique (``kh = (ih + pad_top - oh*stride)/
dilation``), so every entry is one weight and the values are sample-independent.

Along each axis, the taps of an input position depend only on its position class (border, or the
stride's residue in the interior). The values fill exploits that: the rows of one class pair hold the
same weights in the same order and lie at affine offsets, so each class pair is one strided block copy
instead of an ``nnz``-long gather.

The forward pass is one GEMM per group over the batch's columns (im2col), and so is ``JT @ g`` through
the weights (the transposed convolution, :meth:`Conv2d.weights_matvec`). Pruned weights
(``prune_pattern=True``) at most :data:`SPARSE_FORWARD_MAX_DENSITY` dense skip the pruned multiply-adds
on the CPU: the forward multiplies them as a SciPy CSR matrix, the transposed convolution runs compiled
over their non-zeros (:mod:`sparse_scan._numba_conv`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import scipy.sparse

from .. import _kernels
from .. import backend as _backend
from .._checks import flag, integer
from .._host_kernels import conv_kernels, kernels, launch
from .._threads import even_parts, workers_for
from .._types import Array
from ..csr import Pattern, choose_index_dtype
from ..engine.plan import WeightsPath
from ._base import Shape
from ._geometry import IntPair, output_size, pair, window_extent
from ._weighted import RngLike, WeightedLayer

__all__ = ["SPARSE_FORWARD_MAX_DENSITY", "Conv2d"]

KERNEL_FILE = "conv_jt.cu"
CSR_PATH_MAX_PADDED_SHARE = 2.0
"""The compiled sparse transposed convolution runs every tap of every non-zero weight over whole output
planes, padded ones included; JT's SpMV only the taps inside (JT's stored entries). Through the CSR
weights while their taps are at most this many times JT's entries, else the SpMV of JT's (cached,
shared) values. Measured on the pruned VGG-11 (2 cores, float32, batch 1 / 4 / 16): 4x4 planes (1.44x
the entries) 192 / 431 / 1149 us against the SpMV's 292 / 1141 / 2047; 2x2 planes (2.25x) 260 / 557 /
996 us against 115 / 392 / 914."""

SPARSE_FORWARD_MAX_DENSITY = 0.05
"""Pruned weights with at most this fraction of non-zeros multiply the forward's columns as a CSR
matrix on the CPU. Measured on 2 cores against NumPy's GEMM on VGG-11's layers (batch 16): 2-4x
faster at 3%, slower from about 6-10% (SciPy's product runs on one core). ``JT @ g`` through such
weights runs compiled (:func:`_pruned_transposed_convolution`)."""


@dataclass(frozen=True)
class ConvGeometry:
    """Everything the pattern depends on, for one input shape."""

    in_channels: int
    height: int
    width: int
    out_channels: int
    out_height: int
    out_width: int
    kernel: IntPair
    stride: IntPair
    pad_top: int
    pad_left: int
    dilation: IntPair
    groups: int

    @property
    def cin_per_group(self) -> int:
        return self.in_channels // self.groups

    @property
    def cout_per_group(self) -> int:
        return self.out_channels // self.groups

    @property
    def shape(self) -> tuple[int, int]:
        return (self.in_channels * self.height * self.width,
                self.out_channels * self.out_height * self.out_width)

    def kernel_args(self) -> tuple[np.int64, ...]:
        """The scalar arguments every conv kernel takes, in ``conv_jt.cu``'s order."""
        return tuple(np.int64(v) for v in (
            self.in_channels, self.height, self.width, self.out_channels, self.out_height,
            self.out_width, self.kernel[0], self.kernel[1], self.stride[0], self.stride[1],
            self.pad_top, self.pad_left, self.dilation[0], self.dilation[1], self.groups))


def axis_taps(size: int, kernel: int, stride: int, pad_lo: int, dilation: int,
              out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kernel offsets and output positions reaching each input position along one axis.

    Returns
    -------
    offsets, outputs : ndarray, shape (size, kernel)
        Row ``i`` lists the taps of input position ``i`` in increasing output position (decreasing
        kernel offset), valid taps first; invalid slots hold -1.
    counts : ndarray, shape (size,)
        Number of valid taps per position.
    """
    i = np.arange(size)[:, None]
    k = np.arange(kernel - 1, -1, -1)[None, :]  # decreasing offset = increasing output
    numerator = i + pad_lo - k * dilation
    out = numerator // stride
    valid = (numerator % stride == 0) & (out >= 0) & (out < out_size)
    order = np.argsort(~valid, axis=1, kind="stable")  # valid first, order kept
    offsets = np.where(valid, np.broadcast_to(k, valid.shape), -1)
    outputs = np.where(valid, out, -1)
    take = np.take_along_axis
    return take(offsets, order, 1), take(outputs, order, 1), valid.sum(axis=1)


class Conv2d(WeightedLayer):
    """PyTorch's ``nn.Conv2d`` (zeros padding) on NCHW batches.

    Parameters
    ----------
    in_channels, out_channels : int
    kernel_size, stride, dilation : int or (int, int)
    padding : int, (int, int), "valid" or "same"
        ``"same"`` (stride 1 only) pads ``dilation*(kernel-1)`` in total per axis, the extra one at the
        bottom/right when odd, like PyTorch.
    groups : int
        Must divide both channel counts.
    bias : bool
    padding_mode : {"zeros"}
        The only mode whose Jacobian is implemented.
    dtype : numpy dtype, optional
        float32 (default) or float64.
    rng : numpy.random.Generator or int, optional
        Source of PyTorch's default uniform initialisation.
    prune_pattern : bool
        Drop exactly-zero weights from the Jacobian's pattern (pruned networks).

    Attributes
    ----------
    weight : ndarray, shape (out_channels, in_channels // groups, kh, kw)
    bias : ndarray, shape (out_channels,), or None

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import Conv2d
    >>> conv = Conv2d(3, 64, 3, padding=1, rng=0)
    >>> jt = conv.transposed_jacobian(np.zeros((2, 3, 32, 32), np.float32))
    >>> jt.shape, jt.nnz, jt.data.shape  # values shared by the batch
    ((3072, 65536), 1696512, (1696512,))
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | IntPair,
        stride: int | IntPair = 1,
        padding: int | IntPair | str = 0,
        dilation: int | IntPair = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        dtype: Any = None,
        rng: RngLike = None,
        prune_pattern: bool = False,
    ) -> None:
        label = "Conv2d"
        for field, value in (("in_channels", in_channels), ("out_channels", out_channels),
                             ("groups", groups)):
            integer(value, f"layer {label}: {field}", 1)
        bias = flag(bias, f"layer {label}: bias")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"layer {label}: groups: {groups} must divide in_channels={in_channels} and "
                f"out_channels={out_channels}"
            )
        if padding_mode != "zeros":
            raise ValueError(f"layer {label}: padding_mode: only 'zeros' is supported, "
                             f"got {padding_mode!r}")
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        self.kernel_size = pair(kernel_size, "kernel_size", label, 1)
        self.stride = pair(stride, "stride", label, 1)
        self.dilation = pair(dilation, "dilation", label, 1)
        self.padding = padding if isinstance(padding, str) else pair(padding, "padding", label, 0)
        self._pads = self._resolve_padding(label)
        self.padding_mode = padding_mode
        fan_in = self.in_channels // self.groups * self.kernel_size[0] * self.kernel_size[1]
        super().__init__(
            (self.out_channels, self.in_channels // self.groups) + self.kernel_size,
            bias, fan_in, dtype, rng, prune_pattern,
        )
        self._sparse_structure: tuple[Any, Any, list[int | None]] | None = None

    def _resolve_padding(self, label: str) -> tuple[int, int, int, int]:
        """(top, bottom, left, right) from an int pair, 'valid' or 'same'."""
        if self.padding == "valid":
            return (0, 0, 0, 0)
        if self.padding == "same":
            if self.stride != (1, 1):
                raise ValueError(f"layer {label}: padding: 'same' needs stride 1, got {self.stride}")
            pads = []
            for k, d in zip(self.kernel_size, self.dilation, strict=True):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return tuple(pads)  # type: ignore[return-value]
        if isinstance(self.padding, str):
            raise ValueError(f"layer {label}: padding: expected an int, a pair, 'valid' or 'same', "
                             f"got {self.padding!r}")
        return (self.padding[0], self.padding[0], self.padding[1], self.padding[1])

    # --- shapes --------------------------------------------------------------------------------
    def geometry(self, in_shape: Shape) -> ConvGeometry:
        """Validate a per-sample input shape ``(C, H, W)`` and return the conv geometry."""
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 3:
            raise self._error("input", f"expected per-sample shape (C, H, W), got {shape}")
        channels, height, width = shape
        if channels != self.in_channels:
            raise self._error("in_channels",
                              f"input has {channels} channels, layer expects {self.in_channels}")
        top, bottom, left, right = self._pads
        out_h = output_size(height, self.kernel_size[0], self.stride[0], top, bottom, self.dilation[0])
        out_w = output_size(width, self.kernel_size[1], self.stride[1], left, right, self.dilation[1])
        if out_h < 1 or out_w < 1:
            extent = tuple(window_extent(k, d) for k, d in zip(self.kernel_size, self.dilation, strict=True))
            raise self._error(
                "kernel_size",
                f"dilated kernel {extent} is larger than the padded input "
                f"({height + top + bottom}, {width + left + right})",
            )
        return ConvGeometry(channels, height, width, self.out_channels, out_h, out_w,
                            self.kernel_size, self.stride, top, left, self.dilation, self.groups)

    def check_in_shape(self, in_shape: Shape) -> Shape:
        self.geometry(in_shape)
        return tuple(int(s) for s in in_shape)

    def output_shape(self, in_shape: Shape) -> Shape:
        g = self.geometry(in_shape)
        return (g.out_channels, g.out_height, g.out_width)

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        """Cross-correlate the batch ``x`` (B, C, H, W) with the weights, plus bias."""
        x = self._check_input(x)
        self._check_input_dtype(x)
        g = self.geometry(x.shape[1:])
        be = _backend.of(x)
        xp = be.xp
        columns = self._columns(x, g)
        batch = x.shape[0]
        sparse = _host_sparse_weights(be, self, False)
        if sparse is None:
            weight = xp.asarray(self.weight).reshape(g.groups, g.cout_per_group, columns.shape[1])
            out = xp.matmul(weight, columns)
        else:
            out = _grouped_product(sparse, columns)
        out = out.reshape(g.out_channels, batch, g.out_height, g.out_width)
        if self.bias is not None:
            out += xp.asarray(self.bias, dtype=out.dtype)[:, None, None, None]
        return xp.ascontiguousarray(out.transpose(1, 0, 2, 3))

    def _sparse_weights(self, transposed: bool = False) -> list[scipy.sparse.csr_matrix] | None:
        """Per group, the pruned weights ``(cout / groups, taps)`` as CSR for the forward on the host
        (SciPy; :func:`_host_sparse_weights` is the dispatch), or, ``transposed``, one matrix ``W^T``
        of every group (rows ``(ci, kh, kw)``, columns ``co``: :func:`_transposed_weights_csr`) for the
        compiled transposed convolution; None where they are not pruned or too dense to pay
        (:meth:`_csr_pays`). The matrices are
        kept per zero set; their values are gathered from the weights, into the kept arrays, once per
        version of the weights (1.8 ms per backward of the pruned VGG-11 where it was every call)."""
        if self._sparse_layout() is None:
            return None
        _, layout, filled = self._sparse_structure
        side = 1 if transposed else 0
        if filled[side] != self._version:
            flat = self._weight.ravel()
            for matrix, positions in layout[side]:
                np.take(flat, positions, out=matrix.data, mode="clip")  # valid positions by construction
            filled[side] = self._version
        return [matrix for matrix, _ in layout[side]]

    def _sparse_layout(self) -> tuple[list[tuple[scipy.sparse.csr_matrix, np.ndarray]], ...] | None:
        """:meth:`_sparse_weights`' matrices per group with the weights' flat position of each stored
        value (as they are, and transposed), or None; kept per zero set (with the weight versions
        whose values they hold)."""
        if not self.prune_pattern:
            return None
        try:
            key = self._structure_key()
        except ValueError:  # non-finite weights define no zero set: the GEMM gives NaN, like PyTorch
            return None
        key = (key, self._weight.dtype)  # the kept matrices hold values of that dtype
        if self._sparse_structure is None or self._sparse_structure[0] != key:
            groups = self._support().reshape(self.groups, self.out_channels // self.groups, -1)
            layout = None
            if self._csr_pays():
                dtype = self._weight.dtype
                layout = ([], [_transposed_weights_csr(groups, dtype)])
                for index, group in enumerate(groups):
                    layout[0].append(_weights_as_csr(group, index * group.size, group.shape[1], 1, dtype))
            self._sparse_structure = (key, layout, [None, None])
        return self._sparse_structure[1]

    def _csr_pays(self) -> bool:
        """Whether the weights are pruned to at most :data:`SPARSE_FORWARD_MAX_DENSITY` non-zeros,
        so that they multiply as CSR on the host."""
        return (self.prune_pattern
                and np.count_nonzero(self._support()) <= SPARSE_FORWARD_MAX_DENSITY * self._weight.size)

    def _columns(self, x: Array, g: ConvGeometry) -> Array:
        """``(groups, taps, B * out pixels)``: the input element each kernel tap of each output reads
        (``taps = in_channels / groups * kh * kw``, zeros in the padding), the batch folded into the
        columns so that one GEMM per group reads the weights once for every sample."""
        return _im2col(_backend.of(x), x, g, self._pads)

    def pattern_nnz(self, in_shape: Shape) -> int:
        """Counted from the geometry: each weight (non-zero ones only when pruned) is stored once per
        output pixel whose tap for it falls inside the input."""
        g = self.geometry(in_shape)
        rows = _inside_taps(g.height, g.out_height, g.kernel[0], g.stride[0], g.pad_top, g.dilation[0])
        cols = _inside_taps(g.width, g.out_width, g.kernel[1], g.stride[1], g.pad_left, g.dilation[1])
        inside = np.outer(rows, cols)
        if self.prune_pattern:
            self._structure_key()  # a non-finite weight cannot define a pruned pattern
            weights = np.count_nonzero(self._support(), axis=(0, 1))
        else:
            weights = np.full(g.kernel, g.out_channels * g.cin_per_group)
        return int((weights * inside).sum())

    # --- JT @ g through the weights -----------------------------------------------------------
    def weights_path(self, in_shape: Shape) -> WeightsPath:
        """The transposed convolution: one GEMM of every weight with every output pixel per sample,
        or CSR weights where they are heavily pruned (:meth:`_csr_pays`) and the compiled kernel's
        taps are not mostly padding (:data:`CSR_PATH_MAX_PADDED_SHARE`)."""
        g = self.geometry(in_shape)
        plane = g.out_height * g.out_width
        multiply_adds = g.out_channels * g.cin_per_group * g.kernel[0] * g.kernel[1] * plane
        csr = bool(self._csr_pays() and (np.count_nonzero(self._support()) * plane
                                         <= CSR_PATH_MAX_PADDED_SHARE * self.pattern_nnz(in_shape)))
        return WeightsPath(multiply_adds, csr=csr)

    def weights_matvec(self, in_shape: Shape, device: str = "cpu") -> Callable[[Array], Array]:
        """``JT @ g`` for a batch ``g`` of ``(B, out_size)``: the transposed convolution.

        One GEMM per group over all samples, ``W_g^T (taps, cout) @ g (cout, B * pixels)``, gives
        every tap's contribution; they are added into the padded input at their strided positions
        (the adjoint of :meth:`_columns`) and the padding is cropped. Heavily pruned weights
        (:meth:`_sparse_weights`) skip both on the CPU: a compiled direct transposed convolution over
        their non-zeros (:func:`_pruned_transposed_convolution`).
        """
        g = self.geometry(in_shape)
        be = _backend.get(device)
        sparse = _host_sparse_weights(be, self, True)
        if sparse is not None:
            return functools.partial(_pruned_transposed_convolution, g, sparse[0])
        weight = be.asarray(self.weight).reshape(g.groups, g.cout_per_group, -1)
        taps_of = functools.partial(be.xp.matmul, weight.transpose(0, 2, 1))
        return functools.partial(self._transposed_convolution, g, taps_of)

    def _transposed_convolution(self, g: ConvGeometry, taps_of: Callable[[Array], Array],
                                grad_out: Array) -> Array:
        """:meth:`weights_matvec` of ``grad_out``, ``taps_of`` giving the taps' contributions
        ``(groups, taps, B * pixels)`` of the gradient ``(groups, cout, B * pixels)``."""
        be = _backend.of(grad_out)
        batch, pixels = grad_out.shape[0], g.out_height * g.out_width
        grad = (be.xp.asarray(grad_out).reshape(batch, g.groups, g.cout_per_group, pixels)
                .transpose(1, 2, 0, 3).reshape(g.groups, g.cout_per_group, batch * pixels))
        return _col2im(be, taps_of(grad), g, self._pads, batch)

    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """``weight`` and ``bias`` gradients (paper Eq. 2), summed over the batch like PyTorch.

        ``dW[g] = sum_b grad_out[b, g] @ columns[b, g]^T``: one GEMM per group over all samples.
        """
        x = self._check_input(x)
        g = self.geometry(x.shape[1:])
        xp = _backend.of(x).xp
        columns = self._columns(x, g)
        batch, pixels = x.shape[0], g.out_height * g.out_width
        grad = _backend.of(x).asarray(grad_out).reshape(batch, g.groups, g.cout_per_group, pixels)
        # (groups, cout, B * pixels) @ (groups, B * pixels, taps)
        left = grad.transpose(1, 2, 0, 3).reshape(g.groups, g.cout_per_group, batch * pixels)
        grads = {"weight": xp.matmul(left, columns.transpose(0, 2, 1)).reshape(self.weight.shape)}
        if self.bias is not None:
            grads["bias"] = grad.sum(axis=(0, 3)).reshape(-1)
        return grads

    # --- pattern -------------------------------------------------------------------------------
    def _structural_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, Array]:
        g = self.geometry(in_shape)
        return _structural_pattern(be, g, index_dtype)

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        pattern, aux = super()._build_pattern(be, in_shape, index_dtype)
        aux["geometry"] = self.geometry(in_shape)
        if not aux["pruned"]:
            aux["fill_plan"] = _fill_plan(be, aux["geometry"], pattern.indptr)
        return pattern, aux

    # --- values --------------------------------------------------------------------------------
    def _structured_values(self, be: _backend.Backend, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return _fill_values(be, aux["geometry"], pattern, aux, be.asarray(self.weight))

    def __repr__(self) -> str:
        text = (f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}")
        if self.padding not in ((0, 0), "valid"):
            text += f", padding={self.padding}"
        if self.dilation != (1, 1):
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        return text + ")"


# --- NumPy twins -------------------------------------------------------------------------------
def _inside_taps(size: int, out_size: int, kernel: int, stride: int, pad_lo: int,
                 dilation: int) -> np.ndarray:
    """Per kernel offset along one axis, how many output positions read an input position (not the
    padding) through it."""
    positions = (np.arange(out_size)[None, :] * stride - pad_lo
                 + np.arange(kernel)[:, None] * dilation)
    return ((positions >= 0) & (positions < size)).sum(axis=1)


def _taps(g: ConvGeometry) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    rows = axis_taps(g.height, g.kernel[0], g.stride[0], g.pad_top, g.dilation[0], g.out_height)
    cols = axis_taps(g.width, g.kernel[1], g.stride[1], g.pad_left, g.dilation[1], g.out_width)
    return rows, cols


def _row_counts(g: ConvGeometry) -> np.ndarray:
    (_, _, count_h), (_, _, count_w) = _taps(g)
    per_pixel = g.cout_per_group * count_h[:, None] * count_w[None, :]
    return np.broadcast_to(per_pixel, (g.in_channels, g.height, g.width)).ravel()


def _structural_pattern_cpu(be: _backend.Backend, g: ConvGeometry,
                            index_dtype: Any) -> tuple[Pattern, np.ndarray]:
    """Pattern and ``widx`` by strided block writes, one per (row class, column class) run."""
    counts = _row_counts(g)
    nnz = int(counts.sum())
    dtype = choose_index_dtype(nnz, g.shape[1], index_dtype)
    indptr = np.zeros(g.shape[0] + 1, dtype=dtype)
    np.cumsum(counts, out=indptr[1:])
    blocks, weight_index, column_template = _fill_plan_cpu(be, g, indptr)
    weight_index, column_template = weight_index.astype(dtype), column_template.astype(dtype)
    indices = np.empty(nnz, dtype=dtype)
    widx = np.empty(nnz, dtype=dtype)
    for block in blocks:
        channels, h_len, w_len, length = block.shape
        span = slice(block.template_start, block.template_start + channels * length)
        steps = (np.arange(h_len, dtype=dtype)[:, None] * dtype.type(block.column_steps[0])
                 + np.arange(w_len, dtype=dtype)[None, :] * dtype.type(block.column_steps[1]))
        np.add(column_template[span].reshape(channels, 1, 1, length), steps[None, :, :, None],
               out=_block_view(indices, block))
        _block_view(widx, block)[...] = weight_index[span].reshape(channels, 1, 1, length)
    return Pattern(indptr, indices, g.shape), widx


@dataclass(frozen=True)
class AxisRun:
    """Input positions along one axis with the same taps, at arithmetic positions and row offsets."""

    taps: np.ndarray
    outputs: np.ndarray
    offset: int
    offset_step: int
    position_step: int
    length: int


def _axis_runs(taps: np.ndarray, outputs: np.ndarray, counts: np.ndarray,
               row_offsets: np.ndarray) -> list[AxisRun]:
    """Group one axis's positions by tap class, split into runs arithmetic in position and offset."""
    runs = []
    classes: dict[bytes, list[int]] = {}
    for position, row in enumerate(taps):
        classes.setdefault(row.tobytes(), []).append(position)
    for positions in classes.values():
        offsets = row_offsets[positions]
        start = 0
        while start < len(positions):
            stop = start + 1
            step = int(offsets[stop] - offsets[start]) if stop < len(positions) else 0
            pos_step = positions[stop] - positions[start] if stop < len(positions) else 0
            while (stop < len(positions) and offsets[stop] - offsets[stop - 1] == step
                   and positions[stop] - positions[stop - 1] == pos_step):
                stop += 1
            first, count = positions[start], int(counts[positions[start]])
            runs.append(AxisRun(taps[first, :count], outputs[first, :count], int(offsets[start]),
                                step, pos_step, stop - start))
            start = stop
    return runs


@dataclass(frozen=True)
class FillBlock:
    """One strided block of the CSR arrays: the rows of one (row-class run, column-class run) pair.

    Entries ``[start + ci*s0 + p*s1 + q*s2 + e]`` for ``shape = (channels, p, q, e)``; every channel's
    rows share a template of ``e`` entries, whose columns advance by ``column_steps`` per (p, q).
    """

    start: int
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]
    template_start: int
    column_steps: tuple[int, int]


def _block_view(array: np.ndarray, block: FillBlock) -> np.ndarray:
    item = array.itemsize
    return np.lib.stride_tricks.as_strided(
        array[block.start:], shape=block.shape, strides=tuple(s * item for s in block.strides))


def _fill_plan_cpu(be: _backend.Backend, g: ConvGeometry,
                   indptr: np.ndarray) -> tuple[list[FillBlock], np.ndarray, np.ndarray]:
    """Blocks of the structured fills, with the weight index and columns of every block's template.

    Row ``(ci, ih, iw)`` starts at ``ci * channel_len + h_offset[ih] + cout * nh(ih) * w_offset[iw]``;
    within one class pair and arithmetic run that is affine in ``(ci, ih, iw)``; every row of channel
    ``ci`` holds the weights ``weight[co, ci, taps_h][..., taps_w]``, and its columns shift by a
    constant per step of the run.
    """
    (kh, oh, count_h), (kw, ow, count_w) = _taps(g)
    channel_len = int(indptr[g.height * g.width])
    h_offsets = np.concatenate(([0], np.cumsum(g.cout_per_group * count_h * count_w.sum())))[:-1]
    w_offsets = np.concatenate(([0], np.cumsum(count_w)))[:-1]
    ci = np.arange(g.in_channels)[:, None, None, None]
    co = (ci // g.cin_per_group) * g.cout_per_group + np.arange(g.cout_per_group)[:, None, None]
    blocks, weight_index, columns, template_start = [], [], [], 0
    for run_h in _axis_runs(kh, oh, count_h, h_offsets):
        row_scale = g.cout_per_group * len(run_h.taps)
        for run_w in _axis_runs(kw, ow, count_w, w_offsets):
            if len(run_h.taps) == 0 or len(run_w.taps) == 0:
                continue
            taps = run_h.taps[:, None] * g.kernel[1] + run_w.taps[None, :]
            flat = ((co * g.cin_per_group + ci % g.cin_per_group) * g.kernel[0] * g.kernel[1]
                    + taps[None, None]).reshape(g.in_channels, -1)
            cols = ((co * g.out_height + run_h.outputs[:, None]) * g.out_width
                    + run_w.outputs[None, :]).reshape(g.in_channels, -1)
            blocks.append(FillBlock(
                start=run_h.offset + row_scale * run_w.offset,
                shape=(g.in_channels, run_h.length, run_w.length, flat.shape[1]),
                strides=(channel_len, run_h.offset_step, row_scale * run_w.offset_step, 1),
                template_start=template_start,
                column_steps=(run_h.position_step // g.stride[0] * g.out_width,
                              run_w.position_step // g.stride[1]),
            ))
            weight_index.append(flat.ravel())
            columns.append(cols.ravel())
            template_start += flat.size
    if not blocks:
        empty = np.zeros(0, np.int64)
        return blocks, empty, empty
    return blocks, np.concatenate(weight_index), np.concatenate(columns)


def _fill_values_cpu(be: _backend.Backend, g: ConvGeometry, pattern: Pattern, aux: dict[str, Any],
                     weight: np.ndarray) -> np.ndarray:
    """Structured fill: gather the small templates, then one strided block copy per block."""
    blocks, weight_index, _ = aux["fill_plan"]
    templates = weight.ravel()[weight_index]
    data = np.empty(pattern.nnz, dtype=weight.dtype)
    for block in blocks:
        channels, _, _, length = block.shape
        span = slice(block.template_start, block.template_start + channels * length)
        _block_view(data, block)[...] = templates[span].reshape(channels, 1, 1, length)
    return data


# --- GPU twins ---------------------------------------------------------------------------------
def _structural_pattern_gpu(be: _backend.Backend, g: ConvGeometry, index_dtype: Any) -> tuple[Pattern, Array]:
    cp = be.xp
    rows, cols = g.shape
    host_counts = _row_counts(g)  # analytic, tiny host work
    nnz = int(host_counts.sum())
    counts = cp.asarray(host_counts)
    dtype = choose_index_dtype(nnz, cols, index_dtype)
    indptr = cp.zeros(rows + 1, dtype=dtype)
    cp.cumsum(counts, out=indptr[1:])
    indices = cp.empty(nnz, dtype=dtype)
    widx = cp.empty(nnz, dtype=dtype)
    kernel = _kernels.function(KERNEL_FILE, "conv_jt_fill_pattern", dtype)
    _kernels.launch(kernel, rows * g.cout_per_group, g.kernel_args() + (indptr, indices, widx))
    return Pattern(indptr, indices, g.shape), widx


def _fill_values_gpu(be: _backend.Backend, g: ConvGeometry, pattern: Pattern, aux: dict[str, Any],
                     weight: Array) -> Array:
    data = be.xp.empty(pattern.nnz, dtype=weight.dtype)
    kernel = _kernels.function(KERNEL_FILE, "conv_jt_fill_values", pattern.index_dtype, weight.dtype)
    _kernels.launch(kernel, g.shape[0] * g.cout_per_group,
                    g.kernel_args() + (pattern.indptr, be.xp.ascontiguousarray(weight), data))
    return data


_structural_pattern = _backend.twin(cpu=_structural_pattern_cpu, gpu=_structural_pattern_gpu)


# --- columns and their adjoint: compiled on the host, CuPy expressions on the GPU ------------------
def _window_tuple(g: ConvGeometry) -> tuple[int, ...]:
    """The compiled kernels' geometry: ``(C, H, W, Ho, Wo, kh, kw, sh, sw, pt, pl, dh, dw)``."""
    return (g.in_channels, g.height, g.width, g.out_height, g.out_width, *g.kernel, *g.stride,
            g.pad_top, g.pad_left, *g.dilation)


def _host_pieces(count: int, values: int) -> list[tuple[int, int]]:
    """Runs of ``count`` planes or channels for a kernel writing ``values`` values: one per core from
    :data:`~sparse_scan._threads.THREAD_MIN_VALUES` (:func:`~sparse_scan._threads.workers_for`)."""
    return even_parts(count, workers_for(values))


def _im2col_cpu(be: _backend.Backend, x: np.ndarray, g: ConvGeometry, pads: tuple[int, ...]) -> np.ndarray:
    """Compiled (:func:`sparse_scan._numba_kernels.im2col`): one pass, no padded copy."""
    (kh, kw), batch = g.kernel, x.shape[0]
    columns = np.empty((g.in_channels * kh * kw, batch, g.out_height, g.out_width), dtype=x.dtype)
    launch(kernels().im2col, (np.ascontiguousarray(x), _window_tuple(g), columns),
           _host_pieces(g.in_channels, columns.size))
    return columns.reshape(g.groups, g.cin_per_group * kh * kw, batch * g.out_height * g.out_width)


def _im2col_gpu(be: _backend.Backend, x: Array, g: ConvGeometry, pads: tuple[int, ...]) -> Array:
    """CuPy: the padded input, then one strided copy per kernel offset."""
    xp = be.xp
    top, bottom, left, right = pads
    batch = x.shape[0]
    padded = xp.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    channels = (padded.reshape(batch, g.groups, g.cin_per_group, *padded.shape[2:])
                .transpose(1, 2, 0, 3, 4))
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.stride, g.dilation
    rows, cols = (g.out_height - 1) * sh + 1, (g.out_width - 1) * sw + 1
    columns = xp.empty((g.groups, g.cin_per_group, kh, kw, batch, g.out_height, g.out_width),
                       dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            columns[:, :, i, j] = channels[..., i * dh:i * dh + rows:sh, j * dw:j * dw + cols:sw]
    return columns.reshape(g.groups, g.cin_per_group * kh * kw, batch * g.out_height * g.out_width)


def _col2im_cpu(be: _backend.Backend, taps: np.ndarray, g: ConvGeometry, pads: tuple[int, ...],
                batch: int) -> np.ndarray:
    """Compiled (:func:`sparse_scan._numba_kernels.col2im`): every input plane summed in one pass,
    in the CuPy twin's order (equal bit for bit)."""
    (kh, kw) = g.kernel
    taps = np.ascontiguousarray(taps).reshape(g.in_channels * kh * kw, batch, g.out_height, g.out_width)
    out = np.empty((batch, g.in_channels, g.height, g.width), dtype=taps.dtype)
    pieces = _host_pieces(batch * g.in_channels, out.size)
    if g.out_width < COL2IM_ROWS_MIN_WIDTH:
        launch(kernels().col2im_pairs, (taps, *_col2im_pairs(_window_tuple(g), batch), out), pieces)
    else:
        launch(kernels().col2im, (taps, _window_tuple(g), out), pieces)
    return out.reshape(batch, -1)


COL2IM_ROWS_MIN_WIDTH = 8
"""Output planes at least this wide take :func:`sparse_scan._numba_kernels.col2im` (a loop per row of
taps), narrower ones :func:`~sparse_scan._numba_kernels.col2im_pairs` (one table of the plane's
(tap, input) pairs). VGG-11's 3x3 convolutions at batch 4 and 16, ns per tap and thread, rows / pairs
(2 cores, one run): 2x2 planes 8.3-9.2 / 1.7-1.9, 4x4 1.9-5.5 / 1.1-2.8, 8x8 1.2-2.5 / 1.5-2.4, 16x16
0.9-1.2 / 1.1-1.9, 32x32 0.6-0.7 / 1.8 (the pairs' gathers cost more than long rows' loop)."""


@functools.lru_cache(maxsize=64)
def _col2im_pairs(window: tuple[int, ...], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sparse_scan._numba_kernels.col2im_pairs`' table of a geometry (:func:`_window_tuple`)
    and batch: per tap ``(i, j)`` in order, the flat offsets of its outputs inside the input, from the
    plane's first tap (``sources``), and of the input elements they fall on (``targets``)."""
    _, height, width, out_height, out_width, kh, kw, sh, sw, pt, pl, dh, dw = window
    rows, cols = np.meshgrid(np.arange(out_height), np.arange(out_width), indexing="ij")
    sources, targets = [], []
    for i in range(kh):
        for j in range(kw):
            in_rows, in_cols = rows * sh - pt + i * dh, cols * sw - pl + j * dw
            inside = (in_rows >= 0) & (in_rows < height) & (in_cols >= 0) & (in_cols < width)
            sources.append((i * kw + j) * batch * out_height * out_width + (rows * out_width + cols)[inside])
            targets.append((in_rows * width + in_cols)[inside])
    table = np.concatenate(sources), np.concatenate(targets)
    for array in table:
        array.flags.writeable = False
    return table


def _col2im_gpu(be: _backend.Backend, taps: Array, g: ConvGeometry, pads: tuple[int, ...],
                batch: int) -> Array:
    """CuPy: the taps added into the padded input at their strided positions, offset by offset; then
    the padding is cropped."""
    xp = be.xp
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.stride, g.dilation
    taps = taps.reshape(g.groups, g.cin_per_group, kh, kw, batch, g.out_height, g.out_width)
    top, bottom, left, right = pads
    padded = xp.zeros((batch, g.groups, g.cin_per_group, g.height + top + bottom,
                       g.width + left + right), dtype=taps.dtype)
    rows, cols = (g.out_height - 1) * sh + 1, (g.out_width - 1) * sw + 1
    for i in range(kh):
        for j in range(kw):
            padded[..., i * dh:i * dh + rows:sh, j * dw:j * dw + cols:sw] += (
                taps[:, :, i, j].transpose(2, 0, 1, 3, 4))
    return padded[..., top:top + g.height, left:left + g.width].reshape(batch, -1)


_im2col = _backend.twin(cpu=_im2col_cpu, gpu=_im2col_gpu)
_col2im = _backend.twin(cpu=_col2im_cpu, gpu=_col2im_gpu)
# SciPy's CSR weights multiply on the host; the GPU multiplies the dense weights
_host_sparse_weights = _backend.twin(cpu=lambda be, conv, transposed: conv._sparse_weights(transposed),
                                     gpu=lambda be, conv, transposed: None)
_fill_values = _backend.twin(cpu=_fill_values_cpu, gpu=_fill_values_gpu)
# The GPU kernel computes every entry from the geometry: it needs no fill plan.
_fill_plan = _backend.twin(cpu=_fill_plan_cpu, gpu=lambda be, g, indptr: None)


def _weights_as_csr(weights: np.ndarray, offset: int, row_stride: int, column_stride: int,
                    dtype: Any) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """A CSR matrix of ``dtype`` over the non-zeros of ``weights`` (a 2-D view of a layer's weights, or
    of its pattern mask; the values are refilled at every use) and the flat weight position of each
    stored value: ``offset + row * row_stride + column * column_stride``."""
    matrix = scipy.sparse.csr_matrix(weights != 0, dtype=dtype)
    rows = np.repeat(np.arange(weights.shape[0]), np.diff(matrix.indptr))
    positions = (offset + rows * row_stride + matrix.indices * column_stride).astype(np.intp)
    return matrix, positions


def _transposed_weights_csr(groups: np.ndarray, dtype: Any) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """``W^T`` of every group as one CSR matrix, rows ``(ci, kh, kw)`` (global input channel), columns
    ``co`` (global output channel; block-diagonal over the groups), with the weights' flat position of
    each stored value (:func:`_weights_as_csr`). ``groups``: the weights as ``(groups, cout / groups,
    taps)``."""
    count, cout, taps = groups.shape
    parts = [_weights_as_csr(group.T, index * group.size, 1, taps, dtype)
             for index, group in enumerate(groups)]
    nnz = np.cumsum([0] + [matrix.nnz for matrix, _ in parts])
    indptr = np.concatenate([[0]] + [matrix.indptr[1:] + offset
                                     for (matrix, _), offset in zip(parts, nnz[:-1], strict=True)])
    indices = np.concatenate([matrix.indices + index * cout for index, (matrix, _) in enumerate(parts)])
    data = np.concatenate([matrix.data for matrix, _ in parts])
    dtype = choose_index_dtype(int(nnz[-1]), count * cout, None)
    matrix = scipy.sparse.csr_matrix((data, indices.astype(dtype), indptr.astype(dtype)),
                                     shape=(count * taps, count * cout), copy=False)
    return matrix, np.concatenate([positions for _, positions in parts])


DIRECT_MIN_WIDTH = 32
"""Output rows at least this wide take :func:`sparse_scan._numba_conv.transposed_conv` (per output row),
narrower ones :func:`~sparse_scan._numba_conv.transposed_conv_taps` (per whole plane). Measured on the
pruned VGG-11 at batch 16: conv1 (32 wide) 0.42 ms against 0.75, conv2 (16 wide) 5.2 against 1.7."""


def _pruned_transposed_convolution(g: ConvGeometry, weights: scipy.sparse.csr_matrix,
                                   grad_out: np.ndarray) -> np.ndarray:
    """``JT @ grad_out`` (``(B, out size) -> (B, in size)``) through pruned weights ``W^T``
    (:func:`_transposed_weights_csr`): :mod:`sparse_scan._numba_conv`'s kernels, runs of input channels
    of about equal non-zeros on the kernel pool's threads."""
    batch = grad_out.shape[0]
    dtype = np.result_type(weights.dtype, grad_out.dtype)
    data = weights.data.astype(dtype, copy=False)
    grad = np.ascontiguousarray(grad_out, dtype=dtype).reshape(batch, -1)
    module = conv_kernels()
    out_plane = g.out_height * g.out_width
    taps = g.out_width < DIRECT_MIN_WIDTH
    if taps and batch > 1:  # channel-major: each output plane of every sample one run
        grad = np.ascontiguousarray(grad.reshape(batch, g.out_channels, out_plane).transpose(1, 0, 2))
    out = np.empty((batch, g.in_channels, g.height * g.width), dtype=dtype)
    geometry = (g.in_channels, g.height, g.width, g.out_channels, g.out_height, g.out_width, *g.kernel,
                *g.stride, g.pad_top, g.pad_left, *g.dilation, batch)
    work = weights.nnz * out_plane * batch
    workers = workers_for(work)
    per_channel = weights.indptr[::g.kernel[0] * g.kernel[1]]
    cuts = np.searchsorted(per_channel, np.arange(1, workers) * (weights.nnz / workers))
    bounds = [0, *(int(c) for c in cuts), g.in_channels]
    pieces = [(first, last) for first, last in zip(bounds[:-1], bounds[1:], strict=True) if last > first]
    common = (weights.indptr, weights.indices, data, grad.reshape(-1), geometry)
    launch(module.transposed_conv_taps if taps else module.transposed_conv, (*common, out), pieces)
    return out.reshape(batch, -1)


def _grouped_product(matrices: list[scipy.sparse.csr_matrix], blocks: np.ndarray) -> np.ndarray:
    """``matrices[g] @ blocks[g]`` stacked over the groups (one group: no stacking copy)."""
    if len(matrices) == 1:
        return np.asarray(matrices[0] @ blocks[0])[None]
    return np.stack([matrix @ block for matrix, block in zip(matrices, blocks, strict=True)])
