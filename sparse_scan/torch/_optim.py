"""``torch.optim.Adam`` whose step over a pruned layer's ``weight_orig`` moves only the weights it can.

A layer pruned with ``torch.nn.utils.prune`` trains ``weight_orig`` through ``weight_orig * weight_mask``:
its gradient is zero at every pruned weight, so ``torch.optim.Adam`` leaves those weights where they are
(zero gradient, zero moments: a step of exactly zero), yet its default implementation reads and writes
every one of them in about ten passes over all the weights. :class:`PrunedAdam` is ``torch.optim.Adam`` whose
step over such a parameter runs PyTorch's own update function on the weights that can move: their
values and gradients gathered, updated with their moments (held at those weights alone), scattered
back. Its trajectory is ``torch.optim.Adam``'s bit for bit (PyTorch's default and ``foreach`` updates
round each value the same wherever it sits in a tensor).

The weights that can move are those the mask keeps and those whose moments are not zero (pruned since,
by a new mask). The step is taken over them alone where the gradient is zero at every other weight: it
is counted (one read of it) and gathered at the moving weights. With ``trusted_gradients=True``,
:func:`~sparse_scan.torch._bridge.pruned_gradient` proves that in O(1) for the gradient the bridge gave
(its memory and version unchanged) and hands the engine's values of it at the kept weights, and the
dense gradient is not read; a gradient changed since (clipped, accumulated, a hook's) is counted as
before. It is not the default: a write that no version counts (``p.grad.data.clamp_(...)``, a NumPy or
DLPack view) would go unseen, and the count costs 4-5 ms a step on the 97 %-pruned VGG-11. A
gradient that is not zero elsewhere (a penalty on ``weight_orig``, NaN from a dense product) gets the
dense step, as does every parameter the bridge gave no pruned gradient, one with more than
:data:`DENSE_ABOVE` of its weights moving, and every parameter of a ``fused=True`` group: PyTorch's
fused kernel rounds a tensor's last values (past its last whole SIMD vector) in other code than the
rest, so the same update on a compact tensor would not be its trajectory bit for bit, and it streams
every weight as fast as the compact step reaches the kept ones (the 97 %-pruned VGG-11, 2-core AMD
EPYC, in the bridge's iteration: fused dense 3.1-4.7 ms a step; the default implementation 20-23 ms
dense against 10.5-11.0 compact, 4.0-6.2 with ``trusted_gradients``). The gathers wait on memory, not
on a core: 39 % of the cache lines hold a kept weight at 3 % kept, and a compiled gather on two threads
was no faster than ``index_select``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam

from ._bridge import _seen, pruned_gradient

__all__ = ["PrunedAdam"]

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""The state of ``torch.optim.Adam`` shaped like its parameter (``step`` is a scalar)."""

DENSE_ABOVE = 0.5
"""The share of a parameter's weights moving above which its step stays dense. Measured on one tensor
of 2.36 M weights (VGG-11's conv6, 2-core AMD EPYC, caches cold, the default implementation): compact
against dense 1.9 against 6.3 ms with 3 % moving, 5.2 against 7.8 at 50 %, 6.7 against 6.3 at 70 %."""


@dataclass
class _Kept:
    """A parameter stepped compactly: where its moving weights are and the tensor they are updated in."""

    index: torch.Tensor | None  # int64, sorted: the moving weights (None: the dense step, for this mask)
    leaf: torch.Tensor | None  # the stand-in: the parameter's values there, the tensor the update runs on
    mask: torch.Tensor  # the mask the index was built from
    mask_seen: tuple[int, int]  # its (address, version) then


