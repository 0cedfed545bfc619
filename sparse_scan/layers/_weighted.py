"""Layers with parameters (conv, linear): weight/bias validation, initialisation, pattern pruning.

Their transposed Jacobian does not depend on the sample: every stored entry is one weight, so the
values fill is a gather ``weight.flat[widx]`` through an index array built with the pattern. Layers
may provide a faster structured fill for their unpruned pattern. A pruned layer's kept weights
(:class:`~sparse_scan.layers._conv_pruned.PrunedWeights`, once per zero set) serve its sparse
forward and its sampled weight gradient.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable

import numpy as np

from .. import backend as _backend
from .._checks import as_float_dtype, as_rng
from .._host_kernels import launch
from .._threads import even_parts, workers_for
from .._types import Array, RngLike
from ..csr import Pattern
from ._base import FLOAT_DTYPES, Layer, Shape
from ._conv_pruned import SAMPLED_MAX_DENSITY, PrunedWeights, sampled_weight_gradient
from ._geometry import ConvGeometry
from ._kernels import channel_sums


def _bias_gradient_cpu(be: _backend.Backend, grad: np.ndarray) -> np.ndarray:
    batch, channels, plane = grad.shape
    out = np.empty(channels, dtype=grad.dtype)
    launch(channel_sums, (np.ascontiguousarray(grad).reshape(-1), (batch, channels, plane), out),
           even_parts(channels, workers_for(grad.size)))
    return out


bias_gradient = _backend.twin(cpu=_bias_gradient_cpu, gpu=lambda be, grad: grad.sum(axis=(0, 2)))
"""``bias_gradient(be, grad)``: a layer's bias gradient from its output gradient ``grad`` ``(B, C, P)``,
the sum over the batch and the positions per channel: on the host a compiled pass summing in float64
(:func:`~sparse_scan.layers._kernels.channel_sums`), on the GPU CuPy's sum."""


def device_or_host(value: Any) -> Array:
    """A parameter value as an array where it lives: a CuPy array as it is, anything else as NumPy."""
    be = _backend.of(value)
    return value if be.name == "gpu" else np.asarray(value)


