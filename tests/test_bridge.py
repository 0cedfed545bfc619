"""``sparse_scan.torch.bppsa``: BPPSA as the backward of a PyTorch training loop (issue 36).

- The same training as autograd: a LeNet-style CNN, a small torchvision-style ResNet (batch norms
  frozen) and an LSTM classifier, 100 iterations of ``torch.optim.Adam`` from the same weights and
  batches: float64 losses equal to plain autograd's within 1e-10 relative for linear, blelloch and
  hybrid; float32 within 1e-4 for the first 30 iterations.
- ``torch.autograd.gradcheck`` (float64) with PyTorch layers before and after the wrapped module, with
  respect to the input and to the wrapped module's parameters.
- No copy and never stale: the engine's layers hold views of the parameters' storage; a weight changed
  in place (``opt.step()``, ``p.data.mul_()``, ``load_state_dict``, ``copy_`` under ``no_grad``) or
  replaced (``p.data = w``) is what the next forward reads, for each kind of model; one changed
  between a forward and its backward is refused by autograd's own check.
- Modes follow the wrapped module; dropout in training mode draws its own masks; frozen batch norms.
- Clear errors: half precision, autocast, ``create_graph=True``, devices that differ, a module the
  capture refuses, a backward through an earlier forward of a model with dropout in training mode.
- ``torch.nn.utils.prune``'s masks: the pruned pattern, ``weight_orig``'s gradient masked.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from oracles import randomize_batch_norms  # noqa: E402 - after the skip: it imports nothing of torch
from resnet_blocks import BasicBlock  # noqa: E402 - imports torch

from sparse_scan.layers import Conv2d  # noqa: E402
from sparse_scan.torch import BPPSA, CaptureError, bppsa  # noqa: E402
from sparse_scan.weights import named_layers  # noqa: E402


class LeNet(nn.Module):
    """LeNet-style: two conv/ReLU/max-pool stages, two fully connected layers, functional ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class ResNet(nn.Module):
    """A small torchvision-style ResNet: a stem, a BasicBlock, a strided one with downsample, global
    average pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(BasicBlock(4, 4), BasicBlock(4, 8, 2))
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.layer1(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LSTMClassifier(nn.Module):
    """An LSTM read by its last output, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 8, batch_first=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


MODELS = {"lenet": (LeNet, (1, 12, 12)), "resnet": (ResNet, (3, 8, 8)), "lstm": (LSTMClassifier, (12, 3))}
SCHEDULES = [("linear", None), ("blelloch", None), ("hybrid", 1)]


def build(kind: str, dtype=torch.float64) -> nn.Module:
    """A seeded model in ``dtype``, in training mode with its batch norms frozen (eval mode, random
    statistics)."""
    torch.manual_seed(0)
    net = MODELS[kind][0]().to(dtype)
    randomize_batch_norms(net)
    net.train()
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
    return net


def batches(kind: str, count: int, dtype=torch.float64, size: int = 4):
    generator = torch.Generator().manual_seed(1)
    shape = MODELS[kind][1]
    return [(torch.randn((size,) + shape, generator=generator, dtype=dtype),
             torch.randint(0, 5, (size,), generator=generator)) for _ in range(count)]


def train_losses(net: nn.Module, model: nn.Module, data) -> list[float]:
    """Adam on ``net``'s parameters, ``model`` (``net`` or a wrapper of it) computing the loss."""
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for x, labels in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("method, levels", SCHEDULES)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_training_equals_autograds_in_float64(kind, method, levels):
    data = batches(kind, 100)
    reference = build(kind)
    net = copy.deepcopy(reference)
    expected = train_losses(reference, reference, data)
    losses = train_losses(net, bppsa(net, method, levels), data)
    np.testing.assert_allclose(losses, expected, rtol=1e-10)
    for (name, ours), (_, theirs) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
        np.testing.assert_allclose(ours.detach().numpy(), theirs.detach().numpy(), rtol=1e-8, atol=1e-10,
                                   err_msg=name)


@pytest.mark.parametrize("method, levels", SCHEDULES)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_training_equals_autograds_in_float32(kind, method, levels):
    data = batches(kind, 30, torch.float32)
    reference = build(kind, torch.float32)
    net = copy.deepcopy(reference)
    expected = train_losses(reference, reference, data)
    np.testing.assert_allclose(train_losses(net, bppsa(net, method, levels), data), expected, rtol=1e-4)


