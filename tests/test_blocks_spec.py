"""Blocks joining branches in model specs (issue 46): the ``block`` layer type (``join: sum | concat |
product``, ``branches``, ``branch_names``, ``scoped``), weights by PyTorch's state_dict names, one clear
SpecError per bad field, and the command line's ``flops`` and ``run --check`` on such a spec.

The reference is written in plain PyTorch: a stem, an Inception-like module (``torch.cat`` of a 1x1
branch, a 1x1-3x3 branch and the identity, its branches named), a DenseNet layer (``cat([x, f(x)])``,
its layers the module's own children), a squeeze-and-excitation module (``x * sigmoid(fc2(relu(fc1(
avgpool(x)))))``, torchvision's names), a sum block, pooling and a linear head, float64, batch 3. Its
``state_dict`` saved as ``.npz`` loads into the matching spec, whose outputs, activation gradients and
parameter gradients equal autograd's for every schedule.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from oracles import randomize_batch_norms

from sparse_scan import SpecError, load_model
from sparse_scan.cli import app
from sparse_scan.engine.schedule import depth
from sparse_scan.layers import Block, Residual
from sparse_scan.weights import named_layers, state_dict

torch = pytest.importorskip("torch")
nn = torch.nn

RTOL, ATOL = 1e-10, 1e-12

SPEC = """input_shape: [2, 6, 6]
weights: net.npz
layers:
  - {name: stem, type: conv2d, out_channels: 3, kernel_size: 3, padding: 1}
  - {name: stem_bn, type: batchnorm2d}
  - {name: stem_relu, type: relu}
  - name: mixed
    type: block
    join: concat
    branch_names: [branch1x1, branch3x3, identity]
    branches:
      - [{type: conv2d, out_channels: 2, kernel_size: 1}]
      - - {type: conv2d, out_channels: 2, kernel_size: 1}
        - {type: relu}
        - {type: conv2d, out_channels: 3, kernel_size: 3, padding: 1}
      - []
  - name: dense
    type: block
    join: concat
    branch_names: [null, null]
    branches:
      - []
      - - {name: norm, type: batchnorm2d}
        - {name: relu, type: relu}
        - {name: conv, type: conv2d, out_channels: 2, kernel_size: 3, padding: 1, bias: false}
  - name: se
    type: block
    join: product
    branch_names: [null, null]
    branches:
      - - {name: avgpool, type: adaptive_avgpool2d, output_size: 1}
        - {name: fc1, type: conv2d, out_channels: 3, kernel_size: 1}
        - {name: activation, type: relu}
        - {name: fc2, type: conv2d, out_channels: 10, kernel_size: 1}
        - {name: scale_activation, type: sigmoid}
      - []
  - name: sum
    type: block
    join: sum
    branches:
      - [{type: conv2d, out_channels: 10, kernel_size: 3, padding: 1}, {type: tanh}]
      - []
  - {name: pool, type: adaptive_avgpool2d, output_size: 2}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out_features: 4}
