"""Residual blocks (issue 22): one scan element whose JT is ``JT_s + JT_1 ⋯ JT_k``.

A small ResNet-like chain (stem, an identity block, a block with a strided 1x1 convolution and
batch-normalisation shortcut, pooling, a linear head), float64, batch 3: every activation gradient and
every parameter gradient equals PyTorch autograd for every schedule; a block's dense JT equals finite
differences and autograd; nested blocks; the GPU (the stand-in on CPU-only machines) equals the host.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from oracles import finite_difference_jt, torch_jt

from sparse_scan import Sequential
from sparse_scan.csr import Pattern
from sparse_scan.engine._weights_path import gemm_pays
from sparse_scan.engine.plan import operands_needing_patterns
from sparse_scan.engine.schedule import depth
from sparse_scan.layers import (
    AdaptiveAvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    ReLU,
    Residual,
    Tanh,
)
from sparse_scan.layers._block import plan_sum
from sparse_scan.weights import load_state_dict, named_layers, state_dict

RTOL, ATOL = 1e-10, 1e-12


def batchnorm(channels: int, seed: int) -> BatchNorm2d:
    """A frozen BatchNorm2d with random statistics and affine parameters (float64)."""
    rng = np.random.default_rng(seed)
    layer = BatchNorm2d(channels, dtype=np.float64).eval()
    layer.running_mean = rng.standard_normal(channels)
    layer.running_var = rng.uniform(0.5, 2.0, channels)
    layer.weight = rng.uniform(0.5, 1.5, channels)
    layer.bias = rng.standard_normal(channels)
    return layer


def conv(cin: int, cout: int, kernel: int, seed: int, **kwargs) -> Conv2d:
    return Conv2d(cin, cout, kernel, dtype=np.float64, rng=seed, **kwargs)


def basic_block(cin: int, cout: int, stride: int, seed: int) -> Residual:
    """torchvision's BasicBlock without its final ReLU; a strided 1x1 conv + BN shortcut on a change."""
    shortcut = None
    if stride != 1 or cin != cout:
        shortcut = [conv(cin, cout, 1, seed + 5, stride=stride, bias=False), batchnorm(cout, seed + 6)]
    return Residual(conv(cin, cout, 3, seed, stride=stride, padding=1, bias=False), batchnorm(cout, seed + 1),
                    ReLU(), conv(cout, cout, 3, seed + 2, padding=1, bias=False), batchnorm(cout, seed + 3),
                    shortcut=shortcut)


def resnet() -> Sequential:
    """Stem, an identity block, a strided block with a projection shortcut, pool, flatten, linear."""
    return Sequential(conv(3, 4, 3, 0, padding=1), batchnorm(4, 1), ReLU(),
                      basic_block(4, 4, 1, 10), ReLU(),
                      basic_block(4, 8, 2, 20), ReLU(),
                      AdaptiveAvgPool2d(1), Flatten(), Linear(8, 5, dtype=np.float64, rng=3))


def nested_model() -> Sequential:
    """A block whose inner chain holds a block, and a single-layer shortcut, then a head."""
    inner = Residual(conv(3, 3, 3, 30, padding=1), Tanh(), conv(3, 3, 3, 31, padding=1))
    outer = Residual(inner, batchnorm(3, 32), ReLU(), conv(3, 2, 3, 33, padding=1),
                     shortcut=conv(3, 2, 1, 34))
    return Sequential(outer, Flatten(), Linear(2 * 5 * 5, 4, dtype=np.float64, rng=35))


