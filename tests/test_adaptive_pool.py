"""AdaptiveAvgPool2d: forward, pattern and values against a plain-loop reference of PyTorch's rule,
float64 finite differences and PyTorch itself, on random configurations; CPU/GPU parity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from oracles import finite_difference_jt, torch_jt

from sparse_scan import backend
from sparse_scan.layers import AdaptiveAvgPool2d
from sparse_scan.layers._adaptive_pool import adaptive_windows

CPU = backend.get("cpu")

FIXED = [
    (1, (3, 7, 7)),                 # global average pooling
    ((2, 2), (2, 4, 6)),            # divisible
    ((3, 2), (2, 7, 5)),            # non-divisible: windows of unequal lengths that overlap
    ((2, None), (1, 5, 3)),         # None keeps the input's width
    ((None, 4), (2, 3, 9)),
    ((5, 4), (1, 3, 2)),            # larger than the input: inputs repeat
    ((None, None), (2, 3, 4)),      # the identity
    (4, (3, 4, 4)),
]


def random_configs(count: int, seed: int) -> list[tuple[object, tuple[int, int, int]]]:
    """Seeded random output sizes (ints, pairs, None entries, larger than the input) and shapes."""
    rng = np.random.default_rng(seed)
    configs = []
    for _ in range(count):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 10)), int(rng.integers(1, 10)))
        sizes = [None if rng.random() < 0.2 else int(rng.integers(1, 11)) for _ in range(2)]
        configs.append((sizes[0] if rng.random() < 0.2 and sizes[0] is not None else tuple(sizes), shape))
    return configs


CASES = FIXED + random_configs(24, seed=11)
IDS = [f"{i}-{size}-{'x'.join(map(str, shape))}" for i, (size, shape) in enumerate(CASES)]


def make_input(shape, batch=2, dtype=np.float64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype(dtype)


def out_sizes(size, shape) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else size
    return tuple(n if s is None else s for s, n in zip(pair, shape[1:], strict=True))


def reference_forward(size, x: np.ndarray) -> np.ndarray:
    """PyTorch's CPU kernel written out: start = floor(i n / m), end = ceil((i + 1) n / m)."""
    batch, channels, h, w = x.shape
    ho, wo = out_sizes(size, x.shape[1:])
    out = np.empty((batch, channels, ho, wo))
    for i in range(ho):
        h0, h1 = math.floor(i * h / ho), math.ceil((i + 1) * h / ho)
        for j in range(wo):
            w0, w1 = math.floor(j * w / wo), math.ceil((j + 1) * w / wo)
            out[:, :, i, j] = x[:, :, h0:h1, w0:w1].sum(axis=(2, 3)) / ((h1 - h0) * (w1 - w0))
    return out


def reference_members(size, shape) -> list[tuple[int, int]]:
    """Every (input, output) pair of the JT, sorted by row then column."""
    channels, h, w = shape
    ho, wo = out_sizes(size, shape)
    pairs = []
    for c in range(channels):
        for i in range(ho):
            for j in range(wo):
                for p in range(math.floor(i * h / ho), math.ceil((i + 1) * h / ho)):
                    for q in range(math.floor(j * w / wo), math.ceil((j + 1) * w / wo)):
                        pairs.append(((c * h + p) * w + q, (c * ho + i) * wo + j))
    return sorted(pairs)


def test_windows_follow_pytorch_rule():
    for n in range(1, 12):
        for m in range(1, 14):
            starts, ends = adaptive_windows(n, m)
            np.testing.assert_array_equal(starts, [math.floor(i * n / m) for i in range(m)])
            np.testing.assert_array_equal(ends, [math.ceil((i + 1) * n / m) for i in range(m)])