def test_the_wrapper_holds_the_same_parameters_and_the_engine_views_of_them():
    net = build("lenet")
    bnet = bppsa(net)
    assert [id(p) for p in bnet.parameters()] == [id(p) for p in net.parameters()]
    bnet(batches("lenet", 1)[0][0])
    (engine,) = next(iter(bnet._engines.values()))
    layer = engine.model.layers[0]
    assert isinstance(layer, Conv2d)
    assert np.shares_memory(layer.weight, net.conv1.weight.detach().numpy())  # a view, no copy
    assert np.shares_memory(layer.bias, net.conv1.bias.detach().numpy())


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_gradcheck_with_torch_layers_before_and_after(kind):
    """d(output)/d(input) and d(output)/d(the wrapped module's parameters), numerically."""
    torch.manual_seed(3)
    inner = build(kind).eval()
    shape = MODELS[kind][1]
    before = nn.Linear(shape[-1], shape[-1]).double()  # acts on the last axis of every sample
    after = nn.Sequential(nn.Tanh(), nn.Linear(5, 2)).double()
    wrapped = bppsa(inner, "blelloch")

    def model(x, *_parameters):  # the parameters are read where they live: gradcheck perturbs them
        return after(wrapped(before(x)))

    x = torch.randn((2,) + shape, dtype=torch.float64, requires_grad=True)
    parameters = [p for p in inner.parameters()][:4] + list(before.parameters())
    assert torch.autograd.gradcheck(model, (x, *parameters), eps=1e-6, atol=1e-7, rtol=1e-5)


# --- weights changed in place are seen -------------------------------------------------------------
def change_weights(net: nn.Module, how: str) -> None:
    """Change every parameter of ``net`` the way ``how`` says."""
    if how == "step":
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    elif how == "data_mul":
        for p in net.parameters():
            p.data.mul_(1.5)  # .data: not counted by the parameter's version
    elif how == "load_state_dict":
        state = {k: v * 0.5 if v.is_floating_point() else v for k, v in net.state_dict().items()}
        net.load_state_dict(state)
    elif how == "no_grad_copy":
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(p * -1)
    elif how == "data_assign":
        for p in net.parameters():
            p.data = p.data.clone() + 0.25  # new storage
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["step", "data_mul", "load_state_dict", "no_grad_copy", "data_assign"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_weights_changed_in_place_are_seen(kind, how):
    net = build(kind).eval()
    bnet = bppsa(net, "blelloch")
    x = batches(kind, 1)[0][0].requires_grad_(True)
    bnet(x).sum().backward()  # builds and plans the engine
    change_weights(net, how)
    with torch.no_grad():
        expected = net(x)
    out = bnet(x)
    np.testing.assert_allclose(out.detach().numpy(), expected.numpy(), rtol=1e-12, atol=1e-13)
    net.zero_grad()
    out.sum().backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad()
    net(x).sum().backward()
    for name, p in net.named_parameters():
        np.testing.assert_allclose(grads[name].numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_a_weight_changed_between_forward_and_backward_is_refused_by_autograd():
    net = build("lenet")
    out = bppsa(net)(batches("lenet", 1)[0][0])
    with torch.no_grad():
        net.fc1.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# --- modes -------------------------------------------------------------------------------------------
class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, training=self.training))


def test_modes_follow_the_wrapped_module():
    torch.manual_seed(0)
    net = DropoutNet().double()
    bnet = bppsa(net)
    x = torch.randn(64, 6, dtype=torch.float64)
    bnet.eval()
    assert not net.training
    np.testing.assert_allclose(bnet(x).detach().numpy(), net(x).detach().numpy(), rtol=1e-13)
    bnet.train()
    assert net.training
    masked = bnet(x).detach().numpy()
    assert not np.allclose(masked, net.eval()(x).detach().numpy())  # masks drawn in training mode
    net.train()
    first, second = bnet(x), bnet(x)  # two forwards, then the earlier one's backward: refused
    with pytest.raises(RuntimeError, match="backward through an earlier forward of a model with dropout"):
        first.sum().backward()
    second.sum().backward()


