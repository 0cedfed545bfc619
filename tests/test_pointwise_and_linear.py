"""Activations, Flatten and Linear: forward and transposed Jacobians against independent oracles."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import finite_difference_jt, torch_jt
from scipy.special import erf

from sparse_scan import Sequential, backend
from sparse_scan.engine._weights_path import gemm_pays
from sparse_scan.layers import (
    ELU,
    GELU,
    Flatten,
    Hardtanh,
    Identity,
    LeakyReLU,
    Linear,
    ReLU,
    Sigmoid,
    SiLU,
    Softplus,
    Tanh,
)

ACTIVATIONS = [
    (ReLU(), lambda x: np.maximum(x, 0), "ReLU", {}),
    (LeakyReLU(0.2), lambda x: np.where(x > 0, x, 0.2 * x), "LeakyReLU", {"negative_slope": 0.2}),
    (LeakyReLU(), lambda x: np.where(x > 0, x, 0.01 * x), "LeakyReLU", {}),
    (Tanh(), np.tanh, "Tanh", {}),
    (Sigmoid(), lambda x: 1 / (1 + np.exp(-x)), "Sigmoid", {}),
    (GELU(), lambda x: x * (1 + erf(x / np.sqrt(2))) / 2, "GELU", {}),
    (GELU("tanh"), lambda x: x / 2 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), "GELU",
     {"approximate": "tanh"}),
    (SiLU(), lambda x: x / (1 + np.exp(-x)), "SiLU", {}),
    (ELU(), lambda x: np.where(x > 0, x, np.exp(x) - 1), "ELU", {}),
    (ELU(0.7), lambda x: np.where(x > 0, x, 0.7 * (np.exp(x) - 1)), "ELU", {"alpha": 0.7}),
    (Hardtanh(), lambda x: np.clip(x, -1, 1), "Hardtanh", {}),
    (Hardtanh(-0.5, 0.8), lambda x: np.clip(x, -0.5, 0.8), "Hardtanh", {"min_val": -0.5, "max_val": 0.8}),
    (Softplus(), lambda x: np.log1p(np.exp(x)), "Softplus", {}),
    (Softplus(2.0, 3.0), lambda x: np.where(2 * x > 3, x, np.log1p(np.exp(2 * x)) / 2), "Softplus",
     {"beta": 2.0, "threshold": 3.0}),
    (Identity(), lambda x: x, "Identity", {}),
]
IDS = ["relu", "leaky0.2", "leaky", "tanh", "sigmoid", "gelu", "gelu-tanh", "silu", "elu", "elu0.7",
       "hardtanh", "hardtanh-0.5-0.8", "softplus", "softplus2-3", "identity"]


def sample(shape, dtype=np.float64, seed=0):
    # keep away from ReLU's kink so finite differences are exact there
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.where(np.abs(x) < 1e-3, 0.5, x).astype(dtype)


@pytest.mark.parametrize("layer, definition, _name, _kw", ACTIVATIONS, ids=IDS)
@pytest.mark.parametrize("shape", [(3, 2, 3, 5), (4, 7)])
def test_activation_forward_and_jt(layer, definition, _name, _kw, shape):
    x = sample(shape)
    np.testing.assert_allclose(layer.forward(x), definition(x), rtol=1e-13, atol=1e-15)
    jt = layer.transposed_jacobian(x)
    assert not jt.shared and jt.data.shape == (shape[0], int(np.prod(shape[1:])))
    assert layer.jacobian_kind == "diagonal"
    for b in range(shape[0]):
        fd = finite_difference_jt(lambda v: definition(v), x[b])
        np.testing.assert_allclose(jt.todense()[b], fd, atol=1e-8)


@pytest.mark.parametrize("layer, definition, name, kwargs", ACTIVATIONS, ids=IDS)
def test_activation_matches_torch(layer, definition, name, kwargs):
    torch = pytest.importorskip("torch")
    module = getattr(torch.nn, name)(**kwargs)
    x = sample((2, 3, 4, 4))
    with torch.no_grad():
        np.testing.assert_allclose(layer.forward(x), module(torch.from_numpy(x)).numpy(),
                                   rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(layer.transposed_jacobian(x).todense()[1], torch_jt(module, x[1]),
                               rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind, point, slope", [
    (ELU(0.5), 0.0, 0.5), (Hardtanh(-0.5, 0.8), -0.5, 0.0), (Hardtanh(-0.5, 0.8), 0.8, 0.0),
    (Softplus(2.0, 3.0), 1.5, 1 / (1 + np.exp(-3.0))), (ReLU(), 0.0, 0.0),
])
def test_derivatives_at_kinks_follow_pytorch(kind, point, slope):
    """Where the derivative jumps, the JT takes PyTorch's side (checked against autograd when present)."""
    x = np.full((1, 1), point)
    assert float(kind.transposed_jacobian(x).data[0, 0]) == pytest.approx(slope, rel=1e-12)
    torch = pytest.importorskip("torch")
    name = {"ELU": "ELU", "Hardtanh": "Hardtanh", "Softplus": "Softplus", "ReLU": "ReLU"}[type(kind).__name__]
    kwargs = {"ELU": {"alpha": 0.5}, "Hardtanh": {"min_val": -0.5, "max_val": 0.8},
              "Softplus": {"beta": 2.0, "threshold": 3.0}, "ReLU": {}}[name]
    np.testing.assert_allclose(torch_jt(getattr(torch.nn, name)(**kwargs), x[0]), [[slope]], rtol=1e-12)


