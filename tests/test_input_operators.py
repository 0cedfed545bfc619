"""Matrix-free JT operators from the layer's input (``Layer.input_matvec``): ReLU, 2x2 max-pool and
LayerNorm.

ReLU's and the max-pool's must give, bit for bit, what JT's values give (the scaling by the diagonal,
SciPy's SpMV by the selection), NaN inputs included; LayerNorm's applies its dense ``n × n`` blocks in
``O(n)`` per group, equal to their SpMV within rounding. A host backward must use them for every JT
that only matrix-vector steps read, with gradients equal to PyTorch autograd's.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
from oracles import torch_modules

import sparse_scan._sequential as model_module
from sparse_scan import Sequential
from sparse_scan.layers import AvgPool2d, Conv2d, Flatten, LayerNorm, Linear, MaxPool2d, ReLU, Tanh
from sparse_scan.layers import _pooling_jt as pooling


def jt_matvec(layer, x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``JT(x) @ grad`` per sample from JT's values: SciPy's CSR SpMV (the independent oracle)."""
    jt = layer.transposed_jacobian(x)
    data = np.broadcast_to(jt.data, (x.shape[0], jt.pattern.nnz))
    return np.stack([scipy.sparse.csr_matrix((data[s], jt.pattern.indices, jt.pattern.indptr),
                                             shape=jt.pattern.shape) @ grad[s] for s in range(x.shape[0])])


