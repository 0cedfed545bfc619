"""torchvision's classification models through ``export_torch`` and ``bppsa`` (issue 46's zoo).

One test per family of ``torchvision.models`` (``tests/torchvision_models.py``: the smallest variant,
``weights=None``, seeded, eval mode with random batch-norm statistics, float64, 3x32x32 where the model
takes it, else the smallest input it takes, batch 1-2):

- every CNN family: ``export_torch`` writes a spec whose loaded model's forward, input gradient and every
  parameter gradient equal PyTorch autograd's within 1e-10 of each array's largest magnitude, for the
  ``linear`` and ``blelloch`` schedules; then ``bppsa(net, method)`` the same, through autograd's own
  ``backward`` (``.grad`` of the input and of every parameter). Blelloch may be refused by the planning
  bound (issue 46): a one-line ``ScanCostError`` or ``ScanMemoryError`` naming the limit passes for it;
- the families refused today (:data:`REFUSED_TODAY`) are marked ``xfail(strict=True,
  raises=CaptureError)``, and their test checks that the refusal, by ``export_torch`` and by ``bppsa``,
  is one line naming a node of the model's torch.fx graph and the operation it is refused for today: a
  crash or a refusal for another reason fails the test instead of passing as expected;
- the transformer families (vit, swin, swin_v2, maxvit) are refused naming the op, by both doors: an
  attention operation (``MultiheadAttention``, ``scaled_dot_product_attention``, a product of two
  activations); ViT's own self-attention, called as its encoder block calls it, names
  ``MultiheadAttention``;
- every classification model ``torchvision.models.list_models`` names belongs to exactly one family.

When later work makes a refused family exact, its strict xfail turns red (XPASS): delete the family's
entry from :data:`REFUSED_TODAY` and it is held exact from then on. When it makes a family refused for
another op first (the next missing one), its test fails on the reason: update the entry.

Skipped without PyTorch or torchvision, but where ``SPARSE_SCAN_REQUIRE_TORCHVISION=1`` (CI, which installs
both: docs/testing.md says how torchvision's CUDA wheel is imported beside the CPU torch) a missing
torchvision fails.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torchvision_models
from torchvision_models import FAMILIES, Family

from sparse_scan import ScanCostError, ScanMemoryError, export_torch, load_model

torch = pytest.importorskip("torch")
if not torchvision_models.installed():
    if os.environ.get("SPARSE_SCAN_REQUIRE_TORCHVISION") == "1":  # CI: the zoo must run
        raise RuntimeError("SPARSE_SCAN_REQUIRE_TORCHVISION=1 but torchvision is not installed")
    pytest.skip("torchvision is not installed (CI installs it: docs/testing.md)", allow_module_level=True)

from oracles import randomize_batch_norms  # noqa: E402 - after the skip: it imports nothing of torch

from sparse_scan.torch import CaptureError, bppsa  # noqa: E402

METHODS = ("linear", "blelloch")
RTOL = 1e-10

REFUSED_TODAY: dict[str, str] = {}
"""Family -> the start of the reason its refusal gives today (the first op the capture meets that no
layer computes)."""

EXPORT_NAMES = {"convnext": lambda name: f"{name}.gamma" if name.endswith(".layer_scale") else name}
"""Family -> the name ``export_torch`` gives a parameter, where it differs from the module's state_dict
name (docs/torch.md): ConvNeXt's layer scale is a parameter of the block itself, exported as the
``layer_scale`` layer's ``gamma``."""

TRANSFORMER_REFUSAL = r".*(MultiheadAttention|scaled_dot_product_attention|attention|matmul|einsum|bmm)"
"""What a transformer is refused for: an attention operation (issue 46: they stay refused, by name)."""

BATCH = {"alexnet": 1, "inception_v3": 1, "regnet_y": 1, "resnext": 1, "vgg": 1, "wide_resnet": 1}
"""The batch size of the largest models (2 for the others)."""

