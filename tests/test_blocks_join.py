"""Blocks joining branches beyond the residual sum (issue 46): a concatenation along the channels and
a product with broadcasting, as one scan element each.

Small float64 models, batch 3: an Inception-like concatenation of four branches (the identity among
them), DenseNet's growing ``cat([x, f(x)])`` twice, a squeeze-and-excitation gate ``x * sigmoid(fc(
relu(fc(mean(x)))))`` inside a residual block, a product broadcast over one axis, concatenations and
products of flat features, and blocks nested in each other. Every activation gradient and every
parameter gradient equals PyTorch autograd for every schedule; every block's dense JT equals finite
differences and autograd; its entries and fill FLOPs, counted without its union, equal the built
plan's and an independent count; back-propagation never forms a block's JT; the GPU (the stand-in on
CPU-only machines) equals the host.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import scipy.sparse as sp
from oracles import finite_difference_jt, torch_jt, torch_mirror

from sparse_scan import Sequential
from sparse_scan.engine.plan import operands_needing_patterns
from sparse_scan.engine.schedule import depth
from sparse_scan.layers import (
    AdaptiveAvgPool2d,
    BatchNorm2d,
    Block,
    ChannelShuffle,
    Conv2d,
    Flatten,
    Linear,
    MaxPool2d,
    Narrow,
    ReLU,
    Residual,
    Sigmoid,
    Tanh,
)
from sparse_scan.weights import named_layers, state_dict

RTOL, ATOL = 1e-10, 1e-12
F64 = {"dtype": np.float64}


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
    return Conv2d(cin, cout, kernel, rng=seed, **F64, **kwargs)


def squeeze_excitation(channels: int, squeezed: int, seed: int) -> Block:
    """torchvision's ``SqueezeExcitation``: ``x * sigmoid(fc2(relu(fc1(avgpool(x)))))``, its layers the
    block's own children."""
    gate = [AdaptiveAvgPool2d(1), conv(channels, squeezed, 1, seed), ReLU(),
            conv(squeezed, channels, 1, seed + 1), Sigmoid()]
    for layer, name in zip(gate, ["avgpool", "fc1", "activation", "fc2", "scale_activation"], strict=True):
        layer.name = name
    return Block(gate, [], join="product", names=[None, "identity"])


def inception() -> Sequential:
    """Stem, a concatenation of a 1x1 conv, a 1x1-3x3 chain, a pool-projection and the identity, a
    DenseNet-style ``cat([x, f(x)])``, a head."""
    mixed = Block([conv(3, 2, 1, 10)], [conv(3, 2, 1, 11), ReLU(), conv(2, 3, 3, 12, padding=1)],
                  [MaxPool2d(3, stride=1, padding=1), conv(3, 1, 1, 13)], [], join="concat")
    dense = Block([], [batchnorm(9, 20), ReLU(), conv(9, 2, 3, 21, padding=1, bias=False)], join="concat")
    return Sequential(conv(2, 3, 3, 0, padding=1), batchnorm(3, 1), ReLU(), mixed, ReLU(), dense,
                      AdaptiveAvgPool2d(2), Flatten(), Linear(11 * 4, 4, **F64, rng=3))


def densenet() -> Sequential:
    """DenseNet's growing concatenation: ``cat([x, f(x)])`` twice, each ``f`` BN-ReLU-conv."""
    def dense_layer(channels: int, seed: int) -> Block:
        return Block([], [batchnorm(channels, seed), ReLU(), conv(channels, 2, 3, seed + 1, padding=1)],
                     join="concat")

    return Sequential(conv(1, 2, 3, 0, padding=1), dense_layer(2, 10), dense_layer(4, 20), batchnorm(6, 30),
                      ReLU(), AdaptiveAvgPool2d(1), Flatten(), Linear(6, 3, **F64, rng=31))


def se_resnet() -> Sequential:
    """A residual block whose inner chain ends with a squeeze-and-excitation gate (SE-ResNet), then a
    product broadcast over the rows alone (``(C, 1, W)`` over ``(C, H, W)``), a head."""
    block = Residual(conv(3, 4, 3, 10, padding=1), batchnorm(4, 11), ReLU(), conv(4, 4, 3, 12, padding=1),
                     squeeze_excitation(4, 2, 13), shortcut=[conv(3, 4, 1, 15), batchnorm(4, 16)])
    rows = Block([conv(4, 4, 3, 20, padding=1)], [AdaptiveAvgPool2d((1, None)), Tanh()], join="product")
    return Sequential(block, ReLU(), rows, Flatten(), Linear(4 * 5 * 5, 3, **F64, rng=30))


