"""export_torch: a PyTorch module round-trips to a spec whose gradients equal autograd's (its forward
captured by torch.fx; the corpus of models as people write them: test_export_corpus.py)."""

from __future__ import annotations

import os
import pathlib
import re
import stat
import tempfile

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from oracles import randomize_batch_norms

from sparse_scan import export_torch, load_model
from sparse_scan.cli import app
from sparse_scan.layers import BatchNorm2d, Dropout

torch = pytest.importorskip("torch")
nn = torch.nn

from resnet_blocks import BasicBlock  # noqa: E402 - imports torch, skipped above without it


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
    assert_export_equals_autograd(net, spec, (3, 2, 6, 8), method, levels)


def assert_export_equals_autograd(net, spec: pathlib.Path, x_shape: tuple[int, ...], method: str,
                                  levels: int | None) -> None:
    """The exported spec's forward, input gradient and every parameter gradient (by PyTorch's
    names) equal autograd's through ``net`` on a seeded batch, float64."""
    model = load_model(spec, dtype=np.float64)
    x = np.random.default_rng(1).standard_normal(x_shape)
    y = net(torch.from_numpy(x))
    g = np.random.default_rng(2).standard_normal(tuple(y.shape))
    np.testing.assert_allclose(model.forward(x), y.detach().numpy(), rtol=1e-12)
    grads = model.backward(g, method=method, levels=levels)
    parameters = model.parameter_gradients(grads)
    inputs = torch.from_numpy(x).requires_grad_(True)
    net(inputs).backward(torch.from_numpy(g))
    np.testing.assert_allclose(grads[0], inputs.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert sorted(parameters) == sorted(name for name, _ in net.named_parameters())
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(parameters[name], parameter.grad.numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_never_overwrites_and_rejects_unsupported_layers(tmp_path):
    (tmp_path / "net.npz").write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="never overwrites"):
        export_torch(every_layer(), (2, 6, 8), tmp_path / "net.yaml")
    assert (tmp_path / "net.npz").read_bytes() == b"keep"
    with pytest.raises(ValueError, match=r"node '_1' \(module '1'\): InstanceNorm2d is not supported"):
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2)), (1, 5, 5), tmp_path / "b.yaml")
    assert not (tmp_path / "b.yaml").exists()
    with pytest.raises(ValueError, match="needs a name of its own"):  # the weights would be overwritten
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (1, 5, 5), tmp_path / "model.npz")
    assert not (tmp_path / "model.npz").exists()

    with pytest.raises(ValueError, match=r"node '_0' \(module '0'\) fails on a batch of the input shape "
                                         r"\[3, 5, 5\]: RuntimeError"):
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (3, 5, 5), tmp_path / "wrong.yaml")  # 1 channel
    assert not (tmp_path / "wrong.yaml").exists() and not (tmp_path / "wrong.npz").exists()
    with pytest.raises(FileNotFoundError, match="no such directory"):
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (1, 5, 5), tmp_path / "no" / "m.yaml")


