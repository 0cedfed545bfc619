"""Training the paper's recurrent classifier: BPPSA and BP give the same loss curve (and PyTorch's)."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan.optim import Adam
from sparse_scan.recurrent import GRU, LSTM, RNN, Bitstream, RecurrentClassifier
from sparse_scan.train import train_iterations

KINDS = {"rnn": RNN, "gru": GRU, "lstm": LSTM}


def classifier(kind: str) -> RecurrentClassifier:
    return RecurrentClassifier(KINDS[kind](1, 20, rng=0), classes=10, rng=1)


def torch_twin(model: RecurrentClassifier, kind: str):
    """PyTorch's batch-first module and head with the classifier's weights."""
    torch = pytest.importorskip("torch")
    module = getattr(torch.nn, kind.upper())(1, 20, batch_first=True)
    head = torch.nn.Linear(20, 10)
    with torch.no_grad():
        for key, value in module.named_parameters():
            value.copy_(torch.from_numpy(getattr(model.recurrent, key)))
        head.weight.copy_(torch.from_numpy(model.fc.weight))
        head.bias.copy_(torch.from_numpy(model.fc.bias))
    return module, head


def torch_curve(module, head, data, iterations: int, batch_size: int, seed: int, lr: float) -> list[float]:
    """PyTorch's Adam on the batches train_iterations draws (the same permutations)."""
    import torch  # noqa: PLC0415 - optional

    optimizer = torch.optim.Adam(list(module.parameters()) + list(head.parameters()), lr=lr)
    order, position, permutation, losses = np.random.default_rng(seed), 0, None, []
    permutation = order.permutation(len(data))
    for _ in range(iterations):
        if position + batch_size > len(permutation):
            permutation, position = order.permutation(len(data)), 0
        x, labels = data.batch(permutation[position:position + batch_size])
        position += batch_size
        out, _ = module(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(head(out[:, -1]), torch.from_numpy(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
def test_bppsa_and_bp_training_give_the_same_losses(kind):
    data = Bitstream(steps=60, samples=256, seed=0)
    curves, weights = {}, {}
    for method, levels in (("blelloch", None), ("linear", None), ("hybrid", "auto")):
        model = classifier(kind)
        start = {key: value.copy() for key, value in model.state_dict().items()}
        records = train_iterations(model, data, Adam(model, lr=1e-2), iterations=12, batch_size=16,
                                   method=method, levels=levels, seed=3)
        curves[method] = np.array([r["loss"] for r in records])
        weights[method] = model.state_dict()
    assert set(weights["linear"]) == {"fc.weight", "fc.bias", "rnn.weight_ih_l0", "rnn.weight_hh_l0",
                                      "rnn.bias_ih_l0", "rnn.bias_hh_l0"}

    for method in ("blelloch", "hybrid"):
        np.testing.assert_allclose(curves[method], curves["linear"], rtol=1e-5)
        for key, value in weights["linear"].items():
            assert not np.array_equal(value, start[key])  # every parameter was trained
            np.testing.assert_allclose(weights[method][key], value, rtol=1e-4, atol=1e-5, err_msg=key)

@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
def test_training_follows_pytorch_adam_on_the_same_batches(kind):
    data = Bitstream(steps=40, samples=64, seed=1)
    model = classifier(kind)
    module, head = torch_twin(model, kind)
    records = train_iterations(model, data, Adam(model, lr=1e-2), iterations=6, batch_size=8, seed=2)
    expected = torch_curve(module, head, data, 6, 8, 2, 1e-2)
    np.testing.assert_allclose([r["loss"] for r in records], expected, rtol=1e-5)


def test_lstm_bitstream_curve_equals_pytorch_for_100_iterations():
    """The paper's task and sizes (H=20, input 1, 10 classes), T=50, B=16: BPPSA's LSTM training curve
    is PyTorch's to float32 tolerance (bench/lstm.py --curve runs it at the paper's lengths)."""
    data = Bitstream(steps=50, samples=512, seed=3)
    model = classifier("lstm")
    module, head = torch_twin(model, "lstm")
    records = train_iterations(model, data, Adam(model, lr=1e-3), iterations=100, batch_size=16,
                               method="blelloch", seed=4)
    expected = torch_curve(module, head, data, 100, 16, 4, 1e-3)
    losses = np.array([r["loss"] for r in records])
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    assert losses[-10:].mean() < losses[:10].mean()  # it learns


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
def test_gpu_training_gives_the_host_losses(kind):
    """Host labels beside device logits; the scan and the forward on the GPU."""
    data = Bitstream(steps=30, samples=32, seed=2)
    losses = {}
    for device in ("cpu", "gpu"):
        model = classifier(kind)
        records = train_iterations(model, data, Adam(model, lr=1e-2), iterations=3, batch_size=8,
                                   device=device)
        losses[device] = [record["loss"] for record in records]
    np.testing.assert_allclose(losses["gpu"], losses["cpu"], rtol=1e-4)  # float32
