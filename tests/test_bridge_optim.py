"""``sparse_scan.torch.PrunedAdam``: ``torch.optim.Adam``'s trajectory bit for bit, the pruned weights
left out of the step (issue 45).

The oracle is ``torch.optim.Adam`` itself on a copy of the same network, pruned alike, trained through
the bridge on the same batches: every parameter, every moment, every step equal (``torch.equal``, NaN
equal to NaN), for PyTorch's three implementations, ``amsgrad`` and ``maximize``, float32 and float64;
through masks changed during training, gradients changed after the backward (clipping, accumulation, a
penalty on the pruned weights, NaN), both ways of ``state_dict``, and groups with weight decay.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional
prune = pytest.importorskip("torch.nn.utils.prune")

import sparse_scan.torch._optim as optim_module  # noqa: E402 - after the skip
from sparse_scan.torch import PrunedAdam, bppsa  # noqa: E402
from sparse_scan.torch._bridge import pruned_gradient  # noqa: E402


def network() -> nn.Module:
    """Two convolutions and two fully connected layers; the first three (:data:`PRUNED`) are pruned."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 2 * 2, 16), nn.ReLU(), nn.Linear(16, 5))


PRUNED = ("0", "3", "7")


def pair(dtype=torch.float64, amount: float = 0.9) -> tuple[nn.Module, nn.Module]:
    """Two equal networks, the same layers pruned alike."""
    torch.manual_seed(0)
    net = network().to(dtype)
    twin = copy.deepcopy(net)
    for model in (net, twin):
        for name in PRUNED:
            prune.l1_unstructured(model.get_submodule(name), "weight", amount=amount)
    return net, twin


def data(count: int, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 1, 12, 12, generator=generator, dtype=dtype),
             torch.randint(0, 5, (4,), generator=generator)) for _ in range(count)]


def optimizers(net: nn.Module, twin: nn.Module, trusted: bool = False,
               **options) -> tuple[PrunedAdam, torch.optim.Optimizer]:
    """Ours on ``net`` (``trusted_gradients=trusted``), ``torch.optim.Adam`` on ``twin``, the same
    options."""
    return (PrunedAdam(net.parameters(), lr=1e-2, trusted_gradients=trusted, **options),
            torch.optim.Adam(twin.parameters(), lr=1e-2, **options))


def train(net: nn.Module, optimizer: torch.optim.Optimizer, batches, between=None) -> list[float]:
    """The training loop through the bridge; ``between(net, i)`` runs after each backward."""
    bnet = bppsa(net, "blelloch")
    losses = []
    for i, (x, labels) in enumerate(batches):
        optimizer.zero_grad()
        loss = F.cross_entropy(bnet(x), labels)
        loss.backward()
        if between is not None:
            between(net, i)
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_same(net: nn.Module, twin: nn.Module, ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer):
    """Every parameter and moment bit for bit (NaN equal to NaN)."""
    for (name, a), (_, b) in zip(net.named_parameters(), twin.named_parameters(), strict=True):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy(), err_msg=name)
    mine, expected = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert mine.keys() == expected.keys()
    for index, state in expected.items():
        assert mine[index].keys() == state.keys()
        for key, value in state.items():
            np.testing.assert_array_equal(mine[index][key].numpy(), value.numpy(), err_msg=f"{index} {key}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [{}, {"foreach": True}, {"fused": True}, {"amsgrad": True},
                                     {"maximize": True, "betas": (0.8, 0.95), "eps": 1e-6}])
def test_the_trajectory_is_torchs_bit_for_bit_and_steps_the_kept_weights_alone(dtype, options,
                                                                               monkeypatch):
    net, twin = pair(dtype)
    ours, theirs = optimizers(net, twin, trusted=True, **options)
    monkeypatch.setattr(optim_module, "_moves_elsewhere", _not_counted)  # the bridge's gradient is proven
    batches = data(25, dtype)
    assert train(net, ours, batches) == train(twin, theirs, batches)
    assert_same(net, twin, ours, theirs)
    for name in PRUNED:
        module = net.get_submodule(name)
        if options.get("fused"):  # PyTorch's fused kernel streams every weight faster than gathers
            assert ours.moving(module.weight_orig) is None and ours.state[module.weight_orig]
        else:
            assert ours.moving(module.weight_orig) == stepped(module) < module.weight_mask.numel() / 4
            assert ours.state[module.weight_orig] == {}  # held at the kept weights
    assert ours.moving(net[9].weight) is None and ours.moving(net[0].bias) is None
    assert (net[3].weight_orig != twin[3].weight_orig.detach().clone().zero_()).any()
    net.zero_grad()
    F.cross_entropy(bppsa(net, "linear")(batches[0][0]), batches[0][1]).backward()
    assert_kept_gradients_proven(net)