@pytest.mark.parametrize("make, message", [
    (lambda: GELU("erf"), "approximate: must be 'none' or 'tanh'"),
    (lambda: ELU("1"), "alpha: must be a finite number"),
    (lambda: Hardtanh(1.0, -1.0), "min_val .* must be below max_val"),
    (lambda: Softplus(beta=0.0), "beta: must be > 0"),
    (lambda: Softplus(threshold=float("nan")), "threshold: must be a finite number"),
])
def test_bad_activation_arguments_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_relu_keeps_input_dependent_zeros_and_vgg_sparsity():
    relu = ReLU()
    x = sample((2, 64, 32, 32), np.float32)
    jt = relu.transposed_jacobian(x)
    assert jt.nnz == 64 * 32 * 32 and jt.shape == (65536, 65536)
    assert round(jt.pattern.sparsity, 5) == 0.99998
    assert 0 < np.count_nonzero(jt.data) < jt.data.size  # off units stay as explicit zeros
    assert jt.dtype == np.float32
    assert relu.pattern((64, 32, 32)) is jt.pattern


def test_sigmoid_is_quiet_and_exact_at_extremes():
    x = np.array([[-800.0, -40.0, 0.0, 40.0, 800.0]])
    y = Sigmoid().forward(x)
    np.testing.assert_allclose(y, [[0.0, 1 / (1 + np.exp(40)), 0.5, 1 / (1 + np.exp(-40)), 1.0]])
    assert np.all(np.isfinite(Sigmoid().transposed_jacobian(x).data))


def test_leaky_relu_rejects_non_finite_slope():
    with pytest.raises(ValueError, match="LeakyReLU.*negative_slope"):
        LeakyReLU(float("nan"))


@pytest.mark.parametrize("start, end, in_shape, out_shape", [
    (1, -1, (3, 4, 5), (60,)),
    (2, -1, (3, 4, 5), (3, 20)),
    (1, 2, (3, 4, 5), (12, 5)),
])
def test_flatten(start, end, in_shape, out_shape):
    layer = Flatten(start, end)
    x = sample((2,) + in_shape)
    y = layer.forward(x)
    assert y.shape == (2,) + out_shape and layer.output_shape(in_shape) == out_shape
    np.testing.assert_array_equal(y.ravel(), x.ravel())
    jt = layer.transposed_jacobian(x)
    assert jt.shared
    np.testing.assert_array_equal(jt.todense(), np.eye(60))


def test_flatten_rejects_batch_axis():
    with pytest.raises(ValueError, match="Flatten.*start_dim"):
        Flatten(0).forward(np.zeros((2, 3)))


def torch_linear(layer: Linear):
    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(layer.in_features, layer.out_features).double()
    module.weight.data = torch.from_numpy(layer.weight.astype(np.float64))
    module.bias.data = torch.from_numpy(layer.bias.astype(np.float64))
    return module


def test_linear_forward_and_jt():
    layer = Linear(7, 5, dtype=np.float64, rng=2)
    x = sample((3, 7))
    np.testing.assert_allclose(layer.forward(x), x @ layer.weight.T + layer.bias, rtol=1e-13)
    jt = layer.transposed_jacobian(x)
    assert jt.shared and jt.shape == (7, 5) and jt.nnz == 35
    np.testing.assert_allclose(jt.todense(), finite_difference_jt(layer.forward, x[0]), atol=1e-8)
    np.testing.assert_array_equal(jt.todense(), layer.weight.T)


def test_linear_weights_matvec_is_the_jt_product():
    layer = Linear(7, 5, dtype=np.float64, rng=2)
    x, grad = sample((3, 7)), sample((3, 5))
    fd = finite_difference_jt(layer.forward, x[0])
    np.testing.assert_allclose(layer.weights_matvec((7,))(grad), grad @ fd.T, atol=1e-8)
    assert gemm_pays(layer.pattern_nnz((7,)), layer.weights_path((7,)))
    with pytest.raises(ValueError, match="in_features|per-sample shape"):
        layer.weights_matvec((6,))


