"""The layers the model zoos need (issue 46): every one against independent oracles, float64 finite
differences of the forward and PyTorch autograd (``oracles.torch_mirror``), in float32 and float64, on
the host and on the GPU (the stand-in where there is none).

Per layer: the forward equals PyTorch's; JT's values equal finite differences and autograd's Jacobian;
the pattern's ``nnz`` is :meth:`~sparse_scan.layers.Layer.pattern_nnz` and its rows are sorted; a chain
``conv -> layer -> conv`` backpropagates as autograd does by the linear, Blelloch and hybrid scans, with
every parameter gradient (float64 within 1e-10 relative); ``flops`` (static and live) counts it; a spec
entry builds it; the GPU gives the host's results. Then what each layer has of its own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from oracles import finite_difference_jt, masked, torch_jt, torch_mirror

from sparse_scan import Sequential, backend, flops
from sparse_scan.layers import (
    GELU,
    Conv2d,
    DropPath,
    Hardsigmoid,
    Hardswish,
    LayerNorm,
    LayerScale,
    Mish,
    Residual,
    StochasticDepth,
    Upsample,
)
from sparse_scan.spec import model_from_spec

DTYPES = [np.float32, np.float64]
PLANE = (3, 4, 5)


def randomized(layer, seed: int = 0):
    """``layer`` with random values in every parameter it has (PyTorch's initial ones and zeros would
    hide a wrong Jacobian)."""
    rng = np.random.default_rng(seed)
    for name in getattr(layer, "parameter_names", ()):
        value = getattr(layer, name)
        if value is not None:
            setattr(layer, name, rng.uniform(-1.5, 1.5, value.shape).astype(value.dtype))
    return layer


CASES = {  # id: (layer factory of the dtype, per-sample input shape, its spec entry)
    "hardswish": (lambda d: Hardswish(), PLANE, {"type": "hardswish"}),
    "hardsigmoid": (lambda d: Hardsigmoid(), PLANE, {"type": "hardsigmoid"}),
    "mish": (lambda d: Mish(), PLANE, {"type": "mish"}),
    "layer-norm": (lambda d: randomized(LayerNorm((4, 5), dtype=d)), PLANE,
                   {"type": "layer_norm", "normalized_shape": [4, 5]}),
    "layer-norm-last": (lambda d: randomized(LayerNorm(5, eps=1e-3, bias=False, dtype=d)), PLANE,
                        {"type": "layer_norm", "normalized_shape": 5, "eps": 1e-3, "bias": False}),
    "layer-norm-plain": (lambda d: LayerNorm(PLANE, elementwise_affine=False, dtype=d), PLANE,
                         {"type": "layer_norm", "normalized_shape": list(PLANE),
                          "elementwise_affine": False}),
    "layer-norm-channels": (lambda d: randomized(LayerNorm(3, 1e-6, data_format="channels_first", dtype=d)),
                            PLANE, {"type": "layer_norm", "normalized_shape": 3, "eps": 1e-6,
                                    "data_format": "channels_first"}),
    "layer-scale": (lambda d: randomized(LayerScale(3, dtype=d)), PLANE, {"type": "layer_scale"}),
    "upsample-nearest": (lambda d: Upsample(scale_factor=2), PLANE, {"type": "upsample", "scale_factor": 2}),
    "upsample-nearest-size": (lambda d: Upsample(size=[7, 3]), PLANE, {"type": "upsample", "size": [7, 3]}),
    "upsample-nearest-exact": (lambda d: Upsample(scale_factor=1.7, mode="nearest-exact",
                                                  recompute_scale_factor=True), PLANE,
                               {"type": "upsample", "scale_factor": 1.7, "mode": "nearest-exact",
                                "recompute_scale_factor": True}),
    "upsample-bilinear": (lambda d: Upsample(scale_factor=(1.5, 2.0), mode="bilinear"), PLANE,
                          {"type": "upsample", "scale_factor": [1.5, 2.0], "mode": "bilinear"}),
    "upsample-bilinear-corners": (lambda d: Upsample(size=[6, 9], mode="bilinear", align_corners=True), PLANE,
                                  {"type": "upsample", "size": [6, 9], "mode": "bilinear",
                                   "align_corners": True}),
    "stochastic-depth": (lambda d: StochasticDepth(0.3, "row").eval(), PLANE,
                         {"type": "stochastic_depth", "p": 0.3, "mode": "row"}),
    "stochastic-depth-batch": (lambda d: StochasticDepth(0.3, "batch").eval(), PLANE,
                               {"type": "stochastic_depth", "p": 0.3, "mode": "batch"}),
    "drop-path": (lambda d: DropPath(0.2).eval(), PLANE, {"type": "drop_path", "drop_prob": 0.2}),
}
"""Layers with a mode are in eval mode here (a spec's default); their training mode has tests of its own."""
KINKS = {"hardswish": (-3.0, 3.0), "hardsigmoid": (-3.0, 3.0)}
"""Where a layer's derivative jumps: finite differences stay away from them."""


def make_input(case: str, batch: int = 3, dtype=np.float64, seed: int = 0) -> np.ndarray:
    """A batch of the case's shape, its values spread over the kinks but not within 1e-3 of one."""
    _, shape, _ = CASES[case]
    x = 2.5 * np.random.default_rng(seed).standard_normal((batch,) + shape)
    for kink in KINKS.get(case, ()):
        x = np.where(np.abs(x - kink) < 1e-3, kink + 0.5, x)
    return x.astype(dtype)


def make_layer(case: str, dtype=np.float64):
    factory, _, _ = CASES[case]
    return factory(dtype)


def twin(layer, dtype=np.float64):
    """The PyTorch module computing what ``layer`` computes."""
    torch = pytest.importorskip("torch")
    return torch_mirror(layer, getattr(torch, np.dtype(dtype).name))


def autograd(module, x: np.ndarray, grad: np.ndarray):
    """Output, input gradient and parameter gradients of ``module`` by autograd."""
    torch = pytest.importorskip("torch")
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    y = module(tx)
    y.backward(torch.from_numpy(grad).reshape(y.shape))
    return (y.detach().numpy(), tx.grad.numpy(),
            {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None})


# --- the layer against the oracles ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_pytorch(case, dtype):
    layer = make_layer(case, dtype)
    x = make_input(case, dtype=dtype)
    y = layer.forward(x)
    expected, _, _ = autograd(twin(layer, dtype), x, np.zeros_like(y))
    assert y.dtype == dtype and y.shape == (x.shape[0],) + layer.output_shape(x.shape[1:])
    tolerance = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(y, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


@pytest.mark.parametrize("case", list(CASES))
def test_jt_equals_finite_differences_and_autograd(case):
    layer = make_layer(case)
    x = make_input(case, batch=2)
    jt = layer.transposed_jacobian(x)
    dense = jt.todense()
    assert jt.shape == (math.prod(x.shape[1:]), math.prod(layer.output_shape(x.shape[1:])))
    assert jt.data.shape == ((jt.nnz,) if layer.sample_independent else (2, jt.nnz))
    module = twin(layer)
    for b in range(2):
        matrix = dense if layer.sample_independent else dense[b]
        np.testing.assert_allclose(matrix, finite_difference_jt(layer.forward, x[b]), atol=1e-7)
        np.testing.assert_allclose(matrix, torch_jt(module, x[b]), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("case", list(CASES))
def test_pattern_is_canonical_and_counted_without_building_it(case):
    layer = make_layer(case)
    _, shape, _ = CASES[case]
    pattern = layer.pattern(shape)
    assert layer.pattern_nnz(shape) == pattern.nnz
    indptr, indices = np.asarray(pattern.indptr), np.asarray(pattern.indices)
    assert indptr[0] == 0 and indptr[-1] == indices.size and np.all(np.diff(indptr) >= 0)
    rows = np.repeat(np.arange(pattern.shape[0]), np.diff(indptr))
    assert np.all((np.diff(indices) > 0) | (np.diff(rows) > 0))  # sorted, no duplicate, in each row
    assert indices.min(initial=0) >= 0 and indices.max(initial=0) < pattern.shape[1]
    wide = layer.pattern(shape, index_dtype=np.int64)  # int64 indices on request, the same entries
    assert wide.index_dtype == np.int64 and pattern.index_dtype == np.int32
    np.testing.assert_array_equal(wide.indptr, indptr)
    np.testing.assert_array_equal(wide.indices, indices)


def conv_chain(case: str, dtype=np.float64) -> Sequential:
    """``conv -> layer -> conv``: the layer between two general JTs, so the scans multiply it."""
    layer = make_layer(case, dtype)
    _, shape, _ = CASES[case]
    out_shape = layer.output_shape(shape)
    first = Conv2d(shape[0], shape[0], 3, padding=1, dtype=dtype, rng=1)
    last = Conv2d(out_shape[0], 2, 3, padding=1, dtype=dtype, rng=2)
    layer.name = "layer"
    return Sequential(first, layer, last, input_shape=shape)


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 1)])
@pytest.mark.parametrize("case", list(CASES))
def test_a_chains_scan_equals_autograd(case, method, levels):
    torch = pytest.importorskip("torch")
    model = conv_chain(case)
    x = make_input(case)
    y = model.forward(x)
    grad = np.random.default_rng(5).standard_normal(y.shape)
    grads = model.backward(grad, method, levels)
    net = torch.nn.Sequential()
    for layer in model.layers:
        net.add_module(layer.name, twin(layer))
    out, dx, parameters = autograd(net, x, grad)
    np.testing.assert_allclose(y, out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads[0], dx, rtol=1e-10, atol=1e-12 * np.abs(dx).max())
    ours = model.parameter_gradients(grads)
    assert sorted(ours) == sorted(parameters)
    for name, value in ours.items():
        scale = max(1.0, float(np.abs(parameters[name]).max()))  # some sum to 0 (a bias before a norm)
        np.testing.assert_allclose(value, parameters[name], rtol=1e-10, atol=1e-12 * scale)