def stepped(module: nn.Module) -> int:
    """The weights a compact step reads and writes: those the mask keeps."""
    return int(module.weight_mask.sum())


def assert_kept_gradients_proven(net: nn.Module) -> None:
    """After a backward through the bridge: every pruned layer's gradient proven, and the engine's
    values at the kept weights (what the step reads instead of the gradient) are the gradient's there."""
    for name in PRUNED:
        module = net.get_submodule(name)
        mask, kept = pruned_gradient(module.weight_orig)
        assert mask is module.weight_mask and kept is not None
        assert torch.equal(kept, module.weight_orig.grad.reshape(-1)[mask.reshape(-1) != 0])


def _not_counted(flat, values):
    raise AssertionError("the gradient was counted though the bridge's proves it zero at the pruned weights")


@pytest.mark.parametrize("how", ["in place", "pruned again"])
def test_a_mask_changed_during_training_moves_the_newly_pruned_weights_as_torch_does(how):
    """Pruned further after 8 steps: the weights pruned since keep moving by their moments, as
    ``torch.optim.Adam`` moves them, so they stay in the step while their moments are not zero."""
    net, twin = pair(amount=0.5)
    ours, theirs = optimizers(net, twin)
    batches = data(20)
    train(net, ours, batches[:8])
    train(twin, theirs, batches[:8])
    for model in (net, twin):
        if how == "in place":
            with torch.no_grad():
                kept = model[3].weight_mask.nonzero(as_tuple=True)
                model[3].weight_mask[tuple(index[::2] for index in kept)] = 0
        else:
            prune.l1_unstructured(model[3], "weight", amount=0.5)
    before = net[3].weight_orig.detach().clone()
    assert train(net, ours, batches[8:]) == train(twin, theirs, batches[8:])
    assert_same(net, twin, ours, theirs)
    newly = (net[3].weight_mask == 0) & (twin[3].weight_orig.grad == 0)
    assert (net[3].weight_orig[newly] != before[newly]).any()  # moved by their moments alone
    assert stepped(net[3]) < ours.moving(net[3].weight_orig) < net[3].weight_mask.numel()


@pytest.mark.parametrize("change", ["clipped", "accumulated", "penalty", "nan"])
def test_a_gradient_changed_after_the_backward_is_checked_and_stepped_exactly(change, monkeypatch):
    """Clipping scales the gradient in place and accumulation adds into it: no longer provably the
    bridge's, it is counted and still zero at the pruned weights (kept weights stepped); a penalty on
    ``weight_orig`` (a hook) or a NaN batch makes it non-zero there: the dense step, as torch's."""
    counted = []

    def moves_elsewhere(flat, values):
        counted.append(True)
        return bool(torch.count_nonzero(flat) != torch.count_nonzero(values))

    monkeypatch.setattr(optim_module, "_moves_elsewhere", moves_elsewhere)
    net, twin = pair()
    batches = data(6)
    if change == "nan":
        batches[3][0][0, 0, 5, 5] = float("nan")
    if change == "penalty":
        for model in (net, twin):
            model[3].weight_orig.register_hook(lambda g, p=model[3].weight_orig: g + 1e-3 * p.detach())

    def between(model, i):
        if change == "clipped":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif change == "accumulated":
            F.cross_entropy(bppsa(model, "linear")(batches[i - 1][0]), batches[i - 1][1]).backward()

    ours, theirs = optimizers(net, twin, trusted=True)  # the proof fails: counted
    np.testing.assert_array_equal(train(net, ours, batches, between), train(twin, theirs, batches, between))
    assert_same(net, twin, ours, theirs)
    assert counted
    moving = ours.moving(net[3].weight_orig)
    if change in ("clipped", "accumulated"):
        assert moving == stepped(net[3])
    else:
        assert moving is None  # the dense step
        assert (net[3].weight_orig.grad[net[3].weight_mask == 0] != 0).any()


@pytest.mark.parametrize("write", ["scaled", "noise"])
def test_by_default_a_gradient_written_where_no_version_counts_is_read_and_stepped_exactly(write,
                                                                                            monkeypatch):
    """A write through ``.data`` changes no version: the bridge's proof would still hold. By default the
    step reads every pruned gradient (counted, gathered), so it steps what ``.grad`` holds, as
    ``torch.optim.Adam`` does: scaled kept weights, and noise at the pruned ones (the dense step)."""
    counted = []
    original = optim_module._moves_elsewhere
    monkeypatch.setattr(optim_module, "_moves_elsewhere", lambda *a: counted.append(True) or original(*a))
    net, twin = pair()
    batches = data(6)

    def between(model, i):
        grad = model[3].weight_orig.grad
        version = grad._version
        if write == "scaled":
            grad.data.mul_(0.5)
        else:
            grad.data.add_(torch.full_like(grad, 1e-3))
        assert grad._version == version  # unseen by the version counter

    ours, theirs = optimizers(net, twin)
    np.testing.assert_array_equal(train(net, ours, batches, between), train(twin, theirs, batches, between))
    assert_same(net, twin, ours, theirs)
    assert counted
    assert ours.moving(net[3].weight_orig) == (stepped(net[3]) if write == "scaled" else None)