@pytest.mark.parametrize("size, shape", CASES, ids=IDS)
def test_forward_matches_reference(size, shape):
    layer = AdaptiveAvgPool2d(size)
    x = make_input(shape, batch=3)
    out = layer(x)
    assert out.shape == (3,) + layer.output_shape(shape) == (3, shape[0]) + out_sizes(size, shape)
    np.testing.assert_allclose(out, reference_forward(size, x), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("size, shape", CASES, ids=IDS)
def test_forward_matches_torch(size, shape):
    torch = pytest.importorskip("torch")
    x = make_input(shape, batch=3)
    module = torch.nn.AdaptiveAvgPool2d(size)
    np.testing.assert_allclose(AdaptiveAvgPool2d(size)(x), module(torch.from_numpy(x)).numpy(),
                               rtol=1e-13, atol=1e-15)
    x32 = x.astype(np.float32)
    np.testing.assert_allclose(AdaptiveAvgPool2d(size)(x32), module(torch.from_numpy(x32)).numpy(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size, shape", CASES, ids=IDS)
def test_jt_matches_finite_differences(size, shape):
    layer = AdaptiveAvgPool2d(size)
    x = make_input(shape)
    jt = layer.transposed_jacobian(x)
    assert jt.shared
    for b in range(x.shape[0]):
        np.testing.assert_allclose(jt.todense(), finite_difference_jt(layer.forward, x[b]), atol=1e-8)


@pytest.mark.parametrize("size, shape", CASES, ids=IDS)
def test_jt_matches_torch(size, shape):
    torch = pytest.importorskip("torch")
    x = make_input(shape)
    dense = AdaptiveAvgPool2d(size).transposed_jacobian(x).todense()
    for b in range(x.shape[0]):
        np.testing.assert_allclose(dense, torch_jt(torch.nn.AdaptiveAvgPool2d(size), x[b]), atol=1e-15)


@pytest.mark.parametrize("size, shape", CASES, ids=IDS)
def test_pattern_is_the_window_membership(size, shape):
    layer = AdaptiveAvgPool2d(size)
    pattern = layer.pattern(shape)
    members = reference_members(size, shape)
    assert pattern.shape == (math.prod(shape), math.prod(layer.output_shape(shape)))
    assert pattern.index_dtype == np.int32 and pattern.nnz == len(members)
    rows = pattern.row_of_entries()
    same_row = rows[1:] == rows[:-1]
    assert np.all(np.diff(pattern.indices)[same_row] > 0)  # sorted, unique columns per row
    assert list(zip(rows.tolist(), pattern.indices.tolist(), strict=True)) == members


@pytest.mark.parametrize("size, shape", CASES[:4], ids=IDS[:4])
def test_values_are_shared_per_dtype(size, shape):
    layer = AdaptiveAvgPool2d(size)
    assert layer.sample_independent and layer.jacobian_kind == "general"
    for dtype in (np.float32, np.float64):
        x = make_input(shape, batch=3, dtype=dtype)
        jt = layer.transposed_jacobian(x)
        assert jt.dtype == dtype and jt.data.shape == (jt.nnz,)
        assert layer.transposed_jacobian(x).data is jt.data  # computed once per dtype
        # every output averages its window: its column sums to 1
        np.testing.assert_allclose(np.bincount(jt.indices, weights=jt.data, minlength=jt.shape[1]), 1.0,
                                   rtol=1e-6)


def test_int64_indices_and_cache():
    layer = AdaptiveAvgPool2d((3, None))
    x = make_input((2, 7, 5))
    jt32, jt64 = (layer.transposed_jacobian(x, index_dtype=d) for d in (np.int32, np.int64))
    assert jt64.pattern.index_dtype == np.int64 and jt64.pattern.same_as(jt32.pattern)
    np.testing.assert_array_equal(jt64.data, jt32.data)
    assert layer.pattern((2, 7, 5)) is layer.pattern((2, 7, 5))


def test_global_pool_figures():
    pattern = AdaptiveAvgPool2d(1).pattern((64, 8, 8))
    assert pattern.shape == (4096, 64) and pattern.nnz == 4096


@pytest.mark.parametrize("build, field", [
    (lambda: AdaptiveAvgPool2d(0), "output_size"),
    (lambda: AdaptiveAvgPool2d(-2), "output_size"),
    (lambda: AdaptiveAvgPool2d((2,)), "output_size"),
    (lambda: AdaptiveAvgPool2d((2, 0)), "output_size"),
    (lambda: AdaptiveAvgPool2d(2.0), "output_size"),
    (lambda: AdaptiveAvgPool2d(True), "output_size"),
    (lambda: AdaptiveAvgPool2d("22"), "output_size"),
    (lambda: AdaptiveAvgPool2d(None), "output_size"),
    (lambda: AdaptiveAvgPool2d((2, 2**40)), "output_size"),
    (lambda: AdaptiveAvgPool2d(2)(np.zeros((2, 4, 4))), "input"),
    (lambda: AdaptiveAvgPool2d(2).pattern((4, 4)), "input"),
    (lambda: AdaptiveAvgPool2d(2).pattern((1, 0, 4)), "input"),
    (lambda: AdaptiveAvgPool2d(2).transposed_jacobian(np.zeros((1, 1, 4, 4), dtype=np.int32)), "input"),
])
def test_bad_arguments_name_layer_and_field(build, field):
    with pytest.raises(ValueError, match=rf"layer AdaptiveAvgPool2d: {field}:"):
        build()


@pytest.mark.parametrize("size", [3, (2, None), (None, 4), (2, 3)])
def test_repr_matches_torch(size):
    torch = pytest.importorskip("torch")
    assert repr(AdaptiveAvgPool2d(size)) == repr(torch.nn.AdaptiveAvgPool2d(size))


def test_a_list_is_a_pair():
    """A spec gives YAML lists (null for None); the layer keeps them as a tuple."""
    layer = AdaptiveAvgPool2d([2, None])
    assert layer.output_size == (2, None) and layer.output_shape((3, 5, 7)) == (3, 2, 7)


# --- GPU parity: the same body on NumPy and CuPy ---------------------------------------------------
@pytest.mark.parametrize("size, shape", CASES[:6] + CASES[-3:], ids=IDS[:6] + IDS[-3:])
@pytest.mark.parametrize("index_dtype", [None, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_backend_parity(be, size, shape, index_dtype, value_dtype):
    x = make_input(shape, batch=3, dtype=value_dtype)
    cpu_layer, layer = AdaptiveAvgPool2d(size), AdaptiveAvgPool2d(size)
    want = cpu_layer.transposed_jacobian(x, index_dtype=index_dtype)
    got = layer.transposed_jacobian(be.asarray(x), index_dtype=index_dtype)
    assert got.pattern.same_as(want.pattern) and got.pattern.index_dtype == want.pattern.index_dtype
    np.testing.assert_array_equal(be.to_host(got.data), want.data)
    rtol = 1e-6 if value_dtype == np.float32 else 1e-13
    np.testing.assert_allclose(be.to_host(layer(be.asarray(x))), cpu_layer(x), rtol=rtol, atol=rtol)