def test_two_forwards_then_two_backwards_without_dropout():
    net = build("lenet").eval()
    bnet = bppsa(net, "blelloch")
    (x1, _), (x2, _) = batches("lenet", 2)
    first, second = bnet(x1), bnet(x2)
    (first.sum() + 2 * second.sum()).backward()
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    (net(x1).sum() + 2 * net(x2).sum()).backward()
    for mine, theirs in zip(ours, net.parameters(), strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_a_batch_norm_in_training_mode_is_refused_with_the_captures_message():
    net = build("resnet").train()
    with pytest.raises(CaptureError, match=r"node 'bn1' .*training mode.*module.eval\(\)"):
        bppsa(net)(batches("resnet", 1)[0][0])


# --- errors ------------------------------------------------------------------------------------------
def test_what_the_engine_would_compute_otherwise_is_refused():
    net = build("lenet")
    x = batches("lenet", 1)[0][0]
    with pytest.raises(TypeError, match="half precision is not supported"):
        bppsa(copy.deepcopy(net).half())(x.half())
    with pytest.raises(TypeError, match="the input is torch.float32 and the parameters"):
        bppsa(net)(x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="autocast is on"):
        bppsa(net)(x)
    out = bppsa(net)(x.requires_grad_(True))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="different devices"):
        bppsa(copy.deepcopy(net).to("meta"))(x)
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        bppsa(lambda v: v)
    with pytest.raises(ValueError, match="method must be one of"):
        bppsa(net, method="fastest")
    with pytest.raises(CaptureError, match=r"node 'norm' \(module 'norm'.*GroupNorm is not supported"):
        bppsa(Normed())(torch.randn(2, 4))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.norm(x)


def test_torch_layers_before_and_after_and_the_loss_head():
    """An embedding in front (integer ids: PyTorch's), the wrapped MLP, a loss head behind."""
    torch.manual_seed(0)
    embed = nn.Embedding(10, 6).double()
    inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    head = nn.Linear(3, 3).double()
    ids = torch.randint(0, 10, (5,))
    loss = F.cross_entropy(head(bppsa(inner)(embed(ids))), torch.tensor([0, 1, 2, 0, 1]))
    loss.backward()
    ours = [p.grad.clone() for p in (*embed.parameters(), *inner.parameters(), *head.parameters())]
    for p in (*embed.parameters(), *inner.parameters(), *head.parameters()):
        p.grad = None
    F.cross_entropy(head(inner(embed(ids))), torch.tensor([0, 1, 2, 0, 1])).backward()
    theirs = [p.grad for p in (*embed.parameters(), *inner.parameters(), *head.parameters())]
    for mine, expected in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(mine.numpy(), expected.numpy(), rtol=1e-10, atol=1e-13)


def test_torch_pruning_masks_give_the_pruned_pattern_and_masked_gradients():
    import torch.nn.utils.prune as prune

    net = build("lenet").eval()
    for module in (net.conv1, net.conv2, net.fc1):
        prune.l1_unstructured(module, "weight", amount=0.7)
    bnet = bppsa(net, "blelloch")
    x = batches("lenet", 1)[0][0]
    bnet(x).sum().backward()
    (engine,) = next(iter(bnet._engines.values()))
    assert engine.model.layers[0].prune_pattern and engine.model.layers[0].pattern((1, 8, 8)).nnz < 36 * 64
    ours = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad()
    net(x).sum().backward()
    assert "conv1.weight_orig" in ours
    for name, p in net.named_parameters():
        np.testing.assert_allclose(ours[name].numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_the_input_gradient_is_computed_only_where_autograd_wants_it(monkeypatch):
    net = build("lenet")
    bnet = bppsa(net, "linear")
    x = batches("lenet", 1)[0][0]
    bnet(x).sum().backward()
    (engine,) = next(iter(bnet._engines.values()))
    asked = []
    backward = engine.model.backward
    monkeypatch.setattr(engine.model, "backward", lambda *a, **k: asked.append(k["input_gradient"]) or
                        backward(*a, **k))
    reference = copy.deepcopy(net)
    for wants in (False, True):
        net.zero_grad()
        reference.zero_grad()
        ours, theirs = x.clone().requires_grad_(wants), x.clone().requires_grad_(wants)
        bnet(ours).sum().backward()
        reference(theirs).sum().backward()
        assert asked[-1] is wants
        assert (ours.grad is None) is not wants
        if wants:
            np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-10, atol=1e-12)
        for (name, a), (_, b) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_bppsa_is_a_module_with_a_useful_repr():
    bnet = bppsa(build("lenet"), "hybrid", 2)
    assert isinstance(bnet, BPPSA) and isinstance(bnet, nn.Module)
    assert "method='hybrid', levels=2" in repr(bnet) and "(module): LeNet(" in repr(bnet)


