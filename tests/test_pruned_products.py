"""Pruned layers are sparse in the whole iteration (sparse_scan/layers/_conv_pruned.py): the direct
sparse forward and the sampled weight gradient of a pruned Conv2d or Linear against independent
oracles (the convolution and its weight gradient written as sums over window slices, in float64, and
PyTorch's ``conv2d``/``conv2d_weight`` where installed), for grouped, strided, dilated and padded
convolutions and Linear layers, masks keeping 0 % to 99.9 % of the weights, both sides of the
crossovers, 1-3 threads, float32 and float64; where an input or a gradient is not finite the dense
path's IEEE results (PyTorch's); the GPU twins (``rawkernels/conv.cu``) against the host's."""

from __future__ import annotations

import numpy as np
import pytest
from test_conv_kernels import GEOMETRIES as KERNEL_GEOMETRIES

from sparse_scan import backend
from sparse_scan.layers import Conv2d, Linear
from sparse_scan.layers import _conv as conv_module
from sparse_scan.layers import _conv_pruned as pruned_module
from sparse_scan.layers import _linear as linear_module
from sparse_scan.layers import _weighted as weighted_module

# test_conv_kernels' geometries (in, out, kernel, stride, padding, dilation, groups, (H, W)) but its two
# wide ones (its per-row kernel), and a depthwise convolution on a 2x2 plane (its taps mostly padding)
GEOMETRIES = KERNEL_GEOMETRIES[:6] + [(4, 4, 3, 1, 1, 1, 4, (2, 2))]
LINEARS = [(7, 5), (32, 3), (1, 9)]
KEPT = [0.0, 0.001, 0.03, 0.3, 0.999]


def tolerance(dtype) -> float:
    return 1e-5 if np.dtype(dtype) == np.float32 else 1e-12


def _padded(x, top, left, rows, cols):
    out = np.zeros((x.shape[0], x.shape[1], rows, cols))
    h, w = x.shape[2:]
    out[:, :, top:top + h, left:left + w] = x[:, :, :max(0, min(h, rows - top)), :max(0, min(w, cols - left))]
    return out


def taps(x, conv, out_h, out_w):
    """``patch[a, b]``: the input each output reads through kernel tap (a, b), zero in the padding,
    ``(B, C, Ho, Wo)``, float64."""
    top, _, left, _ = conv._pads
    kh, kw = conv.kernel_size
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    rows = top + x.shape[2] + sh * out_h + dh * kh
    cols = left + x.shape[3] + sw * out_w + dw * kw
    padded = _padded(np.asarray(x, np.float64), top, left, rows, cols)
    return {(a, b): padded[:, :, a * dh:a * dh + sh * out_h:sh, b * dw:b * dw + sw * out_w:sw]
            for a in range(kh) for b in range(kw)}


def conv_oracle(conv, weight, x):
    """Forward of ``conv`` with ``weight`` (every weight, zeros included), float64."""
    _, out_h, out_w = conv.output_shape(x.shape[1:])
    cin_g, cout_g = conv.in_channels // conv.groups, conv.out_channels // conv.groups
    y = np.zeros((x.shape[0], conv.out_channels, out_h, out_w))
    for (a, b), patch in taps(x, conv, out_h, out_w).items():
        for group in range(conv.groups):
            w = np.asarray(weight[group * cout_g:(group + 1) * cout_g, :, a, b], np.float64)
            y[:, group * cout_g:(group + 1) * cout_g] += np.einsum(
                "oc,nchw->nohw", w, patch[:, group * cin_g:(group + 1) * cin_g])
    if conv.bias is not None:
        y += np.asarray(conv.bias, np.float64)[:, None, None]
    return y


