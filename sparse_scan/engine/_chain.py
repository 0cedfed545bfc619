"""What the planner knows of a chain of transposed Jacobians: one frozen record of plain data.

The model describes its chain once per plan (:class:`ChainInfo`): per scan element its shape, ``nnz``,
kind and whether its values are shared by the batch (:class:`ElementInfo`), the gradients' sizes and
channels, each layer's path through its weights and the layers' names for error messages, and the
patterns of the elements whose products the schedule computes
(:func:`~sparse_scan.engine.plan.operands_needing_patterns`, a pure function of the schedule). The
planner reads this record only: it never calls back into the model or its layers.

Scan element ``j`` (``1..n``) is the JT of layer ``n - j``; vector ``j`` (``0..n``) is the gradient
w.r.t. that layer's input, vector ``0`` the one w.r.t. the chain's output (``g_n``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..csr import Pattern
from ._weights_path import WeightsPath
from .schedule import Element

if TYPE_CHECKING:
    from .plan import Step

__all__ = ["ChainInfo", "ElementInfo"]


@dataclass(frozen=True)
class ElementInfo:
    """What planning needs of a scan matrix without its pattern's arrays: an mv step needs only this;
    the operands of a product need the pattern too.

    Attributes
    ----------
    shape : tuple of int
        ``(rows, cols)`` of the JT (or product).
    nnz : int
        Stored entries of its pattern.
    kind : {"general", "diagonal", "selection"}
    shared : bool
        Whether its values are the same for every sample.
    fill_flops : int
        FLOPs per sample of computing its values beyond writing them: the products of JTs that make a
        residual block's JT (:meth:`sparse_scan.layers.Layer.jacobian_fill_flops`); 0 for a layer
        whose values are written from its input and weights.
    """

    shape: tuple[int, int]
    nnz: int
    kind: str
    shared: bool
    fill_flops: int = 0


@dataclass(frozen=True)
class ChainInfo:
    """A chain of ``n`` JTs as the planner sees it (:func:`~sparse_scan.engine.plan.build_plan`).

    Attributes
    ----------
    elements : tuple of ElementInfo
        ``elements[j - 1]`` describes scan element ``j``.
    vector_sizes : tuple of int
        ``vector_sizes[j]``: length of gradient ``j`` (``j = 0..n``).
    vector_channels : tuple of int
        ``vector_channels[j]``: its channels (``C`` of ``(C, H, W)``, ``F`` of ``(F,)``, 1 for a
        scalar per sample): products of dense channel blocks run as batched GEMMs.
    names : tuple of str
        ``names[j - 1]``: the name of element ``j``'s layer, for error messages.
    weights : tuple of WeightsPath or None
        ``weights[j - 1]``: how element ``j``'s layer applies its JT through its weights, or None.
    patterns : mapping of int to Pattern
        The patterns of the elements the schedule's products read, by ``j`` (read-only; empty for an
        estimate, which builds none).

    Examples
    --------
    A ReLU then a linear layer of 4 -> 3 features (element 1 is the linear layer's JT):

    >>> chain = ChainInfo(elements=(ElementInfo((4, 3), 12, "general", True),
    ...                             ElementInfo((4, 4), 4, "diagonal", False)),
    ...                   vector_sizes=(3, 4, 4), vector_channels=(3, 4, 4), names=("fc", "relu"),
    ...                   weights=(WeightsPath(12), None))
    >>> chain.n, chain.describe(Element(1, 1)), chain.describe(Element(1, 2))
    (2, "layer 'fc'", "layers 'relu'..'fc'")
    """

    elements: tuple[ElementInfo, ...]
    vector_sizes: tuple[int, ...]
    vector_channels: tuple[int, ...]
    names: tuple[str, ...]
    weights: tuple[WeightsPath | None, ...]
    patterns: Mapping[int, Pattern] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.elements)
        sizes = {"vector_sizes": len(self.vector_sizes) - 1, "vector_channels": len(self.vector_channels) - 1,
                 "names": len(self.names), "weights": len(self.weights)}
        for name, size in sizes.items():
            if size != n:
                raise ValueError(f"ChainInfo: {name} describes {size} elements, elements {n}")
        unknown = sorted(j for j in self.patterns if not 1 <= j <= n)
        if unknown:
            raise ValueError(f"ChainInfo: patterns of elements {unknown}: the chain has elements 1..{n}")
        object.__setattr__(self, "patterns", types.MappingProxyType(dict(self.patterns)))

    @property
    def n(self) -> int:
        """Number of JTs in the chain."""
        return len(self.elements)

    def describe(self, segment: Element) -> str:
        """Names a segment of the scan's elements by its layers, in the model's order."""
        first, last = self.names[segment.hi - 1], self.names[segment.lo - 1]
        return f"layer {first!r}" if segment.lo == segment.hi else f"layers {first!r}..{last!r}"

    def describe_step(self, step: Step) -> str:
        """Names a product step of a plan (:class:`~sparse_scan.engine.plan.Step`, built or estimated)
        by its level, phase and operands."""
        return (f"scan step at level {step.level} ({step.phase} phase), the product of "
                f"{self.describe(step.right)} and {self.describe(step.left)}")
