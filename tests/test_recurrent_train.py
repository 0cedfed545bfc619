"""Training the paper's recurrent classifier: BPPSA and BP give the same loss curve (and PyTorch's)."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan.optim import Adam
from sparse_scan.recurrent import GRU, RNN, Bitstream, RecurrentClassifier, train_recurrent


def classifier(kind: str) -> RecurrentClassifier:
    cell = RNN(1, 20, rng=0) if kind == "rnn" else GRU(1, 20, rng=0)
    return RecurrentClassifier(cell, classes=10, rng=1)


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_bppsa_and_bp_training_give_the_same_losses(kind):
    data = Bitstream(steps=60, samples=256, seed=0)
    curves, weights = {}, {}
    for method, levels in (("blelloch", None), ("linear", None), ("hybrid", "auto")):
        model = classifier(kind)
        start = {key: value.copy() for key, value in model.state_dict().items()}
        records = train_recurrent(model, data, Adam(model, lr=1e-2), iterations=12, batch_size=16,
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

@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_training_follows_pytorch_adam_on_the_same_batches(kind):
    torch = pytest.importorskip("torch")
    data = Bitstream(steps=40, samples=64, seed=1)
    model = classifier(kind)
    module = (torch.nn.RNN if kind == "rnn" else torch.nn.GRU)(1, 20, batch_first=True)
    head = torch.nn.Linear(20, 10)
    with torch.no_grad():
        for key, value in module.named_parameters():
            value.copy_(torch.from_numpy(getattr(model.recurrent, key[:-3])))
        head.weight.copy_(torch.from_numpy(model.fc.weight))
        head.bias.copy_(torch.from_numpy(model.fc.bias))
    optimizer = torch.optim.Adam(list(module.parameters()) + list(head.parameters()), lr=1e-2)
    records = train_recurrent(model, data, Adam(model, lr=1e-2), iterations=6, batch_size=8, seed=2)
    order = np.random.default_rng(2).permutation(len(data))
    for iteration, record in enumerate(records):
        x, labels = data.batch(order[iteration * 8:(iteration + 1) * 8])
        out, _ = module(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(head(out[:, -1]), torch.from_numpy(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_gpu_training_gives_the_host_losses(kind):
    """Host labels beside device logits; the scan and the forward on the GPU."""
    data = Bitstream(steps=30, samples=32, seed=2)
    losses = {}
    for device in ("cpu", "gpu"):
        model = classifier(kind)
        records = train_recurrent(model, data, Adam(model, lr=1e-2), iterations=3, batch_size=8,
                                  device=device)
        losses[device] = [record["loss"] for record in records]
    np.testing.assert_allclose(losses["gpu"], losses["cpu"], rtol=1e-4)  # float32
