"""The model protocol: what the command line, :mod:`sparse_scan.flops` and :mod:`sparse_scan.train` ask of
a model, whatever its kind.

Two kinds implement it: :class:`~sparse_scan.Sequential` (a chain of layers; its backward is a scan
over their sparse transposed Jacobians) and :class:`~sparse_scan.recurrent.RecurrentClassifier` (a
recurrent layer and its linear head; its backward is a scan over dense blocks per layer and
direction). :func:`sparse_scan.load_model` gives either. Code that takes a :class:`Model` (the
``run``, ``flops``, ``train`` and ``eval`` commands, :func:`sparse_scan.flops.analyse`,
:func:`sparse_scan.train.train`, the optimizers, :mod:`sparse_scan.weights`) calls what the protocol
names and never asks which kind it holds. What differs between the kinds is said by the model: the
plan it builds (:class:`ModelPlan`), the phases its backward times, the computation its gradients are
checked against (:meth:`Model.check_reference`), the JTs its scan runs over
(:meth:`Model.jacobian_sizes`).

Examples
--------
>>> import numpy as np
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Flatten, Linear
>>> from sparse_scan.recurrent import RNN, RecurrentClassifier
>>> models = [Sequential(Flatten(), Linear(12, 3, rng=0), input_shape=(4, 3)),
...           RecurrentClassifier(RNN(3, 5, rng=0), classes=3, rng=1, input_shape=(4, 3))]
>>> for model in models:
...     assert isinstance(model, Model)
...     plan = model.plan(method="blelloch", batch=2)
...     logits = model.forward(np.ones((2, 4, 3), np.float32))
...     grads = model.backward(np.ones_like(logits), plan.method, plan.levels)
...     print(type(model).__name__, plan.explain(2)["method"], sorted(model.parameter_gradients(grads))[:2],
...           [size.name for size in model.jacobian_sizes()])
Sequential blelloch ['1.bias', '1.weight'] ['0', '1']
RecurrentClassifier blelloch ['fc.bias', 'fc.weight'] ['rnn.l0']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

from ._types import Array
from .engine.figures import ScanPlanLike

if TYPE_CHECKING:
    from .csr import BatchedCSR

__all__ = ["JacobianSize", "Model", "ModelPlan"]


@dataclass(frozen=True)
class JacobianSize:
    """One kind of transposed Jacobian a model's scan runs over, for one sample: a layer's, or a
    recurrent scan's blocks.

    Attributes
    ----------
    name : str
        The layer's name, or the scan's (``rnn.l0``, ``rnn.l1_reverse``).
    type : str
        The layer's class name, or ``dense`` for a recurrent scan's blocks.
    shape : (int, int)
        ``(in_size, out_size)``.
    nnz : int
        Stored entries (every entry of a dense block).
    blocks : int
        How many JTs of this size the scan runs over: 1 for a layer, ``T`` for a recurrent scan.
    """

    name: str
    type: str
    shape: tuple[int, int]
    nnz: int
    blocks: int = 1


@runtime_checkable
class ModelPlan(ScanPlanLike, Protocol):
    """A model's planned backward: :class:`~sparse_scan.engine.plan.ScanPlan` (a
    :class:`~sparse_scan.Sequential`'s) or :class:`~sparse_scan.recurrent.RecurrentPlan`: a
    :class:`~sparse_scan.engine.figures.ScanPlanLike` (the same figures in the same units) that says
    what it is for a device, and why it was chosen."""

    def peak_bytes(self, batch: int, itemsize: int, device: str | None = None) -> int:
        """Most bytes of scan values live at once, for ``batch`` samples on ``device``."""

    def report(self, batch: int = 1, itemsize: int = 4, device: str | None = None) -> dict[str, Any]:
        """Per-step figures and totals (JSON-friendly), ``peak_bytes`` on ``device``."""

    def explain(self, batch: int = 1, itemsize: int = 4, device: str | None = None) -> dict[str, Any]:
        """The schedule and why (JSON-friendly): ``method``, ``levels``, ``requested``, ``reason``,
        ``critical_flops``, ``work_flops``, ``critical_steps``, ``plan_bytes``, ``peak_bytes``,
        ``fill_flops`` and, for a chosen schedule, the ``candidates`` considered."""


@runtime_checkable
class Model(Protocol):
    """A model whose backward pass is a planned scan (module docstring).

    Attributes
    ----------
    layers : list
        Its layers, in order: what :mod:`sparse_scan.optim` and :mod:`sparse_scan.weights` walk.
    input_shape : tuple of int or None
        One sample's shape, when known (a loaded spec sets it).
    plan_builds : int
        How many plans were built; a cached plan serves every later request for it.
    """

    layers: list[Any]
    input_shape: tuple[int, ...] | None
    plan_builds: int

    def shapes(self, in_shape: Sequence[int]) -> list[tuple[int, ...]]:
        """Per-sample shapes of the activations the backward returns gradients for, input first and
        output last."""

    def forward(self, x: Array) -> Array:
        """The output of the batch ``x`` (NumPy: CPU, CuPy: GPU); keeps what the backward needs."""

    def __call__(self, x: Array) -> Array:
        """:meth:`forward`."""

    def non_finite_output(self) -> str | None:
        """The name of the first layer whose output at the last :meth:`forward` holds NaN or Inf."""

    def plan(self, in_shape: Sequence[int] | None = None, method: str = "auto",
             levels: int | str | None = None, *, batch: int = 1, device: str = "cpu",
             max_step_flops: int | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> ModelPlan:
        """The plan the backward runs for ``method``/``levels`` (cached), for ``in_shape`` (by default
        :attr:`input_shape`), chosen for ``batch`` samples on ``device`` where the choice depends on
        them; a schedule with a step costlier than ``max_step_flops`` is refused
        (:class:`~sparse_scan.ScanCostError`); ``progress(phase, done, total)`` while it is built."""

    def backward(self, grad_out: Array, method: str = "auto", levels: int | str | None = None,
                 device: str | None = None, timings: dict[str, float] | None = None,
                 input_gradient: bool = True, parameters_beside: bool = False) -> list[Array | None]:
        """Gradients w.r.t. every activation of :meth:`shapes` (batch first), by the scan of
        ``method``/``levels`` (``auto``: :meth:`plan`'s choice), from ``grad_out``, the gradient
        w.r.t. the output of the last :meth:`forward`; ``timings`` receives the seconds of the
        backward's phases, named as the model times them. With ``input_gradient`` False the
        model input's gradient is not wanted: a model may skip its work and return None in its
        place (:meth:`parameter_gradients` never reads it). With ``parameters_beside`` the caller asks
        for :meth:`parameter_gradients` of the list returned next: a model may start them while its
        scan goes on."""

    def parameter_gradients(self, grads: Sequence[Array],
                            timings: dict[str, float] | None = None) -> dict[str, Array]:
        """Every parameter's gradient by state_dict name, summed over the batch like PyTorch's, from
        :meth:`backward`'s result; ``timings`` receives the seconds they took where they are a phase
        of their own."""

    def check_reference(self, method: str) -> str:
        """The computation :meth:`check_backward` checks the schedule ``method``'s gradients against,
        a different one: another schedule (``linear``, ``blelloch``) or ``layerwise``."""

    def check_backward(self, grad_out: Array, method: str) -> list[Array]:
        """:meth:`backward`'s gradients by :meth:`check_reference` of ``method`` (arrays on the
        forward's device); :meth:`parameter_gradients` takes them."""

    def jacobian_sizes(self, in_shape: Sequence[int] | None = None) -> list[JacobianSize]:
        """The transposed Jacobians the scan runs over for ``in_shape`` (by default
        :attr:`input_shape`), in the model's order."""

    def transposed_jacobians(self) -> list[BatchedCSR]:
        """The sparse JT of every layer at the last :meth:`forward`; ValueError for a model whose
        JTs are dense blocks built inside its scans (a recurrent one)."""

    def state_dict(self) -> dict[str, Array]:
        """Every parameter by ``"<layer>.<name>"`` (the arrays themselves)."""

    def load_state_dict(self, state: dict[str, Array], strict: bool = True) -> None:
        """Copy parameters in by :meth:`state_dict` name."""

    def train(self, mode: bool = True) -> Model:
        """Every layer in training mode (``mode=True``) or eval mode, like PyTorch's; returns self."""

    def eval(self) -> Model:
        """Every layer in eval mode; returns self."""
