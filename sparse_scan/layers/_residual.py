"""Residual blocks ``y = f(x) + s(x)`` as one scan element.

``f`` is a chain of layers ``f_1 .. f_k`` and ``s`` the identity or a shortcut chain (torchvision's
``downsample``: a strided 1x1 convolution and a frozen batch normalisation). The block's transposed
Jacobian is the sum of the two chains' products::

    JT = JT_s + JT_f,    JT_f = JT_1 · JT_2 ⋯ JT_k    (grad_in = JT_1 (JT_2 (… JT_k grad_out)))

and the scan sees the block as one element of kind ``"general"``. Its pattern is planned once per
input shape from the inner layers' patterns, symbolically: every product with
:func:`~sparse_scan.engine.products.plan_product` (scalings for diagonal factors, dense channel
blocks for unpruned convolutions), then the union of the two chains' patterns with each chain's
entry positions in it (:func:`plan_sum`). A batch's values are the inner JTs' values multiplied
along those plans (:func:`~sparse_scan.engine.run.multiply`, on the arrays' device) and scattered into
the union's entry order: exact, explicit zeros kept, the pattern fixed.

``JT @ g`` also runs without the block's values, through the chains (:meth:`Residual.weights_matvec`:
each inner layer's own path through its weights, or its JT's values for diagonal and other layers):
back-propagation's schedule then never forms the product, which holds more entries than its
factors together. Nested blocks are layers like any other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from .. import backend as _backend
from .._checks import flag
from .._types import Array
from ..csr import BatchedCSR, Pattern, choose_index_dtype
from ..engine.plan import WeightsPath
from ..engine.products import ProductPlan, plan_product
from ..engine.run import multiply
from ..weights import scoped_name
from ._base import Layer, Shape, diagonal_pattern
from ._residual_counts import BlockCounts, block_counts

__all__ = ["ChainProduct", "Residual", "plan_sum"]


def plan_sum(operands: Sequence[Pattern]) -> tuple[Pattern, tuple[np.ndarray, ...]]:
    """The pattern of a sum of CSR matrices (the union of theirs) and each operand's entries in it.

    Parameters
    ----------
    operands : sequence of Pattern
        Host patterns of one shape.

    Returns
    -------
    union : Pattern
        On the host, columns sorted within each row; int32 indices while they fit, int64 beyond.
    positions : tuple of ndarray
        ``positions[i][e]``: where entry ``e`` of operand ``i`` lies in ``union`` (the sum's values
        are ``out[positions[i]] += values_i``, no position repeated within one operand).

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.csr import Pattern
    >>> a = Pattern(np.array([0, 1, 2]), np.array([1, 0]), (2, 2))
    >>> eye = Pattern(np.array([0, 1, 2]), np.array([0, 1]), (2, 2))
    >>> union, (in_a, in_eye) = plan_sum([a, eye])
    >>> union.indptr.tolist(), union.indices.tolist(), in_a.tolist(), in_eye.tolist()
    ([0, 2, 4], [0, 1, 0, 1], [1, 2], [0, 3])
    """
    shapes = {tuple(p.shape) for p in operands}
    if len(shapes) != 1:
        raise ValueError(f"plan_sum: the operands' shapes differ: {sorted(shapes)}")
    rows, cols = shapes.pop()
    keys = [np.asarray(p.row_of_entries(), np.int64) * cols + np.asarray(p.indices, np.int64)
            for p in operands]
    largest = max(range(len(keys)), key=lambda i: len(keys[i]))
    covered = _positions_if_covered(keys, largest)
    if covered is not None:  # a residual block's inner product usually holds its shortcut's pattern
        big = operands[largest]
        dtype = choose_index_dtype(big.nnz, cols)
        return (Pattern(np.asarray(big.indptr).astype(dtype), np.asarray(big.indices).astype(dtype),
                        (rows, cols)), tuple(position.astype(dtype) for position in covered))
    union = np.sort(np.concatenate(keys))
    union = union[np.concatenate(([True], union[1:] != union[:-1]))] if len(union) else union
    dtype = choose_index_dtype(len(union), cols)
    union_rows, union_cols = np.divmod(union, cols)
    indptr = np.zeros(rows + 1, dtype=dtype)
    np.cumsum(np.bincount(union_rows, minlength=rows), out=indptr[1:])
    positions = tuple(np.searchsorted(union, k).astype(dtype) for k in keys)
    return Pattern(indptr, union_cols.astype(dtype), (rows, cols)), positions


def _positions_if_covered(keys: Sequence[np.ndarray], largest: int) -> tuple[np.ndarray, ...] | None:
    """Each operand's positions in operand ``largest`` when that one's keys are strictly increasing
    (CSR with sorted columns) and hold every other operand's keys; else None. Saves sorting the
    union of ~10^7 keys per block of a ResNet."""
    big = keys[largest]
    if len(big) > 1 and not np.all(big[1:] > big[:-1]):
        return None
    positions = []
    for index, key in enumerate(keys):
        if index == largest:
            positions.append(np.arange(len(big), dtype=np.int64))
            continue
        found = np.searchsorted(big, key)
        if np.any(found >= len(big)) or not np.array_equal(big[found], key):
            return None
        positions.append(found)
    return tuple(positions)


@dataclass(frozen=True, eq=False)
class ChainProduct:
    """The symbolic product ``JT_1 · JT_2 ⋯ JT_k`` of a chain of layers' JTs, planned once.

    Attributes
    ----------
    pattern : Pattern
        The product's pattern (host).
    steps : tuple of ProductPlan
        ``steps[i - 1]`` multiplies the product of the first ``i`` JTs by ``JT_{i+1}`` (none for one
        layer).
    """

    pattern: Pattern
    steps: tuple[ProductPlan, ...]

    @classmethod
    def plan(cls, layers: Sequence[Layer], shapes: Sequence[Shape]) -> "ChainProduct":
        """Plan the product of ``layers``' JTs, layer ``i`` taking ``shapes[i]`` (``shapes`` holds
        the chain's output shape last).

        Examples
        --------
        >>> import numpy as np
        >>> from sparse_scan.layers import Conv2d, ReLU
        >>> conv, relu = Conv2d(1, 2, 3, padding=1, rng=0), ReLU()
        >>> chain = ChainProduct.plan([conv, relu], [(1, 4, 4), (2, 4, 4), (2, 4, 4)])
        >>> [step.method for step in chain.steps], chain.pattern.shape
        (['scale_columns'], (16, 32))
        """
        pattern, kind, steps = layers[0].pattern(shapes[0]), layers[0].jacobian_kind, []
        for index, layer in enumerate(layers[1:], start=1):
            channels = (_channels(shapes[0]), _channels(shapes[index]), _channels(shapes[index + 1]))
            step = plan_product(pattern, layer.pattern(shapes[index]), kind, layer.jacobian_kind,
                                channels=channels)
            pattern = step.out
            kind = "diagonal" if kind == layer.jacobian_kind == "diagonal" else "general"
            steps.append(step)
        return cls(pattern, tuple(steps))

    def values(self, layers: Sequence[Layer], activations: Sequence[Array]) -> Array:
        """The product's values at the chain's ``activations`` (each layer's input), on their device:
        ``(nnz,)`` when every factor's are shared by the batch, else ``(B, nnz)``."""
        data = layers[0].transposed_jacobian(activations[0]).data
        for step, layer, x in zip(self.steps, layers[1:], activations[1:], strict=True):
            data = multiply(step, data, layer.transposed_jacobian(x).data)
        return data


def _channels(shape: Shape) -> int:
    """The channels of a per-sample shape, as the engine counts them (1 for a scalar)."""
    return int(shape[0]) if shape else 1


@dataclass(frozen=True, eq=False)
class _Symbolic:
    """A block's symbolic plan for one input shape (host): the chains' products and their sum."""

    inner: ChainProduct
    shortcut: ChainProduct | None
    union: Pattern
    positions: tuple[np.ndarray, np.ndarray]


def _matvec(be: _backend.Backend, jt: BatchedCSR, diagonal: bool, g: Array) -> Array:
    """``JT @ g`` for a batch ``g`` of ``(B, out_size)``: a scaling for a diagonal JT, an SpMM for
    shared values, else each sample's entries summed per row by one sparse product."""
    xp = be.xp
    rows, cols = jt.shape
    if diagonal:
        return g * jt.data
    if jt.shared:
        matrix = be.sparse.csr_matrix((jt.data, jt.indices, jt.indptr), shape=(rows, cols))
        return xp.ascontiguousarray((matrix @ xp.ascontiguousarray(g.T)).T)
    terms = jt.data * g[:, jt.indices]  # (B, nnz): every entry times its column's gradient
    ones = xp.ones(jt.nnz, dtype=terms.dtype)
    rows_of = be.sparse.csr_matrix((ones, xp.arange(jt.nnz, dtype=jt.indices.dtype), jt.indptr),
                                   shape=(rows, jt.nnz))
    return xp.ascontiguousarray((rows_of @ xp.ascontiguousarray(terms.T)).T)


class Residual(Layer):
    """A residual block ``y = f(x) + s(x)``: one scan element whose JT is ``JT_s + JT_1 ⋯ JT_k``.

    Parameters
    ----------
    *layers : Layer
        The inner chain ``f`` (at least one layer), applied in order. Unnamed layers are named by
        position (``"0"``, ``"1"``, ...), like the children of PyTorch's ``nn.Sequential``.
    shortcut : Layer or sequence of Layer, optional
        ``s``: None for the identity (then ``f`` must keep the input's shape), one layer, or a chain
        (torchvision's ``downsample``, e.g. ``[Conv2d(c, 2 * c, 1, stride=2, bias=False),
        BatchNorm2d(2 * c).eval()]``).
    shortcut_name : str
        Under which name the shortcut's parameters appear (``"downsample"`` gives torchvision's
        ``BasicBlock`` names); not used when the block is not ``scoped``.
    scoped : bool
        True: the inner and shortcut layers are named under the block, as a PyTorch module's children
        (below). False: the block is a sum written inline in a module's forward, and its layers keep
        their own names in the scope that holds the block (every layer of the chains, the shortcut's
        included, named by its ``name``), so that their parameters carry that module's state_dict
        names (``"conv1.weight"``, not ``"<block>.conv1.weight"``).

    Attributes
    ----------
    layers : list of Layer
        The inner chain.
    shortcut : tuple of Layer
        The shortcut chain (empty: the identity).
    plan_builds : int
        Symbolic plans built (one per input shape and structure; a second batch builds none).

    Notes
    -----
    Parameters and their gradients are named like the ``state_dict`` of a PyTorch module holding the
    inner layers as children ``"0"``, ``"1"``, ... (or their names) and the shortcut as child
    ``shortcut_name`` (an ``nn.Sequential`` when it is a chain): ``"0.weight"``,
    ``"shortcut.0.weight"``, ``"shortcut.weight"`` for a single shortcut layer. Inner layers named
    ``conv1``, ``bn1``, ``relu``, ``conv2``, ``bn2`` with ``shortcut_name="downsample"`` give exactly a
    torchvision ``BasicBlock``'s names (its final ReLU, after the sum, follows the block).

    Examples
    --------
    >>> import numpy as np
    >>> from sparse_scan.layers import Conv2d, ReLU, Residual
    >>> block = Residual(Conv2d(2, 2, 3, padding=1, dtype=np.float64, rng=0), ReLU(),
    ...                  Conv2d(2, 2, 3, padding=1, dtype=np.float64, rng=1))
    >>> x = np.random.default_rng(0).standard_normal((3, 2, 4, 4))
    >>> block(x).shape
    (3, 2, 4, 4)
    >>> jt = block.transposed_jacobian(x)
    >>> jt.shape, jt.data.shape, block.jacobian_kind
    ((32, 32), (3, 784), 'general')
    >>> g = np.ones((3, 32))
    >>> bool(np.allclose(block.weights_matvec((2, 4, 4))(g), np.einsum("bij,bj->bi", jt.todense(), g)))
    True
    >>> sorted(block.parameter_gradients(x, np.ones_like(x)))
    ['0.bias', '0.weight', '2.bias', '2.weight']
    >>> Residual(Conv2d(2, 4, 1, rng=0)).forward(x.astype(np.float32))
    Traceback (most recent call last):
    ...
    ValueError: layer Residual: output: ...
    """

    jacobian_kind = "general"
    parameter_names: tuple[str, ...] = ()

    def __init__(self, *layers: Layer, shortcut: Layer | Sequence[Layer] | None = None,
                 shortcut_name: str = "shortcut", scoped: bool = True) -> None:
        super().__init__()
        self.scoped = flag(scoped, "Residual: scoped")
        if not layers:
            raise ValueError("Residual needs at least one inner layer (y = f(x) + s(x))")
        if shortcut is None:
            chain: tuple[Any, ...] = ()
        elif isinstance(shortcut, Layer):
            chain = (shortcut,)
        elif isinstance(shortcut, (list, tuple)) and shortcut:
            chain = tuple(shortcut)
        else:
            raise TypeError(f"Residual: shortcut must be None, a Layer or a non-empty list of Layers, got "
                            f"{type(shortcut).__name__}")
        if not isinstance(shortcut_name, str) or not shortcut_name or "." in shortcut_name:
            raise ValueError(f"Residual: shortcut_name must be a non-empty name without dots, got "
                             f"{shortcut_name!r}")
        single = isinstance(shortcut, Layer)
        for where, members in (("layer", layers), ("shortcut layer", chain)):
            for position, layer in enumerate(members):
                if not isinstance(layer, Layer):
                    raise TypeError(f"Residual: {where} {position} is a {type(layer).__name__}, not a "
                                    "sparse_scan Layer")
                if layer.name is None:
                    layer.name = shortcut_name if single and members is chain else str(position)
        self.layers: list[Layer] = list(layers)
        self.shortcut: tuple[Layer, ...] = chain
        self.shortcut_name = shortcut_name
        self._single_shortcut = single
        self.sample_independent = all(layer.sample_independent for layer in self.layers + list(chain))
        self.plan_builds = 0
        paths = [path for path, _ in self.named_children()]
        repeated = sorted({path for path in paths if paths.count(path) > 1})
        if repeated:
            raise ValueError(f"Residual: the inner and shortcut layers need unique names: {repeated[0]!r} "
                             f"names {paths.count(repeated[0])} of them")
        self._symbolic: dict[Hashable, _Symbolic] = {}
        self._counts: dict[Hashable, BlockCounts] = {}
        self._input: Array | None = None
        self._inner_activations: list[Array] = []
        self._shortcut_activations: list[Array] = []

    def named_children(self) -> list[tuple[str, Layer]]:
        """``(name, layer)`` of the inner layers, then of the shortcut's (``shortcut_name`` for one
        layer, ``"<shortcut_name>.<name>"`` in a chain; every layer's own ``name`` when the block is not
        ``scoped``): the prefixes of their parameters' names."""
        if not self.scoped:
            return [(str(layer.name), layer) for layer in self.layers + list(self.shortcut)]
        if self._single_shortcut:
            short = [(self.shortcut_name, self.shortcut[0])]
        else:
            short = [(f"{self.shortcut_name}.{layer.name}", layer) for layer in self.shortcut]
        return [(str(layer.name), layer) for layer in self.layers] + short

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({name}): {layer!r}" for name, layer in self.named_children())
        return f"Residual(\n{inner}\n)"

    # --- shapes --------------------------------------------------------------------------------
    def _shapes(self, in_shape: Shape) -> tuple[list[Shape], list[Shape]]:
        """The per-sample shapes through the inner chain and through the shortcut (input first)."""
        inner, short = [tuple(in_shape)], [tuple(in_shape)]
        for layer in self.layers:
            inner.append(tuple(layer.output_shape(inner[-1])))
        for layer in self.shortcut:
            short.append(tuple(layer.output_shape(short[-1])))
        if inner[-1] != short[-1]:
            which = "the shortcut gives" if self.shortcut else "the identity shortcut keeps"
            hint = "" if self.shortcut else (" (give the block a shortcut= that maps the input to the inner "
                                             "layers' output shape, e.g. a strided 1x1 Conv2d)")
            raise self._error("output", f"the inner layers map {tuple(in_shape)} to {inner[-1]} but {which} "
                              f"{short[-1]}; y = f(x) + s(x) needs equal shapes{hint}")
        return inner, short

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        self._shapes(shape)
        return shape

    def output_shape(self, in_shape: Shape) -> Shape:
        return self._shapes(tuple(int(s) for s in in_shape))[0][-1]

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        """``f(x) + s(x)``; keeps every inner layer's input for the JT and the parameter gradients."""
        x = self._check_input(x)
        inner, short = [x], [x]
        for layer in self.layers:
            inner.append(layer.forward(inner[-1]))
        for layer in self.shortcut:
            short.append(layer.forward(short[-1]))
        self._input, self._inner_activations, self._shortcut_activations = x, inner[:-1], short[:-1]
        return inner[-1] + short[-1]

    def _activations(self, x: Array) -> tuple[list[Array], list[Array]]:
        """The inner layers' and shortcut layers' inputs at ``x``: the last forward's when ``x`` is its
        input array (a Dropout's mask is that forward's), else those of a new forward of ``x``."""
        if x is not self._input:
            self.forward(x)
        return self._inner_activations, self._shortcut_activations

    # --- pattern and values --------------------------------------------------------------------
    def _structure_key(self) -> Hashable:
        return tuple(layer._structure_key() for _, layer in self.named_children())

    def _plan(self, in_shape: Shape) -> _Symbolic:
        """The block's symbolic plan for ``in_shape`` (host, built once per shape and structure)."""
        shape = self.check_in_shape(self._sizes(in_shape))
        key = (shape, self._structure_key())
        entry = self._symbolic.get(key)
        if entry is None:
            inner_shapes, short_shapes = self._shapes(shape)
            inner = ChainProduct.plan(self.layers, inner_shapes)
            shortcut = ChainProduct.plan(self.shortcut, short_shapes) if self.shortcut else None
            short_pattern = (shortcut.pattern if shortcut is not None
                             else diagonal_pattern(_backend.get("cpu"), int(np.prod(shape)), None))
            union, positions = plan_sum([inner.pattern, short_pattern])
            entry = _Symbolic(inner, shortcut, union, (positions[0], positions[1]))
            self._symbolic[key] = entry
            self.plan_builds += 1
        return entry

    def _planned_counts(self, shape: Shape) -> BlockCounts:
        """The block's figures read from its symbolic plan for ``shape`` (built if need be)."""
        symbolic = self._plan(shape)
        flops = int(symbolic.positions[1].shape[0])
        for chain in (symbolic.inner, symbolic.shortcut):
            if chain is not None:
                flops += sum(step.flops for step in chain.steps)
        return BlockCounts(int(symbolic.union.nnz), int(symbolic.positions[1].shape[0]), flops)

    def _block_counts(self, in_shape: Shape) -> BlockCounts:
        """The block's figures for ``in_shape``: from its symbolic plan when built, else counted from
        its layers' structure (:func:`~sparse_scan.layers._residual_counts.block_counts`, exact, no
        product planned), else from the plan, built now (layers the counts do not know)."""
        shape = self.check_in_shape(self._sizes(in_shape))
        key = (shape, self._structure_key())
        if key in self._symbolic:
            return self._planned_counts(shape)
        if key not in self._counts:
            counted = block_counts(self.layers, self.shortcut, *self._shapes(shape))
            self._counts[key] = self._planned_counts(shape) if counted is None else counted
        return self._counts[key]

    def pattern_nnz(self, in_shape: Shape) -> int:
        """Stored entries of the block's JT, counted without planning its products where its layers
        allow (:meth:`_block_counts`; issue 38: a plan's mv steps need only the count)."""
        return self._block_counts(in_shape).nnz

    def jacobian_fill_flops(self, in_shape: Shape) -> int:
        """The products of the inner chain's JTs and of the shortcut chain's (their own layers' fills
        included, for nested blocks), and one add per shortcut entry for the sum."""
        shape = self.check_in_shape(self._sizes(in_shape))
        inner_shapes, short_shapes = self._shapes(shape)
        own = sum(layer.jacobian_fill_flops(s) for layers, shapes in
                  ((self.layers, inner_shapes), (self.shortcut, short_shapes))
                  for layer, s in zip(layers, shapes[:-1], strict=True))
        return self._block_counts(shape).product_flops + own

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        symbolic = self._plan(in_shape)
        union = symbolic.union
        dtype = choose_index_dtype(union.nnz, union.shape[1], index_dtype)
        pattern = Pattern(be.asarray(union.indptr.astype(dtype, copy=False)),
                          be.asarray(union.indices.astype(dtype, copy=False)), union.shape)
        return pattern, {"inner": be.asarray(symbolic.positions[0]),
                         "shortcut": be.asarray(symbolic.positions[1]), "symbolic": symbolic}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        symbolic: _Symbolic = aux["symbolic"]
        inner, short = self._activations(x)
        f = symbolic.inner.values(self.layers, inner)
        s = (be.xp.ones(int(aux["shortcut"].shape[0]), dtype=f.dtype) if symbolic.shortcut is None
             else symbolic.shortcut.values(self.shortcut, short))
        lead = f.shape[:-1] if f.ndim == 2 else s.shape[:-1]
        out = be.xp.zeros(lead + (pattern.nnz,), dtype=np.result_type(f.dtype, s.dtype))
        out[..., aux["inner"]] = f
        out[..., aux["shortcut"]] += s
        return out

    # --- JT @ g through the chains -------------------------------------------------------------
    def weights_path(self, in_shape: Shape) -> WeightsPath:
        """``JT @ g`` through the chains: per inner and shortcut layer its own path through its
        weights (its GEMM's multiply-adds; a CSR path's stored entries) or its JT's SpMV
        (``pattern_nnz``). The planner compares that with the block's ``nnz``
        (:func:`~sparse_scan.engine._weights_path.gemm_pays`): a product holds more entries than its
        factors together, so every block with a convolution or more than one layer takes it."""
        inner_shapes, short_shapes = self._shapes(self.check_in_shape(self._sizes(in_shape)))
        cost = weights = taps = 0
        for layers, shapes in ((self.layers, inner_shapes), (self.shortcut, short_shapes)):
            for layer, shape in zip(layers, shapes, strict=False):
                path = layer.weights_path(shape)
                cost += layer.pattern_nnz(shape) if path is None or path.csr else path.multiply_adds
                weights += 0 if path is None else path.weights
                taps += 0 if path is None else path.taps
        return WeightsPath(cost, calls=len(self.layers) + len(self.shortcut) + 1, weights=weights, taps=taps)

    def weights_matvec(self, in_shape: Shape, device: str = "cpu") -> Callable[[Array], Array]:
        """``g -> JT @ g`` for batches ``(B, out_size) -> (B, in_size)`` at the last :meth:`forward`,
        without the block's JT: ``g`` back through the inner chain plus ``g`` back through the
        shortcut. Inner layers with a path through their weights use it, those with an operator from
        their input (ReLU) that; the others' JT values (a diagonal's: a scaling) are computed now, on
        the calling thread."""
        shape = self.check_in_shape(self._sizes(in_shape))
        if self._input is None or tuple(self._input.shape[1:]) != shape:
            raise RuntimeError(f"layer {self.label}: call forward on a batch of {shape} first "
                               "(weights_matvec reads its activations)")
        be = _backend.get(device)
        inner_shapes, short_shapes = self._shapes(shape)
        inner = [self._operator(be, layer, x, s) for layer, x, s in
                 zip(self.layers, self._inner_activations, inner_shapes, strict=False)]
        short = [self._operator(be, layer, x, s) for layer, x, s in
                 zip(self.shortcut, self._shortcut_activations, short_shapes, strict=False)]
        return functools.partial(_through_chains, inner, short)

    @staticmethod
    def _operator(be: _backend.Backend, layer: Layer, x: Array, shape: Shape) -> Callable[[Array], Array]:
        """``g -> JT @ g`` of one inner layer at its input ``x``, on ``be``: through its weights, by its
        operator from the input (``Layer.input_matvec``), else by its JT's values."""
        if layer.weights_path(shape) is not None:
            return layer.weights_matvec(shape, be.name)
        operator = layer.input_matvec(be.asarray(x))
        if operator is not None:
            return operator
        jt = layer.transposed_jacobian(be.asarray(x))
        return functools.partial(_matvec, be, jt, layer.jacobian_kind == "diagonal")

    # --- parameter gradients -------------------------------------------------------------------
    def parameter_gradients(self, x: Array, grad_out: Array) -> dict[str, Array]:
        """Every inner and shortcut layer's parameter gradients (paper Eq. 2) from the gradient
        ``grad_out`` w.r.t. the block's output, back-propagated through both chains; named as
        :meth:`named_children` prefixes them (``"0.weight"``, ``"shortcut.0.weight"``; a nested block
        that is not ``scoped`` names its own layers' alone). On ``x``'s
        device, wherever the backward ran."""
        x = self._check_input(x)
        be = _backend.of(x)
        batch = x.shape[0]
        inner, short = self._activations(x)
        inner_shapes, short_shapes = self._shapes(tuple(x.shape[1:]))
        grads: dict[str, Array] = {}
        chains = ((self.layers, inner, inner_shapes, [name for name, _ in self.named_children()]),
                  (self.shortcut, short, short_shapes,
                   [name for name, _ in self.named_children()[len(self.layers):]]))
        for layers, activations, shapes, names in chains:
            g = be.asarray(grad_out).reshape(batch, -1)
            for index in range(len(layers) - 1, -1, -1):
                layer, a = layers[index], activations[index]
                if hasattr(layer, "parameter_gradients"):
                    for key, value in layer.parameter_gradients(a, g.reshape((batch,) + shapes[index + 1])
                                                                ).items():
                        grads[scoped_name(names[index], layer, key)] = value
                if index:
                    g = self._operator(be, layer, a, shapes[index])(g)
        return grads


def _through_chains(inner: Sequence[Callable[[Array], Array]], short: Sequence[Callable[[Array], Array]],
                    g: Array) -> Array:
    """``JT_1 (… JT_k g) + JT_s g`` from the chains' operators."""
    f, s = g, g
    for operator in reversed(inner):
        f = operator(f)
    for operator in reversed(short):
        s = operator(s)
    return f + s