SLOW = ("alexnet", "efficientnet", "efficientnet_v2", "googlenet", "inception_v3", "resnext", "vgg",
        "wide_resnet")
"""Families whose test takes more than a few seconds: VGG-11's 132 M float64 parameters, captured three
times; EfficientNet's squeeze-and-excitation blocks, whose JTs are dense (7-22 s on 2 cores). Inception-v3
and RegNet-Y took 40-45 s while a block's first backward planned its products to count them; counted
from the layers' structure (``sparse_scan/layers/_block_counts.py``) they take 2-5 s."""

REFUSAL = re.compile(r"node '(?P<node>[^']+)' \([^`]*?(`.*?`)?\): (?P<reason>.*)")
"""A capture's refusal (``sparse_scan.torch._graph.describe``): ``node 'name' (what at file.py:12:
`code`): reason``."""


def cnn_family(family: Family):
    """``family`` as a test parameter, marked with what it is refused for today."""
    marks = [pytest.mark.slow] if family.name in SLOW else []
    if family.name in REFUSED_TODAY:
        marks.append(pytest.mark.xfail(strict=True, raises=CaptureError,
                                       reason=f"refused today: {REFUSED_TODAY[family.name]}"))
    return pytest.param(family, marks=marks, id=family.name)


def sample(family: Family, net) -> tuple:
    """A seeded input batch of ``family``'s shape and a seeded output gradient for ``net``."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn((BATCH.get(family.name, 2), 3, family.side, family.side), dtype=torch.float64,
                    generator=generator)
    with torch.no_grad():
        shape = net(x).shape
    return x, torch.randn(shape, dtype=torch.float64, generator=generator)


def assert_close(got, want, label: str) -> None:
    """``got`` equals ``want`` within :data:`RTOL` of ``want``'s largest magnitude."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{label}: shape {got.shape}, PyTorch's {want.shape}"
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-300)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=label)


def assert_refused_by_name(net, error: BaseException, reason: str) -> None:
    """``error`` is a one-line refusal naming a node of ``net``'s torch.fx graph, its reason matching
    ``reason`` (a regular expression, from the reason's start)."""
    message = str(error)
    assert "\n" not in message, message
    found = REFUSAL.match(message)
    assert found, f"not a refusal naming a node: {message!r}"
    assert re.match(reason, found["reason"]), f"refused for {found['reason']!r}, not {reason!r}"
    nodes = {node.name for node in torch.fx.symbolic_trace(net).graph.nodes}
    assert found["node"] in nodes, f"node {found['node']!r} is not in the model's graph"


def assert_refused_by_the_bound(error: BaseException, method: str) -> None:
    """A schedule refused by the planning bound says so in one line, naming the limit."""
    message = str(error)
    assert method in METHODS[1:], f"{method} refused: {message}"
    assert "\n" not in message and "over the" in message, message


