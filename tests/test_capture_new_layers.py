"""Issue 46's layers captured from a module's forward: Hardswish, Hardsigmoid, Mish, LayerNorm (over the
last dims, and over the channels: ConvNeXt's permute sandwich, torchvision's and timm's ``LayerNorm2d``),
scales per channel (``layer_scale``), ``Upsample``/``F.interpolate``, stochastic depth (torchvision's
``StochasticDepth``, timm's ``DropPath``), and ``F.batch_norm``/``F.conv2d``/``F.linear``/``F.layer_norm``
given a module's own tensors. ``tests/test_export_corpus.py`` checks every corpus model through
``export_torch``; here:

- ``bppsa`` of the corpus's models with these layers: output, input gradient and every parameter
  gradient (in the parameters' own shapes) equal autograd's in float64 (1e-10 relative), linear and
  blelloch, on the host and on the GPU path (the stand-in where there is no GPU);
- stochastic depth in training mode: the spec says so, the engine draws whole-sample masks, and its
  gradients equal autograd's through the same masks (p = 1: every sample dropped, as PyTorch does);
- the spec's structure: ConvNeXt's block as channels-first layers (a Linear as a 1x1 convolution whose
  weight is the module's, viewed ``(out, in, 1, 1)``), layer scales and functional layers named by
  their modules so that the weights keep their state_dict names;
- what stays refused is refused by name: other permutations, what no layer computes between
  ConvNeXt's permutes, a region that never permutes back, weight tying through a function, a
  ``drop_path`` that does not drop whole samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from test_capture_blocks import CASES, assert_close, bppsa_equals_autograd, on_the_gpu  # noqa: E402, F401
from torch_corpus import DropPath, LayerNorm2d, torchvision  # noqa: E402

from sparse_scan import export_torch, load_model  # noqa: E402
from sparse_scan.torch import CaptureError, bppsa  # noqa: E402

MODELS = ["layer_norm", "new_activations", "mobilenet_v3_block", "efficientnet_mbconv", "convnext_blocks",
          "timm_convnext_blocks", "fused_norm_act", "unet_upsample"]


@pytest.mark.parametrize("method", ["linear", "blelloch"])
@pytest.mark.parametrize("name", MODELS)
def test_bppsa_of_the_new_layers_equals_autograd(name, method):
    bppsa_equals_autograd(name, method, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["linear", "blelloch"])
@pytest.mark.parametrize("name", ["mobilenet_v3_block", "efficientnet_mbconv", "convnext_blocks",
                                  "timm_convnext_blocks", "fused_norm_act", "unet_upsample"])
def test_on_the_gpu_bppsa_of_the_new_layers_equals_autograd(on_the_gpu, name, method):  # noqa: F811
    bppsa_equals_autograd(name, method, on_the_gpu)


def exported(tmp_path, name: str) -> tuple[list[dict], dict[str, np.ndarray]]:
    """The spec's layers and the weights file of corpus model ``name``."""
    case = CASES[name]
    spec = export_torch(case.module(), case.input_shape, tmp_path / "net.yaml")
    with np.load(spec.with_suffix(".npz")) as weights:
        return yaml.safe_load(spec.read_text())["layers"], dict(weights)


def test_convnexts_block_is_channels_first_layers(tmp_path):
    layers, weights = exported(tmp_path, "convnext_blocks")
    net = CASES["convnext_blocks"].module()
    assert [entry["type"] for entry in layers[:2]] == ["conv2d", "layer_norm"]
    assert (layers[1]["name"], layers[1]["data_format"], layers[1]["normalized_shape"]) == (
        "stem.1", "channels_first", 4)  # torchvision's LayerNorm2d: permute, F.layer_norm, permute
    block = layers[2]
    assert (block["type"], block["name"], block["scoped"]) == ("residual", "stage1.0", False)
    inner = block["layers"]
    assert [(entry["name"], entry["type"]) for entry in inner] == [
        ("stage1.0.block.0", "conv2d"), ("stage1.0.block.2", "layer_norm"), ("stage1.0.block.3", "conv2d"),
        ("stage1.0.block.4", "gelu"), ("stage1.0.block.5", "conv2d"), ("stage1.0.layer_scale", "layer_scale"),
        ("stochastic_depth", "stochastic_depth")]
    assert inner[1]["data_format"] == "channels_first" and inner[2]["kernel_size"] == 1
    assert (inner[6]["p"], inner[6]["mode"], inner[6]["training"]) == (0.1, "row", False)
    np.testing.assert_array_equal(weights["stage1.0.block.3.weight"],
                                  net.stage1[0].block[3].weight.detach().numpy()[:, :, None, None])
    np.testing.assert_array_equal(weights["stage1.0.layer_scale.gamma"],
                                  net.stage1[0].layer_scale.detach().numpy())


