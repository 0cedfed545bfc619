"""RNN and GRU with PyTorch's signature: stacked, bidirectional, bias-free, batch_first, dropout,
unbatched; equal to PyTorch autograd in float64 on every schedule, the GPU twin to the NumPy one, and
the one-layer API (the layer form) unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan import backend
from sparse_scan.engine.schedule import depth
from sparse_scan.optim import Adam
from sparse_scan.recurrent import GRU, RNN, Bitstream, RecurrentClassifier
from sparse_scan.train import train_iterations

torch = pytest.importorskip("torch")


def schedules(steps: int) -> list[tuple[str, int | str | None]]:
    return [("linear", None), ("blelloch", None), ("hybrid", "auto")] + [
        ("hybrid", k) for k in range(depth(steps) + 1)]


def assert_close(got, want, rtol, label=""):
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=label)


def make(kind: str, *args, **kwargs):
    """Ours and PyTorch's module of one kind, PyTorch's weights copied into ours."""
    torch_kwargs = {key: value for key, value in kwargs.items() if key not in ("dtype", "rng", "seed")}
    if kind.startswith("rnn"):
        torch_kwargs["nonlinearity"] = kwargs["nonlinearity"] = kind.split("-")[1]
    module = (torch.nn.GRU if kind == "gru" else torch.nn.RNN)(*args, **torch_kwargs).double()
    ours = (GRU if kind == "gru" else RNN)(*args, dtype=np.float64, **kwargs)
    ours.load_state_dict(module.state_dict())
    return ours, module


def torch_reference(module, x, h0, grad_output, grad_h_n):
    x_t = torch.tensor(x, requires_grad=True)
    h0_t = None if h0 is None else torch.tensor(h0, requires_grad=True)
    output, h_n = module(x_t, h0_t)
    loss = (output * torch.tensor(grad_output)).sum()
    if grad_h_n is not None:
        loss = loss + (h_n * torch.tensor(grad_h_n)).sum()
    module.zero_grad()
    loss.backward()
    out = {"output": output.detach().numpy(), "h_n": h_n.detach().numpy(), "input": x_t.grad.numpy()}
    if h0_t is not None:
        out["h0"] = h0_t.grad.numpy()
    out.update({key: value.grad.numpy() for key, value in module.named_parameters()})
    return out


# kind, layers, bidirectional, bias, batch_first, initial state, loss on h_n
CONFIGURATIONS = [
    ("rnn-tanh", 2, True, True, True, True, True),
    ("rnn-relu", 3, False, False, False, False, True),
    ("rnn-tanh", 1, True, False, False, True, False),
    ("gru", 2, True, False, True, True, True),
    ("gru", 3, False, True, False, True, False),
    ("gru", 1, True, True, True, False, True),
]


@pytest.mark.parametrize("kind, layers, bidirectional, bias, batch_first, with_h0, on_state", CONFIGURATIONS)
def test_batched_modules_equal_pytorch_autograd_on_every_schedule(kind, layers, bidirectional, bias,
                                                                  batch_first, with_h0, on_state):
    steps, batch, size, hidden = 10, 3, 2, 4
    torch.manual_seed(layers)
    ours, module = make(kind, size, hidden, num_layers=layers, bias=bias, batch_first=batch_first,
                        bidirectional=bidirectional)
    assert list(ours.state_dict()) == list(module.state_dict())
    rng = np.random.default_rng(layers)
    x = rng.standard_normal(((batch, steps) if batch_first else (steps, batch)) + (size,))
    runs = layers * (2 if bidirectional else 1)
    h0 = rng.standard_normal((runs, batch, hidden)) / 2 if with_h0 else None
    output, h_n = ours(x, h0)
    grad_output = rng.standard_normal(output.shape)
    grad_h_n = rng.standard_normal(h_n.shape) if on_state else None
    want = torch_reference(module, x, h0, grad_output, grad_h_n)
    assert_close(output, want["output"], 1e-12)
    assert_close(h_n, want["h_n"], 1e-12)
    for method, levels in schedules(steps):
        got = ours.backward(grad_output, method, levels, grad_state=grad_h_n)
        for key in set(want) - {"output", "h_n"}:
            assert_close(got[key], want[key], 1e-10, f"{kind} {method} {levels} {key}")


@pytest.mark.parametrize("kind", ["rnn-tanh", "gru"])
def test_a_loss_on_the_final_states_only(kind):
    """No output gradient: the top layer's chains start from h_n alone (the paper's last-state scan)."""
    ours, module = make(kind, 3, 4, num_layers=2, bidirectional=True)
    x = np.random.default_rng(0).standard_normal((7, 2, 3))
    _, h_n = ours(x)
    grad_h_n = np.random.default_rng(1).standard_normal(h_n.shape)
    want = torch_reference(module, x, None, np.zeros((7, 2, 8)), grad_h_n)
    for method, levels in (("blelloch", None), ("linear", None), ("hybrid", 1)):
        got = ours.backward(None, method, levels, grad_state=grad_h_n)
        for key in ("input", "weight_hh_l1_reverse", "weight_ih_l0"):
            assert_close(got[key], want[key], 1e-10, f"{method} {key}")


def test_dropout_masks_are_seeded_applied_in_training_and_absent_in_eval():
    ours = GRU(2, 3, num_layers=3, dropout=0.25, dtype=np.float64, rng=0, seed=5)
    assert ours.training
    x = np.random.default_rng(2).standard_normal((6, 2, 2))
    output, _ = ours(x)
    first = [mask.copy() for mask in ours.dropout_masks]
    assert len(first) == 2 and all(set(np.unique(m)) <= {0.0, 4 / 3} for m in first)
    again = GRU(2, 3, num_layers=3, dropout=0.25, dtype=np.float64, rng=0, seed=5)
    np.testing.assert_array_equal(again(x)[0], output)
    ours(x)
    assert not np.array_equal(ours.dropout_masks[0], first[0])  # the next forward draws new masks
    # PyTorch with the masks applied between one-layer GRUs: same outputs and gradients
    layers = [torch.nn.GRU(2 if k == 0 else 3, 3).double() for k in range(3)]
    with torch.no_grad():
        for k, layer in enumerate(layers):
            for name, value in layer.named_parameters():
                value.copy_(torch.tensor(getattr(ours, name.replace("l0", f"l{k}"))))
    output, _ = ours(x)
    x_t = torch.tensor(x, requires_grad=True)
    hidden = x_t
    for k, layer in enumerate(layers):
        hidden, _ = layer(hidden)
        if k < 2:
            hidden = hidden * torch.tensor(ours.dropout_masks[k])
    assert_close(output, hidden.detach().numpy(), 1e-12)
    hidden.sum().backward()
    got = ours.backward(np.ones(output.shape), "blelloch")
    assert_close(got["input"], x_t.grad.numpy(), 1e-10)
    assert_close(got["weight_hh_l0"], layers[0].weight_hh_l0.grad.numpy(), 1e-10)
    ours.eval()
    ours(x)
    assert ours.dropout_masks == [None, None]
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="train: mode: must be true or false"):
        ours.train("yes")


def test_the_layer_form_of_the_one_layer_api_is_unchanged():
    """``forward`` batch-first returning every state, ``backward`` with short names; multi-layer
    modules use it too (PyTorch's names then)."""
    torch.manual_seed(0)
    module = torch.nn.GRU(3, 4, batch_first=True).double()
    gru = GRU(3, 4, dtype=np.float64, rng=0)
    gru.load_state_dict({key.removesuffix("_l0"): value for key, value in module.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((2, 5, 3))
    h0 = np.random.default_rng(1).standard_normal((2, 4))
    h = gru.forward(x, h0)
    assert_close(h, module(torch.tensor(x), torch.tensor(h0[None]))[0].detach().numpy(), 1e-12)
    grads = gru.backward(np.ones((2, 4)), "blelloch")
    assert sorted(grads) == ["bias_hh", "bias_ih", "h", "h0", "weight_hh", "weight_ih", "x"]
    assert grads["h0"].shape == (2, 4) and grads["h"].shape == (2, 5, 4)
    deep = RNN(3, 4, num_layers=2, bidirectional=True, dtype=np.float64, rng=0)
    out = deep.forward(x)
    assert out.shape == (2, 5, 8)
    module_form, _ = deep(x.transpose(1, 0, 2))
    np.testing.assert_allclose(out, module_form.transpose(1, 0, 2), rtol=1e-14)
    deep.forward(x)  # the backward reads its arguments in the form of the last forward
    last = deep.backward(np.ones((2, 8)), "blelloch")  # a loss on the last output (both directions)
    full = np.zeros((2, 5, 8))
    full[:, -1] = 1
    every = deep.backward(full, "linear")
    assert "weight_hh_l1_reverse" in last and last["h0"].shape == (4, 2, 4)
    for key in last:
        assert_close(last[key], every[key], 1e-12, key)


def test_a_stacked_bidirectional_classifier_trains_like_pytorch():
    data = Bitstream(steps=20, samples=32, seed=1)
    recurrent = GRU(1, 6, num_layers=2, bidirectional=True, rng=0)
    model = RecurrentClassifier(recurrent, classes=10, rng=1)
    assert "rnn.weight_hh_l1_reverse" in model.state_dict()
    torch_module = torch.nn.GRU(1, 6, num_layers=2, bidirectional=True, batch_first=True)
    head = torch.nn.Linear(12, 10)
    with torch.no_grad():
        for key, value in torch_module.named_parameters():
            value.copy_(torch.from_numpy(getattr(recurrent, key)))
        head.weight.copy_(torch.from_numpy(model.fc.weight))
        head.bias.copy_(torch.from_numpy(model.fc.bias))
    optimizer = torch.optim.Adam(list(torch_module.parameters()) + list(head.parameters()), lr=1e-2)
    records = train_iterations(model, data, Adam(model, lr=1e-2), iterations=4, batch_size=8, seed=2)
    order = np.random.default_rng(2).permutation(len(data))
    for iteration, record in enumerate(records):
        x, labels = data.batch(order[iteration * 8:(iteration + 1) * 8])
        out, _ = torch_module(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(head(out[:, -1]), torch.from_numpy(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_bad_arguments_name_the_layer_and_the_field():
    with pytest.raises(ValueError, match="num_layers: must be an int"):
        RNN(2, 3, "relu")  # PyTorch's third argument is num_layers
    with pytest.raises(ValueError, match="bias: must be true or false"):
        GRU(2, 3, bias=1)
    with pytest.raises(ValueError, match="batch_first: must be true or false"):
        GRU(2, 3, batch_first="yes")
    with pytest.raises(ValueError, match="dropout: must be a finite number"):
        RNN(2, 3, dropout=None)
    rnn = RNN(2, 3, num_layers=2, batch_first=True)
    with pytest.raises(ValueError, match=r"layer RNN: input: expected \(batch, time, 2\)"):
        rnn(np.zeros((4, 5, 3)))
    with pytest.raises(ValueError, match=r"layer RNN: h0: expected \(2, 4, 3\)"):
        rnn(np.zeros((4, 5, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"layer RNN: h0: expected \(2, 3\) for unbatched input"):
        rnn(np.zeros((5, 2)), np.zeros((2, 1, 3)))
    with pytest.raises(ValueError, match=r"state_dict: unknown \['weight_hh'\]"):
        rnn.load_state_dict({**rnn.state_dict(), "weight_hh": np.zeros((3, 3))})
    output, h_n = rnn(np.zeros((5, 2)))  # unbatched
    assert output.shape == (5, 3) and h_n.shape == (2, 3)
    with pytest.raises(ValueError, match=r"layer RNN: grad_h_n: expected \(2, 3\)"):
        rnn.backward(np.zeros((5, 3)), grad_state=np.zeros((2, 1, 3)))
    with pytest.raises(ValueError, match="levels applies to method='hybrid' only"):
        rnn.backward(np.zeros((5, 3)), "blelloch", 2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rnn-relu", "gru"])
@pytest.mark.parametrize("with_output", [False, True], ids=["state-only", "every-step"])
def test_gpu_stacked_bidirectional_backward_equals_numpy(kind, with_output):
    gpu = backend.get("gpu")
    steps, batch = 8, 3
    ours, _ = make(kind, 3, 5, num_layers=2, bidirectional=True, batch_first=True, bias=kind == "gru")
    rng = np.random.default_rng(4)
    x, h0 = rng.standard_normal((batch, steps, 3)), rng.standard_normal((4, batch, 5))
    grad_output = rng.standard_normal((batch, steps, 10)) if with_output else None
    grad_h_n = rng.standard_normal((4, batch, 5))
    for method, levels in schedules(steps):
        want_out, _ = ours(x, h0)
        want = ours.backward(grad_output, method, levels, grad_state=grad_h_n)
        got_out, _ = ours(gpu.asarray(x), gpu.asarray(h0))
        assert_close(gpu.to_host(got_out), want_out, 1e-12)
        got = ours.backward(None if grad_output is None else gpu.asarray(grad_output), method, levels,
                            grad_state=gpu.asarray(grad_h_n))
        assert set(got) == set(want)
        for key, value in want.items():
            assert backend.of(got[key]).name == "gpu", key
            assert_close(gpu.to_host(got[key]), value, 1e-10, f"{method} {levels} {key}")