def schedules(n: int) -> list[tuple[str, int | None]]:
    return [("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(depth(n) + 1)]


def make_input(shape, batch=3, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape))


# --- the PyTorch mirror ------------------------------------------------------------------------
def torch_module(layer):
    """A PyTorch float64 module computing ``layer`` (parameters copied by the caller)."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class TorchResidual(nn.Module):
        """``f(x) + s(x)``: children named as :meth:`Residual.named_children` names them."""

        def __init__(self, block: Residual):
            super().__init__()
            self.inner = [str(layer.name) for layer in block.layers]
            for layer in block.layers:
                self.add_module(str(layer.name), torch_module(layer))
            self.shortcut_name = block.shortcut_name if block.shortcut else None
            if len(block.shortcut) == 1 and block.shortcut[0].name == block.shortcut_name:
                self.add_module(block.shortcut_name, torch_module(block.shortcut[0]))
            elif block.shortcut:
                self.add_module(block.shortcut_name, nn.Sequential(*[torch_module(layer)
                                                                     for layer in block.shortcut]))

        def forward(self, x):
            y = x
            for name in self.inner:
                y = getattr(self, name)(y)
            return y + (x if self.shortcut_name is None else getattr(self, self.shortcut_name)(x))

    name = type(layer).__name__
    if name == "Residual":
        return TorchResidual(layer)
    if name == "Conv2d":
        return nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                         layer.padding, layer.dilation, layer.groups, bias=layer.bias is not None).double()
    if name == "BatchNorm2d":
        return nn.BatchNorm2d(layer.num_features, layer.eps).double().eval()
    if name == "Linear":
        return nn.Linear(layer.in_features, layer.out_features).double()
    if name == "AdaptiveAvgPool2d":
        return nn.AdaptiveAvgPool2d(layer.output_size)
    return getattr(nn, name)()


def torch_mirror(model: Sequential):
    """The model as a torch ``nn.Sequential``, loaded from our state_dict (whose names must be its)."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(*[torch_module(layer) for layer in model.layers])
    ours = state_dict(model)
    theirs = {key for key in net.state_dict() if not key.endswith("num_batches_tracked")}
    assert sorted(ours) == sorted(theirs)
    net.load_state_dict({key: torch.from_numpy(value.copy()) for key, value in ours.items()}, strict=False)
    return net


def torch_gradients(net, x: np.ndarray, g: np.ndarray):
    """Autograd's output, activation gradients and parameter gradients of ``net`` at ``x``."""
    torch = pytest.importorskip("torch")
    activations = [torch.from_numpy(x).requires_grad_()]
    for module in net:
        activations.append(module(activations[-1]))
        activations[-1].retain_grad()
    activations[-1].backward(torch.from_numpy(g))
    return (activations[-1].detach().numpy(), [a.grad.numpy() for a in activations],
            {name: p.grad.numpy() for name, p in net.named_parameters()})


@pytest.mark.parametrize("build, shape", [(resnet, (3, 8, 8)), (nested_model, (3, 5, 5))],
                         ids=["resnet", "nested"])
def test_every_schedule_equals_torch_autograd(build, shape):
    model = build()
    x = make_input(shape)
    y = model.forward(x)
    g = np.random.default_rng(7).standard_normal(y.shape)
    net = torch_mirror(model)
    output, activation_grads, parameter_grads = torch_gradients(net, x, g)
    np.testing.assert_allclose(y, output, rtol=1e-12, atol=1e-14)
    for method, levels in schedules(len(model)):
        grads = model.backward(g, method=method, levels=levels)
        for ours, theirs in zip(grads, activation_grads, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=f"{method} {levels}")
        params = model.parameter_gradients(grads)
        assert sorted(params) == sorted(parameter_grads)
        for name, value in parameter_grads.items():
            np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{method} {name}")


def test_names_follow_torchs_state_dict():
    model = resnet()
    names = list(state_dict(model))
    assert names[6:16] == ["3.0.weight", "3.1.weight", "3.1.bias", "3.1.running_mean", "3.1.running_var",
                           "3.3.weight", "3.4.weight", "3.4.bias", "3.4.running_mean", "3.4.running_var"]
    assert "5.shortcut.0.weight" in names and "5.shortcut.1.running_var" in names
    assert list(named_layers(nested_model()))[:5] == ["0", "0.0", "0.0.0", "0.0.1", "0.0.2"]
    # torchvision's BasicBlock names: named inner layers and shortcut_name="downsample"
    layers = [conv(4, 8, 3, 0, stride=2, padding=1, bias=False), batchnorm(8, 1), ReLU(),
              conv(8, 8, 3, 2, padding=1, bias=False), batchnorm(8, 3)]
    for layer, name in zip(layers, ["conv1", "bn1", "relu", "conv2", "bn2"], strict=True):
        layer.name = name
    block = Residual(*layers, shortcut=[conv(4, 8, 1, 4, stride=2, bias=False), batchnorm(8, 5)],
                     shortcut_name="downsample")
    block.name = "layer2.0"
    # torchvision.models.resnet.BasicBlock(4, 8, 2, downsample).state_dict(), num_batches_tracked aside
    bn = ["weight", "bias", "running_mean", "running_var"]
    expected = (["conv1.weight"] + [f"bn1.{key}" for key in bn] + ["conv2.weight"]
                + [f"bn2.{key}" for key in bn] + ["downsample.0.weight"]
                + [f"downsample.1.{key}" for key in bn])
    assert list(state_dict(Sequential(block))) == [f"layer2.0.{key}" for key in expected]


def test_state_dict_round_trip_sets_nested_parameters():
    model, other = resnet(), resnet()
    for value in state_dict(other).values():
        value += 1.0
    load_state_dict(model, state_dict(other))
    assert model.layers[5].shortcut[0].weight is not other.layers[5].shortcut[0].weight
    for key, value in state_dict(other).items():
        np.testing.assert_array_equal(state_dict(model)[key], value)
    with pytest.raises(ValueError, match="'5.shortcut.0.weight' has shape"):
        load_state_dict(model, {"5.shortcut.0.weight": np.zeros((8, 4, 3, 3))}, strict=False)


@pytest.mark.parametrize("which", [3, 5])
def test_block_jt_equals_finite_differences_and_autograd(which):
    model = resnet()
    x = make_input((3, 8, 8))
    model.forward(x)
    block, block_input = model.layers[which], model._activations[which]
    jt = block.transposed_jacobian(block_input)
    assert jt.shared is False and jt.pattern.same_as(block.pattern(block_input.shape[1:]))
    dense = jt.todense()
    net = torch_mirror(model)
    for sample in range(len(x)):
        np.testing.assert_allclose(dense[sample], finite_difference_jt(block.forward, block_input[sample]),
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(dense[sample], torch_jt(net[which], block_input[sample]),
                                   rtol=1e-12, atol=1e-13)
    # the pattern holds the two chains' patterns (explicit zeros kept, never changed by the values)
    zero = np.zeros_like(block_input)
    assert block.transposed_jacobian(zero).pattern is jt.pattern
    wide = block.transposed_jacobian(block_input, index_dtype=np.int64)
    assert wide.pattern.index_dtype == np.int64 and wide.pattern.same_as(jt.pattern)
    np.testing.assert_array_equal(wide.data, jt.data)


def test_without_nonlinearities_the_jt_is_shared_and_a_single_layer_chain_is_its_jt():
    block = Residual(conv(2, 2, 3, 0, padding=1), batchnorm(2, 1), shortcut=batchnorm(2, 2))
    x = make_input((2, 4, 4))
    jt = block.transposed_jacobian(x)
    assert block.sample_independent and jt.shared
    conv_jt = block.layers[0].transposed_jacobian(x).todense()
    bn1, bn2 = (layer.transposed_jacobian(x).todense() for layer in (block.layers[1], block.shortcut[0]))
    np.testing.assert_allclose(jt.todense(), conv_jt @ bn1 + bn2, rtol=1e-14)


def test_plan_sum_positions():
    mats = [sp.random(7, 5, density=0.4, format="csr", random_state=seed) for seed in range(3)]
    union, positions = plan_sum([Pattern(m.indptr, m.indices, m.shape) for m in mats])
    values = np.zeros(union.nnz)
    for m, where in zip(mats, positions, strict=True):
        values[where] += m.data
    total = sp.csr_matrix((values, union.indices, union.indptr), union.shape)
    np.testing.assert_allclose(total.toarray(), sum(m.toarray() for m in mats))
    assert union.nnz == (sum(abs(m) for m in mats)).nnz


@pytest.mark.parametrize("covered", [True, False])
def test_plan_sum_of_a_pattern_and_one_it_holds(covered):
    """The shortcut's pattern inside the inner product's (the usual block): the union is the larger
    pattern itself; one entry outside it takes the general path. Both equal the dense sum."""
    big = sp.random(9, 8, density=0.5, format="csr", random_state=4)
    small = sp.csr_matrix(big.multiply(sp.random(9, 8, density=0.5, format="csr", random_state=5) != 0))
    small.data[:] = 1.0
    if not covered:
        outside = np.argwhere(big.toarray() == 0)[0]
        small = small + sp.csr_matrix(([2.0], ([outside[0]], [outside[1]])), shape=big.shape)
    small.sort_indices()
    union, positions = plan_sum([Pattern(small.indptr, small.indices, small.shape),
                                 Pattern(big.indptr, big.indices, big.shape)])
    assert (union.nnz == big.nnz) is covered
    values = np.zeros(union.nnz)
    for m, where in zip((small, big), positions, strict=True):
        values[where] += m.data
    total = sp.csr_matrix((values, union.indices, union.indptr), union.shape)
    np.testing.assert_allclose(total.toarray(), small.toarray() + big.toarray())
    assert union.nnz == (abs(small) + abs(big)).nnz


def test_the_plan_is_built_once():
    model = resnet()
    for batch in (3, 2):
        y = model.forward(make_input((3, 8, 8), batch=batch))
        for _ in range(2):
            model.backward(np.ones_like(y), method="blelloch")
    assert model.plan_builds == 1
    assert model.layers[3].plan_builds == model.layers[5].plan_builds == 1


def test_back_propagation_goes_through_the_chains_not_the_block_values(monkeypatch):
    model = resnet()
    x = make_input((3, 8, 8))
    y = model.forward(x)
    g = np.random.default_rng(2).standard_normal(y.shape)
    plan = model.plan((3, 8, 8), "linear")
    n = len(model)
    for index in (3, 5):
        block = model.layers[index]
        shape = model.shapes((3, 8, 8))[index]
        path = block.weights_path(shape)
        assert gemm_pays(block.pattern_nnz(shape), path)
        assert n - index in plan.weights.gemm_only
    want = model.backward(g, method="blelloch")

    def refuse(*args):
        raise AssertionError("the block's JT values were computed")

    monkeypatch.setattr(Residual, "_values", refuse)
    for ours, theirs in zip(model.backward(g, method="linear"), want, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 2)])
