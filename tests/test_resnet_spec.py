"""Residual blocks in model specs (issue 22): a ``residual`` layer type with nested names, weights by
PyTorch's state_dict names, seeded init and pruning inside blocks, one clear SpecError per bad field, and
the bundled ResNet-20 through the command line.

The reference is a small ResNet written in plain PyTorch (torchvision is not a dependency): a stem, an
identity BasicBlock and a strided one with a 1x1 conv + batch-norm ``downsample``, pooling and a linear
head, float64, batch 3. Its ``state_dict`` saved as ``.npz`` loads into the matching spec, whose outputs,
activation gradients and parameter gradients equal autograd's for every schedule.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from click.testing import CliRunner
from oracles import randomize_batch_norms

from sparse_scan import Sequential, SpecError, load_model
from sparse_scan.cli import app
from sparse_scan.engine.schedule import depth
from sparse_scan.layers import BatchNorm2d, Conv2d, Flatten, Linear, ReLU, Residual, Tanh
from sparse_scan.weights import load_state_dict, named_layers, state_dict

torch = pytest.importorskip("torch")
nn = torch.nn

from resnet_blocks import BasicBlock  # noqa: E402 - imports torch, skipped above without it

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
RTOL, ATOL = 1e-10, 1e-12


def block_spec(name: str, cin: int, cout: int, stride: int, indent: str = "  ") -> str:
    """The spec entry of a torchvision-style BasicBlock without its final ReLU."""
    s = f", stride: {stride}" if stride != 1 else ""
    text = (f"{indent}- name: {name}\n{indent}  type: residual\n{indent}  layers:\n"
            f"{indent}    - {{name: conv1, type: conv2d, out_channels: {cout}, kernel_size: 3{s}, "
            "padding: 1, bias: false}\n"
            f"{indent}    - {{name: bn1, type: batchnorm2d}}\n{indent}    - {{name: relu, type: relu}}\n"
            f"{indent}    - {{name: conv2, type: conv2d, out_channels: {cout}, kernel_size: 3, padding: 1, "
            "bias: false}\n"
            f"{indent}    - {{name: bn2, type: batchnorm2d}}\n")
    if stride != 1 or cin != cout:
        text += (f"{indent}  shortcut_name: downsample\n{indent}  shortcut:\n"
                 f"{indent}    - {{type: conv2d, out_channels: {cout}, kernel_size: 1{s}, bias: false}}\n"
                 f"{indent}    - {{type: batchnorm2d}}\n")
    return text


SMALL_RESNET = ("input_shape: [3, 8, 8]\nweights: small.npz\nlayers:\n"
                "  - {name: conv1, type: conv2d, out_channels: 4, kernel_size: 3, padding: 1, bias: false}\n"
                "  - {name: bn1, type: batchnorm2d}\n  - {name: relu, type: relu}\n"
                + block_spec("layer1.0", 4, 4, 1) + "  - {name: relu1, type: relu}\n"
                + block_spec("layer2.0", 4, 8, 2) + "  - {name: relu2, type: relu}\n"
                + block_spec("layer2.1", 8, 8, 1) + "  - {name: relu3, type: relu}\n"
                "  - {name: avgpool, type: adaptive_avgpool2d, output_size: 1}\n"
                "  - {name: flatten, type: flatten}\n  - {name: fc, type: linear, out_features: 5}\n")


class SmallResNet(nn.Module):
    """A stem, three BasicBlocks (4 -> 4, 4 -> 8 stride 2, 8 -> 8), global pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(4, 4, 1))
        self.layer2 = nn.Sequential(BasicBlock(4, 8, 2), BasicBlock(8, 8, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def steps(self):
        """The spec's layers, one callable each: the blocks' final ReLUs are layers of their own."""
        blocks = [self.layer1[0], self.layer2[0], self.layer2[1]]
        out = [self.conv1, self.bn1, self.relu]
        for block in blocks:
            out += [block.residual, self.relu]
        return out + [self.avgpool, torch.nn.Flatten(), self.fc]

    def forward(self, x):
        for step in self.steps():
            x = step(x)
        return x


def small_resnet(tmp_path: pathlib.Path) -> tuple[SmallResNet, pathlib.Path]:
    """The torch reference (float64, eval mode, random statistics) and its spec with the weights saved
    under its state_dict names."""
    torch.manual_seed(0)
    net = SmallResNet().double().eval()
    randomize_batch_norms(net)
    np.savez(tmp_path / "small.npz", **{key: value.numpy() for key, value in net.state_dict().items()})
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_RESNET)
    return net, path


def autograd(net: SmallResNet, x: np.ndarray, g: np.ndarray):
    """Output, the gradient w.r.t. every layer's input and output, and every parameter's gradient."""
    activations = [torch.from_numpy(x).requires_grad_()]
    for step in net.steps():
        activations.append(step(activations[-1]))
        activations[-1].retain_grad()
    activations[-1].backward(torch.from_numpy(g))
    return (activations[-1].detach().numpy(), [a.grad.numpy() for a in activations],
            {name: p.grad.numpy() for name, p in net.named_parameters()})


def test_spec_resnet_equals_torch_autograd_for_every_schedule(tmp_path):
    net, path = small_resnet(tmp_path)
    model = load_model(path, dtype=np.float64)
    theirs = {k for k in net.state_dict() if not k.endswith("num_batches_tracked")}
    assert sorted(state_dict(model)) == sorted(theirs)
    x = np.random.default_rng(1).standard_normal((3, 3, 8, 8))
    y = model.forward(x)
    g = np.random.default_rng(2).standard_normal(y.shape)
    output, activation_grads, parameter_grads = autograd(net, x, g)
    np.testing.assert_allclose(y, output, rtol=1e-12, atol=1e-14)
    schedules = [("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(depth(len(model)) + 1)]
    for method, levels in schedules:
        grads = model.backward(g, method=method, levels=levels)
        assert len(grads) == len(activation_grads)
        for ours, want in zip(grads, activation_grads, strict=True):
            np.testing.assert_allclose(ours, want, rtol=RTOL, atol=ATOL, err_msg=f"{method} {levels}")
        params = model.parameter_gradients(grads)
        assert sorted(params) == sorted(parameter_grads)
        for name, want in parameter_grads.items():
            np.testing.assert_allclose(params[name], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{method} {levels} {name}")


def test_spec_blocks_are_residual_layers_with_inferred_channels(tmp_path):
    _, path = small_resnet(tmp_path)
    model = load_model(path, dtype=np.float64)
    block = model.layers[5]
    assert isinstance(block, Residual) and block.name == "layer2.0" and block.shortcut_name == "downsample"
    assert [layer.name for layer in block.layers] == ["conv1", "bn1", "relu", "conv2", "bn2"]
    assert block.layers[0].in_channels == 4 and block.layers[3].in_channels == 8
    assert block.shortcut[0].in_channels == 4 and block.shortcut[1].num_features == 8
    assert model.layers[3].shortcut == ()
    assert "layer2.0.downsample.0" in named_layers(model)


NESTED = """input_shape: [2, 5, 5]
init: {seed: 3}
layers:
  - name: outer
    type: residual
    layers:
      - name: inner
        type: residual
        layers:
          - {name: c1, type: conv2d, out_channels: 2, kernel_size: 3, padding: 1}
          - {type: tanh}
          - {name: c2, type: conv2d, out_channels: 2, kernel_size: 3, padding: 1}
      - {name: bn, type: batchnorm2d}
      - {type: relu}
      - {name: c3, type: conv2d, out_channels: 3, kernel_size: 3, padding: 1}
    shortcut: {type: conv2d, out_channels: 3, kernel_size: 1}
  - {type: flatten}
  - {name: fc, type: linear, out_features: 4}
"""


def test_nested_blocks_and_a_single_shortcut_layer(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text(NESTED)
    model = load_model(path, dtype=np.float64)
    assert list(named_layers(model))[:7] == ["outer", "outer.inner", "outer.inner.c1", "outer.inner.1",
                                             "outer.inner.c2", "outer.bn", "outer.2"]
    assert "outer.shortcut.weight" in state_dict(model) and model.layers[2].in_features == 75
    # the same model built in code, with the spec's parameters, computes the same
    inner = Residual(Conv2d(2, 2, 3, padding=1, dtype=np.float64, rng=0), Tanh(),
                     Conv2d(2, 2, 3, padding=1, dtype=np.float64, rng=0))
    inner.layers[0].name, inner.layers[2].name = "c1", "c2"
    layers = [inner, BatchNorm2d(2, dtype=np.float64).eval(), ReLU(), Conv2d(2, 3, 3, padding=1,
                                                                              dtype=np.float64, rng=0)]
    for layer, name in zip(layers, ["inner", "bn", "2", "c3"], strict=True):
        layer.name = name
    outer = Residual(*layers, shortcut=Conv2d(2, 3, 1, dtype=np.float64, rng=0))
    outer.name = "outer"
    fc = Linear(75, 4, dtype=np.float64, rng=0)
    fc.name = "fc"
    flatten = Flatten()
    flatten.name = "1"
    from_code = Sequential(outer, flatten, fc, input_shape=(2, 5, 5))
    load_state_dict(from_code, state_dict(model))
    x = np.random.default_rng(0).standard_normal((2, 2, 5, 5))
    np.testing.assert_allclose(model.forward(x), from_code.forward(x), rtol=1e-14)
    # the same seed, the same parameters; a model with weights changes none of them
    again = load_model(path, dtype=np.float64)
    for key, value in state_dict(model).items():
        np.testing.assert_array_equal(state_dict(again)[key], value)


def test_init_and_prune_reach_into_blocks(tmp_path):
    text = SMALL_RESNET.replace("weights: small.npz", "init: {seed: 0}\nprune: {amount: 0.5}")
    path = tmp_path / "pruned.yaml"
    path.write_text(text)
    model = load_model(path)
    for name, layer in named_layers(model).items():
        if isinstance(layer, (Conv2d, Linear)):
            assert layer.prune_pattern, name
            assert np.mean(layer.weight == 0) == pytest.approx(0.5, abs=0.05), name
        if isinstance(layer, BatchNorm2d):
            assert np.all(layer.weight == 1) and np.all(layer.running_var == 1), name
    bundled = load_model(DATA / "resnet20-pruned.yaml")
    convs = [layer for layer in named_layers(bundled).values() if isinstance(layer, Conv2d)]
    assert len(convs) == 21
    assert all(np.mean(layer.weight == 0) == pytest.approx(0.9, abs=0.01) for layer in convs)


def test_bundled_resnet20_has_the_papers_architecture():
    model = load_model(DATA / "resnet20.yaml")
    assert model.input_shape == (3, 32, 32) and model.shapes(model.input_shape)[-1] == (10,)
    params = {k: v for k, v in state_dict(model).items() if "running" not in k}
    assert sum(v.size for v in params.values()) == 272_474  # He et al.'s 0.27M
    blocks = [layer for layer in model.layers if isinstance(layer, Residual)]
    assert [b.name for b in blocks] == [f"layer{s}.{i}" for s in (1, 2, 3) for i in range(3)]
    assert [len(b.shortcut) for b in blocks] == [0, 0, 0, 2, 0, 0, 2, 0, 0]
    assert params["layer3.0.downsample.0.weight"].shape == (64, 32, 1, 1)
    assert not any(getattr(layer, "training", False) for layer in named_layers(model).values())


def invoke(*args):
    return CliRunner().invoke(app.main, list(map(str, args)))


def test_command_line_runs_and_checks_resnet20():
    result = invoke("run", DATA / "resnet20.yaml", "--random", "2", "--check")
    assert result.exit_code == 0, result.output
    assert "max relative error vs layer-by-layer back-propagation: " in result.output  # auto: linear
    result = invoke("flops", DATA / "resnet20.yaml")
    assert result.exit_code == 0, result.output
    assert "BP FLOPs" in result.output


BLOCK = "input_shape: [2, 4, 4]\ninit: {{seed: 0}}\nlayers:\n  - name: b\n    type: residual\n{body}"
CONV = "      - {name: c, type: conv2d, out_channels: 2, kernel_size: 3, padding: 1}\n"

BAD = [
    (BLOCK.format(body="    layers: []\n"), ["layer 'b' (layers[0])", "field 'layers'", "non-empty list"]),
    (BLOCK.format(body="    layers: {type: relu}\n"), ["layer 'b' (layers[0])", "field 'layers'"]),
    (BLOCK.format(body=""), ["layer 'b' (layers[0])", "field 'layers'", "missing"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    stride: 2\n"),
     ["layer 'b' (layers[0])", "field 'stride'", "unknown argument of residual",
      "layers, shortcut, shortcut_name"]),
    (BLOCK.format(body="    layers:\n" + CONV.replace("kernel_size: 3", "kernel_size: 3, paddin: 1")),
     ["layer 'b.c' (layers[0].layers[0])", "field 'paddin'", "unknown argument of conv2d"]),
    (BLOCK.format(body="    layers:\n" + CONV.replace("padding: 1", "padding: 1, in_channels: 3")),
     ["layer 'b.c' (layers[0].layers[0])", "field 'in_channels'", "input to this layer has 2"]),
    (BLOCK.format(body="    layers:\n      - {name: x, type: conv3d}\n"),
     ["layer 'b.x' (layers[0].layers[0])", "field 'type'", "unknown layer type"]),
    (BLOCK.format(body="    layers:\n" + CONV.replace("out_channels: 2", "out_channels: 3")),
     ["layer 'b' (layers[0])", "field 'shortcut'", "[3, 4, 4]", "identity shortcut", "add a shortcut"]),
    (BLOCK.format(body="    layers:\n" + CONV.replace("out_channels: 2", "out_channels: 3")
                  + "    shortcut: {type: conv2d, out_channels: 3, kernel_size: 1, stride: 2}\n"),
     ["layer 'b' (layers[0])", "field 'shortcut'", "the shortcut gives [3, 2, 2]"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    shortcut: []\n"),
     ["layer 'b' (layers[0])", "field 'shortcut'", "non-empty list"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    shortcut: relu\n"),
     ["layer 'b' (layers[0])", "field 'shortcut'"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    shortcut: [{type: batchnorm2d, eps: 0}]\n"),
     ["layer 'b.shortcut.0' (layers[0].shortcut[0])", "field 'eps'"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    shortcut_name: down\n"
                       "    shortcut: {name: x, type: relu}\n"),
     ["layer 'b.down' (layers[0].shortcut)", "field 'name'", "shortcut_name"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    shortcut_name: a.b\n"),
     ["layer 'b' (layers[0])", "field 'shortcut_name'", "without dots"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n    shortcut_name: 3\n"),
     ["layer 'b' (layers[0])", "field 'shortcut_name'"]),
    (BLOCK.format(body="    layers: [{name: shortcut, type: relu}]\n    shortcut: {type: relu}\n"),
     ["layer 'b' (layers[0])", "field 'shortcut_name'", "names an inner layer"]),
    (BLOCK.format(body="    layers: [{name: r, type: relu}, {name: r, type: tanh}]\n"),
     ["layer 'b.r' (layers[0].layers[1])", "field 'name'", "used by an earlier layer"]),
    (BLOCK.format(body="    layers: [{type: relu}]\n  - {name: b.0, type: relu}\n"),
     ["layer 'b.0' (layers[1])", "field 'name'", "used by an earlier layer"]),
    (BLOCK.format(body="    layers:\n      - name: inner\n        type: residual\n        layers:\n"
                  "          - {name: c, type: conv2d, out_channels: 2, kernel_size: 3, dilation: 0}\n"),
     ["layer 'b.inner.c' (layers[0].layers[0].layers[0])", "field 'dilation'"]),
    (BLOCK.format(body="    layers:\n      - {name: fc, type: linear, out_features: 2}\n"),
     ["layer 'b.fc' (layers[0].layers[0])", "field 'input'", "flat input"]),
    (BLOCK.format(body="    layers: [{type: lstm, hidden_size: 2}]\n"),
     ["layer 'b.0' (layers[0].layers[0])", "field 'type'", "recurrent"]),
    (BLOCK.format(body="    layers: [relu]\n"), ["layers[0].layers[0]", "field 'type'", "mapping"]),
    (BLOCK.format(body="    layers:\n      - {name: bn, type: batchnorm2d, training: true}\n"),
     ["layer 'b.bn' (layers[0].layers[0])", "field 'training'"]),
]


@pytest.mark.parametrize("text, fragments", BAD)
def test_bad_residual_specs_are_one_error_naming_file_layer_and_field(tmp_path, text, fragments):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("key, value, fragments", [
    ("layer2.0.downsample.0.weight", np.zeros((8, 4, 3, 3)),
     ["layer 'layer2.0.downsample.0' (layers[5].shortcut[0])", "field 'weight'"]),
    ("layer1.0.bn2.running_var", -np.ones(4),
     ["layer 'layer1.0.bn2' (layers[3].layers[4])", "field 'running_var'", "non-negative"]),
    ("layer1.0.conv3.weight", np.ones(1), ["field 'weights'", "'layer1.0.conv3.weight'", "matches no layer"]),
    (None, None, ["layer 'layer2.1.conv2' (layers[7].layers[3])", "field 'weight'",
                  "no 'layer2.1.conv2.weight' in the weights file and no init"]),
])
def test_bad_nested_weights_name_the_nested_layer(tmp_path, key, value, fragments):
    net, path = small_resnet(tmp_path)
    weights = {k: v.numpy() for k, v in net.state_dict().items()}
    if key is None:
        del weights["layer2.1.conv2.weight"]
    else:
        weights[key] = value
    np.savez(tmp_path / "small.npz", **weights)
    with pytest.raises(SpecError) as error:
        load_model(path)
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)
