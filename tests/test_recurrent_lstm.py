"""LSTM through BPPSA: PyTorch's module, blocks and gradients in float64, every schedule, CPU and GPU."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan import backend
from sparse_scan.engine.run import dense_scan
from sparse_scan.engine.schedule import depth
from sparse_scan.recurrent import LSTM

torch = pytest.importorskip("torch")


def schedules(steps: int) -> list[tuple[str, int | str | None]]:
    return [("linear", None), ("blelloch", None), ("hybrid", "auto")] + [
        ("hybrid", k) for k in range(depth(steps) + 1)]


def assert_close(got, want, rtol, label=""):
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=label)


def torch_reference(module, x, hx, grad_output, grad_state):
    """PyTorch's outputs and the gradients of ``<output, grad_output> + <state, grad_state>``."""
    x_t = torch.tensor(x, requires_grad=True)
    hx_t = None if hx is None else tuple(torch.tensor(a, requires_grad=True) for a in hx)
    output, (h_n, c_n) = module(x_t, hx_t)
    loss = (output * torch.tensor(grad_output)).sum()
    for value, seed in zip((h_n, c_n), grad_state, strict=True):
        if seed is not None:
            loss = loss + (value * torch.tensor(seed)).sum()
    module.zero_grad()
    loss.backward()
    out = {"output": output.detach().numpy(), "h_n": h_n.detach().numpy(), "c_n": c_n.detach().numpy(),
           "input": x_t.grad.numpy()}
    if hx_t is not None:
        out.update(h0=hx_t[0].grad.numpy(), c0=hx_t[1].grad.numpy())
    out.update({key: value.grad.numpy() for key, value in module.named_parameters()})
    return out


# layers, bidirectional, proj_size, bias, batch_first, batched, initial state, loss on the final states
CONFIGURATIONS = [
    (1, False, 0, True, False, True, False, False),
    (1, False, 3, True, True, True, True, True),
    (2, True, 0, False, True, True, True, True),
    (2, True, 2, True, False, False, True, True),
    (3, False, 2, False, False, True, False, True),
    (2, False, 0, True, False, False, False, False),
]


@pytest.mark.parametrize("layers, bidirectional, proj, bias, batch_first, batched, with_hx, on_state",
                         CONFIGURATIONS)
def test_lstm_equals_pytorch_autograd_on_every_schedule(layers, bidirectional, proj, bias, batch_first,
                                                        batched, with_hx, on_state):
    steps, batch, size, hidden = 11, 3, 2, 5
    torch.manual_seed(layers + 10 * proj)
    module = torch.nn.LSTM(size, hidden, num_layers=layers, bias=bias, batch_first=batch_first,
                           bidirectional=bidirectional, proj_size=proj).double()
    ours = LSTM(size, hidden, num_layers=layers, bias=bias, batch_first=batch_first,
                bidirectional=bidirectional, proj_size=proj, dtype=np.float64)
    ours.load_state_dict(module.state_dict())
    assert list(ours.state_dict()) == list(module.state_dict())
    rng = np.random.default_rng(layers)
    shape = ((batch, steps) if batch_first else (steps, batch)) if batched else (steps,)
    x = rng.standard_normal(shape + (size,))
    runs, out = layers * (2 if bidirectional else 1), proj or hidden
    state_batch = (batch,) if batched else ()
    hx = (rng.standard_normal((runs,) + state_batch + (out,)) / 2,
          rng.standard_normal((runs,) + state_batch + (hidden,)) / 2) if with_hx else None
    output, (h_n, c_n) = ours(x, hx)
    grad_output = rng.standard_normal(output.shape)
    grad_state = (rng.standard_normal(h_n.shape), rng.standard_normal(c_n.shape)) if on_state else (
        None, None)
    want = torch_reference(module, x, hx, grad_output, grad_state)
    for key, value in (("output", output), ("h_n", h_n), ("c_n", c_n)):
        assert_close(value, want[key], 1e-12, key)
    for method, levels in schedules(steps):
        got = ours.backward(grad_output, method, levels, grad_state=None if not on_state else grad_state)
        keys = set(want) - {"output", "h_n", "c_n"}
        assert set(got) == keys | ({"h0", "c0"} if not with_hx else set())
        for key in keys:
            assert_close(got[key], want[key], 1e-10, f"{method} {levels} {key}")


