"""SGD and Adam: PyTorch's trajectories on copied weights; pruned weights stay zero."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan import Sequential
from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU
from sparse_scan.loss import softmax_cross_entropy
from sparse_scan.optim import SGD, Adam
from sparse_scan.weights import state_dict


def small_model(dtype=np.float32, prune=False):
    model = Sequential(Conv2d(1, 3, 3, dtype=dtype, rng=0, prune_pattern=prune), ReLU(), Flatten(),
                       Linear(3 * 4 * 4, 4, dtype=dtype, rng=1))
    if prune:
        weight = model.layers[0].weight.copy()
        weight[np.abs(weight) < np.quantile(np.abs(weight), 0.5)] = 0
        model.layers[0].weight = weight
    return model


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((5, 1, 6, 6)).astype(np.float32), rng.integers(0, 4, 5)


def our_steps(model, optimizer, steps):
    losses = []
    for step in range(steps):
        x, y = data(step)
        loss, grad = softmax_cross_entropy(model.forward(x), y)
        optimizer.step(model.parameter_gradients(model.backward(grad, method="blelloch")))
        losses.append(loss)
    return losses


@pytest.mark.parametrize("name, kwargs", [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.05, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2)),
])
def test_steps_follow_pytorch(name, kwargs):
    torch = pytest.importorskip("torch")
    model = small_model()
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(48, 4))
    net.load_state_dict({"0.weight": torch.from_numpy(model.layers[0].weight.copy()),
                         "0.bias": torch.from_numpy(model.layers[0].bias.copy()),
                         "3.weight": torch.from_numpy(model.layers[3].weight.copy()),
                         "3.bias": torch.from_numpy(model.layers[3].bias.copy())})
    ours = (SGD if name == "sgd" else Adam)(model, **kwargs)
    theirs = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(net.parameters(), **kwargs)
    losses = our_steps(model, ours, 4)
    for step in range(4):
        x, y = data(step)
        theirs.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        theirs.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5)
    for key, value in state_dict(model).items():
        np.testing.assert_allclose(value, dict(net.named_parameters())[key].detach().numpy(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [lambda m: SGD(m, lr=0.1, momentum=0.9), lambda m: Adam(m, lr=0.05)])
def test_pruned_weights_stay_exactly_zero(optimizer):
    model = small_model(prune=True)
    zeros = model.layers[0].weight == 0
    assert zeros.any() and not zeros.all()
    our_steps(model, optimizer(model), 5)
    assert np.all(model.layers[0].weight[zeros] == 0)
    assert np.all(model.layers[0].weight[~zeros] != 0)


def test_bad_hyper_parameters():
    with pytest.raises(ValueError, match="lr"):
        SGD(small_model(), lr=0)
    with pytest.raises(ValueError, match="nesterov"):
        SGD(small_model(), lr=0.1, nesterov=True)


@pytest.mark.parametrize("make", [lambda m: SGD(m, lr=0.1, momentum=0.9), lambda m: Adam(m, lr=0.05)])
def test_steps_update_in_place_but_never_an_array_the_caller_holds(make):
    model = small_model()
    mine = model.layers[3].weight.copy()
    model.layers[3].weight = mine  # the layer now holds the caller's array
    kept = mine.copy()
    optimizer = make(model)
    our_steps(model, optimizer, 1)
    np.testing.assert_array_equal(mine, kept)  # copied, not changed
    owned = model.layers[3].weight
    assert owned is not mine and not np.array_equal(owned, kept)
    our_steps(model, optimizer, 1)
    assert model.layers[3].weight is owned  # later steps update the optimizer's copy in place


def test_a_step_leaves_the_gradients_alone_and_checks_their_shape():
    model = small_model(prune=True)
    optimizer = SGD(model, lr=0.1, momentum=0.9)
    x, y = data(0)
    _, grad = softmax_cross_entropy(model.forward(x), y)
    grads = model.parameter_gradients(model.backward(grad))
    kept = {key: value.copy() for key, value in grads.items()}
    optimizer.step(grads)
    for key, value in grads.items():
        np.testing.assert_array_equal(value, kept[key])
    with pytest.raises(ValueError, match=r"3\.bias: gradient has shape \(1,\), the parameter \(4,\)"):
        optimizer.step({"3.bias": np.ones(1, dtype=np.float32)})


@pytest.mark.parametrize("make", [lambda m: SGD(m, lr=0.1, momentum=0.9, weight_decay=0.1),
                                  lambda m: Adam(m, lr=0.05)])
def test_a_non_finite_gradient_of_a_pruned_weight_leaves_it_zero(make):
    model = small_model(prune=True)
    zeros = model.layers[0].weight == 0
    optimizer = make(model)
    x, y = data(0)
    _, grad = softmax_cross_entropy(model.forward(x), y)
    grads = model.parameter_gradients(model.backward(grad))
    grads["0.weight"] = np.where(zeros, np.nan, grads["0.weight"])
    optimizer.step(grads)
    optimizer.step(model.parameter_gradients(model.backward(grad)))
    weight = model.layers[0].weight
    assert np.all(weight[zeros] == 0) and np.all(np.isfinite(weight))


@pytest.mark.parametrize("make, message", [
    (lambda m: SGD(m, lr=float("inf")), "lr: must be a finite number"),
    (lambda m: SGD(m, lr="0.1"), "lr: must be a finite number"),
    (lambda m: SGD(m, lr=0), "lr: must be > 0"),
    (lambda m: SGD(m, lr=0.1, momentum=-1), "momentum: must be >= 0"),
    (lambda m: SGD(m, lr=0.1, momentum=float("nan")), "momentum: must be a finite number"),
    (lambda m: SGD(m, lr=0.1, weight_decay=-1), "weight_decay: must be >= 0"),
    (lambda m: SGD(m, lr=0.1, momentum=0.9, nesterov="false"), "nesterov: must be true or false"),
    (lambda m: Adam(m, betas=(1, 1)), r"betas\[0\]: must be >= 0 and < 1"),
    (lambda m: Adam(m, betas=(0.9,)), "betas: expected a pair"),
    (lambda m: Adam(m, eps=-1), "eps: must be >= 0"),
    (lambda m: Adam(m, eps=float("nan")), "eps: must be a finite number"),
])
def test_bad_hyper_parameters_are_refused_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make(small_model())


def test_bad_gradient_dicts_change_nothing():
    model = small_model()
    optimizer = SGD(model, lr=0.1)
    before = {key: value.copy() for key, value in state_dict(model).items()}
    good = np.ones_like(model.layers[0].weight)
    for grads, message in [
        ({"0.wieght": good}, "'0.wieght' names no parameter"),
        ({"0.weight": good, "3.weight": np.ones((9, 9))}, r"3\.weight: gradient has shape \(9, 9\)"),
        ({"0.weight": good.astype(np.complex64)}, "complex64, expected real numbers"),
        ({"0.weight": np.full(good.shape, None)}, "object, expected real numbers"),
    ]:
        with pytest.raises(ValueError, match=message):
            optimizer.step(grads)
    with pytest.raises(TypeError, match="expected a dict"):
        optimizer.step([good])
    for key, value in state_dict(model).items():  # checked before any update: nothing moved
        np.testing.assert_array_equal(value, before[key])


@pytest.mark.parametrize("name, kwargs", [("sgd", dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
                                          ("adam", dict(lr=1e-2))])
def test_pruned_steps_follow_pytorch_with_masked_gradients(name, kwargs):
    """Only the live entries of a pruned weight move: the same trajectory as PyTorch's with the pruned
    gradients masked."""
    torch = pytest.importorskip("torch")
    model = small_model(prune=True)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(48, 4))
    net.load_state_dict({key: torch.from_numpy(value.copy()) for key, value in state_dict(model).items()})
    mask = torch.from_numpy(model.layers[0].weight != 0)
    ours = (SGD if name == "sgd" else Adam)(model, **kwargs)
    theirs = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(net.parameters(), **kwargs)
    our_steps(model, ours, 4)
    for step in range(4):
        x, y = data(step)
        theirs.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        net[0].weight.grad.mul_(mask)
        theirs.step()
    for key, value in state_dict(model).items():
        np.testing.assert_allclose(value, dict(net.named_parameters())[key].detach().numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_optimizers_step_the_parameters_inside_residual_blocks():
    """Nested parameters (``block.0.weight``, ``block.shortcut.weight``) step like top-level ones:
    SGD's update is ``w - lr * g`` for every one, and a pruned weight inside a block keeps its zeros."""
    from sparse_scan.layers import Residual

    inner = Conv2d(2, 2, 3, padding=1, dtype=np.float64, rng=1, prune_pattern=True)
    weight = inner.weight.copy()
    weight.reshape(-1)[::3] = 0.0
    inner.weight = weight
    stem = Conv2d(1, 2, 3, padding=1, dtype=np.float64, rng=0)
    fc = Linear(3 * 5 * 5, 4, dtype=np.float64, rng=4)
    block = Residual(inner, ReLU(), Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=2),
                     shortcut=Conv2d(2, 3, 1, dtype=np.float64, rng=3))
    for layer, name in ((stem, "stem"), (block, "block"), (fc, "fc")):
        layer.name = name
    model = Sequential(stem, block, Flatten(), fc)
    model.forward(np.random.default_rng(0).standard_normal((2, 1, 5, 5)))
    grads = model.parameter_gradients(model.backward(np.ones((2, 4)), "linear"))
    assert {"block.0.weight", "block.2.weight", "block.shortcut.weight"} <= set(grads)
    before = {key: value.copy() for key, value in state_dict(model).items()}
    SGD(model, lr=0.1).step(grads)
    after = state_dict(model)
    for key, grad in grads.items():
        expected = before[key] - 0.1 * grad
        if key == "block.0.weight":
            expected[before[key] == 0] = 0.0
        np.testing.assert_allclose(after[key], expected, rtol=1e-12, atol=1e-15, err_msg=key)
    assert np.all(after["block.0.weight"].reshape(-1)[::3] == 0)
