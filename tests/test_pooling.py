"""MaxPool2d / AvgPool2d: forward, pattern, slot table and values against independent oracles.

Oracles: a plain-loop NumPy reference written from PyTorch's C++ kernels, float64 finite differences,
PyTorch itself (where installed), and the CUDA kernels of ``rawkernels/pooling.cu`` run on the CPU.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
from cuda_on_cpu import compile_for_cpu, pointer
from oracles import finite_difference_jt, torch_jt

from sparse_scan import backend
from sparse_scan.layers import AvgPool2d, MaxPool2d, _pooling
from sparse_scan.layers import _pooling_jt as pooling
from sparse_scan.layers._geometry import output_size
from sparse_scan.layers._pooling_jt import _max_selection_cpu, _pattern_cpu

CPU = backend.get("cpu")


# --- configurations ------------------------------------------------------------------------------
# (kwargs, (C, H, W)): overlapping windows, gaps (stride > kernel), padding (0, 1), dilation 2,
# ceil_mode windows clipped at the end of the input, non-square everything.
MAX_CONFIGS = [
    (dict(kernel_size=2), (2, 4, 6)),
    (dict(kernel_size=(3, 2), stride=(2, 1), padding=(0, 1), dilation=(2, 1), ceil_mode=True),
     (2, 7, 5)),
    (dict(kernel_size=2, stride=2, ceil_mode=True), (1, 5, 7)),
    (dict(kernel_size=3, stride=1, padding=1), (2, 4, 6)),
    (dict(kernel_size=(2, 3), stride=(3, 2)), (1, 8, 7)),
    (dict(kernel_size=(2, 3), stride=2, padding=(1, 1), dilation=2, ceil_mode=True), (3, 6, 9)),
]
AVG_CONFIGS = [
    (dict(kernel_size=2), (2, 4, 6)),
    (dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True,
          count_include_pad=False), (2, 6, 5)),
    (dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), (1, 6, 6)),
    (dict(kernel_size=(2, 4), stride=(1, 3), padding=(0, 1), count_include_pad=False), (2, 5, 8)),
    (dict(kernel_size=(3, 1), stride=(3, 2), ceil_mode=True, count_include_pad=True), (1, 7, 4)),
]


def random_configs(kind: str, count: int, seed: int) -> list[tuple[dict, tuple[int, int, int]]]:
    """Seeded random configurations whose windows fit their input."""
    rng = np.random.default_rng(seed)
    configs = []
    while len(configs) < count:
        kernel = tuple(int(k) for k in rng.integers(1, 5, 2))
        stride = tuple(int(s) for s in rng.integers(1, 4, 2))
        padding = tuple(int(rng.integers(0, k // 2 + 1)) for k in kernel)
        dilation = tuple(int(d) for d in rng.integers(1, 3, 2)) if kind == "max" else (1, 1)
        ceil_mode = bool(rng.integers(2))
        shape = (int(rng.integers(1, 4)), int(rng.integers(3, 10)), int(rng.integers(3, 10)))
        sizes = [output_size(n, k, s, p, p, d, ceil_mode)
                 for n, k, s, p, d in zip(shape[1:], kernel, stride, padding, dilation, strict=True)]
        if min(sizes) < 1:
            continue
        kwargs = dict(kernel_size=kernel, stride=stride, padding=padding, ceil_mode=ceil_mode)
        if kind == "max":
            kwargs["dilation"] = dilation
        else:
            kwargs["count_include_pad"] = bool(rng.integers(2))
        configs.append((kwargs, shape))
    return configs


CASES = ([("max", *c) for c in MAX_CONFIGS + random_configs("max", 14, seed=7)]
         + [("avg", *c) for c in AVG_CONFIGS + random_configs("avg", 14, seed=8)])
CASE_IDS = [f"{kind}-{i}" for i, (kind, _, _) in enumerate(CASES)]


def make_layer(kind: str, kwargs: dict):
    return (MaxPool2d if kind == "max" else AvgPool2d)(**kwargs)


def make_torch_layer(kind: str, kwargs: dict):
    import torch

    return (torch.nn.MaxPool2d if kind == "max" else torch.nn.AvgPool2d)(**kwargs)


def make_input(shape, batch=2, dtype=np.float64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype(dtype)


# --- plain-loop reference (PyTorch's CPU kernels, written out) ------------------------------------
def reference_windows(layer, shape):
    """``(Ho, Wo, table)``: table[k, o] = flat input index of offset k of output o, or -1."""
    c_in, h, w = shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (layer._kernel, layer._stride, layer._padding,
                                              layer._dilation)
    ho = output_size(h, kh, sh, ph, ph, dh, layer.ceil_mode)
    wo = output_size(w, kw, sw, pw, pw, dw, layer.ceil_mode)
    table = np.full((kh * kw, c_in * ho * wo), -1)
    for c in range(c_in):
        for oh in range(ho):
            for ow in range(wo):
                o = (c * ho + oh) * wo + ow
                for i in range(kh):
                    for j in range(kw):
                        ih, iw = oh * sh - ph + i * dh, ow * sw - pw + j * dw
                        if 0 <= ih < h and 0 <= iw < w:
                            table[i * kw + j, o] = (c * h + ih) * w + iw
    return ho, wo, table


def reference_divisor(layer, shape, ho, wo):
    """PyTorch's avg-pool divisor per output position, as its C++ kernel computes it."""
    (_, h, w), (kh, kw), (sh, sw), (ph, pw) = shape, layer._kernel, layer._stride, layer._padding
    divisor = np.empty((ho, wo))
    for oh in range(ho):
        for ow in range(wo):
            hstart, wstart = oh * sh - ph, ow * sw - pw
            hend, wend = min(hstart + kh, h + ph), min(wstart + kw, w + pw)
            pool_size = (hend - hstart) * (wend - wstart)
            hstart, wstart, hend, wend = max(hstart, 0), max(wstart, 0), min(hend, h), min(wend, w)
            real = (hend - hstart) * (wend - wstart)
            divisor[oh, ow] = pool_size if layer.count_include_pad else real
    return divisor


