"""2-D convolution with an analytic CSR transposed Jacobian, general in every PyTorch argument.

:class:`Conv2d` is the layer: its arguments, shapes, forward, parameter gradients and the choice of how
``JT @ g`` runs. Its JT (one weight per entry, shared by the batch) is built by
:mod:`~sparse_scan.layers._conv_jt`; the forward is one GEMM per group over the batch's columns
(im2col, :mod:`~sparse_scan.layers._conv_columns`), and so are ``JT @ g`` through the weights (the
transposed convolution, :meth:`Conv2d.weights_matvec`) and the weight gradient. Pruned weights
(``prune_pattern=True``) skip the pruned multiply-adds in all three
(:mod:`~sparse_scan.layers._conv_pruned`): a direct sparse convolution forward, a compiled transposed
convolution over their non-zeros, and a sampled weight gradient at the kept weights.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._checks import flag, integer
from .._types import Array, RngLike
from ..csr import Pattern
from ..engine.plan import WeightsPath
from ._base import Shape
from ._conv_columns import col2im, im2col
from ._conv_jt import fill_plan, fill_values, inside_taps, structural_pattern
from ._conv_pruned import (
    CSR_PATH_MAX_PADDED_SHARE,
    DIRECT_MAX_DENSITY,
    TRANSPOSED_MAX_DENSITY,
    direct_forward,
    pruned_transposed_convolution,
)
from ._geometry import ConvGeometry, IntPair, output_size, pair, window_extent
from ._weighted import WeightedLayer, bias_gradient

__all__ = ["Conv2d"]


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
        pruned = self._direct_pruned()
        if pruned is not None:
            out = direct_forward(be, g, pruned, self._kept_values(be, pruned), x, self.bias)
            if out is not None:
                return out
        columns = self._columns(x, g)
        batch = x.shape[0]
        weight = xp.asarray(self.weight).reshape(g.groups, g.cout_per_group, columns.shape[1])
        out = xp.matmul(weight, columns).reshape(g.out_channels, batch, g.out_height, g.out_width)
        if self.bias is not None:
            out += xp.asarray(self.bias, dtype=out.dtype)[:, None, None, None]
        return xp.ascontiguousarray(out.transpose(1, 0, 2, 3))

    def _weight_groups(self) -> int:
        return self.groups

    def _direct_max_density(self) -> float:
        return DIRECT_MAX_DENSITY

    def _transposed_weights(self) -> Any:
        """The pruned weights ``W^T`` as CSR for the compiled transposed convolution on the host
        (:meth:`~sparse_scan.layers._conv_pruned.PrunedWeights.transposed`), or None where they are
        not pruned or keep over :data:`~sparse_scan.layers._conv_pruned.TRANSPOSED_MAX_DENSITY`."""
        pruned = self.pruned_weights()
        if pruned is None or pruned.density > TRANSPOSED_MAX_DENSITY:
            return None
        return pruned.transposed(np.asarray(self._kept_source()), self._version)

    def _columns(self, x: Array, g: ConvGeometry) -> Array:
        """``(groups, taps, B * out pixels)``: the input element each kernel tap of each output reads
        (``taps = in_channels / groups * kh * kw``, zeros in the padding), the batch folded into the
        columns so that one GEMM per group reads the weights once for every sample."""
        return im2col(_backend.of(x), x, g, self._pads)

    def pattern_nnz(self, in_shape: Shape) -> int:
        """Counted from the geometry: each weight (non-zero ones only when pruned) is stored once per
        output pixel whose tap for it falls inside the input."""
        g = self.geometry(in_shape)
        rows = inside_taps(g.height, g.out_height, g.kernel[0], g.stride[0], g.pad_top, g.dilation[0])
        cols = inside_taps(g.width, g.out_width, g.kernel[1], g.stride[1], g.pad_left, g.dilation[1])
        inside = np.outer(rows, cols)
        if self.prune_pattern:
            self._structure_key()  # a non-finite weight cannot define a pruned pattern
            weights = self.pruned_weights().per_tap
        else:
            weights = np.full(g.kernel, g.out_channels * g.cin_per_group)
        return int((weights * inside).sum())

    # --- JT @ g through the weights -----------------------------------------------------------
    def weights_path(self, in_shape: Shape) -> WeightsPath:
        """The transposed convolution: one GEMM of every weight with every output pixel per sample,
        or CSR weights where they are heavily pruned (at most
        :data:`~sparse_scan.layers._conv_pruned.TRANSPOSED_MAX_DENSITY` kept) and the compiled kernel's
        taps are not mostly padding
        (:data:`~sparse_scan.layers._conv_pruned.CSR_PATH_MAX_PADDED_SHARE`)."""
        g = self.geometry(in_shape)
        plane = g.out_height * g.out_width
        multiply_adds = g.out_channels * g.cin_per_group * g.kernel[0] * g.kernel[1] * plane
        pruned = self.pruned_weights()
        csr = bool(pruned is not None and pruned.density <= TRANSPOSED_MAX_DENSITY
                   and pruned.nnz * plane <= CSR_PATH_MAX_PADDED_SHARE * self.pattern_nnz(in_shape))
        return WeightsPath(multiply_adds, csr=csr,
                           weights=g.out_channels * g.cin_per_group * g.kernel[0] * g.kernel[1],
                           taps=0 if csr else multiply_adds // g.cout_per_group)

    def weights_matvec(self, in_shape: Shape, device: str = "cpu") -> Callable[[Array], Array]:
        """``JT @ g`` for a batch ``g`` of ``(B, out_size)``: the transposed convolution.

        One GEMM per group over all samples, ``W_g^T (taps, cout) @ g (cout, B * pixels)``, gives
        every tap's contribution; they are added into the padded input at their strided positions
        (the adjoint of :meth:`_columns`) and the padding is cropped. Heavily pruned weights
        (:meth:`_transposed_weights`) skip both on the CPU: a compiled direct transposed convolution
        over their non-zeros (:func:`pruned_transposed_convolution`).
        """
        g = self.geometry(in_shape)
        be = _backend.get(device)
        sparse = self._transposed_weights() if be.name == "cpu" else None
        if sparse is not None:
            return functools.partial(pruned_transposed_convolution, g, sparse)
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
        return col2im(be, taps_of(grad), g, self._pads, batch)

    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """``weight`` and ``bias`` gradients (paper Eq. 2), summed over the batch like PyTorch.

        ``dW[g] = sum_b grad_out[b, g] @ columns[b, g]^T``: one GEMM per group over all samples; pruned
        weights: the kept weights' alone, a sampled product (:attr:`sampled_gradient`).
        """
        x = self._check_input(x)
        g = self.geometry(x.shape[1:])
        be = _backend.of(x)
        batch, pixels = x.shape[0], g.out_height * g.out_width
        grad = be.asarray(grad_out).reshape(batch, g.groups, g.cout_per_group, pixels)

        def dense() -> Array:  # (groups, cout, B * pixels) @ (groups, B * pixels, taps)
            columns = self._columns(x, g)
            left = grad.transpose(1, 2, 0, 3).reshape(g.groups, g.cout_per_group, batch * pixels)
            return be.xp.matmul(left, columns.transpose(0, 2, 1)).reshape(self._weight_shape)

        grads = {"weight": self._weight_gradient(
            be, g, x, grad.reshape(batch, g.out_channels, g.out_height, g.out_width), dense)}
        if self.bias is not None:
            grads["bias"] = bias_gradient(be, grad.reshape(batch, g.out_channels, pixels))
        return grads

    # --- pattern -------------------------------------------------------------------------------
    def _structural_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, Array]:
        g = self.geometry(in_shape)
        return structural_pattern(be, g, index_dtype)

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        pattern, aux = super()._build_pattern(be, in_shape, index_dtype)
        aux["geometry"] = self.geometry(in_shape)
        if not aux["pruned"]:
            aux["fill_plan"] = fill_plan(be, aux["geometry"], pattern.indptr)
        return pattern, aux

    # --- values --------------------------------------------------------------------------------
    def _structured_values(self, be: _backend.Backend, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return fill_values(be, aux["geometry"], pattern, aux, be.asarray(self.weight))

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
