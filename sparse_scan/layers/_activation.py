"""Elementwise activations: ReLU, LeakyReLU, Tanh, Sigmoid, GELU, SiLU, ELU, Hardtanh, Softplus,
Hardswish, Hardsigmoid, Mish, Identity, and Affine (a constant scaling and shift, ``x * 2.0`` or ``x + 1``
in a module's forward).

Their transposed Jacobian is diagonal (``jacobian_kind = "diagonal"``): the pattern is the identity's,
and the values are the elementwise derivative, input-dependent zeros (ReLU's off units) kept explicit.
The values fill is an elementwise array expression, identical on NumPy and CuPy (GELU's ``erf`` comes
from SciPy or CuPy's ``cupyx.scipy.special``, dispatched by :func:`~sparse_scan.backend.twin`).
Derivatives at kinks follow PyTorch's backward (ELU takes its ``x <= 0`` branch at 0, Hardtanh's
gradient is 0 at its bounds, Softplus is linear above its threshold, Hardswish's is 0 at -3 and 1 at 3,
Hardsigmoid's 0 at both).

IEEE values are PyTorch's (``tests/test_ieee.py``): a branch is chosen by PyTorch's comparison, so a NaN
input takes the branch whose test it fails (ReLU's derivative at NaN is 1: PyTorch's backward is
``x <= 0 ? 0 : grad``), a forward never multiplies an infinity by a zero mask (ReLU(-inf) is 0, not
``-inf * 0``), and formulas that PyTorch multiplies out (GELU and SiLU at -inf: ``-inf * 0``, NaN) are
multiplied out here too. Where PyTorch's answer depends on which of its loops reaches an element (the
vectorised body or the scalar tail), the layer's docstring says which it takes: ELU's, Hardtanh's and
Hardswish's derivative at NaN (NaN, 0, NaN: the body's), float32 GELU(inf) (inf: the tail's, and
float64's).

JT's values are derivatives, and ``JT @ g`` multiplies them by the gradient, so a zero derivative times
an infinite or NaN gradient is NaN (a product of matrices) where PyTorch's backward of ReLU and
Hardtanh chooses 0 (a ``where``); with a finite gradient they agree.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._checks import number
from .._host_kernels import launch
from .._threads import even_parts, workers_for
from .._types import Array
from ..csr import Pattern
from ._base import Layer, Shape, diagonal_pattern
from ._kernels import relu_backward, relu_forward

__all__ = ["ELU", "GELU", "Affine", "Hardsigmoid", "Hardswish", "Hardtanh", "Identity", "LeakyReLU", "Mish",
           "ReLU", "SiLU", "Sigmoid", "Softplus", "Tanh"]


def _sigmoid(x: Array) -> Array:
    """The logistic function without overflow warnings (exp of a non-positive argument only)."""
    xp = _backend.of(x).xp
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


class _Elementwise(Layer):
    jacobian_kind = "diagonal"

    def forward(self, x: Array) -> Array:
        return self._apply(self._check_input(x))

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        return diagonal_pattern(be, int(np.prod(in_shape)), index_dtype), {}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return self._derivative(x.reshape(x.shape[0], -1))

    def _apply(self, x: Array) -> Array:
        raise NotImplementedError

    def _derivative(self, x: Array) -> Array:
        """``d f(x) / dx`` elementwise, in ``x``'s dtype and array module."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReLU(_Elementwise):
    """``max(x, 0)``; derivative 0 where ``x <= 0``, else 1 (PyTorch's convention at 0).

    PyTorch's IEEE values: the forward is ``0 if x < 0 else x`` (ReLU(-inf) is 0, ReLU(-0.0) is -0.0,
    ReLU(NaN) is NaN), and the derivative at NaN is 1 (its backward passes the gradient wherever
    ``x <= 0`` is false).
    """

    def _apply(self, x: Array) -> Array:
        return _relu(_backend.of(x), x)

    def _derivative(self, x: Array) -> Array:
        return (~(x <= 0)).astype(x.dtype)

    def input_matvec(self, x: Array) -> Callable[[Array], Array] | None:
        """``g -> g * JT's diagonal`` in one compiled pass on the host (:func:`_relu_matvec`), without
        the values; None on the GPU."""
        x = self._check_input(x)
        return _relu_operator(_backend.of(x), x)