def nested() -> Sequential:
    """A concatenation whose branch holds a product, inside a residual sum's inner chain, and a
    concatenation of flat features whose branches are a product of two Linear layers and a Linear."""
    gated = Block([conv(2, 2, 1, 10)], [conv(2, 2, 3, 11, padding=1), Sigmoid()], join="product")
    inner = Block([gated, Tanh()], [conv(2, 1, 3, 12, padding=1)], join="concat")
    block = Residual(inner, conv(3, 2, 1, 13))
    flat = Block([Block([Linear(2 * 4 * 4, 5, **F64, rng=20)], [Linear(2 * 4 * 4, 5, **F64, rng=21)],
                        join="product"), Tanh()],
                 [Linear(2 * 4 * 4, 3, **F64, rng=22)], join="concat")
    return Sequential(block, Flatten(), flat, Linear(8, 3, **F64, rng=30))


def outer() -> Sequential:
    """A product of two broadcasts: channels ``(C, 1, 1)`` times a map ``(1, H, W)``."""
    product = Block([AdaptiveAvgPool2d(1), conv(2, 3, 1, 10)], [conv(2, 1, 3, 11, padding=1), Tanh()],
                    join="product")
    return Sequential(product, Flatten(), Linear(3 * 4 * 4, 3, **F64, rng=12))


def shuffle_unit() -> Sequential:
    """ShuffleNetV2's stride-1 unit: the channels' halves, the second through a branch, concatenated and
    shuffled; then a shuffle of four groups."""
    unit = Block([Narrow(0, 2)], [Narrow(2, 2), conv(2, 2, 1, 10), batchnorm(2, 11), ReLU(),
                                  conv(2, 2, 3, 12, padding=1, groups=2)], join="concat")
    return Sequential(unit, ChannelShuffle(2), ChannelShuffle(4), Flatten(),
                      Linear(4 * 3 * 3, 3, **F64, rng=13))


MODELS = {"inception": (inception, (2, 5, 5)), "densenet": (densenet, (1, 4, 4)),
          "se_resnet": (se_resnet, (3, 5, 5)), "nested": (nested, (2, 4, 4)), "outer": (outer, (2, 4, 4)),
          "shuffle_unit": (shuffle_unit, (4, 3, 3))}


