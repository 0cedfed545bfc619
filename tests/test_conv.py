"""Conv2d: forward and analytic CSR transposed Jacobian against independent oracles."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
from cuda_on_cpu import compile_for_cpu, pointer
from oracles import finite_difference_jt, torch_jt

from sparse_scan import backend
from sparse_scan.engine._weights_path import gemm_pays
from sparse_scan.layers import Conv2d
from sparse_scan.layers._conv_jt import _structural_pattern_cpu
from sparse_scan.layers._conv_pruned import CSR_PATH_MAX_PADDED_SHARE, TRANSPOSED_MAX_DENSITY

# (in, out, kernel, stride, padding, dilation, groups, H, W): stride 2, dilation 2, groups,
# asymmetric padding, non-square kernels and inputs, 'same' with even kernels, kernel 1.
CONFIGS = [
    (3, 4, 3, 1, 1, 1, 1, 5, 6),
    (4, 6, (2, 3), 2, (1, 0), 1, 2, 7, 5),
    (2, 2, 3, (1, 2), 2, 2, 1, 6, 7),
    (3, 3, 3, 1, "same", 2, 3, 5, 4),
    (2, 3, (2, 4), 1, "same", 1, 1, 5, 6),
    (2, 2, 1, 3, 0, 1, 1, 7, 8),
    (4, 4, (3, 1), (2, 1), (0, 2), (1, 3), 4, 9, 4),
    (2, 4, 2, 2, 0, 1, 2, 4, 4),
    (1, 2, 4, 3, "valid", 1, 1, 10, 9),
]


def make_conv(cfg, dtype=np.float64, seed=1, **kwargs):
    cin, cout, k, s, p, d, g, _, _ = cfg
    return Conv2d(cin, cout, k, stride=s, padding=p, dilation=d, groups=g, dtype=dtype, rng=seed,
                  **kwargs)


def make_input(cfg, batch=2, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, cfg[0], cfg[7], cfg[8])).astype(dtype)


def naive_conv(conv: Conv2d, x: np.ndarray) -> np.ndarray:
    """Direct loops over output pixels and taps: the definition, independent of the engine."""
    top, _, left, _ = conv._pads
    out_c, out_h, out_w = conv.output_shape(x.shape[1:])
    kh_n, kw_n = conv.kernel_size
    cin_g, cout_g = conv.in_channels // conv.groups, conv.out_channels // conv.groups
    y = np.zeros((x.shape[0], out_c, out_h, out_w))
    for co in range(out_c):
        group = co // cout_g
        for oh in range(out_h):
            for ow in range(out_w):
                total = np.zeros(x.shape[0])
                for c in range(cin_g):
                    for kh in range(kh_n):
                        for kw in range(kw_n):
                            ih = oh * conv.stride[0] - top + kh * conv.dilation[0]
                            iw = ow * conv.stride[1] - left + kw * conv.dilation[1]
                            if 0 <= ih < x.shape[2] and 0 <= iw < x.shape[3]:
                                total += conv.weight[co, c, kh, kw] * x[:, group * cin_g + c, ih, iw]
                y[:, co, oh, ow] = total + (conv.bias[co] if conv.bias is not None else 0.0)
    return y


def torch_conv(conv: Conv2d):
    torch = pytest.importorskip("torch")
    module = torch.nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                             conv.padding, conv.dilation, conv.groups).double()
    module.weight.data = torch.from_numpy(conv.weight.astype(np.float64))
    module.bias.data = torch.from_numpy(conv.bias.astype(np.float64))
    return module


@pytest.mark.parametrize("cfg", CONFIGS)
def test_forward_matches_definition(cfg):
    conv, x = make_conv(cfg), make_input(cfg)
    np.testing.assert_allclose(conv.forward(x), naive_conv(conv, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_jt_matches_finite_differences(cfg):
    conv, x = make_conv(cfg), make_input(cfg)
    jt = conv.transposed_jacobian(x)
    assert jt.shared and jt.data.shape == (jt.nnz,)
    fd = finite_difference_jt(lambda v: naive_conv(conv, v), x[0])
    np.testing.assert_allclose(jt.todense(), fd, atol=1e-8)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_forward_and_jt_match_torch(cfg):
    conv, x = make_conv(cfg), make_input(cfg)
    module = torch_conv(conv)
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(conv.forward(x), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(conv.transposed_jacobian(x).todense(), torch_jt(module, x[0]),
                               atol=1e-14)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_pattern_is_canonical_and_exactly_the_guaranteed_nonzeros(cfg):
    conv = make_conv(cfg)
    conv.weight = np.ones_like(conv.weight)  # every structural entry is then a 1
    x = make_input(cfg)
    jt = conv.transposed_jacobian(x)
    p = jt.pattern
    assert p.indptr[0] == 0 and p.indptr[-1] == p.nnz and np.all(np.diff(p.indptr) >= 0)
    for row in range(p.shape[0]):
        cols = p.indices[p.indptr[row]: p.indptr[row + 1]]
        assert np.all(np.diff(cols) > 0)
    # structural non-zeros = entries of the finite-difference Jacobian of the all-ones conv
    fd = finite_difference_jt(lambda v: naive_conv(conv, v), x[0])
    np.testing.assert_array_equal(jt.todense() != 0, np.abs(fd) > 0.5)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_structured_fill_equals_gather(cfg, dtype):
    conv = make_conv(cfg, dtype=dtype)
    jt = conv.transposed_jacobian(make_input(cfg, dtype=dtype))
    _, widx = _structural_pattern_cpu(backend.get("cpu"), conv.geometry((cfg[0], cfg[7], cfg[8])), None)
    assert jt.dtype == dtype
    np.testing.assert_array_equal(jt.data, conv.weight.ravel()[widx])


def test_vgg11_first_conv_figures():
    conv = Conv2d(3, 64, 3, padding=1, rng=0)
    jt = conv.transposed_jacobian(np.zeros((2, 3, 32, 32), np.float32))
    assert jt.shape == (3072, 65536)
    assert jt.nnz == 1_696_512
    assert round(jt.pattern.sparsity, 5) == 0.99157
    assert jt.nbytes_values == 1_696_512 * 4 and round(jt.nbytes_values / 2**20, 1) == 6.5
    assert jt.nbytes_dense == 768 * 2**20
    assert jt.pattern.index_dtype == np.int32


def test_forced_int64_indices_give_the_same_matrix():
    cfg = CONFIGS[1]
    conv, x = make_conv(cfg), make_input(cfg)
    small = conv.transposed_jacobian(x)
    wide = conv.transposed_jacobian(x, index_dtype=np.int64)
    assert wide.pattern.index_dtype == np.int64 and small.pattern.index_dtype == np.int32
    np.testing.assert_array_equal(wide.todense(), small.todense())


def test_pattern_is_cached_per_shape():
    conv = make_conv(CONFIGS[0])
    assert conv.pattern((3, 5, 6)) is conv.pattern((3, 5, 6))
    assert conv.pattern((3, 6, 6)) is not conv.pattern((3, 5, 6))


@pytest.mark.parametrize("cfg", CONFIGS[:4])
def test_pruned_pattern_drops_zero_weights_and_follows_changes(cfg):
    conv, x = make_conv(cfg, prune_pattern=True), make_input(cfg)
    full = make_conv(cfg).transposed_jacobian(x)
    weight = conv.weight.copy()
    weight[np.random.default_rng(3).random(weight.shape) < 0.6] = 0.0
    conv.weight = weight
    pruned = conv.transposed_jacobian(x)
    assert pruned.nnz == np.count_nonzero(pruned.data) < full.nnz
    fd = finite_difference_jt(lambda v: naive_conv(conv, v), x[0])
    np.testing.assert_allclose(pruned.todense(), fd, atol=1e-8)
    first = conv.pattern(x.shape[1:])
    weight[weight == 0] = 0.5  # zero set changes: pattern re-derived
    conv.weight = weight
    assert conv.pattern(x.shape[1:]) is not first
    assert conv.transposed_jacobian(x).nnz == full.nnz


def test_pruned_pattern_rejects_non_finite_weights():
    conv = make_conv(CONFIGS[0], prune_pattern=True)
    weight = conv.weight.copy()
    weight[0, 0, 0, 0] = np.nan
    conv.weight = weight
    with pytest.raises(ValueError, match="weight"):
        conv.pattern((3, 5, 6))


@pytest.mark.parametrize("kwargs, field", [
    (dict(in_channels=3, out_channels=4, kernel_size=3, stride=0), "stride"),
    (dict(in_channels=3, out_channels=4, kernel_size=3, dilation=(1, 0)), "dilation"),
    (dict(in_channels=3, out_channels=4, kernel_size=0), "kernel_size"),
    (dict(in_channels=3, out_channels=4, kernel_size=3, groups=2), "groups"),
    (dict(in_channels=3, out_channels=4, kernel_size=3, padding=-1), "padding"),
    (dict(in_channels=3, out_channels=4, kernel_size=3, padding="same", stride=2), "padding"),
    (dict(in_channels=3, out_channels=4, kernel_size=3, padding_mode="reflect"), "padding_mode"),
    (dict(in_channels=0, out_channels=4, kernel_size=3), "in_channels"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Conv2d.*{field}"):
        Conv2d(**kwargs)


def test_bad_inputs_and_weights_name_layer_and_field():
    conv = Conv2d(3, 4, 5, dilation=2)
    conv.name = "conv1"
    with pytest.raises(ValueError, match="'conv1'.*in_channels.*2 channels"):
        conv.forward(np.zeros((1, 2, 16, 16), np.float32))
    with pytest.raises(ValueError, match="'conv1'.*kernel_size.*larger than the padded input"):
        conv.transposed_jacobian(np.zeros((1, 3, 8, 16), np.float32))
    with pytest.raises(ValueError, match="'conv1'.*input.*\\(C, H, W\\)"):
        conv.forward(np.zeros((3, 16, 16), np.float32))
    with pytest.raises(ValueError, match="'conv1'.*input.*float64.*float32"):
        conv.forward(np.zeros((1, 3, 16, 16), np.float64))
    with pytest.raises(ValueError, match="'conv1'.*input.*int64"):
        conv.forward(np.zeros((1, 3, 16, 16), np.int64))
    with pytest.raises(ValueError, match="'conv1'.*weight.*shape"):
        conv.weight = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match="'conv1'.*weight.*dtype"):
        conv.weight = np.zeros((4, 3, 5, 5), np.int32)
    with pytest.raises(ValueError, match="'conv1'.*bias.*shape"):
        conv.bias = np.zeros(3, np.float32)


# --- the CUDA source, run on the CPU through the shim, against the NumPy twin --------------------
WRAPPERS = r"""
#define GEO long long c_in, long long h, long long w, long long c_out, long long out_h, long long out_w, \
  long long k_h, long long k_w, long long s_h, long long s_w, long long p_t, long long p_l, \
  long long d_h, long long d_w, long long groups