def test_the_spec_and_weights_are_plain_files_under_the_umask(tmp_path):
    """Both files get ``0o666`` less the umask (a temporary file's private mode would keep a shared spec
    from other users), and leave no temporary behind."""
    previous = os.umask(0o027)
    try:
        export_torch(nn.Sequential(nn.Conv2d(1, 2, 3)), (1, 5, 5), tmp_path / "m.yaml")
    finally:
        os.umask(previous)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m.npz", "m.yaml"]
    for name in ("m.yaml", "m.npz"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640, name


def test_every_argument_is_written():
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
    (lambda: nn.AvgPool2d(2, divisor_override=3), "'0'): divisor_override: 3 cannot be represented"),
    (lambda: nn.MaxPool2d(2, return_indices=True), "'0'): return_indices: True cannot be represented"),
    (lambda: nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"), "padding_mode: 'reflect' cannot be"),
    (lambda: nn.GroupNorm(1, 1), "node '_0' (module '0'): GroupNorm is not supported"),
    (lambda: nn.BatchNorm2d(1, track_running_stats=False).eval(),
     "'0'): track_running_stats: False cannot be represented (only True): without running statistics"),
    (lambda: nn.BatchNorm2d(1), "(module '0'): the BatchNorm2d is in training mode"),
    (lambda: nn.Dropout2d(), "node '_0' (module '0'): Dropout2d is not supported"),
])
def test_arguments_the_spec_cannot_represent_are_refused_and_nothing_is_written(tmp_path, module, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        export_torch(nn.Sequential(module()), (1, 6, 6), tmp_path / "m.yaml")
    assert list(tmp_path.iterdir()) == []


def normalised_cnn():
    """Conv2d -> BatchNorm2d -> ReLU -> Dropout -> AdaptiveAvgPool2d -> Flatten -> Linear, float64, eval
    mode, with running statistics and affine parameters away from PyTorch's initial ones."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4, eps=1e-3, momentum=None), nn.ReLU(),
        nn.Dropout(0.3), nn.AdaptiveAvgPool2d((3, None)), nn.Flatten(), nn.Linear(4 * 3 * 7, 5)).double()
    with torch.no_grad():
        bn = net[1]
        bn.running_mean.copy_(torch.randn(4, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(4, dtype=torch.float64) + 0.5)
        bn.weight.copy_(torch.randn(4, dtype=torch.float64))
        bn.bias.copy_(torch.randn(4, dtype=torch.float64))
    return net.eval()


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 1),
                                            ("hybrid", 2), ("hybrid", 3)])
def test_normalised_cnn_round_trip_equals_autograd_at_every_activation(tmp_path, method, levels):
    net = normalised_cnn()
    model = load_model(export_torch(net, (2, 5, 7), tmp_path / "net.yaml"), dtype=np.float64)
    assert isinstance(model.layers[1], BatchNorm2d) and isinstance(model.layers[3], Dropout)
    assert not model.layers[1].training and not model.layers[3].training
    x = np.random.default_rng(1).standard_normal((3, 2, 5, 7))
    g = np.random.default_rng(2).standard_normal((3, 5))
    activations = [torch.from_numpy(x).requires_grad_(True)]
    for child in net:
        activations.append(child(activations[-1]))
        activations[-1].retain_grad()
    np.testing.assert_allclose(model.forward(x), activations[-1].detach().numpy(), rtol=1e-12)
    activations[-1].backward(torch.from_numpy(g))
    grads = model.backward(g, method=method, levels=levels)
    assert len(grads) == len(activations) == 8
    for grad, activation in zip(grads, activations, strict=True):
        np.testing.assert_allclose(grad, activation.grad.numpy(), rtol=1e-10, atol=1e-12)
    parameters = model.parameter_gradients(grads)
    assert sorted(parameters) == sorted(name for name, _ in net.named_parameters())
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(parameters[name], parameter.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_normalisation_dropout_and_adaptive_pool_arguments_and_statistics_are_written(tmp_path):
    net = normalised_cnn()
    net[1] = nn.BatchNorm2d(4, affine=False).eval()
    net[3] = nn.Dropout(0.25, inplace=True).train()  # inplace: no effect on values or gradients
    net[4] = nn.AdaptiveAvgPool2d((None, 2))
    net[6] = nn.Linear(4 * 5 * 2, 5)
    path = export_torch(net.double(), (2, 5, 7), tmp_path / "n.yaml")
    layers = {layer["name"]: layer for layer in yaml.safe_load(path.read_text())["layers"]}
    assert layers["1"] == {"name": "1", "type": "batchnorm2d", "num_features": 4, "eps": 1e-5,
                           "momentum": 0.1, "affine": False, "bias": False, "training": False}
    assert layers["3"] == {"name": "3", "type": "dropout", "p": 0.25, "training": True}
    assert layers["4"] == {"name": "4", "type": "adaptive_avgpool2d", "output_size": [None, 2]}
    assert "null" in path.read_text()
    with np.load(tmp_path / "n.npz") as weights:
        assert {key for key in weights if key.startswith("1.")} == {"1.running_mean", "1.running_var"}
    model = load_model(path, dtype=np.float64)
    bn, drop = model.layers[1], model.layers[3]
    assert bn.weight is None and bn.bias is None and drop.training and drop.p == 0.25
    np.testing.assert_array_equal(bn.running_var, net[1].running_var.numpy())
    x = np.ones((2, 2, 5, 7))
    assert not np.array_equal(model.layers[3](x), x)  # masks in training mode


def test_run_and_flops_on_an_exported_normalised_cnn(tmp_path):
    path = export_torch(normalised_cnn(), (2, 5, 7), tmp_path / "net.yaml")
    runner = CliRunner()
    result = runner.invoke(app.main, ["run", str(path), "--random", "2", "--dtype", "float64", "--method",
                                      "blelloch", "--check", "--out", str(tmp_path / "grads.npz")])
    assert result.exit_code == 0, result.output
    assert "max relative error vs linear scan" in result.output
    with np.load(tmp_path / "grads.npz") as grads:
        assert {"1.weight.grad", "1.bias.grad", "3.out.grad", "4.out.grad"} <= set(grads)
        assert "1.running_mean.grad" not in grads
    result = runner.invoke(app.main, ["flops", str(path)])
    assert result.exit_code == 0, result.output
    assert "BP FLOPs" in result.output


# --- residual blocks, recognised by torch.fx tracing -------------------------------------------
# BasicBlock (resnet_blocks.py) with torchvision's ReLU(inplace=True): the traced graph is torchvision's
class Nested(nn.Module):
    """A block whose inner chain holds a block, with a single-module shortcut."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Tanh()
        self.inner = BasicBlock(8, 8, inplace=True)
        self.conv = nn.Conv2d(8, 6, 3, padding=1)
        self.proj = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        x = self.pre(x)
        return self.conv(self.inner(x)) + self.proj(x)


def resnet_like():
    torch.manual_seed(0)
    net = nn.Sequential()
    for name, module in [("conv1", nn.Conv2d(3, 4, 3, 1, 1, bias=False)), ("bn1", nn.BatchNorm2d(4)),
                         ("relu", nn.ReLU()), ("layer1", nn.Sequential(BasicBlock(4, 4, inplace=True))),
                         ("layer2", nn.Sequential(BasicBlock(4, 8, 2, inplace=True),
                                                  BasicBlock(8, 8, inplace=True))),
                         ("nested", nn.Sequential(Nested())), ("avgpool", nn.AdaptiveAvgPool2d(1)),
                         ("flatten", nn.Flatten()), ("fc", nn.Linear(6, 5))]:
        net.add_module(name, module)
    randomize_batch_norms(net)
    return net.double().eval()


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None)]
                         + [("hybrid", k) for k in (1, 2, 3)])