def weight_gradient_oracle(conv, x, grad):
    """Every weight's gradient of ``conv`` at ``x`` for the output gradient ``grad``, float64."""
    _, out_h, out_w = conv.output_shape(x.shape[1:])
    cin_g, cout_g = conv.in_channels // conv.groups, conv.out_channels // conv.groups
    grad = np.asarray(grad, np.float64).reshape(x.shape[0], conv.out_channels, out_h, out_w)
    out = np.zeros(conv.weight.shape)
    for (a, b), patch in taps(x, conv, out_h, out_w).items():
        for group in range(conv.groups):
            out[group * cout_g:(group + 1) * cout_g, :, a, b] = np.einsum(
                "nohw,nchw->oc", grad[:, group * cout_g:(group + 1) * cout_g],
                patch[:, group * cin_g:(group + 1) * cin_g])
    return out


def pruned_layer(kind, spec, dtype, kept, seed):
    """A pruned Conv2d (``spec`` a geometry) or Linear (``spec`` its sizes) keeping ``kept`` of its
    weights (at least one where ``kept`` > 0), at random."""
    if kind == "conv":
        cin, cout, kernel, stride, padding, dilation, groups, _ = spec
        layer = Conv2d(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
                       dtype=dtype, rng=seed, prune_pattern=True)
    else:
        layer = Linear(*spec, dtype=dtype, rng=seed, prune_pattern=True)
    weight = layer.weight.copy()
    keep = 0 if kept == 0 else max(1, int(round(kept * weight.size)))
    weight.ravel()[np.random.default_rng(seed).permutation(weight.size)[keep:]] = 0
    layer.weight = weight
    return layer


def batch_for(kind, spec, batch, dtype, seed):
    rng = np.random.default_rng(seed)
    shape = (batch, spec[0], *spec[7]) if kind == "conv" else (batch, spec[0])
    return rng.standard_normal(shape).astype(dtype)


def as_conv(layer):
    """A Linear layer as the 1x1 convolution it is, for the oracles."""
    if isinstance(layer, Conv2d):
        return layer
    conv = Conv2d(layer.in_features, layer.out_features, 1, bias=layer.bias is not None, dtype=np.float64)
    conv.weight = np.asarray(layer.weight, np.float64)[:, :, None, None]
    if layer.bias is not None:
        conv.bias = np.asarray(layer.bias, np.float64)
    return conv


def oracles(layer, x, grad):
    """(forward, masked weight gradient) of ``layer`` by the window oracles, float64."""
    conv = as_conv(layer)
    x4 = x.reshape(x.shape[0], conv.in_channels, *x.shape[2:]) if x.ndim == 4 else x[:, :, None, None]
    forward = conv_oracle(conv, conv.weight, x4).reshape(x.shape[0], -1)
    gradient = weight_gradient_oracle(conv, x4, grad).reshape(layer.weight.shape)
    return forward, gradient * (layer.weight != 0)


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"threads{t}")
def threads(request, monkeypatch):
    """The kernels' pieces: runs of channels over ``threads`` threads."""
    monkeypatch.setattr(pruned_module, "workers_for", lambda work, minimum=None: request.param)
    return request.param


@pytest.fixture(params=["sparse", "dense"])
def path(request, monkeypatch):
    """Both sides of the crossovers at every density: the sparse products for every mask, or the dense
    GEMMs (masked) for every mask."""
    limit = 1.0 if request.param == "sparse" else -1.0
    monkeypatch.setattr(conv_module, "DIRECT_MAX_DENSITY", limit)
    monkeypatch.setattr(linear_module, "LINEAR_DIRECT_MAX_DENSITY", limit)
    monkeypatch.setattr(weighted_module, "SAMPLED_MAX_DENSITY", limit)
    return request.param


CASES = ([("conv", g) for g in GEOMETRIES] + [("linear", s) for s in LINEARS])


@pytest.mark.parametrize("kind, spec", CASES, ids=lambda c: c if isinstance(c, str) else "x".join(
    map(str, c[:3])) + (f"-g{c[6]}" if len(c) > 6 else ""))
