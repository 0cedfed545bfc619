"""Blocks: branches of layers over one input, joined, as one scan element.

A :class:`Block` runs its input through branches ``b_1, b_2, ...``, each a chain of layers (or the
identity), and joins their outputs (:mod:`._joins`): their sum (a residual block, :class:`Residual`),
their concatenation along the channels (Inception, SqueezeNet's fire module, DenseNet's ``cat([x,
f(x)])``) or their product with broadcasting (a squeeze-and-excitation gate). A branch's transposed
Jacobian is its chain's product::

    JT_i = JT_i1 · JT_i2 ⋯ JT_ik    (grad_in = JT_i1 (JT_i2 (… JT_ik grad_out)))

and the block's is the sum of the branches' terms ``JT_i · M_i · D_i`` (``M_i``: where the branch's
output lies in the block's, ``D_i``: a product's scaling by the other branch). The scan sees the
block as one element of kind ``"general"``. Its pattern is planned once per input shape from the
layers' patterns, symbolically: every product with
:func:`~sparse_scan.engine.products.plan_product` (scalings for diagonal factors, dense channel
blocks for unpruned convolutions), each term's columns mapped (an offset, a broadcast's repeats), then
the union of the terms with each one's entry positions in it (:func:`plan_sum`). A batch's values are
the layers' JT values multiplied along those plans (:func:`~sparse_scan.engine.run.multiply`, on the
arrays' device), a product's scaled by the other branch's outputs, and scattered into the union's
entry order: exact, explicit zeros kept, the pattern fixed.

``JT @ g`` also runs without the block's values, through the branches (:meth:`Block.weights_matvec`:
each layer's own path through its weights, or its JT's values for diagonal and other layers):
back-propagation's schedule then never forms the product, which holds more entries than its
factors together. Nested blocks are layers like any other.
"""

from __future__ import annotations

import functools
import math
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
from ._block_counts import BlockCounts, Structure, block_counts
from ._joins import JOINS, ColumnMap, join_maps, join_outputs, scales

__all__ = ["Block", "ChainProduct", "plan_sum"]


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



@dataclass(frozen=True, eq=False)
class _Symbolic:
    """A block's symbolic plan for one input shape (host): per branch its chain's product (None: the
    identity), the entries of that product each of its term's entries copies (None: the same) and the
    term's columns (a product's, for its scaling), and the union of the terms."""

    chains: tuple[ChainProduct | None, ...]
    sources: tuple[np.ndarray | None, ...]
    columns: tuple[np.ndarray | None, ...]
    union: Pattern
    positions: tuple[np.ndarray, ...]


@dataclass(frozen=True, eq=False)
class _Layout:
    """A block's shapes for one input shape: per branch its layers' inputs and its output (input first),
    the block's output, and each branch's :class:`~sparse_scan.layers._joins.ColumnMap`."""

    branches: tuple[tuple[Shape, ...], ...]
    out: Shape
    maps: tuple[ColumnMap, ...]


Branch = Layer | Sequence[Layer]