def schedules(n: int) -> list[tuple[str, int | None]]:
    return [("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(1, depth(n))]


def make_input(shape, batch=3, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape))


def blocks_of(model: Sequential) -> list[tuple[str, Block]]:
    return [(path, layer) for path, layer in named_layers(model).items() if isinstance(layer, Block)]


# --- the PyTorch mirror ------------------------------------------------------------------------
def torch_module(layer):
    """A PyTorch float64 module computing ``layer``, its children named as :meth:`Block.named_children`
    names them (parameters copied)."""
    torch = pytest.importorskip("torch")
    if isinstance(layer, ChannelShuffle):
        return torch.nn.ChannelShuffle(layer.groups)
    if isinstance(layer, Narrow):
        class TorchNarrow(torch.nn.Module):
            def forward(self, x):
                return torch.narrow(x, 1, layer.start, layer.length)

        return TorchNarrow()
    if not isinstance(layer, Block):
        return torch_mirror(layer)

    class TorchBlock(torch.nn.Module):
        def __init__(self, block: Block) -> None:
            super().__init__()
            self.join = block.join
            self.chains = []
            for chain, name, single in zip(block.branches, block.branch_names, block._singles, strict=True):
                modules = [torch_module(inner) for inner in chain]
                if name is None:
                    for inner, module in zip(chain, modules, strict=True):
                        self.add_module(str(inner.name), module)
                elif single:
                    self.add_module(name, modules[0])
                elif modules:
                    self.add_module(name, torch.nn.Sequential(collections.OrderedDict(
                        (str(inner.name), module) for inner, module in zip(chain, modules, strict=True))))
                self.chains.append(modules)

        def forward(self, x):
            outputs = []
            for modules in self.chains:
                y = x
                for module in modules:
                    y = module(y)
                outputs.append(y)
            if self.join == "concat":
                return torch.cat(outputs, 1)
            if self.join == "product":
                return outputs[0] * outputs[1]
            return sum(outputs[1:], outputs[0])

    if type(layer) is Residual:
        shortcut = layer.shortcut[0] if layer._single_shortcut else layer.shortcut
        return TorchBlock(Block(layer.layers, shortcut, names=(None, layer.shortcut_name)))
    return TorchBlock(layer)


def torch_net(model: Sequential):
    """The model as a torch ``nn.Sequential`` whose state_dict names are ours."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(collections.OrderedDict((str(layer.name), torch_module(layer))
                                                      for layer in model.layers))
    theirs = {key for key in net.state_dict() if not key.endswith("num_batches_tracked")}
    assert sorted(state_dict(model)) == sorted(theirs)
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


# --- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", sorted(MODELS))
def test_every_schedule_equals_torch_autograd(which):
    build, shape = MODELS[which]
    model = build()
    x = make_input(shape)
    y = model.forward(x)
    g = np.random.default_rng(7).standard_normal(y.shape)
    output, activation_grads, parameter_grads = torch_gradients(torch_net(model), x, g)
    np.testing.assert_allclose(y, output, rtol=1e-12, atol=1e-14)
    for method, levels in schedules(len(model)):
        grads = model.backward(g, method=method, levels=levels)
        for ours, theirs in zip(grads, activation_grads, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=f"{method} {levels}")
        params = model.parameter_gradients(grads)
        assert sorted(params) == sorted(parameter_grads)
        for name, value in parameter_grads.items():
            np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{method} {name}")


@pytest.mark.parametrize("which", sorted(MODELS))
def test_every_blocks_jt_equals_finite_differences_and_autograd(which):
    """At random inputs (no ties of a max-pool's window: its JT at a tie is one of the one-sided
    derivatives, which finite differences average)."""
    build, shape = MODELS[which]
    model = build()
    shapes = {id(layer): s for layer, s in zip(model.layers, model.shapes(shape), strict=False)}
    for path, block in blocks_of(model):
        if id(block) not in shapes:  # a nested block: part of its parent's JT
            continue
        block_input = make_input(shapes[id(block)], batch=2, seed=len(path))
        jt = block.transposed_jacobian(block_input)
        assert jt.pattern.same_as(block.pattern(block_input.shape[1:]))
        assert jt.pattern.nnz == block.pattern_nnz(block_input.shape[1:])
        dense = np.broadcast_to(jt.todense(), (2,) + jt.shape)
        module = torch_module(block)
        for sample in range(2):
            differences = finite_difference_jt(block.forward, block_input[sample])
            np.testing.assert_allclose(dense[sample], differences, rtol=1e-6, atol=1e-7, err_msg=path)
            np.testing.assert_allclose(dense[sample], torch_jt(module, block_input[sample]),
                                       rtol=1e-12, atol=1e-13, err_msg=path)
        # the pattern is fixed: values of another batch (zeros: every ReLU off) fill the same one
        assert block.transposed_jacobian(np.zeros_like(block_input)).pattern is jt.pattern


def test_a_concatenation_of_sample_independent_branches_shares_its_values_a_product_never():
    x = make_input((2, 4, 4))
    cat = Block([conv(2, 3, 3, 0, padding=1)], [], [conv(2, 1, 1, 1), batchnorm(1, 2)], join="concat")
    jt = cat.transposed_jacobian(x)
    assert cat.sample_independent and jt.shared
    projection, norm = cat.branches[2]
    parts = [cat.branches[0][0].transposed_jacobian(x).todense(), np.eye(32),
             projection.transposed_jacobian(x).todense() @ norm.transposed_jacobian(projection(x)).todense()]
    np.testing.assert_array_equal(jt.todense(), np.hstack(parts))  # side by side: no arithmetic
    product = Block([conv(2, 2, 1, 3)], [conv(2, 2, 1, 4)], join="product")
    assert not product.sample_independent and not product.transposed_jacobian(x).shared


# --- planning figures --------------------------------------------------------------------------------
def boolean(pattern) -> sp.csr_matrix:
    return sp.csr_matrix((np.ones(pattern.nnz), pattern.indices, pattern.indptr), shape=pattern.shape)


def chain_flops(layers, in_shape) -> tuple[sp.csr_matrix, int]:
    """The chain's JT product's pattern and FLOPs, left to right from SciPy's boolean products: 2 per
    multiply-add, 1 per entry of a scaling by a diagonal."""
    flops, pattern, diagonal = 0, None, False
    for layer in layers:
        this = boolean(layer.pattern(in_shape))
        if pattern is None:
            pattern, diagonal = this, layer.jacobian_kind == "diagonal"
        else:
            product = (pattern @ this).astype(bool).astype(float)
            scaling = diagonal or layer.jacobian_kind == "diagonal"
            flops += product.nnz if scaling else 2 * int((pattern @ this).sum())
            pattern, diagonal = product, diagonal and layer.jacobian_kind == "diagonal"
        flops += layer.jacobian_fill_flops(in_shape)
        in_shape = layer.output_shape(in_shape)
    return pattern, flops


def independent_figures(block: Block, in_shape) -> tuple[int, int]:
    """The block's entries and fill FLOPs from SciPy: each branch's term ``JT_i M_i`` as a boolean
    matrix (the column map built densely from the join's definition), their union; the chains'
    products, plus a sum's one add per entry of every term but the first, a product's scalings of both
    terms and one add per entry of the second."""
    size = int(np.prod(in_shape))
    outputs = [shapes[-1] for shapes in block._layout(in_shape).branches]
    out_shape = tuple(block.output_shape(in_shape))
    out_size = int(np.prod(out_shape))
    terms, flops, offset = [], 0, 0
    for chain, shape in zip(block.branches, outputs, strict=True):
        pattern, chain_fill = chain_flops(chain, in_shape) if chain else (sp.identity(size, format="csr"), 0)
        flops += chain_fill
        n = int(np.prod(shape))
        if block.join == "concat":
            mapping = sp.csr_matrix((np.ones(n), (np.arange(n), offset + np.arange(n))), shape=(n, out_size))
            offset += n
        else:  # each output position reads the branch's position it broadcasts from
            source = np.broadcast_to(np.arange(n).reshape(tuple(shape)), out_shape).ravel()
            mapping = sp.csr_matrix((np.ones(out_size), (source, np.arange(out_size))), shape=(n, out_size))
        terms.append((pattern @ mapping).astype(bool).astype(float))
    entries = [term.nnz for term in terms]
    flops += {"sum": sum(entries[1:]), "concat": 0, "product": sum(entries) + sum(entries[1:])}[block.join]
    return sum(terms).nnz, flops


@pytest.mark.parametrize("which", sorted(MODELS))
def test_entries_and_fill_flops_are_counted_without_the_union_and_equal_scipys(which):
    build, shape = MODELS[which]
    model = build()
    shapes = {id(layer): s for layer, s in zip(model.layers, model.shapes(shape), strict=False)}
    for path, block in blocks_of(model):
        if id(block) not in shapes:
            continue
        in_shape = shapes[id(block)]
        counted = (block.pattern_nnz(in_shape), block.jacobian_fill_flops(in_shape))
        assert not block._symbolic, f"{path}: counting formed the union"
        assert counted == independent_figures(block, in_shape), path
        assert block.pattern(in_shape).nnz == counted[0]
        assert (block.pattern_nnz(in_shape), block.jacobian_fill_flops(in_shape)) == counted


def test_a_concatenation_of_convolution_and_diagonal_chains_is_counted_from_their_structure_alone():
    block = densenet().layers[1]
    figures = (block.pattern_nnz((2, 4, 4)), block.jacobian_fill_flops((2, 4, 4)))
    assert figures == independent_figures(block, (2, 4, 4)) and block.plan_builds == 0


def test_the_plan_is_built_once_and_back_propagation_never_forms_a_blocks_jt(monkeypatch):
    model = se_resnet()
    for batch in (3, 2):
        y = model.forward(make_input((3, 5, 5), batch=batch))
        for _ in range(2):
            model.backward(np.ones_like(y), method="blelloch")
    assert model.plan_builds == 1
    # the residual block (and the gate nested in it) is read by mv steps alone: its figures are counted
    # from its layers' structure and its products never planned; block '2' is a product's operand
    assert [(name, block.plan_builds) for name, block in blocks_of(model)] == [("0", 0), ("0.4", 0), ("2", 1)]
    x = make_input((3, 5, 5))
    y = model.forward(x)
    g = np.random.default_rng(2).standard_normal(y.shape)
    want = model.backward(g, method="blelloch")

    def refuse(*args):
        raise AssertionError("a block's JT values were computed")

    monkeypatch.setattr(Block, "_values", refuse)
    for ours, theirs in zip(model.backward(g, method="linear"), want, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


# --- devices -------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["inception", "se_resnet", "nested"])
@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None)])
def test_model_on_each_backend_equals_the_host(be, which, method, levels):
    build, shape = MODELS[which]
    host, model = build(), build()
    x = make_input(shape)
    host.forward(x)
    g = np.random.default_rng(7).standard_normal((3, 3 if which != "inception" else 4))
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
    for index, layer in enumerate(model.layers):
        if isinstance(layer, Block):
            jt = layer.transposed_jacobian(model._activations[index])
            reference = host.layers[index].transposed_jacobian(host._activations[index])
            assert jt.pattern.same_as(reference.pattern)
            np.testing.assert_allclose(be.to_host(jt.data), reference.data, rtol=1e-13, atol=1e-15)
            shape_in = tuple(model._activations[index].shape[1:])
            matvec = layer.weights_matvec(shape_in, be.name)(be.asarray(want[index + 1].reshape(3, -1)))
            np.testing.assert_allclose(be.to_host(matvec), want[index].reshape(3, -1), rtol=RTOL, atol=ATOL)


# --- names and arguments -------------------------------------------------------------------------
def test_names_follow_a_pytorch_modules_children():
    model = Sequential(inception().layers[3], se_resnet().layers[0])
    model.layers[0].name, model.layers[1].name = "mixed", "layer1"
    names = list(state_dict(model))
    assert names[:4] == ["mixed.0.0.weight", "mixed.0.0.bias", "mixed.1.0.weight", "mixed.1.0.bias"]
    assert "mixed.2.1.weight" in names and "layer1.4.fc1.weight" in names
    assert "layer1.4.fc2.bias" in names and "layer1.shortcut.1.running_var" in names
    named = Block(conv(2, 2, 1, 0), [ReLU(), conv(2, 2, 1, 1)], join="concat", names=["left", "right"])
    assert [name for name, _ in named.named_children()] == ["left", "right.0", "right.1"]
    layers = [conv(2, 2, 1, 0), ReLU(), conv(2, 2, 1, 1)]
    for layer, name in zip(layers, ["a", "relu", "b"], strict=True):
        layer.name = name
    inline = Block(layers[0], layers[1:], join="concat", scoped=False)
    inline.name = "cat"
    assert list(state_dict(Sequential(conv(1, 2, 1, 2), inline))) == [
        "0.weight", "0.bias", "a.weight", "a.bias", "b.weight", "b.bias"]


def test_bad_arguments_and_shapes_raise_one_clear_error():
    with pytest.raises(ValueError, match="join must be one of sum, concat, product, got 'stack'"):
        Block([ReLU()], [], join="stack")
    with pytest.raises(ValueError, match="a concat joins at least two branches, got 1"):
        Block([ReLU()], join="concat")
    with pytest.raises(ValueError, match="a product joins two branches, got 3"):
        Block([ReLU()], [], [], join="product")
    with pytest.raises(TypeError, match="branch 1 layer 0 is a str"):
        Block([ReLU()], ["relu"])
    with pytest.raises(TypeError, match="branch 0 must be a Layer or a list"):
        Block("relu", [])
    with pytest.raises(ValueError, match="names must be one name without dots"):
        Block([ReLU()], [], names=["a.b", "c"])
    with pytest.raises(ValueError, match="unique names: 'x.0' names 2"):
        Block([ReLU()], [Tanh()], names=["x", "x"], join="concat")
    cat = Block([conv(2, 2, 3, 0)], [], join="concat")
    cat.name = "mixed"
    with pytest.raises(ValueError, match=r"layer 'mixed' \(Block\): output: the branches map \(2, 5, 5\) "
                                         r"to \(2, 3, 3\), \(2, 5, 5\); y = cat\(\[b_1\(x\), b_2\(x\), "
                                         r"\.\.\.\], 1\)"):
        cat.forward(make_input((2, 5, 5)))
    product = Block([AdaptiveAvgPool2d((2, 1))], [], join="product")
    with pytest.raises(ValueError, match=r"to \(2, 2, 1\), \(2, 5, 5\); y = b_1\(x\) \* b_2\(x\) needs .*1 "
                                         r"\(broadcast\)"):
        product.pattern((2, 5, 5))
    with pytest.raises(RuntimeError, match="call forward"):
        Block([ReLU()], [], join="product").weights_matvec((2, 3))


def test_jt_fills_are_counted_where_a_scan_multiplies_a_blocks_jt():
    """A plan whose products read a block's JT adds the costliest such fill to its critical path and
    every one to its work; back-propagation (which applies blocks through their branches) none; the
    static and live figures of :mod:`sparse_scan.flops` agree with the plan."""
    from sparse_scan.flops import analyse, live

    model = Sequential(Tanh(), *se_resnet().layers)
    shape = (3, 5, 5)
    n, shapes = len(model), model.shapes(shape)
    assert model.plan(shape, "linear").fill_flops == (0, 0)
    plan = model.plan(shape, "blelloch")
    read = [j for j in operands_needing_patterns(n, "blelloch", None)
            if isinstance(model.layers[n - j], Block)]
    fills = [model.layers[n - j].jacobian_fill_flops(shapes[n - j]) for j in read]
    assert read and plan.fill_flops == (max(fills), sum(fills))
    model.input_shape = shape
    static = analyse(model, method="blelloch")
    assert static["totals"]["critical_flops"] == plan.critical_flops
    assert static["totals"]["work_flops"] == plan.work_flops
    for index, layer in enumerate(static["layers"]):
        assert layer["nnz"] == model.layers[index].pattern_nnz(shapes[index])
    counted = live(model, make_input(shape), "blelloch")["totals"]
    assert counted["critical_flops"]["static"] == plan.critical_flops
    assert counted["work_flops"]["live"]["max"] <= plan.work_flops
    assert counted["work_flops"]["live"]["min"] >= plan.fill_flops[1]


@pytest.mark.parametrize("which", ["inception", "se_resnet"])
def test_a_distributed_slice_of_blocks_multiplies_their_jts_like_back_propagation(which):
    """A rank's slice product (:mod:`sparse_scan.distributed`) over blocks' JTs, applied to the
    gradient after the slice, gives back-propagation's gradient before it."""
    from sparse_scan.distributed._slices import SliceProduct, apply

    build, shape = MODELS[which]
    model = build()
    y = model.forward(make_input(shape))
    grads = model.backward(np.random.default_rng(3).standard_normal(y.shape), method="linear")
    jacobians, shapes, n = model.transposed_jacobians(), model.shapes(shape), len(model)
    for a, b in [(0, n), (0, 2), (1, n - 1)]:
        product = SliceProduct(model.layers[a:b], shapes[a]).compute(jacobians[a:b])
        np.testing.assert_allclose(apply(product, grads[b].reshape(3, -1)), grads[a].reshape(3, -1),
                                   rtol=RTOL, atol=ATOL, err_msg=f"{a}:{b}")


# --- channels selected and permuted (ShuffleNet) ---------------------------------------------------
def test_narrow_and_channel_shuffle_equal_finite_differences_pytorch_and_the_gpu(be):
    torch = pytest.importorskip("torch")
    x = make_input((6, 2, 3), batch=2)
    for layer, module in [(Narrow(1, 4), lambda t: torch.narrow(t, 1, 1, 4)),
                          (ChannelShuffle(3), torch.nn.ChannelShuffle(3))]:
        jt = layer.transposed_jacobian(x)
        assert jt.shared and jt.pattern.nnz == int(np.prod(layer.output_shape((6, 2, 3))))
        np.testing.assert_array_equal(layer(x), module(torch.from_numpy(x)).numpy())
        np.testing.assert_allclose(jt.todense(), torch_jt(module, x[0]), rtol=0, atol=0)
        np.testing.assert_allclose(jt.todense(), finite_difference_jt(layer.forward, x[0]), atol=1e-9)
        on_device = layer.transposed_jacobian(be.asarray(x))
        assert on_device.pattern.same_as(jt.pattern)
        np.testing.assert_array_equal(be.to_host(layer(be.asarray(x))), layer(x))
    with pytest.raises(ValueError, match=r"layer Narrow: length: channels 4 .. 7 of a sample of shape "
                                         r"\(6, 2, 3\): it has 6"):
        Narrow(4, 4).forward(x)
    with pytest.raises(ValueError, match="4 groups do not divide the 6 channels"):
        ChannelShuffle(4).pattern((6, 2, 3))
    with pytest.raises(ValueError, match="start: must be an int >= 0"):
        Narrow(-1, 2)
