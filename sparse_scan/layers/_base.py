"""The layer protocol shared by every operator: forward, pattern (cached), transposed Jacobian."""

from __future__ import annotations

from typing import Any, Callable, Hashable

import numpy as np

from .. import backend as _backend
from .._checks import flag
from .._types import Array
from ..csr import BatchedCSR, Pattern, choose_index_dtype
from ..engine.plan import WeightsPath

Shape = tuple[int, ...]
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Layer:
    """Base class of the layers in :mod:`sparse_scan.layers`.

    A layer maps a batch ``x`` of shape ``(B, *in_shape)`` to ``(B, *out_shape)``. Its transposed
    Jacobian per sample is a CSR matrix of shape ``(prod(in_shape), prod(out_shape))`` whose pattern
    depends only on the architecture and ``in_shape`` (computed once and cached) and whose values are
    recomputed per batch.

    Attributes
    ----------
    name : str or None
        Used in error messages (set by model builders; defaults to the class name).
    jacobian_kind : {"general", "diagonal", "selection"}
        ``"diagonal"``: JT is diagonal (a product with it is a scaling); ``"selection"``: JT holds at
        most one non-zero per column (output) per sample, chosen by the input (a product with it is
        a gather over those entries, :mod:`sparse_scan.engine._selection`); ``"general"``
        otherwise. The scan planner uses this to avoid general SpGEMMs.
    sample_independent : bool
        Whether JT's values are the same for every sample (then ``data`` has shape ``(nnz,)``).
    training : bool
        PyTorch's mode flag; a layer starts in training mode. Only layers whose forward depends on it
        read it (:class:`Dropout` masks, :class:`BatchNorm2d` refuses batch statistics). Setting it
        sets this layer's only; :meth:`train` and :meth:`eval` also set the layers it holds.
    """

    jacobian_kind: str = "general"
    sample_independent: bool = False
    scoped: bool = True
    """Whether the layers this one holds are named under its name, as PyTorch names a module's
    children (``"block.conv1"``); False for a :class:`Block` written inline in a module's forward,
    whose layers are named in the scope that holds the block (:func:`sparse_scan.weights.scoped_name`)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._patterns: dict[Hashable, tuple[Pattern, dict[str, Any]]] = {}
        self._valid_inputs: set[Hashable] = set()  # (type, dtype, shape) of inputs that passed the checks
        self._training = True

    # --- mode (PyTorch's train/eval) -------------------------------------------------------------
    @property
    def training(self) -> bool:
        """PyTorch's mode flag: True in training mode, False in eval mode."""
        return self._training

    @training.setter
    def training(self, mode: bool) -> None:
        self._training = flag(mode, f"layer {self.label}: training")
        self._mode_set()

    def _mode_set(self) -> None:
        """What a layer forgets when its mode is set (a hook: :class:`Dropout` drops its last mask)."""

    def named_children(self) -> list[tuple[str, "Layer"]]:
        """``(name, layer)`` of the layers this one holds (none; blocks override)."""
        return []

    def train(self, mode: bool = True) -> "Layer":
        """Set training mode (``mode=True``) or eval mode here and in every layer held, like PyTorch's
        ``module.train(mode)``; return self."""
        self.training = mode
        for _, child in self.named_children():
            child.train(mode)
        return self

    def eval(self) -> "Layer":
        """Eval mode here and in every layer held (PyTorch's ``module.eval()``); return self."""
        return self.train(False)

    # --- identification and errors -------------------------------------------------------------
    @property
    def label(self) -> str:
        """How error messages name this layer."""
        return f"{self.name!r} ({type(self).__name__})" if self.name else type(self).__name__

    def _error(self, field: str, message: str) -> ValueError:
        return ValueError(f"layer {self.label}: {field}: {message}")

    # --- shapes --------------------------------------------------------------------------------
    def output_shape(self, in_shape: Shape) -> Shape:
        """Per-sample output shape for a per-sample input shape (no batch axis)."""
        return tuple(in_shape)

    def check_in_shape(self, in_shape: Shape) -> Shape:
        """Validate a per-sample input shape and return it as a tuple of ints."""
        return tuple(int(s) for s in in_shape)

    def _sizes(self, in_shape: Shape) -> Shape:
        """``in_shape`` as positive ints (a zero or negative size is an error naming the layer)."""
        shape = tuple(int(s) for s in in_shape)
        if any(s < 1 for s in shape):
            raise self._error("input", f"per-sample sizes must be positive, got {list(shape)}")
        return shape

    def _check_input(self, x: Array) -> Array:
        """Validate a batched input: array, floating dtype, a non-empty batch axis first, known shape.

        The verdict depends only on the input's type, dtype and shape, so an input like one already
        accepted costs a set lookup: the engine calls this per layer on every backward."""
        signature = (type(x), getattr(x, "dtype", None), getattr(x, "shape", None))
        if signature in self._valid_inputs:
            return x
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise self._error("input", f"expected an ndarray, got {type(x).__name__}")
        if np.dtype(x.dtype) not in FLOAT_DTYPES:
            raise self._error("input", f"dtype must be float32 or float64, got {x.dtype}")
        if x.ndim < 1 or x.shape[0] < 1:
            raise self._error("input", f"expected a batch of at least one sample first, got shape {x.shape}")
        self.check_in_shape(self._sizes(x.shape[1:]))
        self._valid_inputs.add(signature)
        return x

    # --- the protocol --------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        """Apply the layer to a batch ``x`` of shape ``(B, *in_shape)``."""
        raise NotImplementedError

    def __call__(self, x: Array) -> Array:
        return self.forward(x)

    def pattern(self, in_shape: Shape, device: str = "cpu", index_dtype: Any = None) -> Pattern:
        """Return the CSR pattern of the transposed Jacobian for one sample of ``in_shape``.

        Computed once per (shape, device, index dtype, structure) and cached.

        Parameters
        ----------
        in_shape : tuple of int
            Per-sample input shape, without the batch axis.
        device : {"cpu", "gpu", "auto"}
            Where the pattern's arrays live.
        index_dtype : {None, numpy.int32, numpy.int64}
            Force the index dtype; by default int32 while it fits, int64 beyond.
        """
        return self._pattern_entry(self.check_in_shape(self._sizes(in_shape)), _backend.get(device),
                                   index_dtype)[0]

    def jacobian_fill_flops(self, in_shape: Shape) -> int:
        """FLOPs per sample of computing JT's values for ``in_shape`` beyond writing them: 0 for a
        layer whose values come from its input and weights; a block whose JT is a product of its
        layers' JTs (:class:`Block`) counts those products and its join's (the planner adds them to a
        scan that multiplies its JT)."""
        return 0

    def pattern_nnz(self, in_shape: Shape) -> int:
        """Stored entries of :meth:`pattern` for ``in_shape`` (layers that can count them without
        building the pattern override this: a scan plan's mv steps need only the count)."""
        return self.pattern(in_shape).nnz

    def transposed_jacobian(self, x: Array, index_dtype: Any = None) -> BatchedCSR:
        """Return the batched transposed Jacobian at input ``x`` (NumPy or CuPy array).

        The pattern comes from the cache; only the values are computed for this batch. Values are
        ``(nnz,)`` for sample-independent layers (never copied per sample), ``(B, nnz)`` otherwise.
        """
        x = self._check_input(x)
        be = _backend.of(x)
        pattern, aux = self._pattern_entry(x.shape[1:], be, index_dtype)  # checked: a tuple of ints
        return BatchedCSR(pattern, self._values(be, x, pattern, aux))

    def _pattern_entry(
        self, in_shape: Shape, be: _backend.Backend, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        requested = None if index_dtype is None else np.dtype(index_dtype).name
        key = (in_shape, be.device_key(), requested, self._structure_key())
        entry = self._patterns.get(key)
        if entry is None:
            entry = self._build_pattern(be, in_shape, index_dtype)
            self._patterns[key] = entry
        return entry

    def _structure_key(self) -> Hashable:
        """Anything besides the input shape that the pattern depends on (e.g. a pruning mask)."""
        return None

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        """Build the pattern and any auxiliary index arrays the values fill needs."""
        raise NotImplementedError

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        """Fill JT's values for the batch ``x`` into the pattern's entry order."""
        raise NotImplementedError

    # --- JT @ g through the weights (layers with parameters override) ---------------------------
    def weights_path(self, in_shape: Shape) -> WeightsPath | None:
        """How :meth:`weights_matvec` computes ``JT @ g`` for ``in_shape`` (its GEMM's multiply-adds,
        whether its weights multiply as CSR), for the planner to weigh against JT's SpMV
        (:mod:`sparse_scan.engine._weights_path`); None where the layer has no weights to do it
        with. Only layers whose JT is made of their weights (:class:`Conv2d`, :class:`Linear`) offer
        one."""
        return None

    def weights_matvec(self, in_shape: Shape, device: str = "cpu") -> Callable[[Array], Array]:
        """``g -> JT @ g`` for batches of flattened output gradients ``(B, out_size) -> (B, in_size)``
        on ``device``, computed from the layer's weights without JT's values (see
        :meth:`weights_path`). The weights are read now, on the calling thread: the operator holds
        until they change, and may run on any thread."""
        raise NotImplementedError(f"layer {self.label} has no path through its weights")

    # --- JT @ g from the input (layers whose JT is cheaper to apply than to fill override) ------
    def input_matvec(self, x: Array) -> Callable[[Array], Array] | None:
        """``g -> JT(x) @ g`` for batches of flattened output gradients ``(B, out_size) -> (B,
        in_size)``, computed on the host from the layer's input ``x`` without JT's values; None where
        the layer offers none (the default, and every layer on the GPU). A host backward uses it for
        the JTs that only matrix-vector steps read (:func:`sparse_scan.engine.run.through_inputs`), a
        block for its inner layers: :class:`ReLU` and 2x2 :class:`MaxPool2d` offer one, in one compiled
        pass (:mod:`sparse_scan.layers._kernels`), bit for bit what JT's values give; :class:`LayerNorm`
        one that applies its dense blocks in ``O(n)`` per group, equal within rounding."""
        return None


def diagonal_pattern(be: _backend.Backend, size: int, index_dtype: Any) -> Pattern:
    """The pattern of a ``size × size`` diagonal matrix."""
    dtype = choose_index_dtype(size, size, index_dtype)
    indptr = be.xp.arange(size + 1, dtype=dtype)
    return Pattern(indptr, indptr[:-1], (size, size))