def inputs(shape: tuple[int, ...], dtype, seed: int, ties: bool = False) -> np.ndarray:
    """Normal inputs with exact zeros; ``ties``: small integers, so windows hold equal maxima."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, shape) if ties else rng.standard_normal(shape)
    x = x.astype(dtype)
    x.reshape(-1)[::7] = 0
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 5), (2, 4, 3, 3), (1, 2)])
def test_relu_operator_equals_values(dtype, shape):
    layer, x = ReLU(), inputs(shape, dtype, 0)
    x.reshape(-1)[1] = np.nan  # PyTorch's derivative at NaN is 1 (its backward: x <= 0 ? 0 : grad)
    grad = np.random.default_rng(1).standard_normal((shape[0], x[0].size)).astype(dtype)
    got = layer.input_matvec(x)(grad)
    np.testing.assert_array_equal(got, jt_matvec(layer, x, grad))
    np.testing.assert_array_equal(got, grad * ~(x.reshape(shape[0], -1) <= 0))
    assert got.dtype == dtype


def test_relu_operator_keeps_nan_times_zero_like_the_product():
    x = np.array([[-1.0, 2.0, 0.0]])
    grad = np.array([[np.inf, np.nan, 3.0]])
    np.testing.assert_array_equal(ReLU().input_matvec(x)(grad), [[np.nan, np.nan, 0.0]])


def test_relu_operator_threads_cover_every_position(monkeypatch):
    import sparse_scan.layers._activation as activation

    monkeypatch.setattr(activation, "workers_for", lambda work, minimum=None: 3)
    x = inputs((4, 1001), np.float64, 2)
    grad = np.random.default_rng(3).standard_normal(x.shape)
    np.testing.assert_array_equal(ReLU().input_matvec(x)(grad), grad * (x > 0))


POOL_SHAPES = [(2, 3, 4, 4), (3, 2, 5, 7), (1, 1, 2, 2), (2, 4, 8, 2), (1, 2, 6, 1 + 2 * 17), (2, 1, 3, 3)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", POOL_SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_operator_equals_values(dtype, shape, ties):
    layer, x = MaxPool2d(2), inputs(shape, dtype, 4, ties)
    grad = np.random.default_rng(5).standard_normal((shape[0], layer(x)[0].size)).astype(dtype)
    got = layer.input_matvec(x)(grad)
    assert got.dtype == dtype and got.shape == (shape[0], x[0].size)
    np.testing.assert_array_equal(got, jt_matvec(layer, x, grad))


def test_max_pool_operator_matches_torch_on_ties():
    torch = pytest.importorskip("torch")
    layer, x = MaxPool2d(2), inputs((2, 3, 6, 8), np.float64, 6, ties=True)
    grad = np.random.default_rng(7).standard_normal((2, 3, 3, 4))
    inp = torch.from_numpy(x).requires_grad_(True)
    (expected,) = torch.autograd.grad(torch.nn.MaxPool2d(2)(inp), [inp], torch.from_numpy(grad))
    np.testing.assert_array_equal(layer.input_matvec(x)(grad.reshape(2, -1)), expected.numpy().reshape(2, -1))


def test_max_pool_operator_threads_cover_every_plane(monkeypatch):
    monkeypatch.setattr(pooling, "workers_for", lambda work, minimum=None: 3)
    layer, x = MaxPool2d(2), inputs((3, 5, 4, 6), np.float32, 8)
    grad = np.random.default_rng(9).standard_normal((3, 5 * 2 * 3)).astype(np.float32)
    np.testing.assert_array_equal(layer.input_matvec(x)(grad), jt_matvec(layer, x, grad))


def test_max_pool_operator_selects_nan_like_the_fill():
    layer, x = MaxPool2d(2), inputs((2, 2, 4, 6), np.float64, 10)
    x[0, 1, 2, 3] = np.nan
    x[1].reshape(-1)[::3] = np.nan  # several in a window: the last one is selected
    grad = np.random.default_rng(11).standard_normal((2, 12))
    np.testing.assert_array_equal(layer.input_matvec(x)(grad), jt_matvec(layer, x, grad))


def test_operators_refuse_gradients_of_another_shape():
    x = inputs((2, 1, 4, 4), np.float64, 11)
    with pytest.raises(ValueError, match="shape"):
        MaxPool2d(2).input_matvec(x)(np.ones((2, 5)))
    with pytest.raises(ValueError, match="shape"):
        ReLU().input_matvec(x)(np.ones((1, 16)))


@pytest.mark.parametrize("data_format, shape", [("channels_first", (6, 3, 5)), ("channels_last", (3, 5, 6)),
                                                ("channels_last", (6,))])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_operator_equals_its_blocks_spmv(data_format, shape, affine):
    layer = LayerNorm(6, data_format=data_format, elementwise_affine=affine, dtype=np.float64)
    if affine:
        layer.weight = np.random.default_rng(20).standard_normal(6)
        layer.bias = np.random.default_rng(21).standard_normal(6)
    x = inputs((4,) + shape, np.float64, 22)
    grad = np.random.default_rng(23).standard_normal((4, int(np.prod(shape))))
    want = jt_matvec(layer, x, grad)
    np.testing.assert_allclose(layer.input_matvec(x)(grad), want, rtol=1e-13,
                               atol=1e-13 * np.abs(want).max())
    with pytest.raises(ValueError, match="LayerNorm's JT @ g: expected gradients of shape"):
        layer.input_matvec(x)(grad[:, 1:])


def test_a_host_backward_applies_layer_norms_without_their_blocks(monkeypatch):
    f64 = dict(dtype=np.float64)
    model = Sequential(Conv2d(2, 4, 3, padding=1, rng=0, **f64),
                       LayerNorm(4, data_format="channels_first", **f64), ReLU(), Flatten(),
                       Linear(4 * 5 * 5, 3, rng=1, **f64))
    model.forward(inputs((2, 2, 5, 5), np.float64, 24))
    grad = np.random.default_rng(25).standard_normal((2, 3))
    want = model.backward(grad, "blelloch")  # its products read the blocks' values
    monkeypatch.setattr(LayerNorm, "transposed_jacobian",
                        lambda *args: pytest.fail("a LayerNorm's JT was filled"))
    for got, expected in zip(model.backward(grad, "linear"), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer", [MaxPool2d(3, 2, 1), MaxPool2d(2, 1), MaxPool2d(2, padding=1), AvgPool2d(2),
                                   Tanh(), Conv2d(1, 2, 3)])
def test_other_layers_offer_no_operator(layer):
    assert layer.input_matvec(inputs((1, 1, 6, 6), np.float64, 12)) is None


def small_vgg(seed: int = 0) -> Sequential:
    rng = np.random.default_rng(seed)
    f64 = dict(rng=rng, dtype=np.float64)
    return Sequential(Conv2d(2, 4, 3, padding=1, **f64), ReLU(), MaxPool2d(2),
                      Conv2d(4, 4, 3, padding=1, **f64), ReLU(), Conv2d(4, 6, 3, padding=1, **f64), ReLU(),
                      MaxPool2d(2), Flatten(), Linear(6 * 2 * 3, 5, **f64), ReLU())


@pytest.mark.parametrize("method, levels", [("linear", None), ("hybrid", 1), ("blelloch", None)])
def test_backward_uses_operators_and_equals_values_path(monkeypatch, method, levels):
    model = small_vgg()
    x = inputs((3, 2, 9, 13), np.float64, 13)
    model.forward(x)
    grad = np.random.default_rng(14).standard_normal((3, 5))
    with_operators = model.backward(grad, method, levels)
    filled = []
    for kind in (ReLU, MaxPool2d):
        original = kind.transposed_jacobian
        monkeypatch.setattr(kind, "transposed_jacobian", lambda self, x, *args, original=original:
                            filled.append(self) or original(self, x, *args))
    again = model.backward(grad, method, levels)
    if method == "linear":
        assert filled == []  # every ReLU and pool JT went through its operator
    monkeypatch.setattr(model_module, "through_inputs", lambda plan: frozenset())
    without = model.backward(grad, method, levels)
    assert len(filled) == 6 if method == "linear" else len(filled) > 0  # 4 ReLUs, 2 pools
    for a, b, c in zip(with_operators, again, without, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_linear_backward_with_operators_equals_torch_autograd():
    torch = pytest.importorskip("torch")
    model = small_vgg(1)
    x = inputs((2, 2, 8, 12), np.float64, 15)
    model.forward(x)
    grad = np.random.default_rng(16).standard_normal((2, 5))
    grads = model.backward(grad, "linear")
    net = torch.nn.Sequential(*torch_modules(model))
    inp = torch.from_numpy(x).requires_grad_(True)
    (expected,) = torch.autograd.grad(net(inp), [inp], torch.from_numpy(grad))
    np.testing.assert_allclose(grads[0], expected.numpy(), rtol=1e-12, atol=1e-14)


def test_operators_only_on_the_host(be):
    """The layers offer no operator for device arrays (the one place that says so: their operator
    twins), so the GPU scan fills every JT ``through_inputs`` names, and a residual block's inner
    chain keeps its JT values on the GPU."""
    x = be.asarray(inputs((1, 2, 4, 4), np.float64, 17))
    norm = LayerNorm(2, data_format="channels_first", dtype=np.float64)
    offered = [layer.input_matvec(x) is not None for layer in (ReLU(), MaxPool2d(2), norm)]
    assert offered == [be.name == "cpu"] * 3