def test_a_step_without_a_gradient_leaves_the_compact_state_held():
    """A pruned weight with no gradient in one step (``grad`` None: PyTorch's step skips it) keeps its
    compact state, not rebuilt at the next step, and the trajectory stays torch's."""
    net, twin = pair()
    ours, theirs = optimizers(net, twin)

    def between(model, i):
        if i == 3:
            model[3].weight_orig.grad = None

    batches = data(6)
    train(net, ours, batches[:2])
    train(twin, theirs, batches[:2])
    held = ours._kept[net[3].weight_orig]
    assert train(net, ours, batches[2:], between) == train(twin, theirs, batches[2:], between)
    assert_same(net, twin, ours, theirs)
    assert ours._kept[net[3].weight_orig] is held


def test_state_dicts_go_both_ways_with_torch_optim_adam():
    """Ours saved, loaded by ``torch.optim.Adam`` (and torch's by ours): the same continuation."""
    batches = data(12)
    net, twin = pair()
    ours, theirs = optimizers(net, twin)
    train(net, ours, batches[:6])
    train(twin, theirs, batches[:6])
    swapped_theirs, swapped_ours = optimizers(twin, net)
    swapped_ours.load_state_dict(copy.deepcopy(ours.state_dict()))
    swapped_theirs.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert train(net, swapped_ours, batches[6:]) == train(twin, swapped_theirs, batches[6:])
    assert_same(twin, net, swapped_theirs, swapped_ours)
    assert swapped_theirs.moving(twin[3].weight_orig) == stepped(twin[3])


def test_weight_decay_is_refused_for_pruned_weights_and_kept_for_the_others():
    net, twin = pair()
    pruned = [module.weight_orig for module in (net[0], net[3], net[7])]
    others = [p for p in net.parameters() if all(p is not q for q in pruned)]
    with pytest.raises(ValueError, match="parameter group 0 has weight_decay=0.01 and a pruned layer's "
                                         "weight_orig"):
        train(net, PrunedAdam(net.parameters(), lr=1e-2, weight_decay=1e-2), data(1))
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        PrunedAdam(net.parameters(), differentiable=True)
    net, twin = pair()

    def groups(model):
        pruned = {id(model.get_submodule(name).weight_orig) for name in PRUNED}
        return [{"params": [p for p in model.parameters() if id(p) in pruned]},
                {"params": [p for p in model.parameters() if id(p) not in pruned], "weight_decay": 1e-2}]

    assert others
    ours, theirs = PrunedAdam(groups(net), lr=1e-2), torch.optim.Adam(groups(twin), lr=1e-2)
    batches = data(8)
    assert train(net, ours, batches) == train(twin, theirs, batches)
    assert_same(net, twin, ours, theirs)


def test_without_the_bridge_every_parameter_gets_the_dense_step():
    """Plain autograd through the pruning hooks: no gradient the bridge proved, the dense step."""
    net, twin = pair()
    ours, theirs = optimizers(net, twin)
    for x, labels in data(5):
        for model, optimizer in ((net, ours), (twin, theirs)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), labels).backward()
            optimizer.step()
    assert_same(net, twin, ours, theirs)
    assert all(ours.moving(p) is None for p in net.parameters())


@pytest.mark.gpu
def test_on_the_gpu_the_trajectory_is_torchs_and_steps_the_kept_weights_alone(on_the_gpu):
    """The bridge's GPU engine (its sampled weight gradient, CuPy arrays held for the proof) and the
    compact step on the parameters' device: ``torch.optim.Adam``'s trajectory bit for bit."""
    net, twin = (model.to(on_the_gpu) for model in pair())
    ours, theirs = optimizers(net, twin, trusted=True)
    batches = [(x.to(on_the_gpu), labels.to(on_the_gpu)) for x, labels in data(6)]
    assert train(net, ours, batches) == train(twin, theirs, batches)
    for (name, a), (_, b) in zip(net.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for name in PRUNED:
        assert ours.moving(net.get_submodule(name).weight_orig) == stepped(net.get_submodule(name))
    net.zero_grad()
    F.cross_entropy(bppsa(net, "linear")(batches[0][0]), batches[0][1]).backward()
    assert_kept_gradients_proven(net)