def test_timms_layer_scales_and_drop_paths_keep_their_names(tmp_path):
    layers, weights = exported(tmp_path, "timm_convnext_blocks")
    scales = [entry for block in layers if block["type"] == "residual" for entry in block["layers"]
              if entry["type"] in ("layer_scale", "drop_path")]
    assert [(entry["name"], entry["type"]) for entry in scales] == [
        ("stages.0.ls", "layer_scale"), ("drop_path", "drop_path"), ("stages.1.ls", "layer_scale"),
        ("drop_path_1", "drop_path")]
    assert [entry["drop_prob"] for entry in scales[1::2]] == [0.1, 0.2]
    assert weights["stages.0.ls.gamma"].shape == weights["stages.1.ls.gamma"].shape == (4, 1, 1)
    assert weights["stages.1.norm.weight"].shape == (4,)  # LayerNorm2d: F.layer_norm of its own weight


def test_functional_layers_take_their_modules_names(tmp_path):
    layers, weights = exported(tmp_path, "fused_norm_act")
    assert [(entry["name"], entry["type"]) for entry in layers] == [
        ("conv1", "conv2d"), ("bn1", "batchnorm2d"), ("bn1.act", "relu"), ("conv2", "conv2d"),
        ("bn2", "batchnorm2d"), ("bn2.act", "relu"), ("flatten", "flatten"), ("head.norm", "layer_norm"),
        ("head", "linear")]
    assert (layers[3]["stride"], layers[3]["padding"], layers[4]["training"]) == (2, 1, False)
    net = CASES["fused_norm_act"].module()
    expected = {name for name, _ in net.state_dict().items() if not name.endswith("num_batches_tracked")}
    assert set(weights) == expected


class Residual(nn.Module):
    """``x + drop(conv(x))``, then a head: the drop a sample drop module."""

    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.drop = drop
        self.fc = nn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(torch.flatten(torch.tanh(x + self.drop(self.conv(x))), 1))


def sample_drops():
    return {"stochastic_depth": lambda p: torchvision().ops.StochasticDepth(p, "row"),
            "stochastic_depth_batch": lambda p: torchvision().ops.StochasticDepth(p, "batch"),
            "drop_path": lambda p: DropPath(p), "drop_path_unscaled": lambda p: DropPath(p, False)}


@pytest.mark.parametrize("method", ["linear", "blelloch"])
@pytest.mark.parametrize("p", [0.5, 1.0])
@pytest.mark.parametrize("kind", list(sample_drops()))
def test_sample_drops_in_training_mode_equal_autograd_through_the_engines_masks(tmp_path, kind, p, method):
    torch.manual_seed(0)
    net = Residual(sample_drops()[kind](p)).double().train()
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((6, 2, 3, 3)))
    spec = yaml.safe_load(export_torch(net, (2, 3, 3), tmp_path / "net.yaml").read_text())
    (block,) = [entry for entry in spec["layers"] if entry["type"] == "residual"]
    assert [entry["training"] for entry in block["layers"] if entry["type"] in (
        "stochastic_depth", "drop_path")] == [True]
    leaf = x.clone().requires_grad_(True)
    out = bppsa(net, method)(leaf)
    g = torch.from_numpy(np.random.default_rng(2).standard_normal(tuple(out.shape)))
    out.backward(g)
    ours = {key: q.grad.clone() for key, q in net.named_parameters()}
    net.zero_grad()
    scale = 1.0 / (1.0 - p) if p < 1 and kind != "drop_path_unscaled" else 1.0

    def through(mask):
        inputs = x.clone().requires_grad_(True)
        branch = net.conv(inputs) * mask.reshape(-1, 1, 1, 1) * scale
        return inputs, net.fc(torch.flatten(torch.tanh(inputs + branch), 1))

    with torch.no_grad():  # which samples the engine kept: its output is one of the two per sample
        kept = torch.isclose(out, through(torch.ones(6, dtype=torch.float64))[1], rtol=1e-12).all(1)
        dropped = torch.isclose(out, through(torch.zeros(6, dtype=torch.float64))[1], rtol=1e-12).all(1)
    assert bool((kept | dropped).all()), (kept, dropped)
    if kind == "stochastic_depth_batch":
        assert bool(kept.all() or dropped.all())
    if p == 1:
        assert not bool(kept.any())
    inputs, expected = through(kept.to(torch.float64))
    expected.backward(g)
    assert_close(leaf.grad.numpy(), inputs.grad.numpy(), f"{kind} {method}: dL/dx")
    for key, q in net.named_parameters():
        assert_close(ours[key].numpy(), q.grad.numpy(), f"{kind} {method}: {key}")


