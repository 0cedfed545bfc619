"""Parameter gradients (paper Eq. 2): finite differences always, PyTorch autograd when installed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sparse_scan import Sequential
from sparse_scan.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Tanh

CONVS = [dict(in_channels=2, out_channels=3, kernel_size=3),
         dict(in_channels=4, out_channels=6, kernel_size=(2, 3), stride=2, padding=(1, 0), groups=2),
         dict(in_channels=2, out_channels=2, kernel_size=3, dilation=2, padding=2, bias=False)]


@pytest.mark.parametrize("kwargs", CONVS)
def test_conv_parameter_gradients_match_finite_differences(kwargs):
    rng = np.random.default_rng(0)
    conv = Conv2d(**kwargs, dtype=np.float64, rng=1)
    x = rng.standard_normal((3, kwargs["in_channels"], 7, 6))
    g = rng.standard_normal(conv.forward(x).shape)
    grads = conv.parameter_gradients(x, g)

    weight = conv.weight.copy()

    def loss_with(w):
        conv.weight = w
        return float(np.sum(g * conv.forward(x)))

    eps = 1e-6
    for index in [(0, 0, 0, 0), tuple(s - 1 for s in weight.shape), (1, 0, 1, 0)]:
        up, down = weight.copy(), weight.copy()
        up[index] += eps
        down[index] -= eps
        numeric = (loss_with(up) - loss_with(down)) / (2 * eps)
        assert grads["weight"][index] == pytest.approx(numeric, rel=1e-6, abs=1e-8)
    if conv.bias is not None:
        np.testing.assert_allclose(grads["bias"], g.sum(axis=(0, 2, 3)))
    else:
        assert "bias" not in grads


def test_linear_parameter_gradients_are_the_outer_products_summed():
    rng = np.random.default_rng(1)
    linear = Linear(5, 3, dtype=np.float64, rng=0)
    x, g = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
    grads = linear.parameter_gradients(x, g)
    np.testing.assert_allclose(grads["weight"], sum(np.outer(g[b], x[b]) for b in range(4)))
    np.testing.assert_allclose(grads["bias"], g.sum(axis=0))


def model_and_data():
    model = Sequential(Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0), ReLU(), MaxPool2d(2),
                       Conv2d(3, 4, 2, stride=2, groups=1, dtype=np.float64, rng=1), Tanh(), Flatten(),
                       Linear(4, 5, dtype=np.float64, rng=2))
    rng = np.random.default_rng(3)
    return model, rng.standard_normal((3, 2, 4, 4)), rng.standard_normal((3, 5))


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 1)])
def test_model_parameter_gradients_equal_torch_autograd(method, levels):
    torch = pytest.importorskip("torch")
    model, x, g = model_and_data()
    model.forward(x)
    grads = model.parameter_gradients(model.backward(g, method=method, levels=levels))
    assert set(grads) == {f"{i}.{p}" for i in (0, 3, 6) for p in ("weight", "bias")}
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(3, 4, 2, stride=2), torch.nn.Tanh(), torch.nn.Flatten(),
                              torch.nn.Linear(4, 5)).double()
    net.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in (
        (f"{i}.{p}", getattr(model.layers[i], p)) for i in (0, 3, 6) for p in ("weight", "bias"))})
    out = net(torch.from_numpy(x))
    out.backward(torch.from_numpy(g))
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(grads[name], parameter.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_parameter_gradients_need_every_activation_gradient():
    model, x, g = model_and_data()
    model.forward(x)
    with pytest.raises(ValueError, match="expected 8 gradients"):
        model.parameter_gradients(model.backward(g)[:3])


@pytest.mark.parametrize("kwargs", CONVS)
def test_parameter_gradients_on_each_backend_equal_the_host_ones(be, kwargs):
    rng = np.random.default_rng(4)
    conv = Conv2d(**kwargs, dtype=np.float64, rng=1)
    x = rng.standard_normal((3, kwargs["in_channels"], 7, 6))
    g = rng.standard_normal(conv.forward(x).shape)
    want = conv.parameter_gradients(x, g)
    got = conv.parameter_gradients(be.asarray(x), be.asarray(g))
    for name, value in want.items():
        np.testing.assert_allclose(be.to_host(got[name]), value, rtol=1e-12, atol=1e-12)
    # the backward may run on another device than the forward: gradients follow the activations
    for name, value in conv.parameter_gradients(x, be.asarray(g)).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-12, atol=1e-12)
    linear = Linear(5, 3, dtype=np.float64, rng=0)
    xs, gs = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
    for name, value in linear.parameter_gradients(xs, gs).items():
        got_value = linear.parameter_gradients(be.asarray(xs), be.asarray(gs))[name]
        np.testing.assert_allclose(be.to_host(got_value), value, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(linear.parameter_gradients(xs, be.asarray(gs))[name], value, rtol=1e-12,
                                   atol=1e-12)


def pruned_chain(seed: int = 0) -> tuple[Sequential, np.ndarray, np.ndarray]:
    """A chain of pruned convolutions and a Linear (10 % kept: every weight gradient sampled, each
    beside the scan) with a batch and an output gradient."""
    rng = np.random.default_rng(seed)
    layers = [Conv2d(3, 8, 3, padding=1, dtype=np.float64, rng=seed, prune_pattern=True), ReLU(),
              Conv2d(8, 8, 3, padding=1, dtype=np.float64, rng=seed + 1, prune_pattern=True), ReLU(),
              MaxPool2d(2), Flatten(),
              Linear(8 * 4 * 4, 5, dtype=np.float64, rng=seed + 2, prune_pattern=True)]
    for layer in layers:
        if hasattr(layer, "prune_pattern"):
            layer.weight = layer.weight * (rng.random(layer.weight.shape) < 0.1)
    model = Sequential(*layers)
    x = rng.standard_normal((2, 3, 8, 8))
    return model, x, rng.standard_normal((2, 5))


def _record_threads(model: Sequential, calls: list[tuple[str, str]],
                    before: dict[str, Any] | None = None) -> None:
    """Wrap every layer's ``parameter_gradients`` to append ``(layer name, thread name)`` to ``calls``
    (after running ``before[name]()`` where given)."""
    import threading

    for layer in model.layers:
        if hasattr(layer, "parameter_gradients"):
            def wrapped(*args: Any, own: Any = layer.parameter_gradients, name: str = str(layer.name)) -> Any:
                if before and name in before:
                    before[name]()
                calls.append((name, threading.current_thread().name))
                return own(*args)
            layer.parameter_gradients = wrapped


@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_parameter_gradients_beside_the_scan_are_the_same_and_run_on_the_second_thread(method):
    import threading
    import time

    model, x, grad_out = pruned_chain()
    model.forward(x)
    expected = model.parameter_gradients(model.backward(grad_out, method))
    calls: list[tuple[str, str]] = []
    first, *later = [str(layer.name) for layer in model.layers if hasattr(layer, "parameter_gradients")]

    def both_later_ones_ran_beside() -> None:  # the first layer's runs here, first: let the thread finish
        deadline = time.monotonic() + 60
        while len(calls) < len(later) and time.monotonic() < deadline:
            time.sleep(0.001)

    _record_threads(model, calls, {first: both_later_ones_ran_beside})
    grads = model.backward(grad_out, method, input_gradient=False, parameters_beside=True)
    got = model.parameter_gradients(grads)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    # the later layers', each started as the scan reached its output's gradient, from the last layer
    # back; the first layer's output gradient is the scan's last (nothing runs beside it): here
    here = threading.current_thread().name
    assert [name for name, _ in calls] == later[::-1] + [first]
    assert [thread.startswith("sparse-scan-beside") for _, thread in calls] == [True, True, False], calls
    assert calls[-1][1] == here
    calls.clear()
    model.parameter_gradients(model.backward(grad_out, method))  # not asked: all on this thread
    assert calls == [(name, here) for name in [first] + later]


def test_parameter_gradients_not_started_beside_run_here_the_last_queued_first():
    """After the scan the calling thread takes the jobs the second thread has not started, from the
    queue's end (the first layers'), while that thread works from its front: each runs once."""
    import threading

    model, x, grad_out = pruned_chain(3)
    model.forward(x)
    expected = model.parameter_gradients(model.backward(grad_out, "linear"))
    calls: list[tuple[str, str]] = []
    first, middle, last = [str(layer.name) for layer in model.layers if hasattr(layer, "parameter_gradients")]
    last_started, middle_taken = threading.Event(), threading.Event()
    # the last layer's job (queued first) holds the second thread until the middle one is taken here;
    # the first layer's (here, first) waits until that job has started
    _record_threads(model, calls, {last: lambda: (last_started.set(), middle_taken.wait(60)),
                                   middle: middle_taken.set, first: lambda: last_started.wait(60)})
    got = model.parameter_gradients(model.backward(grad_out, "linear", parameters_beside=True))
    assert middle_taken.is_set()
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    here = threading.current_thread().name
    assert sorted(calls) == sorted([(first, here), (middle, here), (last, calls[-1][1])])
    assert calls[-1] == (last, calls[-1][1]) and calls[-1][1].startswith("sparse-scan-beside"), calls


def test_parameter_gradients_of_other_gradients_or_after_a_forward_are_computed_again(monkeypatch):
    model, x, grad_out = pruned_chain(1)
    model.forward(x)
    grads = model.backward(grad_out, "linear", parameters_beside=True)
    other = [None if g is None else 2 * g for g in grads]  # another list: not what the jobs computed
    doubled = model.parameter_gradients(other)
    again = model.parameter_gradients(grads)  # the jobs were dropped: computed here
    for key, value in again.items():
        np.testing.assert_allclose(doubled[key], 2 * value, rtol=1e-12, err_msg=key)
    model.backward(grad_out, "linear", parameters_beside=True)
    y = model.forward(x[::-1].copy())  # a forward first: the jobs are waited for, then dropped
    grads = model.backward(np.ones_like(y), "linear")
    serial = model.parameter_gradients(grads)
    model.forward(x[::-1].copy())
    beside = model.parameter_gradients(model.backward(np.ones_like(y), "linear", parameters_beside=True))
    for key, value in serial.items():
        np.testing.assert_array_equal(beside[key], value, err_msg=key)


def test_an_error_beside_the_scan_is_raised_by_parameter_gradients(monkeypatch):
    model, x, grad_out = pruned_chain(2)
    model.forward(x)
    last = model.layers[-1]
    monkeypatch.setattr(last, "parameter_gradients", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    grads = model.backward(grad_out, "linear", parameters_beside=True)
    with pytest.raises(RuntimeError, match="boom"):
        model.parameter_gradients(grads)