class WeightedLayer(Layer):
    """Base of :class:`Conv2d` and :class:`Linear`.

    Parameters are NumPy arrays with PyTorch's shapes, initialised like PyTorch (uniform in
    ``±1/sqrt(fan_in)``) so a model can be mirrored by copying a state_dict. Assigning ``weight`` or
    ``bias`` validates shape and dtype.

    With ``prune_pattern=True``, weights that are exactly zero are removed from the Jacobian's pattern
    (pruned networks, paper §4.3); the pattern is re-derived whenever the set of zeros changes. Such a
    layer keeps its own copy of the weights and hands out a read-only ``weight``: they change by
    assignment (``layer.weight = w``, ``load_state_dict``) or through :meth:`update_weights` (the
    optimizers), which count the changes, so a pass over unchanged weights finds its pattern and plan
    without looking at the weights (the zero set is hashed once per change, not once per use). Its
    products cost in proportion to the kept weights (:mod:`~sparse_scan.layers._conv_pruned`), and its
    weight gradient is the kept weights' (:attr:`sampled_gradient`).
    """

    sample_independent = True

    def __init__(
        self,
        weight_shape: Shape,
        bias: bool,
        fan_in: int,
        dtype: Any,
        rng: RngLike,
        prune_pattern: bool,
    ) -> None:
        super().__init__()
        self._dtype = as_float_dtype(dtype, self.label)
        self._weight_shape = tuple(weight_shape)
        self._version = 0  # of the weights' values: counts every change
        self._zero_set_version = 0  # counts assignments and the changes of the zero set
        self._zero_set: tuple[int, Hashable] | None = None  # (zero-set version, structure key) last derived
        self._pattern_mask: np.ndarray | None = None  # the kept entries, where the caller fixes them
        self._masked: tuple[Array, Array] | None = None  # assign_masked's mask values and target
        self._pending: Array | None = None  # assign_masked's values, not multiplied by the mask yet
        self._pruned: tuple[Hashable, PrunedWeights] | None = None  # (zero-set key, its kept weights)
        self._sampled_gradient = True
        self._kept_gradient: Array | None = None  # the last weight gradient at the kept weights, if sampled
        generator = as_rng(rng)
        bound = 1.0 / np.sqrt(fan_in) if fan_in > 0 else 0.0
        self._prune_pattern = bool(prune_pattern)
        self._store_weight(generator.uniform(-bound, bound, self._weight_shape).astype(self._dtype))
        self._bias = (
            generator.uniform(-bound, bound, (weight_shape[0],)).astype(self._dtype) if bias else None
        )

    # --- parameters ----------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        """The parameter dtype (JT values have it too)."""
        return self._dtype

    @property
    def weight(self) -> np.ndarray:
        """The weight array, PyTorch's shape (read-only where ``prune_pattern``: assign to change it)."""
        self._settle()
        return self._weight_view

    @property
    def _weight(self) -> Array:
        """The dense weights held (an :meth:`assign_masked` multiplied by the mask first)."""
        self._settle()
        return self._dense_weight

    @_weight.setter
    def _weight(self, value: Array) -> None:
        self._dense_weight, self._pending = value, None

    def _settle(self) -> None:
        """Multiply a pending :meth:`assign_masked` by the mask, into the array the layer keeps: only
        what reads the dense weights pays for it (the sparse products read the kept values)."""
        pending = self._pending
        if pending is not None:
            mask, target = self._masked
            _backend.of(target).xp.multiply(pending, mask, out=target)
            self._pending = None

    def _kept_source(self) -> Array:
        """An array whose values at the kept weights are the weights': a pending :meth:`assign_masked`'s
        values as they are (the mask keeps them unchanged), else the weights."""
        return self._dense_weight if self._pending is None else self._pending

    @property
    def sampled_gradient(self) -> bool:
        """With ``prune_pattern``: whether the weight gradient is the kept weights' alone (True, the
        default: a sampled product costing in proportion to them; the pruned weights' gradients are
        exactly zero, as autograd's gradient of ``weight_orig`` through ``weight_orig * weight_mask``),
        or every weight's (False: the dense product, for a caller whose zero weights may come alive,
        such as the PyTorch bridge's ``prune_pattern=True`` without masks). Above
        :data:`~sparse_scan.layers._conv_pruned.SAMPLED_MAX_DENSITY` kept, or where the input or the
        gradient is not finite, the dense product runs and is masked (IEEE results as autograd's)."""
        return self._sampled_gradient

    @sampled_gradient.setter
    def sampled_gradient(self, value: bool) -> None:
        self._sampled_gradient = bool(value)

    @property
    def kept_gradient(self) -> Array | None:
        """The weight gradient this layer computed last, at the kept weights alone (in the order of
        the ``positions`` of :class:`~sparse_scan.layers._conv_pruned.PrunedWeights`: the flat
        positions, increasing) where it was the sampled product, so exactly zero at every pruned weight;
        None where it was a dense product masked (above the crossover, or for a gradient that is not
        finite: autograd's NaN stays at the pruned weights). What lets
        :class:`sparse_scan.torch.PrunedAdam` (``trusted_gradients=True``) step the kept weights alone
        without reading the dense gradient."""
        return self._kept_gradient

    @weight.setter
    def weight(self, value: Any) -> None:
        weight = self._checked_parameter("weight", value, self._weight_shape)
        if self._bias is not None and weight.dtype != self._bias.dtype:
            raise self._error("weight", f"dtype {weight.dtype} differs from the bias' {self._bias.dtype} "
                              "(convert both with layer.astype(...))")
        self._store_weight(weight)

    @property
    def prune_pattern(self) -> bool:
        """Whether exactly-zero weights are left out of the Jacobian's pattern."""
        return self._prune_pattern

    @prune_pattern.setter
    def prune_pattern(self, value: bool) -> None:
        self._prune_pattern = bool(value)
        self._store_weight(self._weight)

    @property
    def pattern_mask(self) -> np.ndarray | None:
        """With ``prune_pattern``: the weights the pruned pattern keeps (True, the weight's shape), fixed
        by the caller instead of derived from the weights' zero set: ``torch.nn.utils.prune``'s
        ``weight_mask`` (the PyTorch bridge sets it). The weights may then change freely, zeros
        included, without a new pattern, but must be zero outside the mask (an assignment that is not
        is refused). None (the default): the pattern keeps the non-zero weights."""
        return self._pattern_mask

    @pattern_mask.setter
    def pattern_mask(self, mask: Any) -> None:
        self._settle()
        self._masked = None
        if mask is None:
            self._pattern_mask = None
        else:
            kept = np.asarray(_backend.of(mask).to_host(mask)) != 0
            if kept.shape != self._weight_shape:
                raise self._error("pattern_mask", f"expected shape {self._weight_shape}, got {kept.shape}")
            self._check_inside(self._weight, kept)
            self._pattern_mask = kept
        self._store_weight(self._weight)
        self._zero_set_version += 1  # a new mask (or none) is a new pattern, whatever the weights

    def assign_masked(self, values: Array, mask: Any = None) -> None:
        """``weight = values * pattern_mask``, zero outside the mask by construction: how the PyTorch
        bridge gives a layer pruned with ``torch.nn.utils.prune`` its ``weight_orig * weight_mask`` of
        each forward. Nothing is copied or multiplied per call: the layer reads ``values`` (a view of
        the caller's memory, host or GPU) at the kept weights, and multiplies them by the mask into an
        array it keeps only where the dense weights are read (:attr:`weight`, a dense product). The
        caller must not change ``values`` until its next assignment.

        Parameters
        ----------
        values : ndarray
            The unmasked weights, the weight's shape and dtype.
        mask : array_like, optional
            A new :attr:`pattern_mask` (a new zero set), set with the values; by default the current.

        Raises
        ------
        ValueError
            No pattern mask is set, or ``values`` has another shape or dtype than the weight.
        """
        values = device_or_host(values)
        if values.shape != self._weight_shape or values.dtype != self._dtype:
            raise self._error("weight", f"expected {self._dtype} of shape {self._weight_shape}, got "
                              f"{values.dtype} of shape {values.shape}")
        if mask is not None:  # the weights are values * mask: inside the new mask by construction
            kept = np.asarray(_backend.of(mask).to_host(mask)) != 0
            if kept.shape != self._weight_shape:
                raise self._error("pattern_mask", f"expected shape {self._weight_shape}, got {kept.shape}")
            self._pattern_mask, self._masked = kept, None
            self._zero_set_version += 1
        if self._pattern_mask is None:
            raise self._error("weight", "assign_masked needs a pattern_mask")
        be = _backend.of(values)
        kept_values = self._masked
        if (kept_values is None or kept_values[0].dtype != self._dtype
                or _backend.of(kept_values[0]).name != be.name):  # the mask as 0/1 values, and the target
            kept_values = self._masked = (be.asarray(self._pattern_mask.astype(self._dtype)),
                                          be.xp.empty(self._weight_shape, self._dtype))
        self._dense_weight = self._weight_view = kept_values[1]
        self._pending = values
        self._version += 1

    def _check_inside(self, weight: Array, kept: np.ndarray | None) -> None:
        """Refuse weights that are not zero outside the pattern mask ``kept`` (their gradient and their
        products would be left out silently)."""
        be = _backend.of(weight)
        if kept is not None and bool(be.xp.any(weight[be.asarray(~kept)])):  # sync on the GPU
            raise self._error("weight", "non-zero outside the pattern mask (pattern_mask keeps only the "
                              "masked weights): zero them, or set a mask that keeps them")

    def _support(self) -> np.ndarray:
        """The array whose non-zeros the pruned pattern keeps: the pattern mask, or the weights."""
        return self._weight if self._pattern_mask is None else self._pattern_mask

    def pruned_weights(self) -> PrunedWeights | None:
        """With ``prune_pattern``: the kept weights of the current zero set
        (:class:`~sparse_scan.layers._conv_pruned.PrunedWeights`, derived once per zero set); None
        without, or where non-finite weights define no zero set (the dense products then give NaN, as
        PyTorch's)."""
        if not self._prune_pattern:
            return None
        try:
            key = self._structure_key()
        except ValueError:
            return None
        known = self._pruned
        if known is None or known[0] != key:
            known = self._pruned = (key, PrunedWeights(np.asarray(self._support()), self._weight_groups()))
        return known[1]

    def _weight_groups(self) -> int:
        """The groups the weight's output channels fall in (a convolution's ``groups``)."""
        return 1

    def _kept_values(self, be: _backend.Backend, pruned: PrunedWeights) -> Array:
        """The kept weights' values where ``be`` computes (once per version of the weights)."""
        return pruned.values(be, self._kept_source(), self._version)

    def _direct_max_density(self) -> float:
        """The densest pruned weights whose forward is the direct sparse product (the layer's
        crossover constant in :mod:`~sparse_scan.layers._conv_pruned`)."""
        raise NotImplementedError

    def _direct_pruned(self) -> PrunedWeights | None:
        """The pruned weights when the forward is their direct sparse product, else None."""
        pruned = self.pruned_weights()
        return pruned if pruned is not None and pruned.density <= self._direct_max_density() else None

    def gather_kept_values(self, be: _backend.Backend) -> None:
        """Read the kept weights that the next forward's direct product takes where ``be`` computes, now
        (once per version of the weights: the forward then finds them). Nothing where the forward is
        dense. The PyTorch bridge reads the layers last first after an optimizer's step: the step
        writes the weights in parameter order, so the last layers' are still in the cache (the
        97 %-pruned VGG-11's Adam iteration 1.2-3.1 ms faster at batch 16 in in-process A/Bs against
        the forward's order, within noise at batch 1)."""
        pruned = self._direct_pruned()
        if pruned is not None:
            self._kept_values(be, pruned)

    def parameters_beside_scan(self, x: Array) -> bool:
        """Whether the parameter gradients of the batch ``x`` run on a second thread while the scan goes
        on (:meth:`~sparse_scan.Sequential.backward`'s ``parameters_beside``): on the host, where the
        weight gradient is the sampled product (:attr:`sampled_gradient`). In-process A/Bs of the
        bridge's Adam iteration on the pruned VGG-11 (2-core AMD EPYC, fused Adam, the contenders'
        order rotating by round), every such layer beside against none, measured before a job beside
        held its core (:func:`~sparse_scan._threads.submit_beside`, whose figures are the backward's
        since: 90 % at batch 16 3-4 ms faster again): batch 1, 15.7 against 16.0 ms
        (97 %) and 21.4 against 23.6 (90 %); batch 16 and 97 %, 35.0 against 36.0 ms; batch 16 and
        90 %, where the scan's kernels already hold both cores, within noise (53.3 against 52.3 ms,
        53.9 against 53.9). A bound on the work beside the scan (2^25) made no difference once the
        arrays beside it were reused (:meth:`~sparse_scan.layers._conv_pruned.PrunedWeights.reused`):
        every layer beside gave 55.5 against 55.0 ms at 90 % and 35.1 against 35.4 at 97 %."""
        pruned = self.pruned_weights() if self._sampled_gradient else None
        return pruned is not None and pruned.density <= SAMPLED_MAX_DENSITY and _backend.of(x).name == "cpu"

    def _weight_gradient(self, be: _backend.Backend, g: ConvGeometry, x: Array, grad: Array,
                         dense: Callable[[], Array]) -> Array:
        """The weight gradient of the batch ``x`` ``(B, C, H, W)`` and output gradient ``grad``
        ``(B, Cout, Ho, Wo)`` (a Linear layer's as 1x1 planes): the sampled product at the kept weights
        (:attr:`sampled_gradient`), else ``dense()`` (the GEMM), masked where the layer is pruned."""
        self._kept_gradient = None  # first: its memory is reused where nothing holds it
        pruned = self.pruned_weights() if self._sampled_gradient else None
        if pruned is not None and pruned.density <= SAMPLED_MAX_DENSITY:
            sampled = sampled_weight_gradient(be, g, pruned, x, grad)
            if sampled is not None:
                full, self._kept_gradient = sampled
                return full
        full = dense()
        if pruned is not None:  # 0 at the pruned weights; NaN stays NaN (autograd's mask multiplies)
            full *= be.asarray(self._support() != 0)
        return full

    def _store_weight(self, weight: Array) -> None:
        """Hold ``weight`` (a pruned layer: a copy of it, handed out read-only; with a pattern mask, as
        it is: its pattern does not depend on it) as a new version."""
        masked = self._prune_pattern and getattr(self, "_pattern_mask", None) is not None
        if self._prune_pattern and not masked and _backend.of(weight).name == "gpu":
            raise self._error("weight", "a pruned layer (prune_pattern) without a pattern mask keeps its "
                              "weights on the host (its pattern is derived there); assign a NumPy array")
        if masked:
            self._check_inside(weight, self._pattern_mask)
            self._weight, self._weight_view, self._dtype = weight, weight, weight.dtype
            self._version += 1
            return
        if self._prune_pattern:
            weight = np.array(weight, copy=True)  # no one else holds a writable reference
            view = weight.view()
            view.flags.writeable = False
        else:
            view = weight
        self._weight, self._weight_view, self._dtype = weight, view, weight.dtype
        self._version += 1
        self._zero_set_version += 1

    def update_weights(self, positions: np.ndarray, values: Array) -> None:
        """``weight.flat[positions] = values`` in place: how optimizers update a pruned layer's live
        weights (its ``weight`` is read-only). Where a zero weight becomes non-zero or the reverse, the
        zero set changed: the next use re-derives the pattern (and a model re-plans).

        Parameters
        ----------
        positions : ndarray of int
            Flat positions in ``weight``, each at most once.
        values : ndarray
            Their new values, in ``weight``'s dtype.
        """
        flat = self._weight.reshape(-1)
        changed = self._prune_pattern and self._pattern_mask is None and bool(
            np.any((flat[positions] == 0) != (values == 0)))
        flat[positions] = values
        self._version += 1  # after the write: what is derived meanwhile is of the old version
        if changed:
            self._zero_set_version += 1

    @property
    def bias(self) -> np.ndarray | None:
        """The bias array ``(out,)``, or None when the layer has no bias."""
        return self._bias

    @bias.setter
    def bias(self, value: Any) -> None:
        if value is None:
            self._bias = None
            return
        bias = self._checked_parameter("bias", value, (self._weight_shape[0],))
        if bias.dtype != self._weight.dtype:
            raise self._error("bias", f"dtype {bias.dtype} differs from the weight's {self._weight.dtype} "
                              "(convert both with layer.astype(...))")
        self._bias = bias

    def _checked_parameter(self, field: str, value: Any, shape: Shape) -> Array:
        """``value`` as a contiguous array where it lives: NumPy, or CuPy for parameters kept on the GPU
        (the PyTorch bridge's views of CUDA tensors; the layer then runs on the GPU only)."""
        array = device_or_host(value)
        if array.dtype not in FLOAT_DTYPES:
            raise self._error(field, f"dtype must be float32 or float64, got {array.dtype}")
        if tuple(array.shape) != tuple(shape):
            raise self._error(field, f"expected shape {tuple(shape)}, got {tuple(array.shape)}")
        return _backend.of(array).xp.ascontiguousarray(array)

    def astype(self, dtype: Any) -> "WeightedLayer":
        """Convert the parameters to ``dtype`` (float32 or float64) in place and return self."""
        self._dtype = as_float_dtype(dtype, self.label)
        self._store_weight(self._weight.astype(self._dtype))
        if self._bias is not None:
            self._bias = self._bias.astype(self._dtype)
        return self

    def _check_input_dtype(self, x: Array) -> None:
        if np.dtype(x.dtype) != self._dtype:
            raise self._error(
                "input",
                f"dtype {x.dtype} does not match the parameters' {self._dtype}; "
                f"convert one of them (layer.astype(...))",
            )

    # --- pattern -------------------------------------------------------------------------------
    def _structure_key(self) -> Hashable:
        """The pruned pattern's key: a hash of the weights' zero set, derived once per version of the
        weights (asked for on every plan and values call: a known version costs one compare)."""
        if not self._prune_pattern:
            return None
        known = self._zero_set
        if known is not None and known[0] == self._zero_set_version:
            return known[1]
        version = self._zero_set_version
        key = self._zero_set_key()
        self._zero_set = (version, key)
        return key

    def _zero_set_key(self) -> Hashable:
        """A hash of the weights' zero set (non-finite weights define none: ``ValueError``), or of the
        pattern mask."""
        if self._pattern_mask is not None:
            mask = np.packbits(self._pattern_mask.ravel())
            return ("masked", hashlib.blake2b(mask.tobytes(), digest_size=16).hexdigest())
        if not np.isfinite(self._weight).all():
            raise self._error("weight", "non-finite values cannot define a pruned pattern")
        mask = np.packbits(self._weight.ravel() != 0)
        return ("pruned", hashlib.blake2b(mask.tobytes(), digest_size=16).hexdigest())

    def _structural_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, Array]:
        """Return the unpruned pattern and ``widx`` (flat weight index of every entry)."""
        raise NotImplementedError

    def _build_pattern(
        self, be: _backend.Backend, in_shape: Shape, index_dtype: Any
    ) -> tuple[Pattern, dict[str, Any]]:
        pattern, widx = self._structural_pattern(be, in_shape, index_dtype)
        if self.prune_pattern:
            pattern, widx = _drop_zero_weights(be, pattern, widx, be.asarray(self._support().ravel()))
        return pattern, {"widx": widx, "pruned": self.prune_pattern, "in_shape": in_shape}

    # --- values --------------------------------------------------------------------------------
    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        """The weights in the pattern's entry order. A pruned layer's (whose weights change only in
        counted ways) are filled once per version of the weights and kept with the pattern: every
        batch reads the same values (14 ms per backward of the pruned VGG-11 at batch 16 where they
        were filled at every call). Other layers' weights may change in place: filled every call."""
        self._check_input_dtype(x)
        if not aux["pruned"]:
            filled = self._structured_values(be, pattern, aux)
            if filled is not None:
                return filled
            return be.xp.take(be.asarray(self._weight.ravel()), aux["widx"])
        kept = aux.get("values")
        if kept is None or kept[0] != self._version:
            pruned = self.pruned_weights()  # the pattern's zero set: widx holds kept weights only
            if "kept_order" not in aux:  # each entry's kept weight, once per pattern
                aux["kept_order"] = be.asarray(np.searchsorted(pruned.positions, be.to_host(aux["widx"])))
            # gathered from the kept values (read once per version), not from the whole weights
            kept = aux["values"] = (self._version,
                                    be.xp.take(self._kept_values(be, pruned), aux["kept_order"]))
        return kept[1]

    def _structured_values(self, be: _backend.Backend, pattern: Pattern, aux: dict[str, Any]) -> Array:
        """A faster fill of the unpruned pattern's values, or None to use the gather."""
        return None


def _drop_zero_weights(
    be: _backend.Backend, pattern: Pattern, widx: Array, flat_weight: Array
) -> tuple[Pattern, Array]:
    """Remove the entries whose weight is exactly zero from ``pattern`` (and ``widx``)."""
    xp = be.xp
    keep = flat_weight[widx] != 0
    rows = pattern.row_of_entries()[keep]
    counts = xp.bincount(rows, minlength=pattern.shape[0])
    indptr = xp.zeros(pattern.shape[0] + 1, dtype=pattern.index_dtype)
    xp.cumsum(counts, out=indptr[1:])
    return Pattern(indptr, pattern.indices[keep], pattern.shape), widx[keep]
