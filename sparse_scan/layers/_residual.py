"""Residual blocks ``y = f(x) + s(x)``: the sum of an inner chain and a shortcut, as one scan element.

A :class:`~sparse_scan.layers.Block` whose join is the sum of two branches: ``f``, a chain of layers
``f_1 .. f_k`` named as the block's own children, and ``s``, the identity or a shortcut chain
(torchvision's ``downsample``: a strided 1x1 convolution and a frozen batch normalisation) named under
``shortcut_name``. Its transposed Jacobian::

    JT = JT_s + JT_f,    JT_f = JT_1 · JT_2 ⋯ JT_k    (grad_in = JT_1 (JT_2 (… JT_k grad_out)))
"""

from __future__ import annotations

from typing import Any, Sequence

from ._base import Layer, Shape
from ._block import Block

__all__ = ["Residual"]


class Residual(Block):
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

    _members = "the inner and shortcut layers"

    def __init__(self, *layers: Layer, shortcut: Layer | Sequence[Layer] | None = None,
                 shortcut_name: str = "shortcut", scoped: bool = True) -> None:
        if not layers:
            raise ValueError("Residual needs at least one inner layer (y = f(x) + s(x))")
        if shortcut is not None and not isinstance(shortcut, Layer) and not (
                isinstance(shortcut, (list, tuple)) and shortcut):
            raise TypeError(f"Residual: shortcut must be None, a Layer or a non-empty list of Layers, got "
                            f"{type(shortcut).__name__}")
        if not isinstance(shortcut_name, str) or not shortcut_name or "." in shortcut_name:
            raise ValueError(f"Residual: shortcut_name must be a non-empty name without dots, got "
                             f"{shortcut_name!r}")
        short: Any = [] if shortcut is None else shortcut
        super().__init__(list(layers), short, join="sum", names=(None, shortcut_name), scoped=scoped)

    @property
    def layers(self) -> list[Layer]:
        """The inner chain ``f``."""
        return list(self.branches[0])

    @property
    def shortcut(self) -> tuple[Layer, ...]:
        """The shortcut chain (empty: the identity)."""
        return self.branches[1]

    @property
    def shortcut_name(self) -> str:
        return str(self.branch_names[1])

    @property
    def _single_shortcut(self) -> bool:
        """Whether the shortcut was given as one layer (named ``shortcut_name`` itself)."""
        return self._singles[1]

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({name}): {layer!r}" for name, layer in self.named_children())
        return f"Residual(\n{inner}\n)"

    def _mismatch(self, in_shape: Shape, branches: Sequence[Sequence[Shape]], need: str) -> ValueError:
        inner, short = branches[0][-1], branches[1][-1]
        which = "the shortcut gives" if self.shortcut else "the identity shortcut keeps"
        hint = "" if self.shortcut else (" (give the block a shortcut= that maps the input to the inner "
                                         "layers' output shape, e.g. a strided 1x1 Conv2d)")
        return self._error("output", f"the inner layers map {in_shape} to {inner} but {which} {short}; "
                           f"y = f(x) + s(x) needs equal shapes{hint}")