"""


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch1x1 = nn.Sequential(nn.Conv2d(3, 2, 1))
        self.branch3x3 = nn.Sequential(nn.Conv2d(3, 2, 1), nn.ReLU(), nn.Conv2d(2, 3, 3, padding=1))

    def forward(self, x):
        return torch.cat([self.branch1x1(x), self.branch3x3(x), x], 1)


class DenseLayer(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(channels, 2, 3, padding=1, bias=False)

    def forward(self, x):
        return torch.cat([x, self.conv(self.relu(self.norm(x)))], 1)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation's children and forward."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class Sum(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.add_module("0", nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.Tanh()))

    def forward(self, x):
        return getattr(self, "0")(x) + x


def reference() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential()
    for name, module in [("stem", nn.Conv2d(2, 3, 3, padding=1)), ("stem_bn", nn.BatchNorm2d(3)),
                         ("stem_relu", nn.ReLU()), ("mixed", Mixed()), ("dense", DenseLayer(8)),
                         ("se", SqueezeExcitation(10, 3)), ("sum", Sum(10)),
                         ("pool", nn.AdaptiveAvgPool2d(2)), ("flatten", nn.Flatten()),
                         ("fc", nn.Linear(40, 4))]:
        net.add_module(name, module)
    net = net.double().eval()
    randomize_batch_norms(net)
    return net


def spec_and_net(tmp_path):
    net = reference()
    np.savez(tmp_path / "net.npz", **{key: value.numpy() for key, value in net.state_dict().items()})
    path = tmp_path / "net.yaml"
    path.write_text(SPEC)
    return net, path


def autograd(net, x: np.ndarray, g: np.ndarray):
    activations = [torch.from_numpy(x).requires_grad_()]
    for module in net:
        activations.append(module(activations[-1]))
        activations[-1].retain_grad()
    activations[-1].backward(torch.from_numpy(g))
    return (activations[-1].detach().numpy(), [a.grad.numpy() for a in activations],
            {name: p.grad.numpy() for name, p in net.named_parameters()})


def test_spec_blocks_equal_torch_autograd_for_every_schedule(tmp_path):
    net, path = spec_and_net(tmp_path)
    model = load_model(path, dtype=np.float64)
    theirs = [key for key in net.state_dict() if not key.endswith("num_batches_tracked")]
    assert sorted(state_dict(model)) == sorted(theirs)
    blocks = [layer for layer in model.layers if isinstance(layer, Block)]
    assert [block.join for block in blocks] == ["concat", "concat", "product", "sum"]
    assert not any(isinstance(block, Residual) for block in blocks) and not blocks[0].training
    assert "mixed.branch3x3.2" in named_layers(model) and "se.fc2" in named_layers(model)
    x = np.random.default_rng(1).standard_normal((3, 2, 6, 6))
    y = model.forward(x)
    g = np.random.default_rng(2).standard_normal(y.shape)
    output, activation_grads, parameter_grads = autograd(net, x, g)
    np.testing.assert_allclose(y, output, rtol=1e-12, atol=1e-14)
    schedules = [("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(1, depth(len(model)))]
    for method, levels in schedules:
        grads = model.backward(g, method=method, levels=levels)
        for ours, want in zip(grads, activation_grads, strict=True):
            np.testing.assert_allclose(ours, want, rtol=RTOL, atol=ATOL, err_msg=f"{method} {levels}")
        params = model.parameter_gradients(grads)
        assert sorted(params) == sorted(parameter_grads)
        for name, want in parameter_grads.items():
            np.testing.assert_allclose(params[name], want, rtol=RTOL, atol=ATOL, err_msg=f"{method} {name}")


def test_blocks_nest_and_inline_blocks_keep_their_layers_names(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text("""input_shape: [2, 4, 4]
init: {seed: 0}
prune: {amount: 0.5}
layers:
  - name: outer
    type: residual
    layers:
      - name: cat
        type: block
        join: concat
        scoped: false
        branches:
          - [{name: a, type: conv2d, out_channels: 1, kernel_size: 1},
             {name: gate, type: block, join: product,
              branches: [[{type: sigmoid}], [{type: conv2d, out_channels: 1, kernel_size: 3, padding: 1}]]}]
          - [{name: b, type: conv2d, out_channels: 1, kernel_size: 3, padding: 1}]
  - {type: flatten}