@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sparse_products_equal_the_definition(kind, spec, kept, dtype, path, threads):
    """Forward and weight gradient of a pruned layer at every density, on both paths: the window-sum
    oracles' (float64: within 1e-12 of the largest entry; float32: 1e-5), the pruned weights'
    gradients exactly zero."""
    layer = pruned_layer(kind, spec, dtype, kept, seed=threads)
    x = batch_for(kind, spec, 3, dtype, seed=threads)
    y = layer.forward(x)
    grad = np.random.default_rng(7).standard_normal(y.shape).astype(dtype)
    forward, gradient = oracles(layer, x, grad)
    got = layer.parameter_gradients(x, grad)["weight"]
    assert y.dtype == got.dtype == dtype and got.shape == layer.weight.shape
    scale = max(1.0, np.abs(forward).max())
    np.testing.assert_allclose(y.reshape(forward.shape), forward, rtol=0, atol=tolerance(dtype) * scale)
    scale = max(1.0, np.abs(gradient).max())
    np.testing.assert_allclose(got, gradient, rtol=0, atol=tolerance(dtype) * scale)
    assert not got[layer.weight == 0].any()  # exactly zero at the pruned weights


def test_the_sparse_paths_run_no_dense_product(monkeypatch):
    """Heavily pruned: the forward and the weight gradient never form im2col's columns or the GEMM."""
    layer = pruned_layer("conv", GEOMETRIES[0], np.float64, 0.03, seed=0)
    monkeypatch.setattr(Conv2d, "_columns", lambda *args: pytest.fail("a dense product ran"))
    x = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=0)
    y = layer.forward(x)
    layer.parameter_gradients(x, np.ones_like(y))


def test_a_linear_layers_sparse_products_run_no_gemm(monkeypatch):
    layer = pruned_layer("linear", (40, 30), np.float64, 0.03, seed=0)
    x = batch_for("linear", (40, 30), 4, np.float64, seed=1)
    expected = oracles(layer, x, np.ones((4, 30)))
    weight = layer.weight
    monkeypatch.setattr(Linear, "weight", property(lambda self: pytest.fail("the dense weights were read")))
    np.testing.assert_allclose(layer.forward(x), expected[0], rtol=1e-12)
    np.testing.assert_allclose(layer.parameter_gradients(x, np.ones((4, 30)))["weight"], expected[1],
                               rtol=1e-12, atol=1e-12)
    assert weight is not None


def test_the_gradient_of_every_weight_on_request():
    """``sampled_gradient = False``: every weight's gradient, the zero ones' included (the bridge's
    prune_pattern=True without masks)."""
    layer = pruned_layer("conv", GEOMETRIES[1], np.float64, 0.03, seed=0)
    layer.sampled_gradient = False
    x = batch_for("conv", GEOMETRIES[1], 2, np.float64, seed=0)
    grad = np.random.default_rng(1).standard_normal(layer.forward(x).shape)
    expected = weight_gradient_oracle(layer, x, grad)
    got = layer.parameter_gradients(x, grad)["weight"]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert np.count_nonzero(got) > 10 * np.count_nonzero(layer.weight)


@pytest.mark.parametrize("where", ["input", "gradient"])
def test_infinities_and_nans_give_the_dense_products_results(where):
    """``0 * inf`` is NaN: PyTorch's dense convolution multiplies the pruned (zero) weights too, so an
    infinite input makes NaN outputs and gradients the kept weights alone would not. The sparse paths
    see it while they copy and leave those batches to the dense path: NaN where the oracle (every
    weight, zeros included) has NaN, masked gradients (NaN * 0 stays NaN, as autograd's mask)."""
    layer = pruned_layer("conv", GEOMETRIES[0], np.float64, 0.03, seed=0)
    x = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=0)
    grad = np.random.default_rng(1).standard_normal((2, *layer.output_shape(x.shape[1:])))
    if where == "input":
        x[0, 1, 4, 4] = np.inf
        x[1, 0, 0, 3] = np.nan
    else:
        grad[0, 2, 3, 3] = -np.inf
    with np.errstate(invalid="ignore"):
        expected = conv_oracle(layer, layer.weight, x)
        gradient = weight_gradient_oracle(layer, x, grad) * (layer.weight != 0)
        got = layer.forward(x)
        weights = layer.parameter_gradients(x, grad)["weight"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got[~np.isnan(got)], expected[~np.isnan(expected)], rtol=1e-12)
    np.testing.assert_array_equal(np.isnan(weights), np.isnan(gradient))
    assert np.isnan(weights).any()
    finite = np.isfinite(gradient)
    np.testing.assert_allclose(weights[finite], gradient[finite], rtol=1e-12, atol=1e-12)