def test_float32_lstm_follows_pytorch():
    torch.manual_seed(3)
    module = torch.nn.LSTM(3, 8, num_layers=2, batch_first=True)
    ours = LSTM(3, 8, num_layers=2, batch_first=True)
    ours.load_state_dict(module.state_dict())
    x = np.random.default_rng(0).standard_normal((4, 40, 3)).astype(np.float32)
    grad_output = np.random.default_rng(1).standard_normal((4, 40, 8)).astype(np.float32)
    want = torch_reference(module, x, None, grad_output, (None, None))
    output, _ = ours(x)
    assert output.dtype == np.float32
    assert_close(output, want["output"], 1e-5)
    for method, levels in (("linear", None), ("blelloch", None), ("hybrid", 3)):
        got = ours.backward(grad_output, method, levels)
        for key in ("input", "weight_ih_l0", "weight_hh_l1", "bias_hh_l0"):
            assert got[key].dtype == np.float32
            assert_close(got[key], want[key], 2e-4, f"{method} {key}")


@pytest.mark.parametrize("proj", [0, 2])
def test_blocks_are_the_transposed_jacobians_of_one_step(proj):
    """Each filled block is autograd's Jacobian of ``(h_{t-1}, c_{t-1}) -> (h_t, c_t)``, transposed."""
    steps, batch, size, hidden = 4, 2, 3, 4
    torch.manual_seed(proj)
    cell = torch.nn.LSTM(size, hidden, proj_size=proj).double()
    ours = LSTM(size, hidden, proj_size=proj, dtype=np.float64)
    ours.load_state_dict(cell.state_dict())
    rng = np.random.default_rng(5)
    x = rng.standard_normal((batch, steps, size))
    ours.forward(x)
    blocks = ours.transposed_jacobians()
    out = proj or hidden
    assert blocks.shape == (steps, batch, out + hidden, out + hidden)
    h, c = np.zeros((batch, out)), np.zeros((batch, hidden))
    for t in range(steps):
        for b in range(batch):
            def step(state, t=t, b=b):
                h0, c0 = state[None, None, :out], state[None, None, out:]
                _, (h1, c1) = cell(torch.tensor(x[b:b + 1, t:t + 1]).transpose(0, 1), (h0, c0))
                return torch.cat([h1[0, 0], c1[0, 0]])
            state = torch.tensor(np.concatenate([h[b], c[b]]))
            jacobian = torch.autograd.functional.jacobian(step, state).numpy()
            assert_close(blocks[t, b], jacobian.T, 1e-12, f"t={t} b={b}")
        _, (h_t, c_t) = cell(torch.tensor(x[:, t:t + 1]).transpose(0, 1),
                             (torch.tensor(h[None]), torch.tensor(c[None])))
        h, c = h_t[0].detach().numpy(), c_t[0].detach().numpy()


@pytest.mark.parametrize("proj", [0, 3])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("last_only", [False, True])
def test_bp_through_the_factored_blocks_equals_the_filled_ones(proj, dtype, rtol, last_only):
    lstm = LSTM(2, 5, proj_size=proj, dtype=dtype, rng=4)
    rng = np.random.default_rng(2)
    lstm.forward(rng.standard_normal((4, 13, 2)).astype(dtype))
    size = (proj or 5) + 5
    direct = rng.standard_normal((4, size) if last_only else (13, 4, size)).astype(dtype)
    got = lstm.factored_chain(direct)
    assert got.dtype == dtype and got.shape == (14, 4, size)
    assert_close(got, dense_scan(lstm.transposed_jacobians(), direct, "linear"), rtol)

    fills = []
    run = lstm._single_run()
    original = run.transposed_jacobians
    run.transposed_jacobians = lambda *a: fills.append(1) or original(*a)
    seed = rng.standard_normal((4, proj or 5) if last_only else (4, 13, proj or 5)).astype(dtype)
    bp, zero = lstm.backward(seed, "linear"), lstm.backward(seed, "hybrid", 0)
    assert not fills
    blelloch = lstm.backward(seed, "blelloch")
    assert fills
    for key in bp:
        assert_close(zero[key], bp[key], rtol, key)
        assert_close(blelloch[key], bp[key], 100 * rtol, key)


