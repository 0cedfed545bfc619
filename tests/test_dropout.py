"""Dropout: masks (seeded, new per forward, Bernoulli(1 - p)), PyTorch's scaling, the JT against float64
finite differences of the forward that drew the mask and against PyTorch autograd, modes, CPU/GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
from oracles import finite_difference_jt, torch_jt

from sparse_scan import backend
from sparse_scan.layers import Dropout
from sparse_scan.layers._dropout import scaled_mask, uniform_counter


def random_configs(count: int, seed: int) -> list[tuple[float, int, tuple[int, ...]]]:
    """Seeded random (p, batch, per-sample shape): flat and (C, H, W) samples, p = 0 and 1 included."""
    rng = np.random.default_rng(seed)
    configs = [(0.0, 2, (5,)), (1.0, 2, (2, 3, 2)), (0.5, 3, (3, 4))]
    while len(configs) < count:
        p = float(rng.choice([rng.uniform(0.05, 0.95), 0.5, 0.2]))
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(s) for s in rng.integers(1, 6, ndim))
        configs.append((p, int(rng.integers(1, 4)), shape))
    return configs


CASES = random_configs(20, seed=5)
IDS = [f"{i}-p{p:.2f}-b{batch}-{'x'.join(map(str, shape))}" for i, (p, batch, shape) in enumerate(CASES)]


def make_input(batch, shape, dtype=np.float64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype(dtype)


def test_uniform_counter_is_splitmix64():
    """The first outputs of SplitMix64 for seed 0 (the reference generator's published values)."""
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    np.testing.assert_array_equal(uniform_counter(np, np.uint64(0), 3),
                                  [(v >> 11) * 2.0**-53 for v in expected])


def test_masks_are_bernoulli_and_new_per_forward():
    layer = Dropout(0.3, rng=1)
    x = np.ones((50, 40, 10))
    masks = [layer(x) != 0 for _ in range(3)]
    for mask in masks:
        kept = mask.mean()
        assert abs(kept - 0.7) < 4 * math.sqrt(0.3 * 0.7 / mask.size)  # 4 sigma
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    # the samples and the elements are not correlated (neighbours agree as often as chance says)
    agree = (masks[0].reshape(-1)[1:] == masks[0].reshape(-1)[:-1]).mean()
    assert abs(agree - (0.7**2 + 0.3**2)) < 0.02


def test_the_seed_reproduces_the_sequence_of_masks():
    x = make_input(4, (3, 5))
    first, second = Dropout(0.5, rng=7), Dropout(0.5, rng=7)
    for _ in range(3):
        np.testing.assert_array_equal(first(x), second(x))
    assert not np.array_equal(Dropout(0.5, rng=8)(x), Dropout(0.5, rng=7)(x))
    generator = np.random.default_rng(3)
    np.testing.assert_array_equal(Dropout(rng=generator)(x), Dropout(rng=np.random.default_rng(3))(x))


@pytest.mark.parametrize("p, batch, shape", CASES, ids=IDS)
def test_forward_is_the_scaled_mask_and_the_jt_its_diagonal(p, batch, shape):
    layer = Dropout(p, rng=0)
    x = make_input(batch, shape)
    y = layer(x)
    kept = y != 0
    np.testing.assert_array_equal(y[kept], (x * (1 / (1 - p)))[kept] if p < 1 else [])
    jt = layer.transposed_jacobian(x)
    assert layer.jacobian_kind == "diagonal" and not jt.shared
    assert jt.data.shape == (batch, math.prod(shape)) and jt.nnz == math.prod(shape)
    np.testing.assert_array_equal(jt.data * x.reshape(batch, -1), y.reshape(batch, -1))
    assert layer.transposed_jacobian(x).data is not None  # the mask holds until the next forward


@pytest.mark.parametrize("p, batch, shape", CASES, ids=IDS)
def test_jt_matches_finite_differences_of_the_forward(p, batch, shape):
    """Sample ``b``'s JT is the derivative of the forward that drew the mask: a layer seeded alike draws
    it again for a batch whose sample ``b`` is perturbed."""
    x = make_input(batch, shape)
    layer = Dropout(p, rng=4)
    layer(x)
    dense = layer.transposed_jacobian(x).todense()
    for b in range(batch):
        def forward_b(v, b=b):
            batch_x = x.copy()
            batch_x[b] = v[0]
            return Dropout(p, rng=4)(batch_x)[b][None]

        np.testing.assert_allclose(dense[b], finite_difference_jt(forward_b, x[b]), atol=1e-8)


@pytest.mark.parametrize("p, batch, shape", CASES, ids=IDS)
def test_jt_matches_torch_autograd_of_the_same_mask(p, batch, shape):
    """PyTorch's dropout is ``input * bernoulli(1 - p).div_(1 - p)``: autograd of that with this mask."""
    torch = pytest.importorskip("torch")
    x = make_input(batch, shape)
    layer = Dropout(p, rng=2)
    keep = layer(x) != 0  # (x has no zeros)
    dense = layer.transposed_jacobian(x).todense()
    for b in range(batch):
        noise = torch.from_numpy(keep[b]).double()
        noise = noise.div_(1 - p) if p < 1 else noise
        np.testing.assert_allclose(dense[b], torch_jt(lambda t, noise=noise: t * noise[None], x[b]),
                                   rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1.0])