def reference_forward(kind, layer, x):
    ho, wo, table = reference_windows(layer, x.shape[1:])
    flat = x.reshape(x.shape[0], -1)
    out = np.empty((x.shape[0], table.shape[1]))
    for o in range(table.shape[1]):
        members = flat[:, table[table[:, o] >= 0, o]]
        out[:, o] = members.max(axis=1) if kind == "max" else members.sum(axis=1)
    out = out.reshape(x.shape[0], -1, ho, wo)
    if kind == "avg":
        out /= reference_divisor(layer, x.shape[1:], ho, wo)
    return out


# --- forward and Jacobian against the oracles ----------------------------------------------------
@pytest.mark.parametrize("kind, kwargs, shape", CASES, ids=CASE_IDS)
def test_forward_matches_reference(kind, kwargs, shape):
    layer = make_layer(kind, kwargs)
    x = make_input(shape, batch=3)
    out = layer(x)
    assert out.shape == (3,) + layer.output_shape(shape)
    np.testing.assert_allclose(out, reference_forward(kind, layer, x), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind, kwargs, shape", CASES, ids=CASE_IDS)
def test_forward_matches_torch(kind, kwargs, shape):
    torch = pytest.importorskip("torch")
    x = make_input(shape, batch=3)
    expected = make_torch_layer(kind, kwargs)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(make_layer(kind, kwargs)(x), expected, rtol=1e-13, atol=1e-15)
    x32 = x.astype(np.float32)
    expected = make_torch_layer(kind, kwargs)(torch.from_numpy(x32)).numpy()
    np.testing.assert_allclose(make_layer(kind, kwargs)(x32), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, kwargs, shape", CASES, ids=CASE_IDS)
def test_jt_matches_finite_differences(kind, kwargs, shape):
    layer = make_layer(kind, kwargs)
    x = make_input(shape)
    jt = layer.transposed_jacobian(x)
    dense = jt.todense()
    for b in range(x.shape[0]):
        expected = finite_difference_jt(layer.forward, x[b])
        np.testing.assert_allclose(dense if jt.shared else dense[b], expected, atol=1e-7)


@pytest.mark.parametrize("kind, kwargs, shape", CASES, ids=CASE_IDS)
def test_jt_matches_torch(kind, kwargs, shape):
    pytest.importorskip("torch")
    layer = make_layer(kind, kwargs)
    x = make_input(shape)
    dense = layer.transposed_jacobian(x).todense()
    for b in range(x.shape[0]):
        expected = torch_jt(make_torch_layer(kind, kwargs), x[b])
        np.testing.assert_allclose(dense if kind == "avg" else dense[b], expected, atol=1e-15)


@pytest.mark.parametrize("kind, kwargs, shape", CASES, ids=CASE_IDS)
def test_pattern_and_slot_table(kind, kwargs, shape):
    layer = make_layer(kind, kwargs)
    pattern = layer.pattern(shape)
    _, aux = layer._pattern_entry(shape, CPU, None)
    ho, wo, table = reference_windows(layer, shape)
    assert pattern.shape == (int(np.prod(shape)), table.shape[1])
    assert pattern.index_dtype == np.int32 and aux["slot"].dtype == np.int32
    # every row's columns strictly increase (sorted, unique)
    rows = pattern.row_of_entries()
    same_row = rows[1:] == rows[:-1]
    assert np.all(np.diff(pattern.indices)[same_row] > 0)
    # the entries are exactly the (input, output) window memberships
    outputs = np.broadcast_to(np.arange(table.shape[1]), table.shape)
    expected = sorted(zip(table[table >= 0].tolist(), outputs[table >= 0].tolist(), strict=True))
    assert list(zip(rows.tolist(), pattern.indices.tolist(), strict=True)) == expected
    # slot[k, o] is the entry of (input at offset k of o, o), -1 where offset k is padding
    slot = aux["slot"]
    np.testing.assert_array_equal(slot < 0, table < 0)
    np.testing.assert_array_equal(rows[slot[slot >= 0]], table[table >= 0])
    np.testing.assert_array_equal(pattern.indices[slot[slot >= 0]], outputs[table >= 0])
    assert slot.shape == (layer._kernel[0] * layer._kernel[1], pattern.shape[1])


@pytest.mark.parametrize("kind, kwargs, shape", CASES[:4] + CASES[-4:],
                         ids=CASE_IDS[:4] + CASE_IDS[-4:])
def test_values_dtype_and_sharing(kind, kwargs, shape):
    layer = make_layer(kind, kwargs)
    x = make_input(shape, batch=3, dtype=np.float32)
    jt = layer.transposed_jacobian(x)
    assert jt.dtype == np.float32
    if kind == "avg":
        assert layer.sample_independent and layer.jacobian_kind == "general"
        assert jt.shared and jt.data.shape == (jt.nnz,)
    else:
        assert not layer.sample_independent and layer.jacobian_kind == "selection"
        assert jt.data.shape == (3, jt.nnz)
        # a selection: one 1 per (sample, output), zeros elsewhere
        assert set(np.unique(jt.data).tolist()) <= {0.0, 1.0}
        per_output = np.stack([np.bincount(jt.indices, weights=d, minlength=jt.shape[1])
                               for d in jt.data])
        np.testing.assert_array_equal(per_output, 1.0)


# --- max-pool ties, -inf and NaN -----------------------------------------------------------------
def test_max_ties_select_first_maximum():
    x = np.zeros((1, 1, 3, 4))
    x[0, 0, 0, :2] = [1.0, 5.0]
    x[0, 0, 1, :2] = [2.0, 5.0]  # window (0, 0): offsets 1 and 3 tie at 5 -> offset 1
    x[0, 0, 2, 2:] = -np.inf  # window (1, 1): two -inf, its second row lies past the input
    layer = MaxPool2d(2, ceil_mode=True)
    jt = layer.transposed_jacobian(x)
    dense = jt.todense()[0]
    assert dense[1, 0] == 1.0 and dense[5, 0] == 0.0
    # all-zero windows -> their first element; all -inf -> the first too, as in PyTorch
    assert dense[2, 1] == 1.0 and dense[3, 1] == dense[6, 1] == dense[7, 1] == 0.0
    assert dense[8, 2] == 1.0 and dense[9, 2] == 0.0
    assert dense[10, 3] == 1.0 and dense[11, 3] == 0.0


@pytest.mark.parametrize("kwargs", [dict(kernel_size=2), dict(kernel_size=3, stride=1, padding=1),
                                    dict(kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1),
                                         ceil_mode=True)])
def test_max_ties_match_torch_gradient(kwargs):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.integers(-1, 2, size=(2, 2, 6, 7)).astype(np.float64)  # many ties
    x[0, 1, :3, :3] = -np.inf
    weights = rng.standard_normal((2,) + MaxPool2d(**kwargs).output_shape(x.shape[1:]))
    tx = torch.from_numpy(x).requires_grad_()
    torch.nn.MaxPool2d(**kwargs)(tx).backward(torch.from_numpy(weights))
    jt = MaxPool2d(**kwargs).transposed_jacobian(x)
    for b in range(2):
        grad = jt.to_scipy(sample=b) @ weights[b].ravel()
        np.testing.assert_array_equal(grad.reshape(x.shape[1:]), tx.grad[b].numpy())


def test_max_nan_in_window_is_selected_last_first():
    """PyTorch's rule: in window order an element replaces the one held if strictly greater or NaN, so
    a window's last NaN is selected (tests/test_ieee.py compares with PyTorch)."""
    x = make_input((1, 4, 4))
    x[0, 0, 1, 2] = np.nan  # window (0, 1): its one NaN, at offset p
    x[0, 0, 2, 1] = x[0, 0, 3, 0] = np.nan  # window (1, 0): two NaNs, b then p
    dense = MaxPool2d(2).transposed_jacobian(x).todense()[0]
    assert dense[1 * 4 + 2, 1] == 1 and dense[:, 1].sum() == 1
    assert dense[3 * 4 + 0, 2] == 1 and dense[2 * 4 + 1, 2] == 0 and dense[:, 2].sum() == 1
    # the forward pass propagates NaN like PyTorch
    assert np.isnan(MaxPool2d(2)(x)[0, 0, 0, 1]) and np.isnan(MaxPool2d(2)(x)[0, 0, 1, 0])


def test_the_hosts_2x2_forward_is_pytorchs_rule_on_every_special_value_order(monkeypatch):
    """The compiled 2x2 forward (pairs, then the bottom pair's choice over the top's) against the rule
    applied in window order (a later element wins if strictly greater or NaN), the sign of zeros
    included, for every order of four values from -inf, -1, -0, 0, 1, NaN; an odd last row and column
    (in no window) hold NaN that must not leak."""
    calls = []
    compiled = pooling.max_pool_2x2_forward
    monkeypatch.setattr(_pooling, "max_pool_2x2_forward", lambda g, x: calls.append(1) or compiled(g, x))
    special = [-np.inf, -1.0, -0.0, 0.0, 1.0, np.nan]
    orders = np.array(list(itertools.product(special, repeat=4)))  # a, b, p, q per window
    windows = len(orders)  # 1296: one row of 1296 windows per sample
    x = np.full((1, 1, 3, 2 * windows + 1), np.nan)
    x[0, 0, 0, 0:-1:2], x[0, 0, 0, 1::2] = orders[:, 0], orders[:, 1]
    x[0, 0, 1, 0:-1:2], x[0, 0, 1, 1::2] = orders[:, 2], orders[:, 3]
    for dtype in (np.float64, np.float32):
        calls.clear()
        out = MaxPool2d(2)(x.astype(dtype))
        assert calls and out.shape == (1, 1, 1, windows) and out.dtype == dtype
        for k, order in enumerate(orders):
            held = order[0]
            for value in order[1:]:
                if value > held or value != value:
                    held = value
            got = out[0, 0, 0, k]
            same = got == held and np.signbit(got) == np.signbit(held)
            assert (np.isnan(got) and np.isnan(held)) or same, (order, got, held)


def test_max_nan_outside_every_window_is_ignored():
    x = make_input((1, 5, 5))
    x[0, 0, 2, :] = np.nan  # kernel 2, stride 3: input row 2 lies in no window
    assert np.all(MaxPool2d(2, stride=3).transposed_jacobian(x).data.sum(axis=1) == 4)


# --- sizes, dtypes, cache, errors, repr ----------------------------------------------------------
def test_vgg_pool_figures():
    pattern = MaxPool2d(2, 2).pattern((64, 32, 32))
    assert pattern.shape == (65536, 16384)
    assert pattern.nnz == 65536
    assert pattern.sparsity == pytest.approx(1 - 1 / 16384)
    assert pattern.index_dtype == np.int32


@pytest.mark.parametrize("kind, kwargs, shape", [CASES[1], CASES[-1]])
def test_int64_indices(kind, kwargs, shape):
    layer = make_layer(kind, kwargs)
    x = make_input(shape)
    jt32, jt64 = (layer.transposed_jacobian(x, index_dtype=d) for d in (np.int32, np.int64))
    assert jt64.pattern.index_dtype == np.int64 and jt64.indptr.dtype == np.int64
    _, aux = layer._pattern_entry(shape, CPU, np.int64)
    assert aux["slot"].dtype == np.int64
    assert jt64.pattern.same_as(jt32.pattern)
    np.testing.assert_array_equal(jt64.data, jt32.data)


def test_pattern_is_cached():
    layer = MaxPool2d(3, stride=2, padding=1)
    assert layer.pattern((2, 7, 9)) is layer.pattern((2, 7, 9))
    assert layer.pattern((2, 7, 9), index_dtype=np.int64) is not layer.pattern((2, 7, 9))


@pytest.mark.parametrize("build, field", [
    (lambda: MaxPool2d(0), "kernel_size"),
    (lambda: MaxPool2d((2, -1)), "kernel_size"),
    (lambda: AvgPool2d(2, stride=0), "stride"),
    (lambda: MaxPool2d(2, stride=(1, 0)), "stride"),
    (lambda: MaxPool2d(3, dilation=0), "dilation"),
    (lambda: MaxPool2d(3, padding=-1), "padding"),
    (lambda: AvgPool2d(3, padding=(0, -1)), "padding"),
    (lambda: MaxPool2d(3, padding=2), "padding"),
    (lambda: AvgPool2d((2, 4), padding=(1, 3)), "padding"),
    (lambda: MaxPool2d(2.5), "kernel_size"),
    (lambda: MaxPool2d(2).pattern((4, 4)), "input"),
    (lambda: MaxPool2d(2).pattern((1, 0, 4)), "input"),
    (lambda: MaxPool2d(2)(np.zeros((2, 4, 4))), "input"),
    (lambda: AvgPool2d(2).transposed_jacobian(np.zeros((1, 1, 1, 4, 4))), "input"),
    (lambda: MaxPool2d(2)(np.zeros((1, 1, 4, 4), dtype=np.int64)), "input"),
    (lambda: MaxPool2d((5, 2)).pattern((1, 4, 4)), "kernel_size"),
    (lambda: MaxPool2d(3, dilation=(1, 3)).pattern((1, 4, 6)), "kernel_size"),
    (lambda: AvgPool2d((2, 3), padding=(1, 1))(np.zeros((1, 1, 1, 0))), "input"),
])
def test_bad_arguments_name_layer_and_field(build, field):
    with pytest.raises(ValueError, match=rf"layer (Max|Avg)Pool2d: {field}:"):
        build()


@pytest.mark.parametrize("kind, kwargs", [
    ("max", dict(kernel_size=2)),
    ("max", dict(kernel_size=(3, 2), stride=1, padding=(1, 0), dilation=2, ceil_mode=True)),
    ("avg", dict(kernel_size=3)),
    ("avg", dict(kernel_size=(2, 3), stride=(1, 2), padding=1, ceil_mode=True,
                 count_include_pad=False)),
])
def test_repr_matches_torch(kind, kwargs):
    pytest.importorskip("torch")
    assert repr(make_layer(kind, kwargs)) == repr(make_torch_layer(kind, kwargs))


# --- the CUDA kernels, compiled for the CPU ------------------------------------------------------
INDEX_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
VALUE_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _wrappers() -> str:
    text = []
    for index in INDEX_TYPES.values():
        tag = index.replace(" ", "_")
        text.append(
            f'extern "C" void row_counts_{tag}(int grid, int block, const long long* g, {index}* n)'
            f" {{ SHIM_LAUNCH(grid, block, pool_row_counts<{index}>(g, n)); }}\n"
            f'extern "C" void fill_{tag}(int grid, int block, const long long* g, const {index}* p,'
            f" {index}* ind, {index}* slot)"
            f" {{ SHIM_LAUNCH(grid, block, pool_fill<{index}>(g, p, ind, slot)); }}\n")
        for value in VALUE_TYPES.values():
            text.append(
                f'extern "C" void maxpool_{tag}_{value}(int grid, int block, const long long* g,'
                f" long long batch, const {value}* x, const {index}* slot, long long nnz,"
                f" {value}* data) {{ SHIM_LAUNCH(grid, block,"
                f" (maxpool_values<{index}, {value}>(g, batch, x, slot, nnz, data))); }}\n")
    return "".join(text)


@pytest.fixture(scope="module")
def kernels():
    return compile_for_cpu("pooling.cu", _wrappers())


def kernel_pattern(library, g, dtype, grid, block):
    tag = INDEX_TYPES[dtype].replace(" ", "_")
    geometry = g.as_array()
    counts = np.full(g.inputs, -7, dtype=dtype)
    getattr(library, f"row_counts_{tag}")(grid, block, pointer(geometry), pointer(counts))
    indptr = np.zeros(g.inputs + 1, dtype=dtype)
    np.cumsum(counts, out=indptr[1:])
    indices = np.full(g.nnz, -7, dtype=dtype)
    slot = np.full((g.offsets, g.outputs), -1, dtype=dtype)
    getattr(library, f"fill_{tag}")(grid, block, pointer(geometry), pointer(indptr),
                                    pointer(indices), pointer(slot))
    return indptr, indices, slot


def kernel_max_values(library, g, x, slot, nnz, grid, block):
    tag = INDEX_TYPES[slot.dtype].replace(" ", "_")
    data = np.zeros((x.shape[0], nnz), dtype=x.dtype)
    getattr(library, f"maxpool_{tag}_{VALUE_TYPES[x.dtype]}")(
        grid, block, pointer(g.as_array()), ctypes.c_longlong(x.shape[0]), pointer(x),
        pointer(slot), ctypes.c_longlong(nnz), pointer(data))
    return data


def first_windowed_input(pattern) -> int:
    """The first input element that lies in some window (a row with entries)."""
    return int(np.argmax(np.diff(pattern.indptr) > 0))


KERNEL_CASES = [c for c in CASES if c[0] == "max"][:8] + [c for c in CASES if c[0] == "avg"][:4]


@pytest.mark.parametrize("grid, block", [(1, 1), (3, 5), (16, 32)])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_pattern_kernels_on_cpu_match_numpy(kernels, grid, block, index_dtype):
    dtype = np.dtype(index_dtype)
    for kind, kwargs, shape in KERNEL_CASES:
        g = make_layer(kind, kwargs)._geometry(shape)
        expected = _pattern_cpu(CPU, g, dtype)
        for got, want in zip(kernel_pattern(kernels, g, dtype, grid, block), expected,
                             strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("grid, block", [(1, 1), (3, 5), (16, 32)])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_maxpool_kernel_on_cpu_matches_numpy(kernels, grid, block, index_dtype, value_dtype):
    rng = np.random.default_rng(5)
    for i, (kind, kwargs, shape) in enumerate(c for c in KERNEL_CASES if c[0] == "max"):
        layer = make_layer(kind, kwargs)
        pattern, aux = layer._pattern_entry(shape, CPU, index_dtype)
        x = make_input(shape, batch=3, dtype=value_dtype, seed=i)
        x[1] = rng.integers(-1, 2, size=shape)  # ties
        x[2, 0, :2, :2] = -np.inf
        g = aux["geometry"]
        data = kernel_max_values(kernels, g, x, aux["slot"], pattern.nnz, grid, block)
        want = _max_selection_cpu(CPU, x, aux, pattern.nnz)
        assert data.dtype == want.dtype
        np.testing.assert_array_equal(data, want)
        x[0].flat[first_windowed_input(pattern)] = np.nan
        x[0].reshape(-1)[1::5] = np.nan  # windows of several NaNs: the last one is selected
        np.testing.assert_array_equal(kernel_max_values(kernels, g, x, aux["slot"], pattern.nnz, grid, block),
                                      _max_selection_cpu(CPU, x, aux, pattern.nnz))


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_gpu_twins_launch_device_arrays_and_int64_scalars(monkeypatch, index_dtype, value_dtype):
    """The GPU twins called directly, each launch's arguments checked (device arrays, explicit int64
    scalars), against the NumPy twins."""
    gpu = backend.get("gpu")
    launches = []
    launch = pooling._gpu_kernels.launch

    def checked(kernel, work_items, args):
        assert all(isinstance(a, (gpu.xp.ndarray, np.int64)) for a in args), "explicit int64 scalars"
        launches.append(len(args))
        launch(kernel, work_items, args)

    monkeypatch.setattr(pooling._gpu_kernels, "launch", checked)
    for i, (kind, kwargs, shape) in enumerate(KERNEL_CASES):
        layer = make_layer(kind, kwargs)
        g = layer._geometry(shape)
        got = pooling.pattern.twins["gpu"](gpu, g, np.dtype(index_dtype))
        for a, b in zip(got, _pattern_cpu(CPU, g, np.dtype(index_dtype)), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(gpu.to_host(a), b)
        if kind == "max":
            pattern, aux = layer._pattern_entry(shape, CPU, index_dtype)
            _, device_aux = layer._pattern_entry(shape, gpu, index_dtype)
            x = make_input(shape, batch=2, dtype=value_dtype, seed=i)
            x[1] = np.round(x[1])
            got = pooling.max_selection.twins["gpu"](gpu, gpu.asarray(x), device_aux, pattern.nnz)
            np.testing.assert_array_equal(gpu.to_host(got), _max_selection_cpu(CPU, x, aux, pattern.nnz))
    assert 6 in launches and 2 in launches  # maxpool_values (6 arguments) and pool_row_counts (2) ran


# --- GPU parity: the same body on NumPy and CuPy ---------------------------------------------------
@pytest.mark.parametrize("kind, kwargs, shape", KERNEL_CASES + [CASES[-1]])
@pytest.mark.parametrize("index_dtype", [None, np.int64])
@pytest.mark.parametrize("value_dtype", [np.float32, np.float64])
def test_backend_parity(be, kind, kwargs, shape, index_dtype, value_dtype):
    x = make_input(shape, batch=3, dtype=value_dtype)
    x[1] = np.round(x[1])  # ties
    cpu_layer, layer = make_layer(kind, kwargs), make_layer(kind, kwargs)
    want = cpu_layer.transposed_jacobian(x, index_dtype=index_dtype)
    got = layer.transposed_jacobian(be.asarray(x), index_dtype=index_dtype)
    assert got.pattern.same_as(want.pattern)
    assert got.pattern.index_dtype == want.pattern.index_dtype
    np.testing.assert_array_equal(be.to_host(got.data), want.data)
    slots = [lay._pattern_entry(shape, b, index_dtype)[1]["slot"]
             for lay, b in ((layer, be), (cpu_layer, CPU))]
    np.testing.assert_array_equal(be.to_host(slots[0]), slots[1])
    np.testing.assert_allclose(be.to_host(layer(be.asarray(x))), cpu_layer(x), rtol=1e-6)
    if kind == "max":  # NaN selected alike
        x[0].flat[first_windowed_input(want.pattern)] = np.nan
        x[2].reshape(-1)[::3] = np.nan
        np.testing.assert_array_equal(
            be.to_host(layer.transposed_jacobian(be.asarray(x), index_dtype=index_dtype).data),
            cpu_layer.transposed_jacobian(x, index_dtype=index_dtype).data)