def test_pytorch_agrees(threads):
    """PyTorch's convolution and its weight gradient (masked) on a grouped, strided, dilated, padded
    convolution pruned to 3 %: float64 within 1e-12, float32 within 1e-5."""
    torch = pytest.importorskip("torch")
    for dtype in (np.float32, np.float64):
        spec = GEOMETRIES[2]
        layer = pruned_layer("conv", spec, dtype, 0.03 if threads < 3 else 0.2, seed=threads)
        x = batch_for("conv", spec, 4, dtype, seed=threads)
        y = layer.forward(x)
        grad = np.random.default_rng(3).standard_normal(y.shape).astype(dtype)
        weight = torch.from_numpy(layer.weight.copy()).requires_grad_(True)
        out = torch.nn.functional.conv2d(torch.from_numpy(x), weight, torch.from_numpy(layer.bias),
                                         layer.stride, (layer._pads[0], layer._pads[2]), layer.dilation,
                                         layer.groups)
        out.backward(torch.from_numpy(grad))
        expected = weight.grad.numpy() * (layer.weight != 0)
        np.testing.assert_allclose(y, out.detach().numpy(), rtol=0,
                                   atol=tolerance(dtype) * np.abs(out.detach().numpy()).max())
        np.testing.assert_allclose(layer.parameter_gradients(x, grad)["weight"], expected, rtol=0,
                                   atol=tolerance(dtype) * np.abs(expected).max())


def test_kept_weights_are_derived_once_per_zero_set_and_read_once_per_version():
    layer = pruned_layer("conv", GEOMETRIES[0], np.float64, 0.03, seed=0)
    x = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=0)
    pruned = layer.pruned_weights()
    assert layer.pruned_weights() is pruned and pruned.nnz == np.count_nonzero(layer.weight)
    np.testing.assert_array_equal(pruned.positions, np.flatnonzero(layer.weight))
    layer.forward(x)
    values = pruned._values["cpu"][1]
    layer.forward(x)
    assert pruned._values["cpu"][1] is values  # the same version: not gathered again
    layer.weight = layer.weight * 2  # the same zero set: the same kept weights, new values
    assert layer.pruned_weights() is pruned
    np.testing.assert_allclose(layer.forward(x), conv_oracle(layer, layer.weight, x), rtol=1e-12)
    weight = layer.weight.copy()
    weight.ravel()[pruned.positions[0]] = 0
    layer.weight = weight  # a new zero set
    assert layer.pruned_weights() is not pruned and layer.pruned_weights().nnz == pruned.nnz - 1


