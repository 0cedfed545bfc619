"""RNNCell, GRUCell, LSTMCell and CellSequence (a user's loop over a cell, back-propagated by the scan):
equal to PyTorch autograd in float64 on every schedule; the GPU twin equal to the NumPy one."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan import backend
from sparse_scan.engine.schedule import depth
from sparse_scan.recurrent import CellSequence, GRUCell, LSTMCell, RNNCell

torch = pytest.importorskip("torch")

KINDS = ["rnn-tanh", "rnn-relu", "gru", "lstm"]


def schedules(steps: int) -> list[tuple[str, int | str | None]]:
    return [("linear", None), ("blelloch", None), ("hybrid", "auto")] + [
        ("hybrid", k) for k in range(depth(steps) + 1)]


def assert_close(got, want, rtol, label=""):
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=label)


def make(kind: str, size: int, hidden: int, bias: bool = True):
    """Ours and PyTorch's cell, PyTorch's weights copied into ours."""
    if kind.startswith("rnn"):
        nonlinearity = kind.split("-")[1]
        module = torch.nn.RNNCell(size, hidden, bias=bias, nonlinearity=nonlinearity).double()
        ours = RNNCell(size, hidden, bias=bias, nonlinearity=nonlinearity, dtype=np.float64)
    else:
        module = (torch.nn.GRUCell if kind == "gru" else torch.nn.LSTMCell)(size, hidden, bias=bias).double()
        ours = (GRUCell if kind == "gru" else LSTMCell)(size, hidden, bias=bias, dtype=np.float64)
    ours.load_state_dict(module.state_dict())
    return ours, module


def state_of(kind, rng, shape):
    if kind == "lstm":
        return rng.standard_normal(shape) / 2, rng.standard_normal(shape) / 2
    return rng.standard_normal(shape) / 2


def as_tensors(value):
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(torch.tensor(a, requires_grad=True) for a in value)
    return torch.tensor(value, requires_grad=True)


def flat(value):
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_one_step_equals_pytorch(kind, batched, bias):
    torch.manual_seed(1)
    ours, module = make(kind, 3, 4, bias)
    rng = np.random.default_rng(2)
    shape = (5,) if batched else ()
    x, hx = rng.standard_normal(shape + (3,)), state_of(kind, rng, shape + (4,))
    x_t, hx_t = as_tensors(x), as_tensors(hx)
    want = module(x_t, hx_t)
    got = ours(x, hx)
    seeds = tuple(rng.standard_normal(shape + (4,)) for _ in flat(got))
    for a, b in zip(flat(got), flat(want), strict=True):
        assert_close(a, b.detach().numpy(), 1e-12)
    sum((w * torch.tensor(s)).sum() for w, s in zip(flat(want), seeds, strict=True)).backward()
    for method, levels in schedules(1):
        grads = ours.backward(seeds if kind == "lstm" else seeds[0], method, levels)
        assert_close(grads["input"], x_t.grad.numpy(), 1e-10, f"{method} input")
        for name, value in zip(("h0", "c0"), flat(hx_t), strict=False):
            assert_close(grads[name], value.grad.numpy(), 1e-10, f"{method} {name}")
        for key, value in module.named_parameters():
            assert_close(grads[key], value.grad.numpy(), 1e-10, f"{method} {key}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batched", [True, False])
def test_a_loop_over_a_cell_is_back_propagated_like_pytorch(kind, batched):
    """A user's loop: a loss on some steps' h (and the LSTM's last c), the initial state given."""
    steps, hidden = 9, 4
    torch.manual_seed(2)
    ours, module = make(kind, 2, hidden)
    rng = np.random.default_rng(3)
    shape = (3,) if batched else ()
    x, hx = rng.standard_normal((steps,) + shape + (2,)), state_of(kind, rng, shape + (hidden,))
    seeds = [rng.standard_normal(shape + (hidden,)) if t % 3 != 1 else None for t in range(steps)]
    last_c = rng.standard_normal(shape + (hidden,))
    loop, state = CellSequence(ours), hx
    x_t, hx_t = as_tensors(x), as_tensors(hx)
    torch_state, loss = hx_t, 0
    for t in range(steps):
        state = loop(x[t], state)
        torch_state = module(x_t[t], torch_state)
        h = torch_state[0] if kind == "lstm" else torch_state
        assert_close(flat(state)[0], h.detach().numpy(), 1e-12, f"step {t}")
        if seeds[t] is not None:
            loss = loss + (h * torch.tensor(seeds[t])).sum()
    assert len(loop) == steps
    grads_in = list(seeds)
    if kind == "lstm":
        loss = loss + (torch_state[1] * torch.tensor(last_c)).sum()
        grads_in[-1] = (seeds[-1], last_c)
    loss.backward()
    for method, levels in schedules(steps):
        grads = loop.backward(grads_in, method, levels)
        assert_close(grads["input"], x_t.grad.numpy(), 1e-10, f"{method} {levels} input")
        for name, value in zip(("h0", "c0"), flat(hx_t), strict=False):
            assert_close(grads[name], value.grad.numpy(), 1e-10, f"{method} {levels} {name}")
        for key, value in module.named_parameters():
            assert_close(grads[key], value.grad.numpy(), 1e-10, f"{method} {levels} {key}")


def test_stacked_gradients_and_a_broken_chain():
    cell = GRUCell(2, 3, dtype=np.float64, rng=0)
    loop = CellSequence(cell)
    x = np.random.default_rng(0).standard_normal((5, 2, 2))
    h = None
    for x_t in x:
        h = loop(x_t, h)
    listed = loop.backward([np.ones((2, 3))] * 5, "blelloch")
    stacked = loop.backward(np.ones((5, 2, 3)), "blelloch")
    for key in listed:
        np.testing.assert_array_equal(listed[key], stacked[key])
    with pytest.raises(ValueError, match="step 5: hx must be the state step 4 returned"):
        loop(x[0], h.copy())
    with pytest.raises(ValueError, match="expected 5 entries"):
        loop.backward([None] * 4)
    loop.reset()
    assert len(loop) == 0
    with pytest.raises(RuntimeError, match="no step recorded"):
        loop.backward()
    lstm = LSTMCell(2, 3)
    with pytest.raises(ValueError, match=r"layer LSTMCell: hx: expected a pair \(h0, c0\)"):
        lstm(np.zeros((2, 2)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"layer LSTMCell: input: expected \(batch, 2\)"):
        lstm(np.zeros((2, 3)))
    with pytest.raises(RuntimeError, match="call the cell before backward"):
        lstm.backward()
    with pytest.raises(ValueError, match="nonlinearity"):
        RNNCell(2, 3, nonlinearity="gelu")
    assert sorted(RNNCell(2, 3, bias=False).state_dict()) == ["weight_hh", "weight_ih"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rnn-tanh", "gru", "lstm"])
def test_gpu_loop_over_a_cell_equals_numpy(kind):
    gpu = backend.get("gpu")
    steps = 7
    ours, _ = make(kind, 2, 4)
    rng = np.random.default_rng(5)
    x, hx = rng.standard_normal((steps, 3, 2)), state_of(kind, rng, (3, 4))
    seeds = rng.standard_normal((steps, 3, 4))
    for method, levels in schedules(steps):
        results = {}
        for device in ("cpu", "gpu"):
            be = backend.get(device)
            loop = CellSequence(ours)
            state = tuple(be.asarray(a) for a in hx) if kind == "lstm" else be.asarray(hx)
            for t in range(steps):
                state = loop(be.asarray(x[t]), state)
            results[device] = loop.backward(be.asarray(seeds), method, levels)
        assert set(results["gpu"]) == set(results["cpu"])
        for key, value in results["cpu"].items():
            assert backend.of(results["gpu"][key]).name == "gpu", key
            assert_close(gpu.to_host(results["gpu"][key]), value, 1e-10, f"{method} {levels} {key}")