""")
    model = load_model(path, dtype=np.float64)
    assert list(state_dict(model)) == ["outer.a.weight", "outer.a.bias", "outer.gate.1.0.weight",
                                       "outer.gate.1.0.bias", "outer.b.weight", "outer.b.bias"]
    conv = named_layers(model)["outer.gate.1.0"]
    assert conv.prune_pattern and np.count_nonzero(conv.weight) < conv.weight.size
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 4))
    y = model.forward(x)
    for ours, theirs in zip(model.backward(np.ones_like(y), method="blelloch"),
                            model.backward(np.ones_like(y), method="linear"), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def test_the_command_line_counts_and_checks_a_spec_with_blocks(tmp_path):
    _, path = spec_and_net(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app.main, ["flops", str(path), "--method", "blelloch", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    layers = {layer["name"]: layer for layer in report["layers"]}
    assert {"mixed", "dense", "se", "sum"} <= set(layers)
    se = load_model(path).layers[5]
    assert layers["se"]["nnz"] == se.pattern((10, 6, 6)).nnz == 360 ** 2  # every output reads every input
    result = runner.invoke(app.main, ["run", str(path), "--method", "blelloch", "--check", "--random", "2",
                                      "--dtype", "float64", "--device", "cpu"])
    assert result.exit_code == 0, result.output


BLOCK = "input_shape: [2, 4, 4]\ninit: {{seed: 0}}\nlayers:\n  - name: b\n    type: block\n{body}"
BRANCHES = "    branches: [[{type: relu}], []]\n"
SUM, CONCAT, PRODUCT = (f"    join: {join}\n" for join in ("sum", "concat", "product"))
BAD = [
    (BLOCK.format(body=BRANCHES),
     ["layer 'b' (layers[0])", "field 'join'", "sum, concat, product", "missing"]),
    (BLOCK.format(body="    join: stack\n" + BRANCHES), ["field 'join'", "got 'stack'"]),
    (BLOCK.format(body=SUM), ["layer 'b' (layers[0])", "field 'branches'", "at least two"]),
    (BLOCK.format(body=CONCAT + "    branches: [[{type: relu}]]\n"), ["field 'branches'", "at least two"]),
    (BLOCK.format(body=PRODUCT + "    branches: [[], [], []]\n"), ["field 'branches'", "two branches"]),
    (BLOCK.format(body=SUM + "    branches: [[], relu]\n"),
     ["field 'branches'", "branch 1 must be a list of layers"]),
    (BLOCK.format(body=SUM + "    layers: []\n" + BRANCHES),
     ["field 'layers'", "unknown argument of block", "join, branches, branch_names, scoped"]),
    (BLOCK.format(body=SUM + "    branch_names: [a]\n" + BRANCHES),
     ["field 'branch_names'", "2 names without dots"]),
    (BLOCK.format(body=SUM + "    branch_names: [a, b.c]\n" + BRANCHES), ["field 'branch_names'"]),
    (BLOCK.format(body=SUM + "    scoped: false\n    branch_names: [a, c]\n" + BRANCHES),
     ["field 'branch_names'", "scoped: false"]),
    (BLOCK.format(body=SUM + "    scoped: 1\n" + BRANCHES), ["field 'scoped'", "true or false"]),
    (BLOCK.format(body=CONCAT + "    branches: [[{type: maxpool2d, kernel_size: 2}], []]\n"),
     ["layer 'b' (layers[0])", "field 'branches'", "(2, 2, 2), (2, 4, 4)", "but for the channels"]),
    (BLOCK.format(body=PRODUCT + "    branches: [[{type: adaptive_avgpool2d, output_size: 2}], []]\n"),
     ["field 'branches'", "(2, 2, 2), (2, 4, 4)", "broadcast"]),
    (BLOCK.format(body=SUM + "    branches: [[{type: conv2d, out_channels: 3, kernel_size: 1}], []]\n"),
     ["field 'branches'", "needs equal shapes"]),
    (BLOCK.format(body=SUM + "    branches: [[{name: c, type: conv2d, out_channels: 2, kernel_size: 0}], "
                  "[]]\n"),
     ["layer 'b.0.c' (layers[0].branches[0][0])", "field 'kernel_size'"]),
    (BLOCK.format(body=SUM + "    branch_names: [x, x]\n    branches: [[{type: relu}], [{type: relu}]]\n"),
     ["layer 'b.x.0' (layers[0].branches[1][0])", "field 'name'", "used by an earlier layer"]),
    (BLOCK.format(body=CONCAT + "    branches: [[{type: narrow, start: 1, length: 2}], []]\n"),
     ["layer 'b.0.0' (layers[0].branches[0][0])", "field 'length'", "channels 1 .. 2 of a sample"]),
    (BLOCK.format(body=CONCAT + "    branches: [[{type: narrow, length: 1}], []]\n"),
     ["layer 'b.0.0' (layers[0].branches[0][0])", "field 'start'", "missing (required by narrow)"]),
    ("input_shape: [2, 4, 4]\nlayers:\n  - {name: s, type: channel_shuffle, groups: 3}\n",
     ["layer 's' (layers[0])", "field 'groups'", "3 groups do not divide the 2 channels"]),
]


@pytest.mark.parametrize("text, fragments", BAD)
def test_bad_block_specs_are_one_error_naming_file_layer_and_field(tmp_path, text, fragments):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message, message