def test_the_weight_gradient_reads_the_forwards_planes_of_the_same_batch_only(monkeypatch):
    """The forward's input planes serve the weight gradient of that very array (no second copy); a
    forward always copies its input (a buffer refilled in place between forwards is read anew), and a
    gradient of another array copies that one."""
    from sparse_scan.layers import _conv_pruned

    layer = pruned_layer("conv", GEOMETRIES[0], np.float64, 0.03, seed=0)
    copies = []
    planes = _conv_pruned._planes
    monkeypatch.setattr(_conv_pruned, "_planes",
                        lambda x, *rest, **named: copies.append(x.shape) or planes(x, *rest, **named))
    x = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=0)
    grad = np.random.default_rng(1).standard_normal(layer.forward(x).shape)
    np.testing.assert_allclose(layer.parameter_gradients(x, grad)["weight"], oracles(layer, x, grad)[1],
                               rtol=1e-12, atol=1e-12)
    assert len(copies) == 2  # the forward's input, the gradient's output gradient: the input not again
    x[:] = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=5)  # the buffer refilled in place
    np.testing.assert_allclose(layer.forward(x), conv_oracle(layer, layer.weight, x), rtol=1e-12)
    np.testing.assert_allclose(layer.parameter_gradients(x, grad)["weight"], oracles(layer, x, grad)[1],
                               rtol=1e-12, atol=1e-12)
    other = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=6)
    np.testing.assert_allclose(layer.parameter_gradients(other, grad)["weight"],
                               oracles(layer, other, grad)[1], rtol=1e-12, atol=1e-12)
    assert len(copies) == 2 + 2 + 2  # the second forward and gradient as the first; the other array: both


def test_assign_masked_multiplies_only_where_the_dense_weights_are_read():
    """The bridge's ``weight_orig * weight_mask`` of every forward: nothing multiplied or copied per
    assignment; the sparse products read the kept values, a dense read multiplies once."""
    layer = Conv2d(4, 6, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True)
    mask = np.random.default_rng(0).random(layer.weight.shape) < 0.03  # every product sparse
    values = np.random.default_rng(1).standard_normal(layer.weight.shape)
    layer.assign_masked(values, mask)
    target = layer._dense_weight
    target[...] = np.nan  # written only when the dense weights are read
    x = np.random.default_rng(2).standard_normal((2, 4, 6, 6))
    y = layer.forward(x)
    grads = layer.parameter_gradients(x, np.ones_like(y))
    layer.weights_matvec(x.shape[1:])(np.ones((2, y[0].size)))
    assert np.isnan(target).all()
    np.testing.assert_allclose(y, conv_oracle(layer, values * mask, x), rtol=1e-12)
    expected = weight_gradient_oracle(layer, x, np.ones_like(y)) * mask
    np.testing.assert_allclose(grads["weight"], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(layer.weight, values * mask)  # read: multiplied now
    assert layer.weight is target


# --- the GPU twins: the same bodies on NumPy and CuPy ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind, spec", CASES[:6] + CASES[-2:])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kept", [0.0, 0.03, 0.999])
def test_gpu_twins_match_the_hosts(kind, spec, dtype, kept, path):
    """``rawkernels/conv.cu``'s pruned forward and sampled weight gradient (and the dense paths, masked,
    beyond the crossovers) equal the host twins."""
    gpu = backend.get("gpu")
    layer = pruned_layer(kind, spec, dtype, kept, seed=1)
    x = batch_for(kind, spec, 3, dtype, seed=1)
    y = layer.forward(x)
    grad = np.random.default_rng(4).standard_normal(y.shape).astype(dtype)
    on_gpu = layer.forward(gpu.asarray(x))
    assert backend.of(on_gpu).name == "gpu"
    np.testing.assert_allclose(gpu.to_host(on_gpu), y, rtol=0,
                               atol=tolerance(dtype) * max(1, np.abs(y).max()))
    expected = layer.parameter_gradients(x, grad)["weight"]
    expected_kept = layer.kept_gradient
    on_device = layer.parameter_gradients(gpu.asarray(x), gpu.asarray(grad))["weight"]
    got, got_kept = gpu.to_host(on_device), layer.kept_gradient
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance(dtype) * max(1, np.abs(expected).max()))
    assert not got[layer.weight == 0].any()
    # the sampled product's values at the kept weights, in their order, on both (none where it is dense)
    assert (expected_kept is None) == (got_kept is None) == (path == "dense")
    if expected_kept is not None:
        np.testing.assert_array_equal(expected_kept, expected.reshape(-1)[layer.weight.reshape(-1) != 0])
        np.testing.assert_array_equal(gpu.to_host(got_kept), got.reshape(-1)[layer.weight.reshape(-1) != 0])