def test_model_on_each_backend_equals_the_host(be, method, levels):
    host, model = resnet(), resnet()
    x = make_input((3, 8, 8))
    g = np.random.default_rng(7).standard_normal((3, 5))
    host.forward(x)
    want = host.backward(g, method=method, levels=levels)
    want_params = host.parameter_gradients(want)
    model.forward(be.asarray(x))
    got = model.backward(be.asarray(g), method=method, levels=levels)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(be.to_host(a), b, rtol=RTOL, atol=ATOL)
    params = model.parameter_gradients(got)
    assert sorted(params) == sorted(want_params)
    for name, value in params.items():
        np.testing.assert_allclose(be.to_host(value), want_params[name], rtol=RTOL, atol=ATOL)
    block = model.layers[5]
    jt, reference = block.transposed_jacobian(model._activations[5]), host.layers[5].transposed_jacobian(
        host._activations[5])
    assert jt.pattern.same_as(reference.pattern)
    np.testing.assert_allclose(be.to_host(jt.data), reference.data, rtol=1e-13, atol=1e-15)
    matvec = block.weights_matvec((4, 8, 8), be.name)(be.asarray(want[6].reshape(3, -1)))
    np.testing.assert_allclose(be.to_host(matvec), want[5].reshape(3, -1), rtol=RTOL, atol=ATOL)