def _relu_host(be: _backend.Backend, x: np.ndarray) -> np.ndarray:
    """``0 if x < 0 else x`` in one compiled pass (:func:`sparse_scan.layers._kernels.relu_forward`;
    runs of positions per core from :data:`~sparse_scan._threads.THREAD_MIN_VALUES` values)."""
    source = np.ascontiguousarray(x)
    out = np.empty(source.shape, dtype=source.dtype)
    launch(relu_forward, (source.reshape(-1), out.reshape(-1)), even_parts(out.size, workers_for(out.size)))
    return out


_relu = _backend.twin(cpu=_relu_host, gpu=lambda be, x: be.xp.where(x < 0, x.dtype.type(0), x))


def _relu_matvec(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``grad * (0 if x <= 0 else 1)`` for flat ``(B, n)`` batches, in their result dtype
    (:func:`sparse_scan.layers._kernels.relu_backward`; runs of positions per core from
    :data:`~sparse_scan._threads.THREAD_MIN_VALUES` values)."""
    if grad.shape != x.shape:  # the kernel reads without bounds checks
        raise ValueError(f"ReLU's JT @ g: expected gradients of shape {x.shape}, got {grad.shape}")
    out = np.empty(x.shape, dtype=np.result_type(x, grad))
    size = out.size
    pieces = even_parts(size, workers_for(size))
    launch(relu_backward,
           (x.reshape(-1), np.ascontiguousarray(grad).reshape(-1), out.reshape(-1)), pieces)
    return out


_relu_operator = _backend.twin(
    cpu=lambda be, x: functools.partial(_relu_matvec, np.ascontiguousarray(x).reshape(x.shape[0], -1)),
    gpu=lambda be, x: None)


class LeakyReLU(_Elementwise):
    """``x`` where ``x > 0``, ``negative_slope * x`` elsewhere.

    Parameters
    ----------
    negative_slope : float
        Slope for ``x <= 0`` (PyTorch's default 0.01).
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.negative_slope = number(negative_slope, f"layer {self.label}: negative_slope")

    def _apply(self, x: Array) -> Array:
        return x * self._derivative(x)

    def _derivative(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        return xp.where(x > 0, x.dtype.type(1), x.dtype.type(self.negative_slope))

    def __repr__(self) -> str:
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class Tanh(_Elementwise):
    """``tanh(x)``; derivative ``1 - tanh(x)**2``."""

    def _apply(self, x: Array) -> Array:
        return _backend.of(x).xp.tanh(x)

    def _derivative(self, x: Array) -> Array:
        y = self._apply(x)
        return 1 - y * y


class Sigmoid(_Elementwise):
    """``1 / (1 + exp(-x))``; derivative ``s (1 - s)``."""

    def _apply(self, x: Array) -> Array:
        return _sigmoid(x)

    def _derivative(self, x: Array) -> Array:
        s = self._apply(x)
        return s * (1 - s)


def _erf_cpu(be: _backend.Backend, x: Array) -> Array:
    import scipy.special  # noqa: PLC0415 - SciPy is imported only where it is needed

    return scipy.special.erf(x)


def _erf_gpu(be: _backend.Backend, x: Array) -> Array:
    import cupyx.scipy.special  # noqa: PLC0415 - GPU code only

    return cupyx.scipy.special.erf(x)


_erf = _backend.twin(cpu=_erf_cpu, gpu=_erf_gpu)


class Identity(_Elementwise):
    """``x``; its transposed Jacobian is the identity (PyTorch's ``nn.Identity``)."""

    def _apply(self, x: Array) -> Array:
        return x

    def _derivative(self, x: Array) -> Array:
        return _backend.of(x).xp.ones_like(x)


class SiLU(_Elementwise):
    """``x * sigmoid(x)``; derivative ``s (1 + x (1 - s))``."""

    def _apply(self, x: Array) -> Array:
        return x * _sigmoid(x)

    def _derivative(self, x: Array) -> Array:
        s = _sigmoid(x)
        return s * (1 + x * (1 - s))


class GELU(_Elementwise):
    """``x * Phi(x)`` with the normal CDF ``Phi`` (``approximate="none"``), or PyTorch's tanh
    approximation ``x / 2 * (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (``approximate="tanh"``).

    GELU(inf) is inf, GELU(-inf) NaN (``-inf * 0``) and the derivative at both NaN, as PyTorch computes
    them in float64 (in float32 its vectorised ``erf`` makes GELU(inf) NaN but for a tensor's last few
    elements).

    Parameters
    ----------
    approximate : {"none", "tanh"}
    """

    _K = float(np.sqrt(2.0 / np.pi))

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"layer {self.label}: approximate: must be 'none' or 'tanh', "
                             f"got {approximate!r}")
        self.approximate = approximate

    def _apply(self, x: Array) -> Array:
        if self.approximate == "tanh":
            xp = _backend.of(x).xp
            return x * (1 + xp.tanh(self._K * (x + 0.044715 * x * x * x))) / 2
        return x * self._cdf(x)

    def _cdf(self, x: Array) -> Array:
        return ((1 + _erf(_backend.of(x), x / np.sqrt(2.0))) / 2).astype(x.dtype, copy=False)

    def _derivative(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        if self.approximate == "tanh":
            inner = self._K * (x + 0.044715 * x * x * x)
            t = xp.tanh(inner)
            return ((1 + t) / 2 + x * (1 - t * t) * self._K * (1 + 3 * 0.044715 * x * x) / 2).astype(
                x.dtype, copy=False)
        density = xp.exp(-x * x / 2) / np.sqrt(2 * np.pi)
        return (self._cdf(x) + x * density).astype(x.dtype, copy=False)

    def __repr__(self) -> str:
        return f"GELU(approximate={self.approximate!r})"


class ELU(_Elementwise):
    """``x`` where ``x > 0``, ``alpha (exp(x) - 1)`` elsewhere; derivative 1, or ``alpha exp(x)`` for
    ``x <= 0``. At NaN the derivative is NaN (PyTorch's vectorised loop; its scalar loop, a tensor's
    last few elements, gives 1).

    Parameters
    ----------
    alpha : float
        PyTorch's default 1.0.
    """

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = number(alpha, f"layer {self.label}: alpha")

    def _apply(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        return xp.where(x > 0, x, self.alpha * xp.expm1(self._negative_part(x))).astype(x.dtype, copy=False)

    def _derivative(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        return xp.where(x > 0, x.dtype.type(1), self.alpha * xp.exp(self._negative_part(x))).astype(
            x.dtype, copy=False)

    @staticmethod
    def _negative_part(x: Array) -> Array:
        """``x`` where ``x <= 0``, +0 elsewhere (no overflow in ``exp`` where its branch is not taken),
        ``-0.0`` kept (ELU(-0.0) is -0.0): ``min(x, 0)`` with ``x``'s sign."""
        xp = _backend.of(x).xp
        return xp.copysign(xp.minimum(x, x.dtype.type(0)), x)

    def __repr__(self) -> str:
        return f"ELU(alpha={self.alpha})"


class Hardtanh(_Elementwise):
    """``x`` clipped to ``[min_val, max_val]``; derivative 1 strictly inside, 0 elsewhere and at NaN
    (PyTorch's vectorised loop; its scalar loop, a tensor's last few elements, gives 1).

    Parameters
    ----------
    min_val, max_val : float
        PyTorch's defaults -1 and 1; ``min_val < max_val``.
    """

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0) -> None:
        super().__init__()
        self.min_val = number(min_val, f"layer {self.label}: min_val")
        self.max_val = number(max_val, f"layer {self.label}: max_val")
        if not self.min_val < self.max_val:
            raise ValueError(f"layer {self.label}: min_val ({self.min_val}) must be below max_val "
                             f"({self.max_val})")

    def _apply(self, x: Array) -> Array:
        return _backend.of(x).xp.clip(x, self.min_val, self.max_val).astype(x.dtype, copy=False)

    def _derivative(self, x: Array) -> Array:
        return ((x > self.min_val) & (x < self.max_val)).astype(x.dtype)

    def __repr__(self) -> str:
        return f"Hardtanh(min_val={self.min_val}, max_val={self.max_val})"


class Softplus(_Elementwise):
    """``log(1 + exp(beta x)) / beta``, and ``x`` where ``beta x > threshold``; derivative
    ``sigmoid(beta x)``, or 1 above the threshold.

    Parameters
    ----------
    beta : float
        PyTorch's default 1.0 (positive).
    threshold : float
        PyTorch's default 20.0.
    """

    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        super().__init__()
        self.beta = number(beta, f"layer {self.label}: beta", minimum=0.0, inclusive=False)
        self.threshold = number(threshold, f"layer {self.label}: threshold")

    def _apply(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        scaled = self.beta * x
        soft = xp.logaddexp(0, scaled) / self.beta
        return xp.where(scaled > self.threshold, x, soft).astype(x.dtype, copy=False)

    def _derivative(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        scaled = self.beta * x
        slope = xp.where(scaled > self.threshold, x.dtype.type(1), _sigmoid(scaled))
        return slope.astype(x.dtype, copy=False)

    def __repr__(self) -> str:
        return f"Softplus(beta={self.beta}, threshold={self.threshold})"


def _hard_gate(x: Array) -> Array:
    """``min(max(x + 3, 0), 6)``, NaN kept (PyTorch's ``hardsigmoid`` and ``hardswish`` before their
    division by 6)."""
    xp = _backend.of(x).xp
    return xp.minimum(xp.maximum(x + x.dtype.type(3), x.dtype.type(0)), x.dtype.type(6))


class Hardswish(_Elementwise):
    """``x * min(max(x + 3, 0), 6) / 6`` (PyTorch's ``nn.Hardswish``, MobileNetV3's); derivative 0 for
    ``x <= -3``, 1 for ``x >= 3``, ``x / 3 + 1/2`` between: PyTorch's sides of the kinks.

    PyTorch's IEEE values: Hardswish(-inf) is NaN (``-inf * 0``), Hardswish(-5) is -0.0; the derivative
    at NaN is NaN (PyTorch's vectorised loop; its scalar loop, a tensor's last few elements, gives 1).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[-4.0, -3.0, -1.5, 0.0, 3.0]])
    >>> Hardswish().forward(x)
    array([[-0.   , -0.   , -0.375,  0.   ,  3.   ]])
    >>> Hardswish().transposed_jacobian(x).data
    array([[0. , 0. , 0. , 0.5, 1. ]])
    """

    def _apply(self, x: Array) -> Array:
        return x * _hard_gate(x) / x.dtype.type(6)

    def _derivative(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        middle = x / x.dtype.type(3) + x.dtype.type(0.5)
        return xp.where(x <= -3, x.dtype.type(0), xp.where(x >= 3, x.dtype.type(1), middle))


_ONE_SIXTH = np.float32(1) / np.float32(6)
"""PyTorch's Hardsigmoid slope, a float32 constant whatever the dtype."""


class Hardsigmoid(_Elementwise):
    """``min(max(x + 3, 0), 6) / 6`` (PyTorch's ``nn.Hardsigmoid``); derivative 1/6 strictly between -3
    and 3, 0 elsewhere, at the kinks and at NaN (PyTorch's). The 1/6 is PyTorch's float32 constant in
    both dtypes (its float64 backward multiplies by ``1.0f / 6.0f`` too: 0.1666666716...).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[-3.0, 0.0, 1.5, 3.0]])
    >>> Hardsigmoid().forward(x)
    array([[0.  , 0.5 , 0.75, 1.  ]])
    >>> Hardsigmoid().transposed_jacobian(x).data.round(4)
    array([[0.    , 0.1667, 0.1667, 0.    ]])
    """

    def _apply(self, x: Array) -> Array:
        return _hard_gate(x) / x.dtype.type(6)

    def _derivative(self, x: Array) -> Array:
        xp = _backend.of(x).xp
        return xp.where((x > -3) & (x < 3), x.dtype.type(_ONE_SIXTH), x.dtype.type(0))


class Mish(_Elementwise):
    """``x * tanh(softplus(x))`` (PyTorch's ``nn.Mish``, softplus without a threshold); derivative
    ``t + x s (1 - t^2)`` with ``t = tanh(softplus(x))`` and ``s = sigmoid(x)``, PyTorch's formula.

    PyTorch's IEEE values: Mish(-inf) is NaN (``-inf * 0``), and the derivative is NaN at both infinities
    (``inf * 0`` in the formula); ``softplus`` is ``logaddexp(0, x)`` here (no overflow warning where
    PyTorch's ``log1p(exp(x))`` overflows to the same infinity).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[-1.0, 0.0, 2.0]])
    >>> Mish().forward(x).round(4)
    array([[-0.3034,  0.    ,  1.944 ]])
    >>> Mish().transposed_jacobian(x).data.round(4)
    array([[0.0592, 0.6   , 1.0693]])
    """

    def _apply(self, x: Array) -> Array:
        return x * self._tanh_softplus(x)

    @staticmethod
    def _tanh_softplus(x: Array) -> Array:
        xp = _backend.of(x).xp
        return xp.tanh(xp.logaddexp(x.dtype.type(0), x)).astype(x.dtype, copy=False)

    def _derivative(self, x: Array) -> Array:
        t = self._tanh_softplus(x)
        return t + x * _sigmoid(x) * (1 - t * t)


class Affine(_Elementwise):
    """``x * scale + shift`` with constants: what ``x * 2.0``, ``x / 4``, ``x + 1``, ``1 - x`` or ``-x``
    compute in a module's forward. The transposed Jacobian is ``scale`` times the identity, the same
    for every sample.

    Parameters
    ----------
    scale, shift : float
        Finite numbers; with ``scale == 1`` the forward only adds ``shift``, with ``shift == 0`` it only
        multiplies (PyTorch's rounding for ``x + c`` and ``x * c``).

    Examples
    --------
    >>> import numpy as np
    >>> Affine(scale=-1.0, shift=1.0).forward(np.array([[0.25, 2.0]]))
    array([[ 0.75, -1.  ]])
    >>> Affine(scale=2.0).transposed_jacobian(np.zeros((3, 2))).data
    array([2., 2.])
    """

    sample_independent = True

    def __init__(self, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__()
        self.scale = number(scale, f"layer {self.label}: scale")
        self.shift = number(shift, f"layer {self.label}: shift")

    def _apply(self, x: Array) -> Array:
        out = x if self.scale == 1 else x * x.dtype.type(self.scale)
        return out if self.shift == 0 else out + x.dtype.type(self.shift)

    def _derivative(self, x: Array) -> Array:
        return _backend.of(x).xp.full(x.shape, self.scale, dtype=x.dtype)

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        return be.xp.full(pattern.nnz, self.scale, dtype=x.dtype)

    def __repr__(self) -> str:
        return f"Affine(scale={self.scale}, shift={self.shift})"
