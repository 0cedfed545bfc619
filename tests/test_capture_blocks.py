"""Joins of branches captured from a module's forward (issue 46): ``torch.cat`` of branches along the
channels and the product of two branches (a broadcast gate) become inline ``block`` layers, through
``export_torch`` (the corpus, ``tests/torch_corpus.py``, checks every one against autograd) and through
``bppsa``, on the host and on the GPU (the stand-in where there is none).

- ``bppsa`` of SqueezeNet's fire modules, an inception module, torchvision's dense block, an SE-ResNet
  block and nested joins: output, input gradient and every parameter gradient equal autograd's in
  float64 (1e-10 relative) for linear and blelloch.
- The spec's structure: DenseNet's growing ``torch.cat(features, 1)`` is a chain of ``cat([x, f(x)])``
  blocks; a squeeze-and-excitation module's ``scale * x`` a product block named by the module, its
  layers by their modules.
- What stays refused is refused by name: a concatenation along another axis, a product whose shapes
  the block does not broadcast, a division of two branches.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
nn = torch.nn

from torch_corpus import CORPUS  # noqa: E402 - imports torch, skipped above without it

from sparse_scan import export_torch  # noqa: E402
from sparse_scan.torch import BPPSA, CaptureError, bppsa  # noqa: E402

CASES = {case.name: case for case in CORPUS}
JOINS = ["squeezenet_fire", "inception_module", "densenet_block", "se_resnet_block", "nested_joins",
         "concat_branches", "branch_product", "shufflenet_units"]


def assert_close(got, want, label: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-300)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * scale, err_msg=label)


def bppsa_equals_autograd(name: str, method: str, device) -> None:
    case = CASES[name]
    net = case.module().to(device)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, *case.input_shape))).to(device)
    leaf = x.clone().requires_grad_(True)
    out = bppsa(net, method)(leaf)
    g = torch.from_numpy(np.random.default_rng(2).standard_normal(tuple(out.shape))).to(device)
    out.backward(g)
    ours = {key: p.grad.detach().cpu().numpy().copy() for key, p in net.named_parameters()}
    net.zero_grad()
    reference = x.clone().requires_grad_(True)
    expected = net(reference)
    expected.backward(g)
    assert_close(out.detach().cpu().numpy(), expected.detach().cpu().numpy(), f"{name}: forward")
    assert_close(leaf.grad.cpu().numpy(), reference.grad.cpu().numpy(), f"{name} {method}: dL/dx")
    for key, p in net.named_parameters():
        assert_close(ours[key], p.grad.cpu().numpy(), f"{name} {method}: {key}")


@pytest.mark.parametrize("method", ["linear", "blelloch"])
@pytest.mark.parametrize("name", JOINS)
def test_bppsa_of_joined_branches_equals_autograd(name, method):
    bppsa_equals_autograd(name, method, torch.device("cpu"))


@pytest.fixture
def on_the_gpu(monkeypatch):
    """CUDA tensors where a GPU is; else host tensors the CuPy stand-in's device arrays share."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setattr(BPPSA, "_device_of", staticmethod(lambda x: "gpu"))
    return torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["linear", "blelloch"])
@pytest.mark.parametrize("name", ["inception_module", "densenet_block", "se_resnet_block",
                                  "shufflenet_units"])
def test_on_the_gpu_bppsa_of_joined_branches_equals_autograd(on_the_gpu, name, method):
    bppsa_equals_autograd(name, method, on_the_gpu)


def exported(tmp_path, name: str) -> list[dict]:
    case = CASES[name]
    return yaml.safe_load(export_torch(case.module(), case.input_shape, tmp_path / "net.yaml").read_text())[
        "layers"]