class Block(Layer):
    """Branches of layers over one input, joined: one scan element whose JT is built from theirs.

    Parameters
    ----------
    *branches : Layer or sequence of Layer
        At least two: each a chain of layers applied in order (a list; empty: the identity), or one
        layer. Unnamed layers of a chain are named by position (``"0"``, ``"1"``, ...), like the
        children of PyTorch's ``nn.Sequential``.
    join : {"sum", "concat", "product"}
        ``sum``: ``y = b_1(x) + b_2(x) + ...`` (equal shapes); ``concat``: ``torch.cat([b_1(x), b_2(x),
        ...], 1)``, along the channels (the other axes equal); ``product``: ``b_1(x) * b_2(x)`` of two
        branches with broadcasting (a ``(C, 1, 1)`` gate over ``(C, H, W)``: the axes equal or 1).
    names : sequence of (str or None), optional
        Each branch's name among the block's children (default its index, ``"0"``, ``"1"``, ...); None:
        the branch's layers are children of the block themselves (the gate of a squeeze-and-excitation
        module: ``"fc1"``, not ``"0.fc1"``). Not used when the block is not ``scoped``.
    scoped : bool
        True: the layers are named under the block, as a PyTorch module's children (below). False: the
        block is a join written inline in a module's forward, and its layers keep their own names in
        the scope that holds the block, so their parameters carry that module's state_dict names.

    Attributes
    ----------
    branches : tuple of tuple of Layer
        The chains (empty: the identity).
    join : str
    branch_names : tuple of (str or None)
    plan_builds : int
        Symbolic plans of the branches' products built (one per input shape and structure; a second
        batch builds none).

    Notes
    -----
    Parameters and their gradients are named like the ``state_dict`` of a PyTorch module holding each
    branch as a child named by ``names`` (an ``nn.Sequential`` for a chain: ``"1.0.weight"``; one layer:
    ``"1.weight"``), or holding a branch named None's layers itself (``"fc1.weight"``).
    :class:`Residual` is the sum of an inner chain and a shortcut, with its own names.

    Examples
    --------
    An Inception-like concatenation of a 1x1 and a 3x3 convolution, and a squeeze-and-excitation gate:

    >>> import numpy as np
    >>> from sparse_scan.layers import AdaptiveAvgPool2d, Block, Conv2d, ReLU, Sigmoid
    >>> mixed = Block([Conv2d(2, 3, 1, dtype=np.float64, rng=0)],
    ...               [Conv2d(2, 4, 3, padding=1, dtype=np.float64, rng=1), ReLU()], join="concat")
    >>> x = np.random.default_rng(0).standard_normal((3, 2, 4, 4))
    >>> mixed(x).shape, mixed.transposed_jacobian(x).shape
    ((3, 7, 4, 4), (32, 112))
    >>> gate = [AdaptiveAvgPool2d(1), Conv2d(2, 1, 1, dtype=np.float64, rng=2), ReLU(),
    ...         Conv2d(1, 2, 1, dtype=np.float64, rng=3), Sigmoid()]
    >>> se = Block([], gate, join="product", names=[None, None])
    >>> jt = se.transposed_jacobian(x)
    >>> jt.shape, jt.data.shape
    ((32, 32), (3, 1024))
    >>> g = np.ones((3, 32))
    >>> bool(np.allclose(se.weights_matvec((2, 4, 4))(g), np.einsum("bij,bj->bi", jt.todense(), g)))
    True
    >>> sorted(se.parameter_gradients(x, np.ones_like(x)))
    ['1.bias', '1.weight', '3.bias', '3.weight']
    >>> Block([Conv2d(2, 3, 1, rng=0)], [], join="sum").forward(x.astype(np.float32))
    Traceback (most recent call last):
    ...
    ValueError: layer Block: output: the branches map (2, 4, 4) to (3, 4, 4), (2, 4, 4); y = b_1(x) + ...
    """

    jacobian_kind = "general"
    parameter_names: tuple[str, ...] = ()
    joins: tuple[str, ...] = JOINS
    """The joins a block takes (:data:`~sparse_scan.layers._joins.JOINS`)."""

    def __init__(self, *branches: Branch, join: str = "sum", names: Sequence[str | None] | None = None,
                 scoped: bool = True) -> None:
        super().__init__()
        owner = type(self).__name__
        self.scoped = flag(scoped, f"{owner}: scoped")
        if not isinstance(join, str) or join not in JOINS:
            raise ValueError(f"{owner}: join must be one of {', '.join(JOINS)}, got {join!r}")
        if len(branches) < 2 or (join == "product" and len(branches) != 2):
            wanted = "two branches" if join == "product" else "at least two branches"
            raise ValueError(f"{owner}: a {join} joins {wanted}, got {len(branches)}")
        names = [str(index) for index in range(len(branches))] if names is None else list(names)
        if len(names) != len(branches) or not all(
                name is None or (isinstance(name, str) and name and "." not in name) for name in names):
            raise ValueError(f"{owner}: names must be one name without dots (or None) per branch, got "
                             f"{names!r}")
        chains, singles = [], []
        for index, branch in enumerate(branches):
            if isinstance(branch, (list, tuple)):
                chain = tuple(branch)
            elif isinstance(branch, Layer):
                chain = (branch,)
            else:
                raise TypeError(f"{owner}: branch {index} must be a Layer or a list of Layers (empty: the "
                                f"identity), got {type(branch).__name__}")
            for position, layer in enumerate(chain):
                if not isinstance(layer, Layer):
                    raise TypeError(f"{owner}: branch {index} layer {position} is a {type(layer).__name__}, "
                                    "not a sparse_scan Layer")
                if layer.name is None:
                    single = isinstance(branch, Layer) and names[index] is not None
                    layer.name = names[index] if single else str(position)
            chains.append(chain)
            singles.append(isinstance(branch, Layer))
        self.branches: tuple[tuple[Layer, ...], ...] = tuple(chains)
        self.join = join
        self.branch_names: tuple[str | None, ...] = tuple(names)
        self._singles = tuple(singles)
        self.sample_independent = join != "product" and all(
            layer.sample_independent for chain in chains for layer in chain)
        self.plan_builds = 0
        paths = [path for path, _ in self.named_children()]
        repeated = sorted({path for path in paths if paths.count(path) > 1})
        if repeated:
            raise ValueError(f"{owner}: {self._members} need unique names: {repeated[0]!r} names "
                             f"{paths.count(repeated[0])} of them")
        self._chains: dict[Hashable, tuple[ChainProduct | None, ...]] = {}
        self._symbolic: dict[Hashable, _Symbolic] = {}
        self._counts: dict[Hashable, BlockCounts] = {}
        self._input: Array | None = None
        self._branch_activations: list[list[Array]] = []
        self._branch_outputs: list[Array] = []

    _members = "the branches' layers"
    """How a message names the layers a block holds."""

    def _branch_children(self) -> list[list[tuple[str, Layer]]]:
        """Per branch, ``(name, layer)`` of its layers as :meth:`named_children` names them."""
        out = []
        for chain, name, single in zip(self.branches, self.branch_names, self._singles, strict=True):
            if not self.scoped or name is None:
                out.append([(str(layer.name), layer) for layer in chain])
            elif single:
                out.append([(name, chain[0])])
            else:
                out.append([(f"{name}.{layer.name}", layer) for layer in chain])
        return out

    def named_children(self) -> list[tuple[str, Layer]]:
        """``(name, layer)`` of every branch's layers, in branch order: ``"<branch>.<name>"`` in a chain,
        ``"<branch>"`` for a branch of one layer, the layer's own ``name`` in a branch named None or
        when the block is not ``scoped``: the prefixes of their parameters' names."""
        return [child for children in self._branch_children() for child in children]

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({name}): {layer!r}" for name, layer in self.named_children())
        return f"{type(self).__name__}(join={self.join!r}\n{inner}\n)"

    # --- shapes --------------------------------------------------------------------------------
    def _layout(self, in_shape: Shape) -> _Layout:
        """The shapes through every branch and how they join, for a per-sample ``in_shape``."""
        branches = []
        for chain in self.branches:
            shapes = [tuple(in_shape)]
            for layer in chain:
                shapes.append(tuple(layer.output_shape(shapes[-1])))
            branches.append(tuple(shapes))
        try:
            out, maps = join_maps(self.join, tuple(shapes[-1] for shapes in branches))
        except ValueError as error:
            raise self._mismatch(tuple(in_shape), branches, str(error)) from None
        return _Layout(tuple(branches), out, maps)

    def _mismatch(self, in_shape: Shape, branches: Sequence[Sequence[Shape]], need: str) -> ValueError:
        """The error of branches whose outputs do not join (``need``: what the join needs)."""
        listed = ", ".join(str(shapes[-1]) for shapes in branches)
        return self._error("output", f"the branches map {in_shape} to {listed}; {need}")

    def check_in_shape(self, in_shape: Shape) -> Shape:
        shape = tuple(int(s) for s in in_shape)
        self._layout(shape)
        return shape

    def output_shape(self, in_shape: Shape) -> Shape:
        return self._layout(tuple(int(s) for s in in_shape)).out

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        """The branches' outputs joined; keeps every layer's input and every branch's output for the
        JT and the parameter gradients."""
        x = self._check_input(x)
        activations, outputs = [], []
        for chain in self.branches:
            values = [x]
            for layer in chain:
                values.append(layer.forward(values[-1]))
            activations.append(values[:-1])
            outputs.append(values[-1])
        self._input, self._branch_activations, self._branch_outputs = x, activations, outputs
        return join_outputs(self.join, outputs)

    def _activations(self, x: Array) -> tuple[list[list[Array]], list[Array]]:
        """Every branch's layers' inputs and its output at ``x``: the last forward's when ``x`` is its
        input array (a Dropout's mask is that forward's), else those of a new forward of ``x``."""
        if x is not self._input:
            self.forward(x)
        return self._branch_activations, self._branch_outputs

    # --- pattern and values --------------------------------------------------------------------
    def _structure_key(self) -> Hashable:
        return tuple(layer._structure_key() for _, layer in self.named_children())

    def _key(self, in_shape: Shape) -> tuple[Shape, Hashable]:
        shape = self.check_in_shape(self._sizes(in_shape))
        return shape, (shape, self._structure_key())

    def _chain_products(self, in_shape: Shape) -> tuple[ChainProduct | None, ...]:
        """Every branch's :class:`ChainProduct` for ``in_shape`` (None: the identity), planned once per
        shape and structure (host)."""
        shape, key = self._key(in_shape)
        chains = self._chains.get(key)
        if chains is None:
            layout = self._layout(shape)
            chains = tuple(ChainProduct.plan(chain, shapes) if chain else None
                           for chain, shapes in zip(self.branches, layout.branches, strict=True))
            self._chains[key] = chains
            self.plan_builds += 1
        return chains

    def _branch_patterns(self, shape: Shape) -> list[Pattern]:
        """Every branch's JT pattern (host): its chain's product's, or the identity's."""
        identity = diagonal_pattern(_backend.get("cpu"), math.prod(shape), None)
        return [identity if chain is None else chain.pattern for chain in self._chain_products(shape)]

    def _plan(self, in_shape: Shape) -> _Symbolic:
        """The block's symbolic plan for ``in_shape`` (host, built once per shape and structure)."""
        shape, key = self._key(in_shape)
        entry = self._symbolic.get(key)
        if entry is None:
            maps = self._layout(shape).maps
            terms = [column_map.columns(pattern)
                     for column_map, pattern in zip(maps, self._branch_patterns(shape), strict=True)]
            union, positions = plan_sum([pattern for pattern, _ in terms])
            columns = tuple(np.asarray(pattern.indices) if self.join == "product" else None
                            for pattern, _ in terms)
            entry = _Symbolic(self._chain_products(shape), tuple(source for _, source in terms), columns,
                              union, tuple(positions))
            self._symbolic[key] = entry
        return entry

    def _block_counts(self, in_shape: Shape) -> BlockCounts:
        """The block's figures for ``in_shape``, counted once per shape and structure from its layers'
        structure (:func:`~sparse_scan.layers._block_counts.block_counts`: exact, no product planned, no
        union formed)."""
        shape, key = self._key(in_shape)
        counted = self._counts.get(key)
        if counted is None:
            layout = self._layout(shape)
            counted = self._counts[key] = block_counts(self.join, self.branches, layout.branches, layout.maps)
        return counted

    def jt_structure(self, in_shape: Shape) -> Structure:
        """The structure of the block's JT pattern for ``in_shape``
        (:class:`~sparse_scan.layers._block_counts.Structure`), for a block holding this one."""
        return self._block_counts(in_shape).structure

    def pattern_nnz(self, in_shape: Shape) -> int:
        """Stored entries of the block's JT, counted without planning a product or forming the union
        (:meth:`_block_counts`; issue 38: a plan's mv steps need only the count)."""
        return self._block_counts(in_shape).nnz

    def jacobian_fill_flops(self, in_shape: Shape) -> int:
        """The products of every branch's JTs (their own layers' fills included, for nested blocks) and
        the join's (:func:`~sparse_scan.layers._joins.fill_flops`: a sum's adds, a product's scalings and
        add)."""
        shape = self.check_in_shape(self._sizes(in_shape))
        own = sum(layer.jacobian_fill_flops(s) for chain, shapes in
                  zip(self.branches, self._layout(shape).branches, strict=True)
                  for layer, s in zip(chain, shapes[:-1], strict=True))
        return self._block_counts(shape).product_flops + own

    def _build_pattern(self, be: _backend.Backend, in_shape: Shape,
                       index_dtype: Any) -> tuple[Pattern, dict[str, Any]]:
        symbolic = self._plan(in_shape)
        union = symbolic.union
        dtype = choose_index_dtype(union.nnz, union.shape[1], index_dtype)
        pattern = Pattern(be.asarray(union.indptr.astype(dtype, copy=False)),
                          be.asarray(union.indices.astype(dtype, copy=False)), union.shape)

        def device(arrays: Sequence[np.ndarray | None]) -> list[Array | None]:
            return [None if array is None else be.asarray(array) for array in arrays]

        return pattern, {"positions": device(symbolic.positions), "sources": device(symbolic.sources),
                         "columns": device(symbolic.columns), "symbolic": symbolic}

    def _values(self, be: _backend.Backend, x: Array, pattern: Pattern, aux: dict[str, Any]) -> Array:
        symbolic: _Symbolic = aux["symbolic"]
        activations, outputs = self._activations(x)
        products = [None if chain is None else chain.values(layers, inputs) for chain, layers, inputs in
                    zip(symbolic.chains, self.branches, activations, strict=True)]
        found = [data for data in products if data is not None]
        dtype = np.result_type(*(data.dtype for data in found)) if found else x.dtype
        size = math.prod(x.shape[1:])
        layout = self._layout(tuple(x.shape[1:]))
        terms = []
        for data, source, columns, scale in zip(products, aux["sources"], aux["columns"],
                                                scales(self.join, layout.maps, outputs), strict=True):
            data = be.xp.ones(size, dtype=dtype) if data is None else data
            data = data if source is None else data[..., source]
            terms.append(data if scale is None else data * scale[:, columns])
        lead = max((term.shape[:-1] for term in terms), key=len)
        out = be.xp.zeros(lead + (pattern.nnz,), dtype=np.result_type(*(term.dtype for term in terms)))
        out[..., aux["positions"][0]] = terms[0]
        for term, positions in zip(terms[1:], aux["positions"][1:], strict=True):
            out[..., positions] += term
        return out

    # --- JT @ g through the branches ----------------------------------------------------------
    def weights_path(self, in_shape: Shape) -> WeightsPath:
        """``JT @ g`` through the branches: per layer its own path through its weights (its GEMM's
        multiply-adds; a CSR path's stored entries) or its JT's SpMV (``pattern_nnz``), and a product's
        scalings. The planner compares that with the block's ``nnz``
        (:func:`~sparse_scan.engine._weights_path.gemm_pays`): a product holds more entries than its
        factors together, so every block with a convolution or more than one layer takes it."""
        layout = self._layout(self.check_in_shape(self._sizes(in_shape)))
        cost = weights = taps = 0
        for chain, shapes in zip(self.branches, layout.branches, strict=True):
            for layer, shape in zip(chain, shapes, strict=False):
                path = layer.weights_path(shape)
                cost += layer.pattern_nnz(shape) if path is None or path.csr else path.multiply_adds
                weights += 0 if path is None else path.weights
                taps += 0 if path is None else path.taps
        if self.join == "product":
            cost += 2 * math.prod(layout.out)
        calls = sum(len(chain) for chain in self.branches) + 1
        return WeightsPath(cost, calls=calls, weights=weights, taps=taps)

    def weights_matvec(self, in_shape: Shape, device: str = "cpu") -> Callable[[Array], Array]:
        """``g -> JT @ g`` for batches ``(B, out_size) -> (B, in_size)`` at the last :meth:`forward`,
        without the block's JT: ``g`` (a product's scaled by the other branch's outputs) mapped to each
        branch's output (its columns, a broadcast's sum) and back through the branch, summed. Layers
        with a path through their weights use it, those with an operator from their input (ReLU) that;
        the others' JT values (a diagonal's: a scaling) are computed now, on the calling thread."""
        shape = self.check_in_shape(self._sizes(in_shape))
        if self._input is None or tuple(self._input.shape[1:]) != shape:
            raise RuntimeError(f"layer {self.label}: call forward on a batch of {shape} first "
                               "(weights_matvec reads its activations)")
        be = _backend.get(device)
        layout = self._layout(shape)
        operators = [[self._operator(be, layer, x, s) for layer, x, s in zip(chain, inputs, shapes,
                                                                            strict=False)]
                     for chain, inputs, shapes in
                     zip(self.branches, self._branch_activations, layout.branches, strict=True)]
        outputs = [be.asarray(output) for output in self._branch_outputs]
        return functools.partial(_through_branches, operators, layout.maps,
                                 scales(self.join, layout.maps, outputs))

    @staticmethod
    def _operator(be: _backend.Backend, layer: Layer, x: Array, shape: Shape) -> Callable[[Array], Array]:
        """``g -> JT @ g`` of one layer at its input ``x``, on ``be``: through its weights, by its
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
        """Every layer's parameter gradients (paper Eq. 2) from the gradient ``grad_out`` w.r.t. the
        block's output, mapped to each branch's output and back-propagated through the branch; named as
        :meth:`named_children` prefixes them (``"0.weight"``, ``"shortcut.0.weight"``; a nested block
        that is not ``scoped`` names its own layers' alone). On ``x``'s device, wherever the backward
        ran."""
        x = self._check_input(x)
        be = _backend.of(x)
        batch = x.shape[0]
        activations, outputs = self._activations(x)
        layout = self._layout(tuple(x.shape[1:]))
        g_out = be.asarray(grad_out).reshape(batch, -1)
        grads: dict[str, Array] = {}
        for chain, inputs, shapes, children, column_map, scale in zip(
                self.branches, activations, layout.branches, self._branch_children(), layout.maps,
                scales(self.join, layout.maps, outputs), strict=True):
            g = column_map.gradient(g_out if scale is None else g_out * scale)
            for index in range(len(chain) - 1, -1, -1):
                layer, a = chain[index], inputs[index]
                if hasattr(layer, "parameter_gradients"):
                    for key, value in layer.parameter_gradients(a, g.reshape((batch,) + shapes[index + 1])
                                                                ).items():
                        grads[scoped_name(children[index][0], layer, key)] = value
                if index:
                    g = self._operator(be, layer, a, shapes[index])(g)
        return grads


def _through_branches(operators: Sequence[Sequence[Callable[[Array], Array]]], maps: Sequence[ColumnMap],
                      scalings: Sequence[Array | None], g: Array) -> Array:
    """``Σ_i JT_i1 (… JT_ik (M_i (D_i g)))`` from the branches' operators."""
    total = None
    for chain, column_map, scale in zip(operators, maps, scalings, strict=True):
        h = column_map.gradient(g if scale is None else g * scale)
        for operator in reversed(chain):
            h = operator(h)
        total = h if total is None else total + h
    return total