def test_layer_form_and_dropout_masks():
    """The layer form takes batch-first input; training-mode dropout draws masks from the seed, which
    the backward applies; eval mode has none."""
    lstm = LSTM(2, 4, num_layers=3, dropout=0.5, dtype=np.float64, rng=0, seed=11)
    x = np.random.default_rng(0).standard_normal((3, 6, 2))
    first = lstm.forward(x)
    masks = [m.copy() for m in lstm.dropout_masks]
    assert len(masks) == 2 and all(set(np.unique(m)) <= {0.0, 2.0} for m in masks)
    again = LSTM(2, 4, num_layers=3, dropout=0.5, dtype=np.float64, rng=0, seed=11)
    np.testing.assert_array_equal(again.forward(x), first)  # the same seed, the same masks
    grads = lstm.backward(np.ones((3, 4)), "blelloch")
    assert set(grads) >= {"h", "x", "h0", "c0", "weight_hh_l2"}
    torch.manual_seed(0)
    module = torch.nn.LSTM(2, 4, num_layers=3, batch_first=True).double()
    lstm.load_state_dict(module.state_dict())
    lstm.eval()
    assert not lstm.training
    out = lstm.forward(x)
    assert lstm.dropout_masks == [None, None]
    np.testing.assert_allclose(out, module(torch.tensor(x))[0].detach().numpy(), rtol=1e-12)
    assert lstm.train() is lstm and lstm.training


def test_dropout_gradients_equal_pytorch_with_the_same_masks():
    """Training-mode dropout between layers: our masks applied in a PyTorch composition of one-layer
    LSTMs give the same outputs and gradients."""
    ours = LSTM(2, 3, num_layers=2, dropout=0.3, bidirectional=True, dtype=np.float64, rng=1, seed=4)
    layers = [torch.nn.LSTM(2 if k == 0 else 6, 3, bidirectional=True).double() for k in range(2)]
    with torch.no_grad():
        for k, layer in enumerate(layers):
            for name, value in layer.named_parameters():
                value.copy_(torch.tensor(getattr(ours, name.replace("l0", f"l{k}"))))
    x = np.random.default_rng(3).standard_normal((5, 2, 2))
    output, _ = ours(x)
    (mask,) = ours.dropout_masks
    x_t = torch.tensor(x, requires_grad=True)
    hidden, _ = layers[0](x_t)
    want, _ = layers[1](hidden * torch.tensor(mask))
    np.testing.assert_allclose(output, want.detach().numpy(), rtol=1e-12)
    grad_output = np.random.default_rng(4).standard_normal(output.shape)
    (want * torch.tensor(grad_output)).sum().backward()
    for method, levels in schedules(5):
        got = ours.backward(grad_output, method, levels)
        assert_close(got["input"], x_t.grad.numpy(), 1e-10, method)
        assert_close(got["weight_ih_l0_reverse"], layers[0].weight_ih_l0_reverse.grad.numpy(), 1e-10)


