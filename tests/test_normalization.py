"""BatchNorm2d with frozen statistics: forward, diagonal JT and parameter gradients against float64
finite differences and PyTorch (eval mode) on random configurations; training mode refused; CPU/GPU.

The new layers inside Sequential: BatchNorm2d, Dropout and AdaptiveAvgPool2d in one chain, every
schedule (linear, blelloch, hybrid at every depth) equal, and every activation and parameter gradient
equal to PyTorch autograd.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from oracles import finite_difference_jt, torch_jt

from sparse_scan import Sequential
from sparse_scan.engine.schedule import depth
from sparse_scan.layers import (
    AdaptiveAvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    ReLU,
    Tanh,
)
from sparse_scan.optim import SGD


def random_configs(count: int, seed: int) -> list[tuple[dict, tuple[int, int, int]]]:
    """Seeded random (kwargs, (C, H, W)): eps from 1e-5 to 0.5, with and without affine."""
    rng = np.random.default_rng(seed)
    configs = [(dict(num_features=3), (3, 4, 5)), (dict(num_features=1, affine=False), (1, 1, 1)),
               (dict(num_features=2, bias=False), (2, 3, 2))]
    while len(configs) < count:
        channels = int(rng.integers(1, 6))
        kwargs = dict(num_features=channels, eps=float(10 ** rng.uniform(-5, math.log10(0.5))),
                      affine=bool(rng.integers(4) > 0))
        if rng.integers(2):
            kwargs["momentum"] = float(rng.uniform(0, 1))
        if kwargs["affine"] and rng.integers(4) == 0:
            kwargs["bias"] = False
        configs.append((kwargs, (channels, int(rng.integers(1, 6)), int(rng.integers(1, 6)))))
    return configs


CASES = random_configs(20, seed=3)
KINDS = {(True, True): "affine", (True, False): "scale", (False, True): "plain", (False, False): "plain"}
IDS = [f"{i}-c{kw['num_features']}-{KINDS[kw.get('affine', True), kw.get('bias', True)]}-"
       f"{'x'.join(map(str, shape))}" for i, (kw, shape) in enumerate(CASES)]


def make_layer(kwargs: dict, dtype=np.float64, seed: int = 0) -> BatchNorm2d:
    """A frozen layer with random statistics (and affine parameters)."""
    layer = BatchNorm2d(**kwargs, dtype=dtype, training=False)
    rng = np.random.default_rng(seed)
    shape = (layer.num_features,)
    layer.running_mean = rng.standard_normal(shape).astype(dtype)
    layer.running_var = rng.uniform(0.05, 3.0, shape).astype(dtype)
    if layer.affine:
        layer.weight = rng.uniform(-2, 2, shape).astype(dtype)
    if layer.bias is not None:
        layer.bias = rng.standard_normal(shape).astype(dtype)
    return layer


def torch_batchnorm(layer: BatchNorm2d):
    """PyTorch's module in eval mode with the layer's state (the dtype of the layer's parameters)."""
    torch = pytest.importorskip("torch")
    no_bias = {"bias": False} if layer.affine and layer.bias is None else {}  # (a newer PyTorch's)
    module = torch.nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum,
                                  affine=layer.affine, dtype=getattr(torch, layer.dtype.name), **no_bias)
    state = {name: torch.from_numpy(getattr(layer, name).copy()) for name in layer.parameter_names
             if getattr(layer, name) is not None}
    module.load_state_dict(state, strict=False)
    return module.eval()


