"""export_torch: a PyTorch nn.Sequential round-trips to a spec whose gradients equal autograd's."""

from __future__ import annotations

import pathlib
import re
import tempfile

import numpy as np
import pytest

from sparse_scan import export_torch, load_model

torch = pytest.importorskip("torch")
nn = torch.nn


def every_layer():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, (2, 3), stride=(1, 2), dilation=1, groups=2, bias=False), nn.LeakyReLU(0.1),
        nn.AvgPool2d(2, stride=1, padding=1, count_include_pad=False), nn.Sigmoid(),
        nn.Flatten(2, 3), nn.GELU(approximate="tanh"), nn.Flatten(), nn.Linear(4 * 3 * 2, 6),
        nn.ELU(0.5), nn.Hardtanh(-0.5, 0.75), nn.Softplus(2.0, 1.0), nn.SiLU(inplace=True), nn.Identity(),
        nn.Tanh(), nn.Linear(6, 3)).double()


@pytest.mark.parametrize("method, levels", [("blelloch", None), ("hybrid", 2)])
def test_round_trip_gradients_equal_autograd(tmp_path, method, levels):
    net = every_layer()
    spec = export_torch(net, (2, 6, 8), tmp_path / "net.yaml")
    model = load_model(spec, dtype=np.float64)
    x = np.random.default_rng(1).standard_normal((3, 2, 6, 8))
    g = np.random.default_rng(2).standard_normal((3, 3))
    np.testing.assert_allclose(model.forward(x), net(torch.from_numpy(x)).detach().numpy(), rtol=1e-12)
    grads = model.backward(g, method=method, levels=levels)
    parameters = model.parameter_gradients(grads)
    inputs = torch.from_numpy(x).requires_grad_(True)
    net(inputs).backward(torch.from_numpy(g))
    np.testing.assert_allclose(grads[0], inputs.grad.numpy(), rtol=1e-10, atol=1e-12)
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(parameters[name], parameter.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_never_overwrites_and_rejects_unsupported_layers(tmp_path):
    (tmp_path / "net.npz").write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="never overwrites"):
        export_torch(every_layer(), (2, 6, 8), tmp_path / "net.yaml")
    assert (tmp_path / "net.npz").read_bytes() == b"keep"
    with pytest.raises(ValueError, match="layer '1': type: BatchNorm2d is not supported"):
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), (1, 5, 5), tmp_path / "b.yaml")
    assert not (tmp_path / "b.yaml").exists()
    with pytest.raises(ValueError, match="needs a name of its own"):  # the weights would be overwritten
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (1, 5, 5), tmp_path / "model.npz")
    assert not (tmp_path / "model.npz").exists()

    with pytest.raises(ValueError, match="nothing written, the spec would not load: .*field 'in_channels'"):
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (3, 5, 5), tmp_path / "wrong.yaml")  # 1 channel
    assert not (tmp_path / "wrong.yaml").exists() and not (tmp_path / "wrong.npz").exists()
    with pytest.raises(FileNotFoundError, match="no such directory"):
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (1, 5, 5), tmp_path / "no" / "m.yaml")


def test_every_argument_is_written():
    import yaml

    net = every_layer()
    with tempfile.TemporaryDirectory() as folder:
        layers = yaml.safe_load(export_torch(net, (2, 6, 8), pathlib.Path(folder) / "n.yaml")
                                .read_text())["layers"]
    by_name = {layer["name"]: layer for layer in layers}
    assert by_name["7"] == {"name": "7", "type": "flatten", "start_dim": 2, "end_dim": 3}
    assert by_name["8"] == {"name": "8", "type": "gelu", "approximate": "tanh"}
    assert by_name["13"] == {"name": "13", "type": "softplus", "beta": 2.0, "threshold": 1.0}
    assert by_name["3"]["groups"] == 2 and by_name["3"]["bias"] is False and by_name["3"]["in_channels"] == 4


@pytest.mark.parametrize("module, fragment", [
    (lambda: nn.AvgPool2d(2, divisor_override=3), "layer '0': divisor_override: 3 cannot be represented"),
    (lambda: nn.MaxPool2d(2, return_indices=True), "layer '0': return_indices: True cannot be represented"),
    (lambda: nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"), "padding_mode: 'reflect' cannot be"),
    (lambda: nn.ReLU6(), "layer '0': type: ReLU6 is not supported"),
])
def test_arguments_the_spec_cannot_represent_are_refused_and_nothing_is_written(tmp_path, module, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        export_torch(nn.Sequential(module()), (1, 6, 6), tmp_path / "m.yaml")
    assert list(tmp_path.iterdir()) == []