def test_shape_mismatches_raise_one_clear_error():
    identity = Residual(conv(4, 8, 3, 0, padding=1))
    identity.name = "block"
    message = (r"layer 'block' \(Residual\): output: the inner layers map \(4, 6, 6\) to \(8, 6, 6\) but the "
               r"identity shortcut keeps \(4, 6, 6\); .*shortcut=")
    with pytest.raises(ValueError, match=message):
        Sequential(conv(3, 4, 1, 1), identity).forward(make_input((3, 6, 6)))
    wrong = Residual(conv(4, 8, 3, 0, stride=2, padding=1), shortcut=conv(4, 8, 1, 1))
    with pytest.raises(ValueError, match=r"to \(8, 3, 3\) but the shortcut gives \(8, 6, 6\)"):
        wrong.pattern((4, 6, 6))
    with pytest.raises(ValueError, match="expected 4 channels"):
        Residual(batchnorm(4, 0)).forward(make_input((3, 6, 6)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one inner layer"):
        Residual()
    with pytest.raises(TypeError, match="layer 1 is a str"):
        Residual(ReLU(), "relu")
    with pytest.raises(TypeError, match="shortcut must be"):
        Residual(ReLU(), shortcut=[])
    with pytest.raises(ValueError, match="shortcut_name"):
        Residual(ReLU(), shortcut=ReLU(), shortcut_name="a.b")
    first, second = conv(2, 2, 1, 0), conv(2, 2, 1, 1)
    first.name = second.name = "conv"
    with pytest.raises(ValueError, match="unique names: 'conv'"):
        Residual(first, second)
    with pytest.raises(RuntimeError, match="call forward"):
        Residual(ReLU()).weights_matvec((2, 3))


def test_train_and_eval_set_every_nested_layer_as_pytorch_does():
    """``train(mode)``/``eval()`` reach every layer of every block; the ``training`` attribute is the
    layer's own (PyTorch: ``module.training = False`` leaves the children alone)."""
    torch = pytest.importorskip("torch")
    layers = nested_model().layers
    model = Sequential(layers[0], Dropout(0.5), *layers[1:])
    reference = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Dropout())),
                                    torch.nn.Dropout())

    def modes(layers) -> set[bool]:
        return {layer.training for layer in layers}

    assert model.train() is model and modes(named_layers(model).values()) == {True}
    assert model.eval() is model and reference.eval() is reference
    assert modes(named_layers(model).values()) == modes(reference.modules()) == {False}
    outer = model.layers[0]
    assert outer.train() is outer
    reference[0].train()
    assert modes(named_layers(model).values()) == modes(reference.modules()) == {True, False}
    assert all(layer.training for layer in named_layers(Sequential(outer)).values())
    outer.training = reference[0].training = False
    assert modes(outer.layers) == modes(reference[0].children()) == {True}
    with pytest.raises(ValueError, match=r"layer '0' \(Residual\): training: must be true or false"):
        outer.train("no")