def make_input(shape, batch=2, dtype=np.float64, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype(dtype)


# --- the layer against the oracles ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, shape", CASES, ids=IDS)
def test_forward_matches_torch_eval(kwargs, shape):
    torch = pytest.importorskip("torch")
    for dtype, tolerance in ((np.float64, 1e-13), (np.float32, 1e-6)):
        layer = make_layer(kwargs, dtype)
        x = make_input(shape, batch=3, dtype=dtype)
        with torch.no_grad():
            expected = torch_batchnorm(layer)(torch.from_numpy(x)).numpy()
        got = layer(x)
        assert got.dtype == dtype and got.shape == x.shape
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kwargs, shape", CASES, ids=IDS)
def test_jt_is_a_shared_per_channel_diagonal_equal_to_finite_differences(kwargs, shape):
    layer = make_layer(kwargs)
    x = make_input(shape)
    jt = layer.transposed_jacobian(x)
    assert layer.jacobian_kind == "diagonal" and layer.sample_independent
    assert jt.shared and jt.data.shape == (math.prod(shape),) and jt.shape == (jt.nnz, jt.nnz)
    np.testing.assert_array_equal(jt.indices, np.arange(jt.nnz))
    for b in range(x.shape[0]):
        np.testing.assert_allclose(jt.todense(), finite_difference_jt(layer.forward, x[b]), atol=1e-8)


@pytest.mark.parametrize("kwargs, shape", CASES, ids=IDS)
def test_jt_matches_torch_autograd(kwargs, shape):
    pytest.importorskip("torch")
    layer = make_layer(kwargs)
    x = make_input(shape)
    dense = layer.transposed_jacobian(x).todense()
    for b in range(x.shape[0]):
        np.testing.assert_allclose(dense, torch_jt(torch_batchnorm(layer), x[b]), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kwargs, shape", CASES, ids=IDS)
def test_parameter_gradients_match_torch_and_finite_differences(kwargs, shape):
    torch = pytest.importorskip("torch")
    layer = make_layer(kwargs)
    x, rng = make_input(shape, batch=3), np.random.default_rng(2)
    g = rng.standard_normal(x.shape)
    grads = layer.parameter_gradients(x, g)
    if not layer.affine:
        assert grads == {}
        return
    module = torch_batchnorm(layer)
    module(torch.from_numpy(x)).backward(torch.from_numpy(g))
    assert sorted(grads) == sorted(name for name, _ in module.named_parameters())
    for name in grads:
        np.testing.assert_allclose(grads[name], getattr(module, name).grad.numpy(), rtol=1e-12, atol=1e-13)
        # and a central difference of L = sum(g * y) along a random direction of the parameter
        direction, eps, value = rng.standard_normal(shape[0]), 1e-6, getattr(layer, name)

        def loss(step, name=name, direction=direction, value=value):
            setattr(layer, name, value + step * direction)
            return float(np.sum(g * layer(x)))

        numeric = (loss(eps) - loss(-eps)) / (2 * eps)
        setattr(layer, name, value)
        assert float(grads[name] @ direction) == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_state_matches_torch_names_and_defaults():
    torch = pytest.importorskip("torch")
    layer, module = BatchNorm2d(4), torch.nn.BatchNorm2d(4)
    expected = {k: v.numpy() for k, v in module.state_dict().items() if k != "num_batches_tracked"}
    assert list(layer.parameter_names) == list(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(getattr(layer, name), value)
        assert getattr(layer, name).dtype == np.float32
    plain = BatchNorm2d(2, affine=False)
    assert plain.weight is None and plain.bias is None
    assert repr(layer) == repr(module)
    assert repr(BatchNorm2d(3, 1e-3, None, False)) == repr(torch.nn.BatchNorm2d(3, 1e-3, None, False))
    assert repr(BatchNorm2d(3, bias=False)) == repr(torch.nn.BatchNorm2d(3, bias=False))
    assert BatchNorm2d(3, bias=False).bias is None


def test_astype_and_dtypes():
    layer = make_layer(dict(num_features=2), np.float32)
    x = make_input((2, 3, 3))
    with pytest.raises(ValueError, match=r"layer BatchNorm2d: input: dtype float64 does not match.*astype"):
        layer(x)
    assert layer.astype(np.float64) is layer and layer.running_var.dtype == np.float64
    assert layer(x).dtype == np.float64 and layer.transposed_jacobian(x).dtype == np.float64
    with pytest.raises(ValueError, match=r"layer BatchNorm2d: weight: dtype float32 differs"):
        layer.weight = np.ones(2, np.float32)


# --- training mode, errors ----------------------------------------------------------------------
def test_training_mode_is_refused_with_how_to_freeze():
    layer = BatchNorm2d(2, dtype=np.float64)
    layer.name = "bn1"
    assert layer.training  # PyTorch's modules start in training mode
    x = make_input((2, 3, 3))
    message = r"layer 'bn1' \(BatchNorm2d\): training: .*every sample.*layer\.eval\(\)"
    for call in (layer.forward, layer.transposed_jacobian, lambda v: layer.parameter_gradients(v, v)):
        with pytest.raises(ValueError, match=message):
            call(x)
    assert layer.eval() is layer and not layer.training
    layer(x)
    layer.train()
    with pytest.raises(ValueError, match="training"):
        layer(x)
    model = Sequential(Conv2d(2, 2, 1, dtype=np.float64, rng=0), BatchNorm2d(2, dtype=np.float64))
    with pytest.raises(ValueError, match=r"layer '1' \(BatchNorm2d\): training: .*layer\.eval\(\)"):
        model.forward(x)


@pytest.mark.parametrize("build, field", [
    (lambda: BatchNorm2d(0), "num_features"),
    (lambda: BatchNorm2d(2.0), "num_features"),
    (lambda: BatchNorm2d(2, eps=0), "eps"),
    (lambda: BatchNorm2d(2, eps=-1e-5), "eps"),
    (lambda: BatchNorm2d(2, eps="1e-5"), "eps"),
    (lambda: BatchNorm2d(2, momentum=1.5), "momentum"),
    (lambda: BatchNorm2d(2, momentum=float("nan")), "momentum"),
    (lambda: BatchNorm2d(2, affine="yes"), "affine"),
    (lambda: BatchNorm2d(2, bias=None), "bias"),
    (lambda: setattr(BatchNorm2d(2, bias=False), "bias", np.ones(2, np.float32)), "bias"),
    (lambda: BatchNorm2d(2, track_running_stats=False), "track_running_stats"),
    (lambda: BatchNorm2d(2, training=0), "training"),
    (lambda: BatchNorm2d(2, dtype=np.int32), "dtype"),
    (lambda: BatchNorm2d(2).eval()(np.zeros((1, 3, 2, 2), np.float32)), "input"),
    (lambda: BatchNorm2d(2).eval()(np.zeros((1, 2, 4), np.float32)), "input"),
    (lambda: BatchNorm2d(2).eval().pattern((3, 2, 2)), "input"),
    (lambda: setattr(BatchNorm2d(2), "weight", np.ones(3, np.float32)), "weight"),
    (lambda: setattr(BatchNorm2d(2), "bias", np.ones((2, 1), np.float32)), "bias"),
    (lambda: setattr(BatchNorm2d(2), "running_mean", np.ones(2, np.int64)), "running_mean"),
    (lambda: setattr(BatchNorm2d(2), "running_var", -np.ones(2, np.float32)), "running_var"),
    (lambda: setattr(BatchNorm2d(2, affine=False), "weight", np.ones(2, np.float32)), "weight"),
])
def test_bad_arguments_name_layer_and_field(build, field):
    with pytest.raises(ValueError, match=rf"layer BatchNorm2d: {field}:"):
        build()


# --- GPU parity: the same body on NumPy and CuPy ---------------------------------------------------
@pytest.mark.parametrize("kwargs, shape", CASES[:5], ids=IDS[:5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backend_parity(be, kwargs, shape, dtype):
    layer = make_layer(kwargs, dtype)
    x, g = make_input(shape, batch=3, dtype=dtype), make_input(shape, batch=3, dtype=dtype, seed=4)
    tolerance = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(be.to_host(layer(be.asarray(x))), layer(x), rtol=tolerance, atol=tolerance)
    want, got = layer.transposed_jacobian(x), layer.transposed_jacobian(be.asarray(x))
    assert got.pattern.same_as(want.pattern) and got.shared
    np.testing.assert_array_equal(be.to_host(got.data), want.data)
    for name, value in layer.parameter_gradients(x, g).items():
        np.testing.assert_allclose(be.to_host(layer.parameter_gradients(be.asarray(x), be.asarray(g))[name]),
                                   value, rtol=tolerance, atol=tolerance)
        # the backward may run on another device than the forward: gradients follow the activations
        np.testing.assert_allclose(layer.parameter_gradients(x, be.asarray(g))[name], value, rtol=1e-15)


# --- the new layers inside Sequential ------------------------------------------------------------
def new_layers_model() -> Sequential:
    """Conv -> frozen BN -> ReLU -> Dropout (training) -> BN -> adaptive pool -> linear, float64."""
    first = make_layer(dict(num_features=3), seed=5)
    second = make_layer(dict(num_features=3, eps=0.1, affine=False), seed=6)
    return Sequential(Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0), first, ReLU(),
                      Dropout(0.3, rng=1), second, AdaptiveAvgPool2d((3, None)), Tanh(), Flatten(),
                      Linear(3 * 3 * 5, 4, dtype=np.float64, rng=2))


SCHEDULES = [("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(depth(9) + 1)]


def torch_mirror(model: Sequential):
    """The model in PyTorch (float64), Dropout as multiplication by the mask of the last forward."""
    torch = pytest.importorskip("torch")

    class Mask(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.mask = torch.from_numpy(mask)

        def forward(self, t):
            return t * self.mask.reshape(t.shape)

    jts = model.transposed_jacobians()
    modules = []
    for index, layer in enumerate(model.layers):
        if isinstance(layer, BatchNorm2d):
            modules.append(torch_batchnorm(layer))
        elif isinstance(layer, Dropout):
            modules.append(Mask(np.asarray(jts[index].data)))  # the diagonal: the scaled mask
        elif isinstance(layer, Conv2d):
            modules.append(torch.nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                                           padding=layer.padding).double())
        elif isinstance(layer, Linear):
            modules.append(torch.nn.Linear(layer.in_features, layer.out_features).double())
        elif isinstance(layer, AdaptiveAvgPool2d):
            modules.append(torch.nn.AdaptiveAvgPool2d(layer.output_size))
        else:
            modules.append(getattr(torch.nn, type(layer).__name__)())
        if isinstance(layer, (Conv2d, Linear)):
            modules[-1].weight.data = torch.from_numpy(layer.weight.copy())
            modules[-1].bias.data = torch.from_numpy(layer.bias.copy())
    return torch.nn.Sequential(*modules)


def test_every_schedule_and_torch_agree():
    torch = pytest.importorskip("torch")
    model = new_layers_model()
    x = make_input((2, 6, 5), batch=3)
    y = model.forward(x)
    g = np.random.default_rng(7).standard_normal(y.shape)
    reference = model.backward(g, method="linear")
    for method, levels in SCHEDULES:
        for a, b in zip(model.backward(g, method=method, levels=levels), reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # PyTorch: every activation's gradient and every parameter's
    net = torch_mirror(model)
    activations = [torch.from_numpy(x).requires_grad_()]
    for module in net:
        activations.append(module(activations[-1]))
        activations[-1].retain_grad()
    np.testing.assert_allclose(activations[-1].detach().numpy(), y, rtol=1e-12, atol=1e-14)
    activations[-1].backward(torch.from_numpy(g))
    for ours, theirs in zip(reference, activations, strict=True):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-10, atol=1e-12)
    grads = model.parameter_gradients(reference)
    expected = {name: p.grad.numpy() for name, p in net.named_parameters()}
    assert sorted(grads) == sorted(expected) == ["0.bias", "0.weight", "1.bias", "1.weight", "8.bias",
                                                 "8.weight"]
    for method, levels in SCHEDULES:
        got = model.parameter_gradients(model.backward(g, method=method, levels=levels))
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12)


def test_optimizer_steps_the_affine_parameters_not_the_statistics():
    model = new_layers_model()
    x = make_input((2, 6, 5), batch=3)
    y = model.forward(x)
    grads = model.parameter_gradients(model.backward(np.ones_like(y), method="blelloch"))
    state = {key: value.copy() for key, value in model.state_dict().items()}
    assert {"1.running_mean", "1.running_var", "4.running_mean", "4.running_var"} <= set(state)
    SGD(model, lr=0.1).step(grads)
    after = model.state_dict()
    np.testing.assert_allclose(after["1.weight"], state["1.weight"] - 0.1 * grads["1.weight"])
    for key in ("1.running_mean", "1.running_var", "4.running_var"):
        np.testing.assert_array_equal(after[key], state[key])


def test_dropout_masks_change_between_forwards_and_the_backward_follows():
    model = new_layers_model()
    x = make_input((2, 6, 5), batch=2)
    g = np.ones((2, 4))
    model.forward(x)
    first = model.backward(g, method="blelloch")
    model.forward(x)
    second = model.backward(g, method="blelloch")
    assert not np.allclose(first[0], second[0])  # a new mask
    model.layers[3].eval()  # the identity
    model.forward(x)
    grads = model.backward(g, method="blelloch")
    np.testing.assert_array_equal(grads[3], grads[4])


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 2)])
def test_model_on_each_backend_equals_the_host(be, method, levels):
    model = new_layers_model()
    x = make_input((2, 6, 5), batch=3)
    g = np.random.default_rng(7).standard_normal((3, 4))
    # the same seed draws the same masks on either device: two models, one per backend
    host = new_layers_model()
    host.forward(x)
    want = host.backward(g, method=method, levels=levels)
    want_params = host.parameter_gradients(want)
    model.forward(be.asarray(x))
    got = model.backward(be.asarray(g), method=method, levels=levels)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(be.to_host(a), b, rtol=1e-10, atol=1e-12)
    for name, value in model.parameter_gradients(got).items():
        np.testing.assert_allclose(be.to_host(value), want_params[name], rtol=1e-10, atol=1e-12)