def test_residual_modules_round_trip_with_autograds_gradients(tmp_path, method, levels):
    net = resnet_like()
    spec = export_torch(net, (3, 8, 8), tmp_path / "net.yaml")
    entries = yaml.safe_load(spec.read_text())["layers"]
    names = [entry["name"] for entry in entries]
    # torchvision's BasicBlock: its sum a block named by the module's path, its layers by theirs (the
    # spec's parameter names are PyTorch's), its ReLU called again after the sum a layer of its own
    assert names[3:9] == ["layer1.0", "layer1.0.relu_1", "layer2.0", "layer2.0.relu_1", "layer2.1",
                          "layer2.1.relu_1"]
    assert entries[3]["scoped"] is False and "shortcut" not in entries[3]
    assert [entry["name"] for entry in entries[3]["layers"]] == [
        "layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu", "layer1.0.conv2", "layer1.0.bn2"]
    assert [entry["name"] for entry in entries[5]["shortcut"]] == ["layer2.0.downsample.0",
                                                                   "layer2.0.downsample.1"]
    assert names[9:11] == ["nested.0.pre", "nested.0"]
    assert entries[10]["shortcut"][0]["name"] == "nested.0.proj"
    assert entries[10]["layers"][0]["type"] == "residual"
    assert_export_equals_autograd(net, spec, (3, 3, 8, 8), method, levels)


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.relu(self.conv(x)) + x


class TwoSums(Functional):
    def forward(self, x):
        return self.conv(x) + x + x


class Concat(Functional):
    def forward(self, x):
        return torch.cat([self.conv(x), x], 1)


class ConcatRows(Functional):
    def forward(self, x):
        return torch.cat([self.conv(x), x], 2)


class SharedWeights(Functional):
    def forward(self, x):
        return self.conv(self.conv(x)) + self.conv(x)


class Split(Functional):
    def __init__(self) -> None:
        super().__init__()
        self.conv2 = nn.Conv2d(2, 2, 3, padding=1)
        self.a = nn.Conv2d(2, 2, 1)
        self.b = nn.BatchNorm2d(2)

    def forward(self, x):  # the shortcut a, b: two modules, no nn.Sequential holding them
        return self.conv2(self.conv(x)) + self.b(self.a(x))


@pytest.mark.parametrize("module", [Functional, TwoSums, Split, Concat])
@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_inline_sums_are_captured_as_residual_blocks(tmp_path, module, method):
    """``relu(conv(x)) + x``, ``conv(x) + x + x`` (a block in a block), a shortcut of two modules no
    nn.Sequential holds, and ``torch.cat([conv(x), x], 1)``: blocks whose layers keep the module's
    names."""
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("block", module().double().eval())
    spec = export_torch(net, (2, 4, 4), tmp_path / "net.yaml")
    assert_export_equals_autograd(net, spec, (3, 2, 4, 4), method, None)


@pytest.mark.parametrize("module, fragment", [
    (ConcatRows(), "node 'cat' (torch.cat at test_export.py:"),
    (SharedWeights(), "node 'block_conv_1' (module 'block.conv' at test_export.py:"),
])
def test_other_module_patterns_are_refused_with_the_node_named(tmp_path, module, fragment):
    net = nn.Sequential()
    net.add_module("block", module)
    with pytest.raises(ValueError) as error:
        export_torch(net, (2, 4, 4), tmp_path / "net.yaml")
    assert fragment in str(error.value), str(error.value)
    assert not (tmp_path / "net.yaml").exists() and not (tmp_path / "net.npz").exists()