def test_eval_mode_sample_drops_are_the_identity(tmp_path):
    net = Residual(DropPath(0.3)).double().eval()
    spec = export_torch(net, (2, 3, 3), tmp_path / "net.yaml")
    x = np.random.default_rng(1).standard_normal((2, 2, 3, 3))
    np.testing.assert_allclose(load_model(spec, dtype=np.float64).forward(x),
                               net(torch.from_numpy(x)).detach().numpy(), rtol=1e-13)


# --- refused, by name --------------------------------------------------------------------------------
class Permuted(nn.Module):
    """ConvNeXt's permute sandwich holding ``middle``, or a permutation ``dims`` that is not it."""

    def __init__(self, middle: nn.Module, dims=(0, 2, 3, 1), back=True) -> None:
        super().__init__()
        self.middle, self.dims, self.back = middle, dims, back

    def forward(self, x):
        x = self.middle(x.permute(*self.dims))
        return x.permute(0, 3, 1, 2) if self.back else torch.flatten(x, 1)


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    """Named and called as timm's drop_path, but a dropout of single elements."""
    return F.dropout(x, drop_prob, training)


class FakeDropPath(nn.Module):
    def forward(self, x):
        return drop_path(x, 0.5, self.training)


class TwoLayersOneModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        x = torch.flatten(x, 1)
        return F.linear(torch.tanh(F.linear(x, self.weight, self.bias)), self.weight, self.bias)


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = TwoLayersOneModule()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("module, shape, fragment", [
    (lambda: Permuted(nn.Identity(), dims=(0, 3, 1, 2)), (2, 3, 4),
     r"node 'permute' \(\.permute\(\) at .*\): permutes axes \[0, 3, 1, 2\]; only ConvNeXt's channels-last "
     r"block is captured"),
    (lambda: Permuted(nn.Conv2d(4, 4, 1)), (4, 4, 4),
     r"node 'middle' \(module 'middle' at .*\): between ConvNeXt's permute\(0, 2, 3, 1\) and "
     r"permute\(0, 3, 1, 2\) \(channels last\), conv2d is not supported"),
    (lambda: Permuted(nn.LayerNorm((2, 2))), (2, 3, 2),
     r"node 'middle' .*: a LayerNorm over \[2, 2\] between ConvNeXt's permutes; only one over the 2 "
     r"channels"),
    (lambda: Permuted(nn.LayerNorm(2), back=False), (2, 3, 3),
     r"node 'permute' .*: permutes axes \[0, 2, 3, 1\], and the forward returns node 'flatten' .* before "
     r"permute\(0, 3, 1, 2\)"),
    (Owner, (4,), r"node 'linear_1' \(linear at .*\): the tensors of 'inner' feed node 'linear' .* too "
                  r"\(weight tying\)"),
    (FakeDropPath, (2, 3, 3), None),
])
def test_what_no_layer_computes_is_refused_naming_the_node(tmp_path, module, shape, fragment):
    net = module().double()
    if fragment is None:  # a drop_path that is not one: refused in training mode, the identity in eval
        net.train()
        fragment = (r"node 'drop_path' .*: in training mode it does not keep or drop whole "
                    r"samples as the row mode of stochastic depth does")
    with pytest.raises(CaptureError, match=fragment):
        export_torch(net, shape, tmp_path / "net.yaml")
    assert list(tmp_path.iterdir()) == []


def test_a_layer_norm2d_over_other_axes_than_the_channels_is_refused(tmp_path):
    class Odd(LayerNorm2d):
        def forward(self, x):
            return F.layer_norm(x.permute(0, 2, 3, 1), (4, 4), self.weight, self.bias).permute(0, 3, 1, 2)

    with pytest.raises(CaptureError, match=r"node 'layer_norm' .*: a LayerNorm over \[4, 4\] between"):
        export_torch(nn.Sequential(Odd((4, 4))).double(), (4, 3, 4), tmp_path / "net.yaml")
    with pytest.raises(CaptureError, match=r"node 'layer_norm' .*: it is given weight='weight', bias='bias'; "
                                           r"a functional layer is captured where its tensors are one "
                                           r"submodule's own"):  # the root's own: no layer name
        export_torch(Odd((4, 4)).double(), (4, 3, 4), tmp_path / "net.yaml")