class PrunedAdam(torch.optim.Adam):
    """``torch.optim.Adam`` that steps a pruned layer's ``weight_orig`` at the weights that can move.

    Takes ``torch.optim.Adam``'s arguments and gives its trajectory bit for bit: the update is
    PyTorch's own function on the gathered values. A parameter whose gradient the bridge
    (:func:`~sparse_scan.torch.bppsa`) computed for a ``torch.nn.utils.prune`` mask is stepped at the
    kept weights and those whose moments are not zero; every other parameter, and one whose gradient
    is not zero elsewhere, by the dense step.

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups, as ``torch.optim.Adam``'s.
    *args, **kwargs
        ``torch.optim.Adam``'s hyper-parameters. ``weight_decay`` moves every weight of
        ``weight_orig``, pruned ones included: a group holding a pruned parameter must have
        ``weight_decay=0`` (refused at the step otherwise). ``differentiable=True`` is refused.
    trusted_gradients : bool, optional
        True: a pruned gradient the bridge computed and nothing has changed by a counted write (its
        memory and version as autograd stored them) is stepped with the engine's values at the kept
        weights, without reading ``.grad`` (faster: the 97 %-pruned VGG-11's step 4-5 ms shorter).
        Only for a loop that writes no gradient through ``.data``, NumPy or DLPack (writes no version
        counts: they would go unseen). False (the default): every pruned gradient is read, whatever
        wrote it.

    Notes
    -----
    The state of a compactly stepped parameter is held at its moving weights (``opt.state[p]`` is
    empty for it); :meth:`state_dict` gives ``torch.optim.Adam``'s dense state (copies of those
    moments), which ``torch.optim.Adam`` and this class load alike.

    Examples
    --------
    >>> import torch
    >>> import torch.nn.utils.prune as prune
    >>> import sparse_scan.torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    >>> _ = prune.l1_unstructured(net[0], "weight", amount=0.97)
    >>> bnet = sparse_scan.torch.bppsa(net)
    >>> opt = sparse_scan.torch.PrunedAdam(net.parameters(), lr=1e-3)
    >>> bnet(torch.randn(8, 64)).square().sum().backward()
    >>> opt.step()                                   # 123 of net[0]'s 4096 weights read and written
    >>> opt.moving(net[0].weight_orig)
    123
    """

    def __init__(self, params: Iterable[Any], *args: Any, trusted_gradients: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.trusted_gradients = bool(trusted_gradients)
        if any(group["differentiable"] for group in self.param_groups):
            raise ValueError("sparse_scan.torch.PrunedAdam: differentiable=True is not supported (the step "
                             "gathers and scatters the weights); use torch.optim.Adam")
        self._kept: dict[torch.Tensor, _Kept] = {}

    def moving(self, parameter: torch.Tensor) -> int | None:
        """How many weights of ``parameter`` the last step read and wrote (None: every one, densely)."""
        kept = self._kept.get(parameter)
        return None if kept is None or kept.index is None else kept.index.numel()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of ``torch.optim.Adam`` (the closure, if any, reevaluates the model first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for number, group in enumerate(self.param_groups):
            stand_ins = [self._stand_in(p, group, number) for p in group["params"]]
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            has_complex = self._init_group({**group, "params": stand_ins}, *lists)
            beta1, beta2 = group["betas"]
            options = {key: group[key] for key in ("foreach", "capturable", "differentiable", "fused",
                                                   "decoupled_weight_decay") if key in group}
            adam(*lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], grad_scale=getattr(self, "grad_scale", None),
                 found_inf=getattr(self, "found_inf", None), **options)
            for parameter, stand_in in zip(group["params"], stand_ins, strict=True):
                if stand_in is not parameter:
                    parameter.view(-1).index_copy_(0, self._kept[parameter].index, stand_in)
                    stand_in.grad = None
        return loss

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Adam``'s state dict: every moment dense (copies, for the compactly held ones)."""
        held = {parameter: self.state.pop(kept.leaf) for parameter, kept in self._kept.items()
                if kept.leaf is not None and kept.leaf in self.state}
        for parameter, state in held.items():
            self.state[parameter] = _densified(parameter, self._kept[parameter].index, state)
        try:
            return super().state_dict()
        finally:
            for parameter, state in held.items():
                del self.state[parameter]
                self.state[self._kept[parameter].leaf] = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``torch.optim.Adam``'s (or this class's) state dict."""
        super().load_state_dict(state_dict)
        self._kept.clear()  # the compact state was replaced: the next step compacts the loaded one

    # --- the stand-ins ------------------------------------------------------------------------
    def _stand_in(self, parameter: torch.Tensor, group: dict[str, Any], number: int) -> torch.Tensor:
        """The tensor the group's update runs on for ``parameter``: itself (the dense step), or the
        values at its moving weights with their gradient."""
        grad = parameter.grad
        if grad is None:  # no step for it (PyTorch's skips it too): its state stays as it is held
            return parameter
        given = None if group["fused"] else pruned_gradient(parameter)
        if given is None or grad.is_sparse or not parameter.is_contiguous():
            self._dense(parameter)
            return parameter
        if group["weight_decay"] != 0:
            raise ValueError(f"sparse_scan.torch.PrunedAdam: parameter group {number} has weight_decay="
                             f"{group['weight_decay']} and a pruned layer's weight_orig: the decay moves "
                             "every weight, the pruned ones too; give the pruned weights a group with "
                             "weight_decay=0, or use torch.optim.Adam")
        mask, proven = given
        if not self.trusted_gradients:
            proven = None  # read: a write through .data or a view changes no version
        kept = self._kept.get(parameter)
        if kept is None or kept.mask is not mask or kept.mask_seen != _seen(mask):
            kept = self._compact(parameter, mask)
        if kept.index is None:
            return parameter
        flat = grad.reshape(-1)
        if proven is not None and proven.numel() == kept.index.numel():
            values = proven  # the engine's values at the kept weights: the gradient not read again
        else:
            values = flat.index_select(0, kept.index)
        if proven is None and _moves_elsewhere(flat, values):
            self._dense(parameter)
            self._kept[parameter] = _Kept(None, None, mask, _seen(mask))  # its moments move them all now
            return parameter
        torch.index_select(parameter.view(-1), 0, kept.index, out=kept.leaf)  # the weights' values of now
        kept.leaf.grad = values
        return kept.leaf

    def _compact(self, parameter: torch.Tensor, mask: torch.Tensor) -> _Kept:
        """Hold ``parameter``'s state at the weights that can move: those ``mask`` keeps and those
        whose moments are not zero (NaN included)."""
        self._dense(parameter)
        state = self.state.pop(parameter, {})
        moving = mask.reshape(-1) != 0
        for key in MOMENTS:
            if key in state:
                moving |= state[key].reshape(-1) != 0
        if int(moving.sum()) > moving.numel() * DENSE_ABOVE:
            self.state[parameter] = state
            self._kept[parameter] = _Kept(None, None, mask, _seen(mask))
            return self._kept[parameter]
        index = moving.nonzero().reshape(-1)
        kept = _Kept(index, parameter.reshape(-1)[index], mask, _seen(mask))
        if state:
            self.state[kept.leaf] = {key: value.reshape(-1)[index] if key in MOMENTS else value
                                     for key, value in state.items()}
        self._kept[parameter] = kept
        return kept

    def _dense(self, parameter: torch.Tensor) -> None:
        """Hold ``parameter``'s state densely again."""
        kept = self._kept.pop(parameter, None)
        if kept is not None and kept.leaf is not None and kept.leaf in self.state:
            self.state[parameter] = _densified(parameter, kept.index, self.state.pop(kept.leaf))


def _densified(parameter: torch.Tensor, index: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
    """A compact state as ``torch.optim.Adam`` holds it: each moment the parameter's shape, zero where
    it could not move."""
    return {key: torch.zeros_like(parameter).view(-1).index_copy_(0, index, value).view_as(parameter)
            if key in MOMENTS else value for key, value in state.items()}


def _moves_elsewhere(flat: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the gradient ``flat`` is not zero somewhere outside the positions ``values`` were
    gathered from (a NaN counts as not zero)."""
    return bool(torch.count_nonzero(flat) != torch.count_nonzero(values))