def test_scaling_equals_torch_on_torch_mask(dtype, p):
    """Given the mask PyTorch drew, the layer's factor gives PyTorch's output bit for bit, and
    PyTorch's masks keep as many elements as ours."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    x = make_input(8, (4, 6, 6), dtype=dtype)
    x[x == 0] = 1
    expected = torch.nn.functional.dropout(torch.from_numpy(x), p, training=True).numpy()
    keep = expected != 0
    np.testing.assert_array_equal(x * scaled_mask(np, keep, p, dtype), expected)
    ours = Dropout(p, rng=0)(x) != 0
    assert abs(ours.mean() - keep.mean()) < 8 * math.sqrt(p * (1 - p) / x.size) + 1e-12


def test_eval_is_the_identity_as_in_torch():
    torch = pytest.importorskip("torch")
    x = make_input(2, (3, 4, 4))
    layer = Dropout(0.4, training=False)
    module = torch.nn.Dropout(0.4).eval()
    np.testing.assert_array_equal(layer(x), module(torch.from_numpy(x)).numpy())
    np.testing.assert_array_equal(layer.transposed_jacobian(x).todense()[1], torch_jt(module, x[1]))


def test_modes():
    x = make_input(2, (3,))
    layer = Dropout(0.5, rng=0)
    assert layer.training  # PyTorch's modules start in training mode
    with pytest.raises(ValueError, match=r"layer Dropout: input: no mask.*call forward\(x\) first"):
        layer.transposed_jacobian(x)
    layer(x)
    with pytest.raises(ValueError, match=r"layer Dropout: input: batch shape \(3, 3\) differs"):
        layer.transposed_jacobian(make_input(3, (3,)))
    assert layer.eval() is layer and not layer.training
    np.testing.assert_array_equal(layer.transposed_jacobian(x).todense(), np.eye(3)[None].repeat(2, 0))
    assert layer(x) is x
    layer.train()
    with pytest.raises(ValueError, match="no mask"):  # changing the mode forgets the mask
        layer.transposed_jacobian(x)
    layer.training = False
    assert not layer.training


@pytest.mark.parametrize("build, field", [
    (lambda: Dropout(-0.1), "p"),
    (lambda: Dropout(1.5), "p"),
    (lambda: Dropout("0.5"), "p"),
    (lambda: Dropout(float("nan")), "p"),
    (lambda: Dropout(True), "p"),
    (lambda: Dropout(training="yes"), "training"),
    (lambda: Dropout().train(1), "training"),
    (lambda: Dropout()(np.zeros((2, 3), dtype=np.int64)), "input"),
    (lambda: Dropout()(np.zeros((0, 3))), "input"),
])
def test_bad_arguments_name_layer_and_field(build, field):
    with pytest.raises(ValueError, match=rf"layer Dropout: {field}:"):
        build()


@pytest.mark.parametrize("p", [0.5, 0.25, 0.0, 1.0])
def test_repr_matches_torch(p):
    torch = pytest.importorskip("torch")
    assert repr(Dropout(p)) == repr(torch.nn.Dropout(p))


# --- GPU parity: the same body on NumPy and CuPy ---------------------------------------------------
@pytest.mark.parametrize("p, batch, shape", CASES[:6], ids=IDS[:6])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backend_parity(be, p, batch, shape, dtype):
    """A seed draws the same masks on either device: forward and JT values equal bit for bit."""
    x = make_input(batch, shape, dtype=dtype)
    cpu_layer, layer = Dropout(p, rng=9), Dropout(p, rng=9)
    for _ in range(2):
        want, got = cpu_layer(x), layer(be.asarray(x))
        np.testing.assert_array_equal(be.to_host(got), want)
        jt_want, jt_got = cpu_layer.transposed_jacobian(x), layer.transposed_jacobian(be.asarray(x))
        assert jt_got.pattern.same_as(jt_want.pattern)
        np.testing.assert_array_equal(be.to_host(jt_got.data), jt_want.data)
    layer.eval()
    np.testing.assert_array_equal(be.to_host(layer.transposed_jacobian(be.asarray(x)).data), 1)


@pytest.mark.gpu
def test_gpu_masks_need_no_upload_or_synchronisation(device_stats):
    gpu = backend.get("gpu")
    x = gpu.asarray(make_input(4, (3, 8, 8)))
    layer = Dropout(0.5, rng=0)
    device_stats.clear()
    layer(x)
    layer.transposed_jacobian(x)
    assert device_stats.uploads == 0 and not device_stats.syncs