def test_linear_matches_torch():
    layer = Linear(6, 4, dtype=np.float64, rng=3)
    module = torch_linear(layer)
    x = sample((2, 6))
    np.testing.assert_allclose(layer.transposed_jacobian(x).todense(), torch_jt(module, x[0]),
                               rtol=1e-14)


def test_linear_pruned_pattern():
    layer = Linear(6, 4, dtype=np.float64, rng=3, prune_pattern=True)
    weight = layer.weight.copy()
    weight[:, ::2] = 0
    weight[1, 1] = 0
    layer.weight = weight
    jt = layer.transposed_jacobian(sample((2, 6)))
    assert jt.nnz == 11
    np.testing.assert_array_equal(jt.todense(), weight.T)
    # a generic gather (pruned path) equals the structured copy (unpruned path)
    full = Linear(6, 4, dtype=np.float64, rng=3)
    full.weight = weight
    np.testing.assert_array_equal(full.transposed_jacobian(sample((2, 6))).todense(), weight.T)


def test_linear_bad_inputs_name_layer_and_field():
    layer = Linear(12, 3)
    layer.name = "fc"
    with pytest.raises(ValueError, match="'fc'.*input.*add a Flatten"):
        layer.forward(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="'fc'.*input.*\\(12,\\)"):
        layer.forward(np.zeros((2, 11), np.float32))
    with pytest.raises(ValueError, match="'fc'.*weight.*shape"):
        layer.weight = np.zeros((12, 3), np.float32)
    with pytest.raises(ValueError, match="Linear.*out_features"):
        Linear(3, 0)


def test_default_initialisation_is_pytorch_like_and_seeded():
    a, b = Linear(100, 50, rng=7), Linear(100, 50, rng=7)
    np.testing.assert_array_equal(a.weight, b.weight)
    assert a.weight.dtype == np.float32 and np.abs(a.weight).max() <= 0.1
    assert Linear(4, 2, bias=False).bias is None
    assert Linear(4, 2).astype(np.float64).weight.dtype == np.float64


# --- GPU parity: the same bodies on NumPy and CuPy ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_twin_matches_cpu(dtype):
    gpu = backend.get("gpu")
    x = sample((3, 2, 4, 5), dtype)
    layers = [layer for layer, *_ in ACTIVATIONS] + [Flatten()]
    for layer in layers:
        on_cpu, on_gpu = layer.transposed_jacobian(x), layer.transposed_jacobian(gpu.asarray(x))
        assert on_gpu.pattern.same_as(on_cpu.pattern)
        # float32: CUDA's tanhf/expf are within 2 ulp of NumPy's, and 1 - y*y cancels for |x| > 1.8
        rtol = 1e-5 if dtype == np.float32 else 1e-10
        np.testing.assert_allclose(gpu.to_host(on_gpu.data), on_cpu.data, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(gpu.to_host(layer.forward(gpu.asarray(x))), layer.forward(x),
                                   rtol=rtol, atol=rtol)
    for prune in (False, True):
        linear = Linear(40, 10, dtype=dtype, rng=1, prune_pattern=prune)
        weight = linear.weight.copy()
        weight[:, ::3] = 0
        linear.weight = weight
        v = x.reshape(3, 40)
        on_cpu, on_gpu = linear.transposed_jacobian(v), linear.transposed_jacobian(gpu.asarray(v))
        assert on_gpu.pattern.same_as(on_cpu.pattern)
        np.testing.assert_array_equal(gpu.to_host(on_gpu.data), on_cpu.data)


@pytest.mark.parametrize("prune", [False, True])
def test_linear_pattern_nnz_is_counted_without_building_the_pattern(prune):
    layer = Linear(6, 4, dtype=np.float64, rng=3, prune_pattern=prune)
    weight = layer.weight.copy()
    weight[:, ::2] = 0
    layer.weight = weight
    counted = layer.pattern_nnz((6,))
    assert not layer._patterns and counted == layer.pattern((6,)).nnz == (12 if prune else 24)


def test_a_new_pattern_mask_is_a_new_pattern_and_the_model_replans():
    # the key of a layer's pruned pattern follows its mask: a model must not reuse the plan of the
    # pattern the weights' zero set gave before the mask was set
    layer = Linear(4, 3, dtype=np.float64, rng=0, prune_pattern=True)
    weight = np.array(layer.weight)
    weight[0] = 0
    layer.weight = weight
    model = Sequential(layer, input_shape=(4,))
    before = model.plan((4,), "linear")
    assert layer.pattern_nnz((4,)) == 8
    layer.pattern_mask = np.ones((3, 4), bool)
    after = model.plan((4,), "linear")
    assert layer.pattern_nnz((4,)) == 12 and after is not before
    assert model.plan_builds == 2