def test_evaluation_restores_each_layers_own_mode():
    """:func:`sparse_scan.train.evaluate` runs in eval mode and gives back each layer's mode, mixed
    modes within a block included."""
    from sparse_scan.train import evaluate

    layers = nested_model().layers
    model = Sequential(layers[0], Dropout(0.5, rng=0), *layers[1:])
    outer = model.layers[0]
    outer.layers[0].eval()  # the inner block and its layers in eval mode, the rest training
    before = {path: layer.training for path, layer in named_layers(model).items()}
    x, y = make_input((3, 5, 5), batch=6), np.array([0, 1, 2, 3, 0, 1])
    result = evaluate(model, x, y, batch_size=4)
    assert {path: layer.training for path, layer in named_layers(model).items()} == before
    assert set(before.values()) == {True, False}
    twice = evaluate(model, x, y, batch_size=4)
    assert result == twice  # the dropout layer was the identity both times


def test_jt_fills_are_counted_where_a_scan_multiplies_a_blocks_jt():
    """A block's JT is a product of its layers' JTs: its fill FLOPs are those products' (counted here
    from SciPy's boolean products of the layers' patterns), plus one add per shortcut entry; a plan
    whose products read a block's JT adds the costliest fill to its critical path and every fill to its
    work, back-propagation (which applies blocks through their chains) none."""
    model = Sequential(Tanh(), *nested_model().layers)
    shape = (3, 5, 5)
    outer = model.layers[1]
    inner = outer.layers[0]

    def product_flops(layers, in_shape) -> int:
        """FLOPs of multiplying the chain's JTs left to right: 2 per multiply-add (1 per scaling)."""
        flops, pattern, diagonal = 0, None, False
        for layer in layers:
            p = layer.pattern(in_shape)
            this = sp.csr_matrix((np.ones(p.nnz), p.indices, p.indptr), shape=p.shape)
            if pattern is not None:
                scaling = diagonal or layer.jacobian_kind == "diagonal"
                multiply_adds = int((abs(pattern) @ abs(this)).sum())
                flops += (pattern @ this).nnz if scaling else 2 * multiply_adds
                pattern = (pattern @ this).astype(bool).astype(float)
            else:
                pattern = this
            diagonal = diagonal if pattern is not this else layer.jacobian_kind == "diagonal"
            in_shape = layer.output_shape(in_shape)
        return flops

    inner_fill = product_flops(inner.layers, shape) + 3 * 5 * 5  # identity shortcut: one add per entry
    assert inner.jacobian_fill_flops(shape) == inner_fill
    shortcut_entries = outer.shortcut[0].pattern(shape).nnz
    assert outer.jacobian_fill_flops(shape) == (product_flops(outer.layers, shape) + inner_fill
                                                + shortcut_entries)
    assert ReLU().jacobian_fill_flops(shape) == 0
    n = len(model)  # the block (layer 1) is scan element n - 1
    method, levels = next(s for s in schedules(n) if n - 1 in operands_needing_patterns(n, *s))
    assert model.plan(shape, "linear").fill_flops == (0, 0)
    plan = model.plan(shape, method, levels)
    assert plan.fill_flops == (outer.jacobian_fill_flops(shape),) * 2
    by_level: dict[int, int] = {}
    for step in plan.steps:
        by_level[step.level] = max(by_level.get(step.level, 0), step.flops)
    assert plan.critical_flops == sum(by_level.values()) + plan.fill_flops[0]
    assert plan.work_flops == sum(step.flops for step in plan.steps) + plan.fill_flops[1]
    assert model.estimate(shape, method, levels).fill_flops == plan.fill_flops
    assert plan.explain()["fill_flops"] == {"critical": plan.fill_flops[0], "work": plan.fill_flops[1]}
    from sparse_scan.flops import live

    counted = live(model, make_input(shape), method, levels)["totals"]
    assert counted["critical_flops"]["static"] == plan.critical_flops
    assert counted["work_flops"]["static"] == plan.work_flops
    assert counted["work_flops"]["live"]["max"] <= plan.work_flops
    assert counted["work_flops"]["live"]["min"] >= plan.fill_flops[1]