def test_densenets_growing_concatenation_is_a_chain_of_concat_blocks(tmp_path):
    layers = exported(tmp_path, "densenet_block")
    blocks = [entry for entry in layers if entry["type"] == "block"]
    assert [entry["join"] for entry in blocks] == ["concat"] * 3
    for index, block in enumerate(blocks):  # cat([x, f(x)]): the identity and BN-ReLU-conv
        assert block["scoped"] is False and block["branches"][0] == []
        assert [entry["name"] for entry in block["branches"][1]] == [
            f"denselayers.{index}.norm1", f"denselayers.{index}.relu1", f"denselayers.{index}.conv1"]
    assert [entry["name"] for entry in layers][:5] == ["conv0", "denselayers.0", "denselayers.1",
                                                        "denselayers.2", "transition.0"]


def test_a_squeeze_excitation_product_is_a_block_named_by_its_module(tmp_path):
    layers = exported(tmp_path, "se_resnet_block")
    (residual,) = [entry for entry in layers if entry["type"] == "residual"]
    se = residual["layers"][-1]
    assert (se["type"], se["join"], se["name"]) == ("block", "product", "se")
    assert [[entry["name"] for entry in branch] for branch in se["branches"]] == [
        ["se.avgpool", "se.fc1", "se.activation", "se.fc2", "se.scale_activation"], []]
    rows = [entry for entry in layers if entry["type"] == "block" and entry is not se]
    assert [(entry["join"], [len(branch) for branch in entry["branches"]]) for entry in rows] == [
        ("product", [0, 2])]


def test_shufflenets_units_are_narrow_pieces_concatenated_and_channel_shuffles(tmp_path):
    layers = exported(tmp_path, "shufflenet_units")
    assert [entry["type"] for entry in layers] == [
        "conv2d", "batchnorm2d", "relu", "block", "channel_shuffle", "block", "channel_shuffle",
        "channel_shuffle", "adaptive_avgpool2d", "flatten", "linear"]
    split = layers[5]  # stride 1: x1, x2 = x.chunk(2, dim=1); torch.cat((x1, branch2(x2)), 1)
    assert split["join"] == "concat" and [entry["type"] for entry in split["branches"][0]] == ["narrow"]
    pieces = [split["branches"][0][0], split["branches"][1][0]]
    assert [(entry["start"], entry["length"]) for entry in pieces] == [(0, 4), (4, 4)]
    assert [entry["groups"] for entry in layers if entry["type"] == "channel_shuffle"] == [2, 2, 4]


class CatRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return torch.cat([self.conv(x), x], dim=-1)


class Outer(nn.Module):
    """A flat branch times a (B, 1, F) one: PyTorch broadcasts them to (B, B, F), across samples."""

    def forward(self, x):
        return torch.flatten(x, 2) * torch.flatten(x, 1)


class ChunkRows(CatRows):
    def forward(self, x):
        top, bottom = x.chunk(2, dim=2)
        return torch.cat([self.conv(top), bottom], 1)


class Quotient(CatRows):
    def forward(self, x):
        return self.conv(x) / torch.sigmoid(x)


@pytest.mark.parametrize("module, shape, fragment", [
    (CatRows, (2, 3, 3), r"node 'cat' \(torch.cat at test_capture_blocks.py:\d+: .*\): torch.cat along "
                         r"dim -1 of 4-axis tensors; only the concatenation along the channels"),
    (Outer, (1, 1, 4), r"node 'mul' \(\* at .*\): multiplies tensors of shapes \[2, 1, 4\] and \[2, 4\]; "
                       r"a product of two branches needs shapes of one length"),
    (ChunkRows, (2, 4, 3), r"node 'chunk' \(\.chunk\(\) at .*\): chunk along dim 2 of 4-axis tensors; only "
                           r"pieces of the channels \(dim 1\) are layers"),
    (Quotient, (2, 3, 3), r"node 'truediv' \(/ at .*\): divides 2 tensors; only a sum \(or difference\) or a "
                          r"product of two branches, or torch.cat of branches, joins branches"),
])
def test_joins_the_blocks_do_not_represent_are_refused_naming_the_node(tmp_path, module, shape, fragment):
    with pytest.raises(CaptureError, match=fragment):
        export_torch(module().double(), shape, tmp_path / "net.yaml")
    assert list(tmp_path.iterdir()) == []