# --- the GPU path (CUDA tensors; through the CuPy stand-in on host tensors where no GPU is: on_the_gpu) -
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["linear", "blelloch"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_on_the_gpu_the_same_gradients_as_autograd(on_the_gpu, kind, method):
    net = build(kind).eval().to(on_the_gpu)
    bnet = bppsa(net, method)
    x = batches(kind, 1)[0][0].to(on_the_gpu)
    g = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(on_the_gpu)
    leaf = x.clone().requires_grad_(True)
    out = bnet(leaf)
    out.backward(g)
    ours = {name: p.grad.clone() for name, p in net.named_parameters()}
    reference = x.clone().requires_grad_(True)
    net.zero_grad()
    expected = net(reference)
    expected.backward(g)
    np.testing.assert_allclose(out.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=1e-12,
                               atol=1e-13)
    np.testing.assert_allclose(leaf.grad.cpu().numpy(), reference.grad.cpu().numpy(), rtol=1e-10, atol=1e-13)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(ours[name].cpu().numpy(), p.grad.cpu().numpy(), rtol=1e-10, atol=1e-13,
                                   err_msg=name)


@pytest.mark.gpu
def test_on_the_gpu_the_engine_holds_views_of_the_parameters(on_the_gpu):
    import cupy

    net = build("resnet").eval().to(on_the_gpu)
    bnet = bppsa(net)
    bnet(batches("resnet", 1)[0][0].to(on_the_gpu)).sum().backward()
    (engine,) = next(iter(bnet._engines.values()))
    layers = named_layers(engine.model)
    for key, source in engine.capture.sources.items():
        held = getattr(layers[key.rpartition(".")[0]], key.rpartition(".")[2])
        tensor = source.read(net)
        assert isinstance(held, cupy.ndarray), key
        assert held.__cuda_array_interface__["data"][0] == tensor.data_ptr(), key  # the same memory
    with torch.no_grad():
        net.fc.weight.mul_(2)
    x = batches("resnet", 1)[0][0].to(on_the_gpu)
    np.testing.assert_allclose(bnet(x).detach().cpu().numpy(), net(x).detach().cpu().numpy(), rtol=1e-12)


@pytest.mark.gpu
def test_on_the_gpu_patterns_from_weights_are_refused(on_the_gpu):
    net = build("lenet").eval().to(on_the_gpu)
    with pytest.raises(RuntimeError, match="without a torch.nn.utils.prune mask .* runs on CPU tensors only"):
        bppsa(net, prune_pattern=True)(batches("lenet", 1)[0][0].to(on_the_gpu))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_on_the_gpu_torch_pruned_layers_give_autograds_gradients(on_the_gpu, method):
    """Layers pruned with torch.nn.utils.prune on CUDA tensors: the pattern from the mask, the direct
    sparse forward and the sampled weight gradient (the GPU's kernels), every gradient autograd's."""
    import torch.nn.utils.prune as prune

    net = build("lenet").eval().to(on_the_gpu)
    for module in (net.conv1, net.conv2, net.fc1):
        prune.l1_unstructured(module, "weight", amount=0.9)
    bnet = bppsa(net, method)
    x = batches("lenet", 1)[0][0].to(on_the_gpu)
    out = bnet(x)
    out.sum().backward()
    (engine,) = next(iter(bnet._engines.values()))
    assert engine.model.layers[0].prune_pattern and engine.model.layers[0].pruned_weights().density < 0.2
    ours = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad()
    expected = net(x)
    expected.sum().backward()
    np.testing.assert_allclose(out.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=1e-12)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(ours[name].cpu().numpy(), p.grad.cpu().numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_cuda_tensors_without_a_usable_gpu_are_refused(monkeypatch):
    monkeypatch.setattr(BPPSA, "_device_of", staticmethod(lambda x: "gpu"))
    monkeypatch.setattr("sparse_scan.backend.gpu_usable", lambda: False)
    with pytest.raises(RuntimeError, match="need CuPy with a usable GPU"):
        bppsa(build("lenet"))(batches("lenet", 1)[0][0])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lstm", "lenet", "lenet-pruned"])
def test_on_the_gpu_a_warm_iteration_uploads_nothing_and_waits_only_where_documented(on_the_gpu, device_stats,
                                                                                     kind):
    """After the first iteration, a forward and backward through the bridge wait for the GPU only where
    docs/gpu.md says: no upload from pageable memory (the weights are the tensors' memory), the
    recurrent layer's check of its input, a pruned layer's check that its batch is finite (its sparse
    forward and weight gradient)."""
    import torch.nn.utils.prune as prune

    net = build(kind.partition("-")[0]).eval().to(on_the_gpu)
    if kind == "lenet-pruned":
        for module in (net.conv1, net.conv2, net.fc1):
            prune.l1_unstructured(module, "weight", amount=0.9)
    bnet = bppsa(net, "blelloch")
    x = batches(kind.partition("-")[0], 1)[0][0].to(on_the_gpu)
    bnet(x).sum().backward()
    device_stats.clear()
    bnet(x).sum().backward()
    documented = (("recurrent/_module.py:", "in _sequence"),  # file, function
                  ("in _direct_forward_gpu",), ("in _sampled_weight_gradient_gpu",))
    unexpected = [sync for sync in device_stats.syncs
                  if not any(all(part in sync for part in where) for where in documented)]
    assert unexpected == [], unexpected


def test_a_pruned_iteration_reads_the_kept_weights_alone():
    """A layer pruned with torch.nn.utils.prune to 3 %: forward, scan and weight gradient read
    ``weight_orig`` at the kept weights (no masked copy of the weights is formed), the weight gradient
    is the sampled product's (exactly zero at the pruned weights, autograd's elsewhere), and a mask
    that is not 0/1 is refused by name."""
    import torch.nn.utils.prune as prune

    net = build("lenet").eval()
    for module in (net.conv1, net.conv2, net.fc1):
        prune.l1_unstructured(module, "weight", amount=0.97)
    bnet = bppsa(net, "linear")
    x = batches("lenet", 1)[0][0]
    for _ in range(2):
        net.zero_grad()
        bnet(x).sum().backward()
    (engine,) = next(iter(bnet._engines.values()))
    pruned = [layer for layer in engine.model.layers if getattr(layer, "prune_pattern", False)]
    assert len(pruned) == 3 and all(layer._pending is not None for layer in pruned)  # never multiplied
    ours = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad()
    net(x).sum().backward()
    for name, p in net.named_parameters():
        np.testing.assert_allclose(ours[name].numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    assert not ours["conv2.weight_orig"][net.conv2.weight_mask == 0].any()
    with torch.no_grad():
        net.conv2.weight_mask.mul_(0.5)
    with pytest.raises(RuntimeError, match="'conv2.weight_mask' holds values other than 0 and 1"):
        bnet(x)


def test_a_pruned_forward_reads_the_kept_weights_last_layer_first(monkeypatch):
    """An optimizer's step writes the weights in parameter order, so the last layers' are the ones still
    in the cache: the bridge's forward reads the pruned layers' kept weights last layer first, each once
    per version of the weights (the layers' direct products then find them), and its output is
    autograd's."""
    import torch.nn.utils.prune as prune

    from sparse_scan.layers._conv_pruned import PrunedWeights

    net = build("lenet").eval()
    for module, amount in ((net.conv1, 0.9), (net.conv2, 0.95), (net.fc1, 0.99)):
        prune.l1_unstructured(module, "weight", amount=amount)
    bnet = bppsa(net, "linear")
    x = batches("lenet", 1)[0][0]
    bnet(x)
    (engine,) = next(iter(bnet._engines.values()))
    layers = named_layers(engine.model)
    read, values = [], PrunedWeights.values

    def reading(self, be, weight, version):
        known = self._values.get(be.name)
        if known is None or known[0] != version:
            read.append(next(name for name, layer in layers.items()
                             if getattr(layer, "_pruned", None) and layer._pruned[1] is self))
        return values(self, be, weight, version)

    monkeypatch.setattr(PrunedWeights, "values", reading)
    with torch.no_grad():
        for module in (net.conv1, net.conv2, net.fc1):
            module.weight_orig.mul_(1.5)  # a step: a new version of every weight
    out = bnet(x)
    assert read == ["fc1", "conv2", "conv1"]
    np.testing.assert_allclose(out.detach().numpy(), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    read.clear()
    bnet(x)
    assert read == ["fc1", "conv2", "conv1"]  # the bridge binds weight_orig anew at each forward


class Small(nn.Module):
    """A convolution, an activation and a global pool: changes of stride or padding keep the shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.act(self.conv(x))), 1))


def _double(module, inputs, output):
    return output * 2


TREE_CHANGES = {
    "replaced by another type": lambda net: setattr(net, "act", nn.Tanh()),
    "replaced by the same type": lambda net: setattr(net, "act", nn.LeakyReLU(0.3)),
    "replaced inside a Sequential": lambda net: setattr(net, "fc", nn.Sequential(nn.Linear(4, 3))),
    "stride set": lambda net: setattr(net.conv, "stride", (2, 2)),
    "padding set": lambda net: setattr(net.conv, "padding", (0, 0)),
    "forward patched": lambda net: setattr(net.act, "forward", lambda x: torch.sigmoid(x) * 3),
}


def _check_changes_are_seen(device, change):
    torch.manual_seed(0)
    net = Small().double().eval().to(device)
    bnet = bppsa(net, "blelloch")
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    bnet(x).sum().backward()  # captured as it was
    TREE_CHANGES[change](net)
    net.double().to(device)
    net.zero_grad()
    leaf = x.clone().requires_grad_(True)
    out = bnet(leaf)
    out.square().sum().backward()
    ours = {name: p.grad.clone() for name, p in net.named_parameters()}
    reference = x.clone().requires_grad_(True)
    net.zero_grad()
    expected = net(reference)
    expected.square().sum().backward()
    np.testing.assert_allclose(out.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=1e-12)
    np.testing.assert_allclose(leaf.grad.cpu().numpy(), reference.grad.cpu().numpy(), rtol=1e-10, atol=1e-14)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(ours[name].cpu().numpy(), p.grad.cpu().numpy(), rtol=1e-10, atol=1e-14,
                                   err_msg=name)


@pytest.mark.parametrize("change", sorted(TREE_CHANGES))
def test_any_change_of_the_module_tree_is_captured_again(change):
    """A submodule replaced (another type, the same type with other arguments, inside a container), a
    hyper-parameter set in place (stride, padding), a forward patched onto the instance, a forward
    hook: the next forward captures the module as it is, so outputs and gradients stay autograd's."""
    _check_changes_are_seen(torch.device("cpu"), change)


@pytest.mark.gpu
@pytest.mark.parametrize("change", sorted(TREE_CHANGES))
def test_on_the_gpu_any_change_of_the_module_tree_is_captured_again(on_the_gpu, change):
    _check_changes_are_seen(on_the_gpu, change)


def test_a_forward_hook_added_after_the_capture_is_refused_by_name():
    """torch.fx does not trace hooks: the capture's probe sees the hooked layer differ and names it,
    instead of the engine running the module as it was."""
    net = Small().double().eval()
    bnet = bppsa(net)
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    bnet(x)
    net.act.register_forward_hook(_double)
    with pytest.raises(CaptureError, match="node 'act'.*differ from the module's"):
        bnet(x)


def test_a_dropout_probability_set_in_place_is_captured_again():
    """``p`` changed between forwards in training mode: the kept entries are scaled by the new
    ``1 / (1 - p)``."""
    net = nn.Sequential(nn.Linear(6, 400), nn.Dropout(0.5)).double().train()
    bnet = bppsa(net, "linear")
    x = torch.randn(2, 6, dtype=torch.float64)
    first = bnet(x)
    net[1].p = 0.75
    second = bnet(x).detach()
    before = net[0](x).detach()
    kept = second != 0
    np.testing.assert_allclose(second[kept].numpy(), (before[kept] * 4).numpy(), rtol=1e-12)
    assert 0.1 < kept.double().mean() < 0.4 and first is not None


def test_an_unchanged_tree_keeps_its_engine_and_modes_switch_between_two():
    net = Small().double().eval()
    bnet = bppsa(net)
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    bnet(x)
    net.train()
    bnet(x)
    net.eval()
    bnet(x)
    assert sum(len(engines) for engines in bnet._engines.values()) == 2  # eval and train, each once


@pytest.mark.parametrize("how", ["in place", "pruned again"])
def test_a_pruning_mask_changed_during_training_re_plans(how):
    """Pruned further: a mask written in place re-plans the same engine; pruning again with
    torch.nn.utils.prune (a new hook) captures again. The next forward's pattern is the new mask's,
    exact."""
    import torch.nn.utils.prune as prune

    net = build("lenet").eval()
    prune.l1_unstructured(net.conv2, "weight", amount=0.5)
    bnet = bppsa(net, "blelloch")
    x = batches("lenet", 1)[0][0]
    bnet(x).sum().backward()
    (engine,) = next(iter(bnet._engines.values()))
    before = engine.model.layers[3].pattern((4, 6, 6)).nnz
    if how == "in place":
        with torch.no_grad():
            kept = net.conv2.weight_mask.nonzero(as_tuple=True)
            net.conv2.weight_mask[tuple(index[::2] for index in kept)] = 0  # half of what is left
    else:
        prune.l1_unstructured(net.conv2, "weight", amount=0.5)
    net.zero_grad()
    out = bnet(x)
    out.sum().backward()
    now = list(bnet._engines.values())[-1][-1]  # the engine of the tree as it is now
    assert (now is engine) == (how == "in place")
    assert now.model.layers[3].pattern((4, 6, 6)).nnz < before
    ours = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad()
    expected = net(x)
    expected.sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=1e-12)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(ours[name].numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_a_pattern_mask_refuses_weights_outside_it():
    layer = Conv2d(1, 2, 3, dtype=np.float64, rng=0)
    layer.prune_pattern = True
    mask = np.ones_like(layer.weight)
    mask[0, 0, 0, 0] = 0
    with pytest.raises(ValueError, match="non-zero outside the pattern mask"):
        layer.pattern_mask = mask
    layer.weight = layer.weight * mask
    layer.pattern_mask = mask
    assert layer.pattern((1, 5, 5)).nnz == 17 * 9
    weight = layer.weight * 2
    layer.weight = weight
    assert layer.weight is weight  # with a mask: held as it is, no copy
    with pytest.raises(ValueError, match="non-zero outside the pattern mask"):
        layer.weight = np.ones_like(weight)


def test_assign_masked_multiplies_into_the_layers_own_array():
    layer = Conv2d(1, 2, 3, dtype=np.float64, rng=0)
    layer.prune_pattern = True
    mask = (np.arange(18).reshape(2, 1, 3, 3) % 3 != 0).astype(np.float64)
    with pytest.raises(ValueError, match="assign_masked needs a pattern_mask"):
        layer.assign_masked(layer.weight)
    layer.weight = layer.weight * mask
    layer.pattern_mask = mask
    values = np.random.default_rng(0).standard_normal((2, 1, 3, 3))
    layer.assign_masked(values)
    target = layer.weight
    np.testing.assert_array_equal(target, values * mask)
    layer.assign_masked(2 * values)
    assert layer.weight is target  # the same array, written again
    np.testing.assert_array_equal(layer.weight, 2 * values * mask)
    x = np.random.default_rng(1).standard_normal((2, 1, 5, 5))
    reference = Conv2d(1, 2, 3, dtype=np.float64, rng=0)
    reference.weight, reference.bias = 2 * values * mask, layer.bias
    np.testing.assert_allclose(layer.forward(x), reference.forward(x), rtol=1e-13)
    with pytest.raises(ValueError, match="expected float64 of shape"):
        layer.assign_masked(values.astype(np.float32))