@pytest.mark.gpu
def test_gpu_twins_leave_non_finite_batches_to_the_dense_path():
    gpu = backend.get("gpu")
    layer = pruned_layer("conv", GEOMETRIES[0], np.float64, 0.03, seed=0)
    x = batch_for("conv", GEOMETRIES[0], 2, np.float64, seed=0)
    x[0, 1, 4, 4] = np.inf
    with np.errstate(invalid="ignore"):
        expected = layer.forward(x)
        grads = layer.parameter_gradients(x, np.ones_like(expected))["weight"]
        got = gpu.to_host(layer.forward(gpu.asarray(x)))
        got_grads = gpu.to_host(layer.parameter_gradients(gpu.asarray(x), gpu.asarray(np.ones_like(expected)))
                                ["weight"])
    assert np.isnan(expected).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isnan(got_grads), np.isnan(grads))
    assert layer.kept_gradient is None  # a dense product masked: NaN may sit at the pruned weights


def test_a_sampled_gradient_reuses_the_memory_of_the_last_one_only_where_nothing_holds_it():
    from sparse_scan.layers import _conv_pruned

    layer = Conv2d(4, 6, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True)
    layer.weight = layer.weight * (np.random.default_rng(0).random(layer.weight.shape) < 0.05)
    x = np.random.default_rng(1).standard_normal((2, 4, 6, 6))
    grads = [np.random.default_rng(seed).standard_normal(layer.forward(x).shape) for seed in (2, 3)]
    layer.forward(x)
    expected = [weight_gradient_oracle(layer, x, g) * (layer.weight != 0) for g in grads]

    def weight_gradient(k):
        return layer.parameter_gradients(x, grads[k])["weight"]

    def address(array):
        return array.__array_interface__["data"][0]

    first = weight_gradient(0)
    memory = address(first)
    del first  # nothing holds it: the layer keeps its memory for the next one (malloc cannot reuse it)
    second = weight_gradient(1)
    assert (address(second) == memory) is _conv_pruned.REFCOUNTS_EXACT  # no reuse where counts are not
    np.testing.assert_allclose(second, expected[1], rtol=1e-12, atol=1e-12)
    third = weight_gradient(0)  # ``second`` is held: new memory, ``second`` untouched
    assert address(third) != memory
    np.testing.assert_allclose(second, expected[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(third, expected[0], rtol=1e-12, atol=1e-12)
    view, held = third[0], address(third)
    del third, second
    fourth = weight_gradient(1)  # the last one's memory is held by a view: new memory again
    assert address(fourth) != held
    np.testing.assert_allclose(view, expected[0][0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fourth, expected[1], rtol=1e-12, atol=1e-12)


def test_where_reference_counts_are_not_exact_no_gradient_memory_is_reused(monkeypatch):
    import weakref

    from sparse_scan.layers import _conv_pruned

    layer = Conv2d(4, 6, 3, padding=1, dtype=np.float64, rng=0, prune_pattern=True)
    layer.weight = layer.weight * (np.random.default_rng(0).random(layer.weight.shape) < 0.05)
    x = np.random.default_rng(1).standard_normal((2, 4, 6, 6))
    grad = np.random.default_rng(2).standard_normal(layer.forward(x).shape)
    pruned = layer.pruned_weights()
    for exact in (True, False):
        monkeypatch.setattr(_conv_pruned, "REFCOUNTS_EXACT", exact)
        last = weakref.ref(pruned.reused("gradient", 10, np.float64))  # held by nothing but the layer
        assert (pruned.reused("gradient", 10, np.float64) is last()) is exact
        np.testing.assert_allclose(layer.parameter_gradients(x, grad)["weight"],
                                   weight_gradient_oracle(layer, x, grad) * (layer.weight != 0),
                                   rtol=1e-12, atol=1e-12)