def test_bad_arguments_name_the_layer_and_the_field():
    with pytest.raises(ValueError, match="proj_size: must be an int >= 0 and <= 3"):
        LSTM(2, 4, proj_size=4)
    with pytest.raises(ValueError, match="dropout: must be a probability"):
        LSTM(2, 4, dropout=1.5)
    with pytest.raises(ValueError, match="num_layers: must be an int >= 1"):
        LSTM(2, 4, num_layers=0)
    lstm = LSTM(2, 4, num_layers=2, proj_size=2)
    x = np.zeros((5, 3, 2))
    with pytest.raises(ValueError, match=r"layer LSTM: hx: expected a pair \(h0, c0\)"):
        lstm(x, np.zeros((2, 3, 2)))
    with pytest.raises(ValueError, match=r"layer LSTM: h0: expected \(2, 3, 2\)"):
        lstm(x, (np.zeros((2, 3, 4)), np.zeros((2, 3, 4))))
    with pytest.raises(ValueError, match="layer LSTM: c0: values must be finite"):
        lstm(x, (np.zeros((2, 3, 2)), np.full((2, 3, 4), np.nan)))
    with pytest.raises(ValueError, match=r"layer LSTM: input: expected \(time, batch, 2\)"):
        lstm(np.zeros((5, 3, 3)))
    with pytest.raises(RuntimeError, match="call forward before backward"):
        lstm.backward(np.zeros((5, 3, 2)))
    output, (h_n, c_n) = lstm(x)
    with pytest.raises(ValueError, match=r"layer LSTM: grad_output: expected \(5, 3, 2\)"):
        lstm.backward(np.zeros((5, 3, 4)))
    with pytest.raises(ValueError, match=r"layer LSTM: grad_c_n: expected \(2, 3, 4\)"):
        lstm.backward(None, grad_state=(None, np.zeros((2, 3, 2))))
    with pytest.raises(ValueError, match="grad_state: expected a pair"):
        lstm.backward(None, grad_state=np.zeros((2, 3, 2)))
    with pytest.raises(AttributeError, match="has no weight_ih"):
        lstm.weight_ih  # noqa: B018
    with pytest.raises(ValueError, match="one chain per layer and direction"):
        lstm.transposed_jacobians()
    grads = lstm.backward(None, grad_state=(np.ones(h_n.shape), None))  # the final states only
    assert grads["input"].shape == x.shape and float(np.abs(grads["input"]).max()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("proj, layers, bidirectional", [(0, 1, False), (2, 2, True)])
@pytest.mark.parametrize("last_only", [False, True], ids=["every-step", "last-only"])
def test_gpu_lstm_backward_equals_numpy(proj, layers, bidirectional, last_only):
    gpu = backend.get("gpu")
    steps, batch = 9, 3
    lstm = LSTM(3, 5, num_layers=layers, bidirectional=bidirectional, proj_size=proj, batch_first=True,
                dtype=np.float64, rng=7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((batch, steps, 3))
    width = (2 if bidirectional else 1) * (proj or 5)
    runs = layers * (2 if bidirectional else 1)
    hx = (rng.standard_normal((runs, batch, proj or 5)), rng.standard_normal((runs, batch, 5)))
    grad_output = None if last_only else rng.standard_normal((batch, steps, width))
    grad_state = (rng.standard_normal((runs, batch, proj or 5)), rng.standard_normal((runs, batch, 5)))
    want_out, want_state = lstm(x, hx)
    on_device = lstm(gpu.asarray(x), tuple(gpu.asarray(a) for a in hx))
    assert backend.of(on_device[0]).name == "gpu"
    assert_close(gpu.to_host(on_device[0]), want_out, 1e-12)
    assert_close(gpu.to_host(on_device[1][1]), want_state[1], 1e-12)
    device_grad = None if grad_output is None else gpu.asarray(grad_output)
    for method, levels in schedules(steps):
        lstm(x, hx)
        want = lstm.backward(grad_output, method, levels, grad_state=grad_state)
        lstm(gpu.asarray(x), tuple(gpu.asarray(a) for a in hx))
        got = lstm.backward(device_grad, method, levels, grad_state=tuple(gpu.asarray(a) for a in grad_state))
        assert set(got) == set(want)
        for key, value in want.items():
            assert backend.of(got[key]).name == "gpu", key
            assert_close(gpu.to_host(got[key]), value, 1e-10, f"{method} {levels} {key}")