#define GEO_ARGS c_in, h, w, c_out, out_h, out_w, k_h, k_w, s_h, s_w, p_t, p_l, d_h, d_w, groups
#define PATTERN(NAME, I) extern "C" void NAME(int grid, int block, GEO, const I* indptr, I* indices, \
  I* widx) { SHIM_LAUNCH(grid, block, conv_jt_fill_pattern<I>(GEO_ARGS, indptr, indices, widx)); }
#define VALUES(NAME, I, T) extern "C" void NAME(int grid, int block, GEO, const I* indptr, \
  const T* weight, T* data) { SHIM_LAUNCH(grid, block, conv_jt_fill_values<I, T>(GEO_ARGS, indptr, \
  weight, data)); }
PATTERN(pattern_int32, int)
PATTERN(pattern_int64, long long)
VALUES(values_int32_float32, int, float)
VALUES(values_int32_float64, int, double)
VALUES(values_int64_float32, long long, float)
VALUES(values_int64_float64, long long, double)
"""


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("launch", [(1, 1), (3, 5), (64, 32)])
def test_kernel_source_on_cpu_matches_numpy_twin(cfg, index_dtype, launch):
    library = compile_for_cpu("conv.cu", WRAPPERS)
    conv = make_conv(cfg)
    geometry = conv.geometry((cfg[0], cfg[7], cfg[8]))
    expected, expected_widx = _structural_pattern_cpu(backend.get("cpu"), geometry, index_dtype)
    index_name = np.dtype(index_dtype).name
    indices = np.full(expected.nnz, -7, dtype=index_dtype)
    widx = np.full(expected.nnz, -7, dtype=index_dtype)
    scalars = [ctypes.c_longlong(int(v)) for v in geometry.kernel_args()]
    getattr(library, f"pattern_{index_name}")(*launch, *scalars, pointer(expected.indptr),
                                              pointer(indices), pointer(widx))
    np.testing.assert_array_equal(indices, expected.indices)
    np.testing.assert_array_equal(widx, expected_widx)
    for dtype in (np.float32, np.float64):
        weight = conv.weight.astype(dtype)
        data = np.full(expected.nnz, np.nan, dtype=dtype)
        getattr(library, f"values_{index_name}_{np.dtype(dtype).name}")(
            *launch, *scalars, pointer(expected.indptr), pointer(weight), pointer(data))
        np.testing.assert_array_equal(data, weight.ravel()[expected_widx])


# --- GPU parity: the same bodies on NumPy and CuPy ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("prune", [False, True])
def test_gpu_twin_matches_cpu(cfg, dtype, prune):
    gpu = backend.get("gpu")
    conv = make_conv(cfg, dtype=dtype, prune_pattern=prune)
    if prune:
        weight = conv.weight.copy()
        weight[::2] = 0
        conv.weight = weight
    x = make_input(cfg, dtype=dtype)
    on_cpu = conv.transposed_jacobian(x)
    on_gpu = conv.transposed_jacobian(gpu.asarray(x))
    assert backend.of(on_gpu.data).name == "gpu"
    assert on_gpu.pattern.same_as(on_cpu.pattern)
    np.testing.assert_array_equal(gpu.to_host(on_gpu.data), on_cpu.data)
    np.testing.assert_allclose(gpu.to_host(conv.forward(gpu.asarray(x))), conv.forward(x),
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weights_matvec_equals_jt_product(cfg, dtype):
    """The transposed convolution through the weights equals JT @ g with the finite-difference JT
    (float64) and the CSR JT (both dtypes), for several samples at once."""
    conv, x = make_conv(cfg, dtype=dtype), make_input(cfg, batch=3, dtype=dtype)
    out_size = int(np.prod(conv.output_shape(x.shape[1:])))
    grad = np.random.default_rng(5).standard_normal((3, out_size)).astype(dtype)
    got = conv.weights_matvec(x.shape[1:])(grad)
    assert got.shape == (3, x[0].size) and got.dtype == dtype
    csr = conv.transposed_jacobian(x).todense()
    np.testing.assert_allclose(got, grad @ csr.T, rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-5 if dtype == np.float32 else 1e-12)
    if dtype == np.float64:
        fd = finite_difference_jt(lambda v: naive_conv(conv, v), x[0])
        np.testing.assert_allclose(got, grad @ fd.T, atol=1e-7)


def test_the_gemm_over_the_weights_pays_for_unpruned_weights_not_for_heavily_pruned_ones():
    shape = (8, 10, 10)
    dense = Conv2d(8, 16, 3, padding=1, rng=0)
    pruned = Conv2d(8, 16, 3, padding=1, rng=0, prune_pattern=True)
    weight = pruned.weight.copy()
    weight.ravel()[np.random.default_rng(0).permutation(weight.size)[: int(0.97 * weight.size)]] = 0
    pruned.weight = weight
    assert gemm_pays(dense.pattern_nnz(shape), dense.weights_path(shape))
    assert not gemm_pays(pruned.pattern_nnz(shape), pruned.weights_path(shape))
    assert not dense.weights_path(shape).csr and pruned.weights_path(shape).csr
    # pruned or not, the weights' GEMM is JT @ g: the zero weights contribute nothing
    x = np.random.default_rng(1).standard_normal((2,) + shape).astype(np.float32)
    grad = np.random.default_rng(2).standard_normal((2, 16 * 100)).astype(np.float32)
    np.testing.assert_allclose(pruned.weights_matvec(shape)(grad),
                               grad @ pruned.transposed_jacobian(x).todense().T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [cfg for cfg in CONFIGS if make_conv(cfg).weight.size >= 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heavily_pruned_weights_multiply_as_csr(cfg, dtype):
    """At most TRANSPOSED_MAX_DENSITY non-zeros: the CPU forward runs direct and the transposed
    convolution takes CSR weights (every geometry), equal to the direct definition and to JT, following
    assigned values (same zero set: the kept structure) and zero sets."""
    conv, x = make_conv(cfg, dtype=dtype, prune_pattern=True), make_input(cfg, dtype=dtype)
    weight = conv.weight.copy()
    keep = max(1, int(TRANSPOSED_MAX_DENSITY * weight.size))
    weight.ravel()[np.random.default_rng(4).permutation(weight.size)[keep:]] = 0
    conv.weight = weight
    assert conv._transposed_weights() is not None
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(conv.forward(x), naive_conv(conv, x), rtol=rtol, atol=rtol)
    layout = conv.pruned_weights()
    conv.weight = conv.weight * 3  # same zero set: the kept structure, the current values
    assert conv.pruned_weights() is layout
    np.testing.assert_allclose(conv.forward(x), naive_conv(conv, x), rtol=rtol, atol=rtol)
    # the transposed convolution through the same CSR weights is JT @ g (finite differences)
    grad = np.random.default_rng(6).standard_normal((x.shape[0], conv.forward(x)[0].size)).astype(dtype)
    got = conv.weights_matvec(x.shape[1:])(grad)
    assert got.dtype == dtype
    # the plan takes the CSR path unless most of its taps fall in the padding (JT's entries are the rest)
    taps = np.count_nonzero(conv.weight) * math.prod(conv.forward(x).shape[2:])
    mostly_inside = taps <= CSR_PATH_MAX_PADDED_SHARE * conv.transposed_jacobian(x).nnz
    assert conv.weights_path(x.shape[1:]).csr == mostly_inside
    if dtype == np.float64:
        fd = finite_difference_jt(lambda v: naive_conv(conv, v), x[0])
        np.testing.assert_allclose(got, grad @ fd.T, atol=1e-7)
    np.testing.assert_allclose(got, grad @ conv.transposed_jacobian(x).todense().T, rtol=rtol, atol=rtol)
    conv.weight = np.where(conv.weight == 0, dtype(1), conv.weight)  # dense now: back to the GEMM
    assert conv._transposed_weights() is None and not conv.weights_path(x.shape[1:]).csr
    np.testing.assert_allclose(conv.forward(x), naive_conv(conv, x), rtol=rtol, atol=rtol)
    weight = np.where(conv.weight == 1.0, dtype(0), conv.weight)
    weight.flat[0] = np.nan  # a diverged weight: NaN outputs, as PyTorch gives, not an error
    conv.weight = weight
    assert np.isnan(conv.forward(x)).any()


def test_pruned_pattern_follows_assigned_zero_sets_and_refuses_writes_in_place():
    conv = Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True)
    x = make_input((2, 3, 3, 1, 1, 1, 1, 5, 5))
    full = conv.transposed_jacobian(x).nnz
    with pytest.raises(ValueError, match="read-only"):  # the zero set changes only where it is counted
        conv.weight[0, 0] = 0.0
    weight = conv.weight.copy()
    weight[0, 0] = 0.0  # 9 weights of one (out, in) pair, 25 entries each at most
    conv.weight = weight
    weight[0, 1] = 0.0  # the layer holds a copy: the caller's array is theirs to change
    pruned = conv.transposed_jacobian(x)
    assert pruned.nnz < full
    np.testing.assert_allclose(pruned.todense(), finite_difference_jt(lambda v: naive_conv(conv, v), x[0]),
                               atol=1e-8)
    assert conv.transposed_jacobian(x).pattern is pruned.pattern  # unchanged zero set: cached
    conv.weight = conv.weight * 2  # a new version, the same zero set: the same pattern
    assert conv.transposed_jacobian(x).pattern is pruned.pattern
    weight = conv.weight.copy()
    weight[0, 0, 0, 0] = np.nan  # a new non-zero that is not finite cannot define a pattern
    conv.weight = weight
    with pytest.raises(ValueError, match=r"layer Conv2d: weight: non-finite"):
        conv.transposed_jacobian(x)


def test_update_weights_counts_zero_set_changes_only():
    """The optimizers' path: values changed in place at given positions; the zero set is derived
    again only where one of them became zero or non-zero."""
    conv = Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True)
    x = make_input((2, 3, 3, 1, 1, 1, 1, 5, 5))
    pattern = conv.transposed_jacobian(x).pattern
    version = conv._zero_set_version
    conv.update_weights(np.array([0, 5]), np.array([0.25, -0.5]))  # non-zero stays non-zero
    assert conv._zero_set_version == version and conv.weight.flat[5] == -0.5
    assert conv.transposed_jacobian(x).pattern is pattern
    conv.update_weights(np.array([0]), np.array([0.0]))  # a live weight lands on zero
    smaller = conv.transposed_jacobian(x)
    assert conv._zero_set_version > version and smaller.nnz < pattern.nnz
    conv.update_weights(np.array([0]), np.array([1.0]))  # and comes back
    assert conv.transposed_jacobian(x).nnz == pattern.nnz
    np.testing.assert_allclose(conv.transposed_jacobian(x).todense(),
                               finite_difference_jt(lambda v: naive_conv(conv, v), x[0]), atol=1e-8)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("prune", [False, True])
def test_pattern_nnz_is_counted_without_building_the_pattern(cfg, prune):
    conv = make_conv(cfg, prune_pattern=prune)
    if prune:
        weight = conv.weight.copy()
        weight[np.random.default_rng(4).random(weight.shape) < 0.5] = 0.0
        conv.weight = weight
    shape = (cfg[0], cfg[7], cfg[8])
    counted = conv.pattern_nnz(shape)
    assert not conv._patterns  # nothing built to count it
    assert counted == conv.pattern(shape).nnz


def test_kept_csr_weights_follow_a_dtype_change():
    """The CSR weights kept per zero set hold values of the weights' dtype: converting the layer
    (same zero set) gives results in the new dtype, equal to the direct definition."""
    cfg = CONFIGS[0]
    conv, x = make_conv(cfg, dtype=np.float32, prune_pattern=True), make_input(cfg, dtype=np.float32)
    weight = conv.weight.copy()
    weight.ravel()[np.random.default_rng(4).permutation(weight.size)[1:]] = 0
    conv.weight = weight
    assert conv.forward(x).dtype == np.float32
    conv.astype(np.float64)
    conv.weight = conv.weight * (1 + 1e-10)  # same zero set; values no float32 holds
    x64 = x.astype(np.float64)
    out = conv.forward(x64)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, naive_conv(conv, x64), rtol=1e-12, atol=1e-12)
    grad = np.ones((x.shape[0], out[0].size))
    assert conv.weights_matvec(x.shape[1:])(grad).dtype == np.float64


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("rows_from", [0, 10**6])
def test_compiled_columns_and_their_adjoint_equal_the_cupy_twins(monkeypatch, cfg, dtype, threaded,
                                                                 rows_from):
    """The host's compiled im2col and col2im against the CuPy twins' expressions run on NumPy:
    the same columns, and the same sums in the same order (every geometry, cut over channels and
    planes or not; col2im by rows of taps and by its table of pairs)."""
    from sparse_scan.layers import _conv_columns as _conv

    monkeypatch.setattr(_conv, "COL2IM_ROWS_MIN_WIDTH", rows_from)
    if threaded:
        monkeypatch.setattr(_conv, "workers_for", lambda work, minimum=None: 3)
    conv, x = make_conv(cfg, dtype=dtype), make_input(cfg, batch=3, dtype=dtype)
    g, cpu = conv.geometry(x.shape[1:]), backend.get("cpu")
    columns = _conv._im2col_cpu(cpu, x, g, conv._pads)
    np.testing.assert_array_equal(columns, _conv._im2col_gpu(cpu, x, g, conv._pads))
    taps = np.random.default_rng(2).standard_normal(columns.shape).astype(dtype)
    got = _conv._col2im_cpu(cpu, taps, g, conv._pads, 3)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, _conv._col2im_gpu(cpu, taps, g, conv._pads, 3))


def test_csr_weights_and_jt_values_take_the_values_of_every_version_once():
    """A pruned layer's kept CSR weights and JT values are filled once per version of the weights:
    after an assignment and after update_weights (the optimizers' path), not at every call."""
    conv = make_conv(CONFIGS[0], prune_pattern=True)
    x = make_input(CONFIGS[0])
    weight = conv.weight.copy()
    weight.ravel()[np.random.default_rng(4).permutation(weight.size)[2:]] = 0
    conv.weight = weight
    values = conv.transposed_jacobian(x).data
    assert conv.transposed_jacobian(x[:1]).data is values  # every batch reads the same values
    conv.forward(x)
    pruned = conv.pruned_weights()
    kept = pruned._values["cpu"][1]
    conv.forward(x)
    assert pruned._values["cpu"] == (conv._version, kept) and pruned._transposed is None
    live = np.flatnonzero(conv.weight)
    conv.update_weights(live, conv.weight.ravel()[live] * 3)
    np.testing.assert_allclose(conv.forward(x), naive_conv(conv, x), rtol=1e-12, atol=1e-12)
    grad = np.random.default_rng(6).standard_normal((x.shape[0], conv.forward(x)[0].size))
    np.testing.assert_allclose(conv.weights_matvec(x.shape[1:])(grad),
                               grad @ conv.transposed_jacobian(x).todense().T, rtol=1e-12, atol=1e-12)
    assert conv.pruned_weights() is pruned  # the same zero set: the same kept weights
    assert pruned._values["cpu"][0] == pruned._transposed[2][0] == conv._version
    np.testing.assert_allclose(conv.transposed_jacobian(x).todense(),
                               finite_difference_jt(lambda v: naive_conv(conv, v), x[0]), atol=1e-8)
    assert not np.array_equal(conv.transposed_jacobian(x).data, values)


def test_pruned_layers_on_tiny_planes_keep_the_spmv():
    """VGG-11's last pruned convolutions (3x3, padding 1, on 2x2 planes): 2.25 taps per JT entry, and
    on 4x4 planes 1.44, the compiled kernel over the CSR weights; on 1x1 planes (9 taps per entry, 8 of
    them in the padding) JT's SpMV."""
    for side, through_weights in [(1, False), (2, True), (4, True)]:
        conv = Conv2d(64, 64, 3, padding=1, rng=0, prune_pattern=True)
        weight = conv.weight.copy()
        weight.ravel()[np.random.default_rng(1).permutation(weight.size)[weight.size // 33:]] = 0
        conv.weight = weight
        assert conv.weights_path((64, side, side)).csr is through_weights


@pytest.mark.parametrize("shape", [(16, 64, 1024), (3, 5, 4), (1, 7, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_hosts_bias_gradient_is_summed_in_float64(shape, dtype):
    from sparse_scan.layers._weighted import bias_gradient

    grad = np.random.default_rng(0).standard_normal(shape).astype(dtype) * 100
    got = bias_gradient(backend.get("cpu"), grad)
    exact = np.array([math.fsum(grad[:, c].ravel().astype(np.float64)) for c in range(shape[1])])
    assert got.dtype == dtype
    if dtype == np.float32:  # float64's sum errs far below float32's rounding: the exact sum, rounded
        np.testing.assert_allclose(got, exact.astype(dtype), rtol=np.finfo(dtype).eps, atol=0)
    else:  # a reassociated float64 sum: within a few epsilons of the magnitudes summed
        bound = 4 * np.finfo(dtype).eps * np.abs(grad).sum(axis=(0, 2))
        assert np.all(np.abs(got - exact) <= bound)
    grad[0, 0, 0], grad[-1, -1, -1] = np.nan, np.inf
    got = bias_gradient(backend.get("cpu"), grad)
    assert np.isnan(got[0]) and (np.isinf(got[-1]) if shape[1] > 1 else True)