def autograd(net, x, g) -> tuple:
    """PyTorch's output, input gradient and parameter gradients (None where autograd gives none: a
    module the forward does not use in eval mode, such as GoogLeNet's auxiliary heads)."""
    net.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    y = net(leaf)
    y.backward(g)
    grads = {name: None if p.grad is None else p.grad.numpy().copy() for name, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return y.detach().numpy(), leaf.grad.numpy(), grads


@pytest.mark.parametrize("family", [cnn_family(family) for family in FAMILIES if not family.transformer])
def test_family_equals_autograd_through_export_and_bppsa(tmp_path, family):
    net = torchvision_models.build(family, torch.float64)
    randomize_batch_norms(net)
    x, g = sample(family, net)
    try:
        spec = export_torch(net, tuple(x.shape[1:]), tmp_path / "model.yaml")
    except CaptureError as error:
        if family.name not in REFUSED_TODAY:
            raise
        assert_refused_by_name(net, error, REFUSED_TODAY[family.name])
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(CaptureError) as bridge:
            bppsa(net)(x)
        assert_refused_by_name(net, bridge.value, REFUSED_TODAY[family.name])
        raise
    y, dx, grads = autograd(net, x, g)
    used = {name for name, grad in grads.items() if grad is not None}
    exported = {EXPORT_NAMES.get(family.name, str)(name): name for name in used}

    model = load_model(spec, dtype=np.float64)
    assert_close(model.forward(x.numpy()), y, f"{family.name} export: forward")
    for method in METHODS:
        try:
            gradients = model.backward(g.numpy(), method=method)
        except (ScanCostError, ScanMemoryError) as error:
            assert_refused_by_the_bound(error, method)
            continue
        assert_close(gradients[0], dx, f"{family.name} export {method}: dL/dx")
        parameters = model.parameter_gradients(gradients)
        assert set(parameters) == set(exported), f"{family.name} export {method}"
        for name, theirs in exported.items():  # a Linear exported as a 1x1 convolution: (out, in, 1, 1)
            assert_close(parameters[name].reshape(grads[theirs].shape), grads[theirs],
                         f"{family.name} export {method}: {name}")
    del model

    for method in METHODS:
        leaf = x.clone().requires_grad_(True)
        try:  # the scan is planned at the first backward (today), or earlier
            out = bppsa(net, method=method)(leaf)
            assert_close(out.detach().numpy(), y, f"{family.name} bppsa {method}: forward")
            out.backward(g)
        except (ScanCostError, ScanMemoryError) as error:
            assert_refused_by_the_bound(error, method)
            net.zero_grad(set_to_none=True)
            continue
        assert_close(leaf.grad.numpy(), dx, f"{family.name} bppsa {method}: dL/dx")
        for name, parameter in net.named_parameters():
            if name in used:
                assert_close(parameter.grad.numpy(), grads[name], f"{family.name} bppsa {method}: {name}")
            else:
                assert parameter.grad is None, f"{family.name} bppsa {method}: {name} has a gradient"
        net.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", [family for family in FAMILIES if family.transformer],
                         ids=lambda family: family.name)
def test_transformer_is_refused_naming_the_op(tmp_path, family):
    net = torchvision_models.build(family, torch.float64)
    x = torch.randn((1, 3, family.side, family.side), dtype=torch.float64)
    with pytest.raises(CaptureError) as error:
        export_torch(net, tuple(x.shape[1:]), tmp_path / "model.yaml")
    assert_refused_by_name(net, error.value, TRANSFORMER_REFUSAL)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CaptureError) as bridge:
        bppsa(net)(x)
    assert_refused_by_name(net, bridge.value, TRANSFORMER_REFUSAL)


class SelfAttention(torch.nn.Module):
    """A ``MultiheadAttention`` called as torchvision's ViT encoder block calls it (``x, _ =
    self.self_attention(x, x, x, need_weights=False)``)."""

    def __init__(self, attention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x):
        out, _ = self.attention(x, x, x, need_weights=False)
        return out


def test_vit_self_attention_is_refused_naming_multihead_attention(tmp_path):
    (family,) = [family for family in FAMILIES if family.name == "vit"]
    block = torchvision_models.build(family, torch.float64).encoder.layers[0]
    net = SelfAttention(block.self_attention)
    tokens = (family.side // 32) ** 2 + 1  # vit_b_32's 32x32 patches and its class token
    with pytest.raises(CaptureError) as error:
        export_torch(net, (tokens, block.self_attention.embed_dim), tmp_path / "model.yaml")
    assert_refused_by_name(net, error.value, r"MultiheadAttention\b.*not supported")


def test_every_classification_model_belongs_to_one_family():
    models = torchvision_models.load().models
    names = models.list_models(module=models)
    assert len(names) >= 80, names  # torchvision 0.28 has 80
    for name in names:
        assert len(torchvision_models.family_of(name)) == 1, (name, torchvision_models.family_of(name))
    for family in FAMILIES:
        assert family.builder in names and torchvision_models.family_of(family.builder) == [family]