@pytest.mark.parametrize("case", list(CASES))
def test_flops_count_the_layer(case):
    model = conv_chain(case)
    report = flops.analyse(model, "blelloch")
    sizes = model.jacobian_sizes()
    assert [row["nnz"] for row in report["layers"]] == [size.nnz for size in sizes]
    assert report["totals"]["bp_flops"] == sum(2 * size.nnz for size in sizes)
    figures = flops.live(model, make_input(case, batch=2), "blelloch")
    critical = figures["totals"]["critical_flops"]
    assert critical["static"] == report["totals"]["critical_flops"]
    assert critical["live"]["max"] <= critical["static"]
    assert figures["bp"][1]["static"] == 2 * sizes[1].nnz


@pytest.mark.parametrize("case", list(CASES))
def test_a_spec_entry_builds_the_layer(case):
    _, shape, entry = CASES[case]
    model = model_from_spec({"input_shape": list(shape), "init": {"seed": 0},
                             "layers": [{"name": "layer", **entry}]}, dtype=np.float64)
    layer, expected = model.layers[0], make_layer(case)
    assert type(layer) is type(expected) and repr(layer) == repr(expected)
    model.load_state_dict({f"layer.{name}": getattr(expected, name)
                           for name in getattr(expected, "parameter_names", ())
                           if getattr(expected, name) is not None})
    assert not layer.training  # a spec model loads in eval mode
    x = make_input(case)
    np.testing.assert_array_equal(model.forward(x), expected.eval().forward(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_gives_the_hosts_results(be, case, dtype):
    host, device = make_layer(case, dtype), make_layer(case, dtype)
    x = make_input(case, dtype=dtype)
    tolerance = 1e-6 if dtype == np.float32 else 1e-13
    y = host.forward(x)
    np.testing.assert_allclose(be.to_host(device.forward(be.asarray(x))), y, rtol=tolerance, atol=tolerance)
    want, got = host.transposed_jacobian(x), device.transposed_jacobian(be.asarray(x))
    assert backend.of(got.data).name == be.name and got.dtype == dtype
    assert got.pattern.same_as(want.pattern) and got.shared == want.shared
    np.testing.assert_allclose(be.to_host(got.data), want.data, rtol=tolerance, atol=tolerance)
    if hasattr(host, "parameter_gradients"):
        grad = np.random.default_rng(6).standard_normal(y.shape).astype(dtype)
        for name, value in host.parameter_gradients(x, grad).items():
            ours = device.parameter_gradients(be.asarray(x), be.asarray(grad))[name]
            np.testing.assert_allclose(be.to_host(ours), value, rtol=tolerance, atol=tolerance)


# --- the activations --------------------------------------------------------------------------------
@pytest.mark.parametrize("case, derivatives", [
    ("hardswish", {-3.0: 0.0, 3.0: 1.0, -3.5: 0.0, 0.0: 0.5, 1.5: 1.0, -1.5: 0.0, 4.0: 1.0}),
    ("hardsigmoid", {-3.0: 0.0, 3.0: 0.0, 0.0: 1 / 6, 2.9: 1 / 6, -2.9: 1 / 6, 3.1: 0.0}),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_derivatives_at_and_between_the_kinks_are_pytorchs(case, derivatives, dtype):
    """Hardswish: 0 at -3 and 1 at 3; Hardsigmoid: 0 at both; between, PyTorch's float32 1/6 in both
    dtypes (Hardsigmoid) — checked against autograd at each point."""
    layer = make_layer(case, dtype)
    x = np.array([list(derivatives)], dtype=dtype)
    values = layer.transposed_jacobian(x).data[0]
    np.testing.assert_allclose(values, list(derivatives.values()), rtol=1e-6)
    _, expected, _ = autograd(twin(layer, dtype), x, np.ones_like(x))
    np.testing.assert_array_equal(values, expected[0])


def test_activations_are_diagonal_per_sample():
    for case in ("hardswish", "hardsigmoid", "mish"):
        layer = make_layer(case)
        assert layer.jacobian_kind == "diagonal" and not layer.sample_independent
        assert repr(layer) == f"{type(layer).__name__}()"


# --- layer normalisation and layer scale ---------------------------------------------------------
def test_layer_norm_over_channels_is_the_permuted_last_dimension_norm():
    """channels_first equals moving the channels last, normalising them, moving them back."""
    channels = randomized(LayerNorm(3, data_format="channels_first", dtype=np.float64))
    last = LayerNorm(3, data_format="channels_last", dtype=np.float64)
    last.weight, last.bias = channels.weight, channels.bias
    x = make_input("layer-norm-channels")
    expected = np.moveaxis(last.forward(np.moveaxis(x, 1, -1)), -1, 1)
    np.testing.assert_allclose(channels.forward(x), expected, rtol=1e-14, atol=1e-14)
    grad = np.random.default_rng(1).standard_normal(x.shape)
    ours = channels.parameter_gradients(x, grad)
    theirs = last.parameter_gradients(np.moveaxis(x, 1, -1), np.moveaxis(grad, 1, -1))
    for name in ("weight", "bias"):
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-13)
    # a dense C x C block per pixel: row (c, p) reads the columns (c', p) of every c'
    pattern = channels.pattern(PLANE)
    row = 2 * 20 + 7  # channel 2, pixel 7
    np.testing.assert_array_equal(pattern.indices[pattern.indptr[row]:pattern.indptr[row + 1]], [7, 27, 47])


@pytest.mark.parametrize("case", ["layer-norm", "layer-norm-last", "layer-norm-channels", "layer-scale"])
def test_parameter_gradients_equal_finite_differences(case):
    """Along a random direction of each parameter, the central difference of ``L = sum(g * y)``."""
    layer = make_layer(case)
    x = make_input(case)
    grad = np.random.default_rng(2).standard_normal(layer.forward(x).shape)
    rng = np.random.default_rng(3)
    for name, value in layer.parameter_gradients(x, grad).items():
        original = getattr(layer, name)
        direction, eps = rng.standard_normal(original.shape), 1e-6

        def loss(step, name=name, original=original, direction=direction):
            setattr(layer, name, original + step * direction)
            return float(np.sum(grad * layer.forward(x)))

        numeric = (loss(eps) - loss(-eps)) / (2 * eps)
        setattr(layer, name, original)
        assert value.shape == original.shape
        assert float(np.sum(value * direction)) == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_layer_norm_state_and_repr_are_pytorchs():
    torch = pytest.importorskip("torch")
    for args, kwargs in (((5,), {}), (((4, 5),), {"eps": 1e-6}), ((5,), {"elementwise_affine": False}),
                         ((5,), {"bias": False})):
        layer, module = LayerNorm(*args, **kwargs), torch.nn.LayerNorm(*args, **kwargs)
        assert repr(layer) == repr(module)
        state = {name: value.numpy() for name, value in module.state_dict().items()}
        ours = {name: getattr(layer, name) for name in layer.parameter_names
                if getattr(layer, name) is not None}
        assert sorted(ours) == sorted(state)
        for name, value in state.items():
            np.testing.assert_array_equal(ours[name], value)
            assert ours[name].dtype == np.float32
    assert repr(LayerNorm(3, data_format="channels_first")) == (
        "LayerNorm((3,), eps=1e-05, elementwise_affine=True, bias=True, data_format='channels_first')")
    assert repr(LayerScale(4)) == "LayerScale(4, init_values=1e-05)"
    np.testing.assert_array_equal(LayerScale(2, 1e-6).gamma, np.full((2, 1, 1), 1e-6, np.float32))


@pytest.mark.parametrize("build, field", [
    (lambda: LayerNorm(0), "normalized_shape"),
    (lambda: LayerNorm([]), "normalized_shape"),
    (lambda: LayerNorm("3"), "normalized_shape"),
    (lambda: LayerNorm((3, 2.0)), "normalized_shape"),
    (lambda: LayerNorm(3, eps=-1e-5), "eps"),
    (lambda: LayerNorm(3, eps=float("nan")), "eps"),
    (lambda: LayerNorm(3, elementwise_affine="yes"), "elementwise_affine"),
    (lambda: LayerNorm(3, bias=1), "bias"),
    (lambda: LayerNorm(3, data_format="nchw"), "data_format"),
    (lambda: LayerNorm((3, 4), data_format="channels_first"), "normalized_shape"),
    (lambda: LayerNorm(3, dtype=np.int32), "dtype"),
    (lambda: LayerNorm(3)(np.zeros((2, 4, 4), np.float32)), "input"),
    (lambda: LayerNorm(3, data_format="channels_first")(np.zeros((2, 4, 3), np.float32)), "input"),
    (lambda: LayerNorm(3)(np.zeros((2, 3), np.float64)), "input"),
    (lambda: LayerNorm((2, 3)).pattern((3,)), "input"),
    (lambda: setattr(LayerNorm(3), "weight", np.ones(4, np.float32)), "weight"),
    (lambda: setattr(LayerNorm(3), "bias", np.ones(3, np.float64)), "bias"),
    (lambda: setattr(LayerNorm(3, bias=False), "bias", np.ones(3, np.float32)), "bias"),
    (lambda: setattr(LayerNorm(3, elementwise_affine=False), "weight", np.ones(3, np.float32)), "weight"),
    (lambda: LayerScale(0), "dim"),
    (lambda: LayerScale(2, init_values=float("inf")), "init_values"),
    (lambda: LayerScale(2)(np.zeros((1, 3, 2, 2), np.float32)), "input"),
    (lambda: LayerScale(2)(np.zeros((1, 2, 4), np.float32)), "input"),
    (lambda: setattr(LayerScale(2), "gamma", np.ones(2, np.float32)), "gamma"),
])
def test_bad_arguments_name_the_layer_and_the_field(build, field):
    with pytest.raises(ValueError, match=rf"layer \w+: {field}:"):
        build()


def test_a_convnext_block_equals_torchvisions_for_every_schedule():
    """ConvNeXt's CNBlock (eval mode): a depthwise 7x7 conv, the channels-last LayerNorm between two
    permutes, two Linear layers around a GELU (1x1 convolutions here), the layer scale, plus the
    input: as torchvision writes it, against a Residual of our layers."""
    torch = pytest.importorskip("torch")
    dim, shape = 4, (4, 6, 6)
    f64 = {"dtype": np.float64}
    layers = [Conv2d(dim, dim, 7, padding=3, groups=dim, rng=1, **f64),
              randomized(LayerNorm(dim, 1e-6, data_format="channels_first", **f64), 2),
              Conv2d(dim, 4 * dim, 1, rng=3, **f64), GELU(), Conv2d(4 * dim, dim, 1, rng=4, **f64),
              randomized(LayerScale(dim, 1e-6, **f64), 5)]
    model = Sequential(Residual(*layers), input_shape=shape)

    class CNBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dwconv = torch.nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = torch.nn.LayerNorm(dim, eps=1e-6)
            self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
            self.layer_scale = torch.nn.Parameter(torch.ones(dim, 1, 1))

        def forward(self, x):
            y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
            y = self.fc2(torch.nn.functional.gelu(self.fc1(y))).permute(0, 3, 1, 2)
            return self.layer_scale * y + x

    net = CNBlock().double()
    with torch.no_grad():
        for module, layer in ((net.dwconv, layers[0]), (net.norm, layers[1]), (net.fc1, layers[2]),
                              (net.fc2, layers[4])):
            module.weight.copy_(torch.from_numpy(layer.weight.reshape(module.weight.shape)))
            module.bias.copy_(torch.from_numpy(layer.bias))
        net.layer_scale.copy_(torch.from_numpy(layers[5].gamma))
    x = np.random.default_rng(6).standard_normal((2,) + shape)
    y = model.forward(x)
    grad = np.random.default_rng(7).standard_normal(y.shape)
    out, dx, parameters = autograd(net, x, grad)
    np.testing.assert_allclose(y, out, rtol=1e-10, atol=1e-12)
    names = {"0.0": "dwconv", "0.1": "norm", "0.2": "fc1", "0.4": "fc2"}
    for method in ("linear", "blelloch"):
        grads = model.backward(grad, method)
        np.testing.assert_allclose(grads[0], dx, rtol=1e-10, atol=1e-12)
        ours = model.parameter_gradients(grads)
        assert len(ours) == len(parameters)
        for key, value in ours.items():
            path, _, parameter = key.rpartition(".")
            theirs = parameters["layer_scale" if parameter == "gamma" else f"{names[path]}.{parameter}"]
            np.testing.assert_allclose(value.reshape(theirs.shape), theirs, rtol=1e-10, atol=1e-12)


# --- upsampling -------------------------------------------------------------------------------------
def upsample_configurations() -> list[tuple[dict, tuple[int, int, int]]]:
    """Arguments and per-sample shapes across the modes, sizes and scale factors (some not exact in
    binary), both of PyTorch's nearest kernels (outputs up to 128 pixels wide and tall together, and a
    1x1 input of 4 channels; larger outputs) and recomputed scales."""
    configurations = []
    for mode, align in (("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bilinear", True)):
        common = {"mode": mode, "align_corners": align}
        for height in (1, 2, 3, 5, 7):
            for out in (1, 2, 4, 6, 9, 13, 29, 97, 130):
                configurations.append(({"size": (out, 2 + out % 5), **common}, (2, height, 3)))
            for scale in (0.5, 0.7, 1.0, 1.7, 2.0, 3.3, 13.7):
                for recompute in (None, True) if height * scale >= 1 else ():
                    configurations.append(({"scale_factor": (scale, 1.3), "recompute_scale_factor": recompute,
                                            **common}, (2, height, 5)))
        configurations.append(({"scale_factor": 2.5, **common}, (4, 1, 1)))
        configurations.append(({"size": (70, 90), **common}, (1, 6, 7)))
    return configurations


@pytest.mark.parametrize("dtype", DTYPES)
def test_upsample_takes_pytorchs_indices_and_weights(dtype):
    """Nearest outputs equal PyTorch's exactly (the same source pixels), bilinear ones to rounding, over
    :func:`upsample_configurations`, in float32 and float64 (whose indices PyTorch computes in each
    dtype)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for kwargs, shape in upsample_configurations():
        x = rng.standard_normal((1,) + shape).astype(dtype)
        layer = Upsample(**kwargs)
        expected = torch.nn.Upsample(**kwargs)(torch.from_numpy(x)).numpy()
        got = layer.forward(x)
        assert got.shape == expected.shape == (1,) + layer.output_shape(shape), (kwargs, shape)
        if kwargs["mode"] == "bilinear":
            tolerance = 1e-6 if dtype == np.float32 else 1e-14
            np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=str(kwargs))
        else:
            np.testing.assert_array_equal(got, expected, err_msg=str(kwargs))


@pytest.mark.parametrize("index", range(0, 260, 13))
def test_upsample_jt_equals_autograd_and_its_entries_count(index):
    """JT (float64) equals autograd's Jacobian, its pattern holds no more than the forward's weights
    (two per axis and output at most), and ``pattern_nnz`` counts it."""
    configurations = upsample_configurations()
    kwargs, shape = configurations[index % len(configurations)]
    layer = Upsample(**kwargs)
    x = np.random.default_rng(index).standard_normal((1,) + shape)
    jt = layer.transposed_jacobian(x)
    out_shape = layer.output_shape(shape)
    per_output = 4 if kwargs["mode"] == "bilinear" else 1
    assert jt.shared and layer.pattern_nnz(shape) == jt.nnz <= per_output * math.prod(out_shape)
    np.testing.assert_allclose(jt.todense(), torch_jt(twin(layer), x[0]), rtol=1e-13, atol=1e-15)
    # each output's weights sum to 1: an upsampling moves values, it does not scale them
    np.testing.assert_allclose(jt.todense().sum(axis=0), 1.0, rtol=1e-14)


def test_upsample_attributes_and_repr_are_pytorchs():
    torch = pytest.importorskip("torch")
    for kwargs in ({"scale_factor": 2}, {"size": 5}, {"size": [3, 4], "mode": "bilinear"},
                   {"scale_factor": (1.5, 2), "mode": "bilinear", "align_corners": True},
                   {"scale_factor": 0.5, "mode": "nearest-exact", "recompute_scale_factor": True}):
        layer, module = Upsample(**kwargs), torch.nn.Upsample(**kwargs)
        assert repr(layer) == repr(module)
        for name in ("size", "scale_factor", "mode"):
            assert getattr(layer, name) == getattr(module, name), name
    assert Upsample(size=3, mode="bilinear").align_corners is False
    assert Upsample(size=3).align_corners is None


@pytest.mark.parametrize("build, field", [
    (lambda: Upsample(), "size"),
    (lambda: Upsample(size=2, scale_factor=2), "size"),
    (lambda: Upsample(scale_factor=2, mode="bicubic"), "mode"),
    (lambda: Upsample(scale_factor=2, align_corners=True), "align_corners"),
    (lambda: Upsample(scale_factor=2, mode="bilinear", align_corners="yes"), "align_corners"),
    (lambda: Upsample(size=2, recompute_scale_factor=True), "recompute_scale_factor"),
    (lambda: Upsample(scale_factor=2, recompute_scale_factor=1), "recompute_scale_factor"),
    (lambda: Upsample(size=0), "size"),
    (lambda: Upsample(size=(2, 3, 4)), "size"),
    (lambda: Upsample(size=2.0), "size"),
    (lambda: Upsample(scale_factor=-1), "scale_factor"),
    (lambda: Upsample(scale_factor=float("nan")), "scale_factor"),
    (lambda: Upsample(scale_factor=True), "scale_factor"),
    (lambda: Upsample(scale_factor=0.1).output_shape((1, 4, 4)), "input"),
    (lambda: Upsample(scale_factor=2)(np.zeros((1, 4, 4), np.float32)), "input"),
])
def test_upsample_bad_arguments_name_the_field(build, field):
    with pytest.raises(ValueError, match=rf"layer Upsample: {field}:"):
        build()


def test_upsample_one_pattern_serves_both_dtypes():
    layer = Upsample(scale_factor=1.3, mode="bilinear")
    x = np.random.default_rng(0).standard_normal((2, 2, 7, 5))
    single, double = layer.transposed_jacobian(x.astype(np.float32)), layer.transposed_jacobian(x)
    assert single.pattern is double.pattern and single.dtype == np.float32 and double.dtype == np.float64
    np.testing.assert_allclose(single.data, double.data, atol=1e-6)  # scales rounded to float32
    assert layer.transposed_jacobian(x).data is double.data  # computed once per dtype


# --- stochastic depth and drop path --------------------------------------------------------------
def sample_drop(kind: str, p: float, rng=0):
    return (DropPath(p, rng=rng) if kind == "drop-path" else StochasticDepth(p, kind, rng=rng))


@pytest.mark.parametrize("kind", ["row", "batch", "drop-path"])
def test_masks_drop_whole_samples_or_the_batch(kind):
    layer = sample_drop(kind, 0.3, rng=1)
    x = np.ones((400, 2, 3))
    kept = []
    for _ in range(3):
        y = layer.forward(x)
        assert set(np.unique(y).tolist()) <= {0.0, 1 / 0.7}
        rows = y.reshape(400, -1)
        assert (rows == rows[:, :1]).all()  # a sample is kept or dropped whole
        if kind == "batch":
            assert (rows == rows[0, 0]).all()  # ... and the batch as one
        kept.append(rows[:, 0] != 0)
        jt = layer.transposed_jacobian(x)
        assert jt.shared == (kind == "batch")
        np.testing.assert_array_equal(np.broadcast_to(jt.data, rows.shape), rows)  # JT: the mask
    if kind != "batch":
        share = np.mean(kept)
        assert abs(share - 0.7) < 4 * math.sqrt(0.21 / (3 * 400))  # 4 sigma
        assert not np.array_equal(kept[0], kept[1])  # a new mask per forward
    same = sample_drop(kind, 0.3, rng=1)
    assert np.array_equal(same.forward(x) != 0, kept[0][:, None, None] * np.ones_like(x, bool))


@pytest.mark.parametrize("kind", ["row", "batch", "drop-path"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scaling_is_pytorchs_and_the_jt_the_forwards(kind, dtype):
    """Kept samples are multiplied by ``1 / (1 - p)`` as torchvision's ``noise.div_(survival_rate)``
    makes it in the dtype; JT equals finite differences and autograd of the forward that drew it."""
    torch = pytest.importorskip("torch")
    layer = sample_drop(kind, 0.3, rng=2)
    x = make_input("stochastic-depth", batch=6, dtype=dtype)
    y = layer.forward(x)
    scale = torch.ones(1, dtype=getattr(torch, np.dtype(dtype).name)).div_(1.0 - 0.3).numpy()[0]
    jt = layer.transposed_jacobian(x)
    factor = np.broadcast_to(jt.data, (6, jt.nnz)).reshape(x.shape)
    assert set(np.unique(factor).tolist()) <= {0.0, float(scale)} and jt.dtype == dtype
    np.testing.assert_array_equal(y, x * factor)
    for b in range(2):
        dense = jt.todense() if jt.shared else jt.todense()[b]
        sample = factor[b:b + 1].astype(np.float64)
        np.testing.assert_allclose(dense, finite_difference_jt(lambda v, m=sample: v * m, x[b]), atol=1e-6)
        np.testing.assert_array_equal(dense, torch_jt(masked(sample), x[b].astype(np.float64)))


@pytest.mark.parametrize("kind", ["row", "batch", "drop-path"])
@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_a_training_chain_backpropagates_the_mask(kind, method):
    """``conv -> drop -> conv`` in training mode against autograd through the same mask; the mask of
    the last forward, a new one after the next forward."""
    torch = pytest.importorskip("torch")
    f64 = {"dtype": np.float64}
    model = Sequential(Conv2d(3, 3, 3, padding=1, rng=1, **f64), sample_drop(kind, 0.5, rng=3),
                       Conv2d(3, 2, 3, padding=1, rng=2, **f64), input_shape=PLANE)
    x = make_input("stochastic-depth", batch=5)
    y = model.forward(x)
    grad = np.random.default_rng(4).standard_normal(y.shape)
    data = model.transposed_jacobians()[1].data
    factor = np.array(np.broadcast_to(data, (5, data.shape[-1]))).reshape(x.shape)
    net = torch.nn.Sequential(twin(model.layers[0]), masked(factor), twin(model.layers[2]))
    out, dx, parameters = autograd(net, x, grad)
    np.testing.assert_allclose(y, out, rtol=1e-12, atol=1e-12)
    grads = model.backward(grad, method)
    np.testing.assert_allclose(grads[0], dx, rtol=1e-10, atol=1e-12)
    ours = model.parameter_gradients(grads)
    assert sorted(ours) == sorted(parameters)
    for name, value in ours.items():
        np.testing.assert_allclose(value, parameters[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["row", "batch", "drop-path"])
def test_identity_in_eval_mode_and_at_p_0_masks_at_p_1(kind):
    x = make_input("stochastic-depth", batch=4)
    for layer in (sample_drop(kind, 0.4).eval(), sample_drop(kind, 0.0)):
        np.testing.assert_array_equal(layer.forward(x), x)
        ones = np.ones(x[0].size) if layer.sample_independent else np.ones((4, x[0].size))
        np.testing.assert_array_equal(layer.transposed_jacobian(x).data, ones)
    dropped = sample_drop(kind, 1.0)
    x[0, 0, 0, 0] = np.inf
    with np.errstate(invalid="ignore"):
        y = dropped.forward(x)
    assert np.isnan(y[0, 0, 0, 0]) and (y.ravel()[1:] == 0).all()  # inf * 0, as PyTorch multiplies
    assert not dropped.transposed_jacobian(x).data.any()


def test_the_same_seed_gives_the_same_masks_on_the_gpu(be):
    x = make_input("stochastic-depth", batch=64)
    for kind in ("row", "batch", "drop-path"):
        host, device = sample_drop(kind, 0.5, rng=7), sample_drop(kind, 0.5, rng=7)
        for _ in range(2):
            np.testing.assert_array_equal(be.to_host(device.forward(be.asarray(x))), host.forward(x))
            want, got = host.transposed_jacobian(x), device.transposed_jacobian(be.asarray(x))
            assert backend.of(got.data).name == be.name
            np.testing.assert_array_equal(be.to_host(got.data), want.data)


def test_modes_reprs_and_bad_arguments():
    layer = StochasticDepth(0.2, "row")
    assert layer.training and repr(layer) == "StochasticDepth(p=0.2, mode=row)"
    assert repr(DropPath()) == "DropPath(drop_prob=0.000)"
    assert repr(DropPath(0.1234)) == "DropPath(drop_prob=0.123)"
    x = make_input("stochastic-depth")
    with pytest.raises(ValueError, match=r"layer StochasticDepth: input: no mask.*forward\(x\) first"):
        layer.transposed_jacobian(x)
    layer.forward(x)
    with pytest.raises(ValueError, match=r"StochasticDepth: input: batch of 2 samples, the last .* had 3"):
        layer.transposed_jacobian(x[:2])
    layer.eval()
    layer.train()
    with pytest.raises(ValueError, match="no mask"):  # a mode change forgets the mask
        layer.transposed_jacobian(x)
    for build, field in [(lambda: StochasticDepth(-0.1, "row"), "p"),
                         (lambda: StochasticDepth(1.5, "row"), "p"),
                         (lambda: StochasticDepth(float("nan"), "row"), "p"),
                         (lambda: StochasticDepth(0.1, "column"), "mode"),
                         (lambda: DropPath(2.0), "drop_prob"),
                         (lambda: DropPath(0.1, scale_by_keep="yes"), "scale_by_keep"),
                         (lambda: DropPath(0.1, training=1), "training")]:
        with pytest.raises(ValueError, match=rf"layer \w+: {field}:"):
            build()


def test_a_spec_in_training_mode_draws_seeded_masks():
    spec = {"input_shape": list(PLANE), "init": {"seed": 3},
            "layers": [{"name": "drop", "type": "stochastic_depth", "p": 0.5, "mode": "row",
                        "training": True}]}
    x = np.ones((16,) + PLANE, np.float32)
    first, again = (model_from_spec(spec).forward(x) for _ in range(2))
    np.testing.assert_array_equal(first, again)  # the spec's seed, the same masks
    assert set(np.unique(first).tolist()) == {0.0, 2.0}
