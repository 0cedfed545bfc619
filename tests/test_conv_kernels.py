"""The compiled transposed convolution over pruned weights (sparse_scan/layers/_kernels.py) against
independent oracles: SciPy's CSR ``JT @ g`` (JT from the layer's pattern fill), the dense JT and, where
installed, PyTorch's ``conv2d_input`` (its transposed convolution), over random geometries."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan.layers import Conv2d
from sparse_scan.layers import _conv_pruned as _conv

# (in, out, kernel, stride, padding, dilation, groups, (H, W))
GEOMETRIES = [
    (3, 8, 3, 1, 1, 1, 1, (9, 9)),
    (4, 6, 3, 2, 0, 1, 2, (9, 8)),
    (4, 6, (3, 2), (2, 1), (1, 2), (2, 1), 2, (10, 7)),
    (6, 12, 1, 1, 0, 1, 3, (5, 5)),
    (2, 5, (2, 4), (1, 3), (0, 1), (1, 2), 1, (6, 11)),
    (8, 4, 5, 3, 2, 1, 4, (12, 12)),
    (3, 4, 3, 1, 1, 1, 1, (4, 34)),  # rows 34 wide: the per-row form (DIRECT_MIN_WIDTH)
    (2, 3, 3, (1, 2), (2, 0), (1, 1), 1, (5, 70)),  # per-row form with a stride along the row
]


def pruned_conv(geometry, dtype, density, seed):
    cin, cout, kernel, stride, padding, dilation, groups, _ = geometry
    conv = Conv2d(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
                  dtype=dtype, rng=seed, prune_pattern=True)
    rng = np.random.default_rng(seed)
    weight = conv.weight.copy()
    weight.ravel()[rng.permutation(weight.size)[max(1, int(density * weight.size)):]] = 0
    conv.weight = weight
    return conv


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"threads{t}")
def threads(request, monkeypatch):
    """The kernels' pieces: one run of channels per thread, every call cut over ``threads``."""
    monkeypatch.setattr(_conv, "workers_for", lambda work, minimum=None: request.param)
    return request.param


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[:3])) + f"-g{g[6]}")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 5])
def test_transposed_convolution_is_jt_times_g(geometry, dtype, batch, threads):
    """Pruned to 4% (the compiled path) and every weight kept (the same kernels called directly on
    dense CSR weights): SciPy's CSR JT @ g and the dense JT agree."""
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, geometry[0], *geometry[7])).astype(dtype)
    for density in (0.04, 1.0):
        conv = pruned_conv(geometry, dtype, density, seed=threads)
        g = conv.geometry(x.shape[1:])
        grad = rng.standard_normal((batch, conv.forward(x)[0].size)).astype(dtype)
        weights, positions = _conv.transposed_weights_csr(
            conv.weight.reshape(conv.groups, conv.out_channels // conv.groups, -1), conv.weight.dtype)
        weights.data[:] = conv.weight.ravel()[positions]
        got = _conv.pruned_transposed_convolution(g, weights, grad)
        jt = conv.transposed_jacobian(x)
        want = np.stack([jt.to_scipy(s) @ grad[s] for s in range(batch)])
        rtol = 2e-5 if dtype == np.float32 else 1e-12
        assert got.dtype == dtype and got.shape == (batch, x[0].size)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(got, grad @ np.asarray(jt.todense()).T, rtol=rtol, atol=rtol)
        if density < 1:  # the layer's own path takes the compiled kernels
            assert conv.weights_path(x.shape[1:]).csr
            np.testing.assert_allclose(conv.weights_matvec(x.shape[1:])(grad), got, rtol=0, atol=0)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[:3])) + f"-g{g[6]}")
def test_transposed_convolution_matches_torch(geometry, threads):
    """PyTorch's own transposed convolution (``conv2d_input``) of the pruned weights, float64."""
    torch = pytest.importorskip("torch")
    conv = pruned_conv(geometry, np.float64, 0.04, seed=7)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, geometry[0], *geometry[7]))
    out = conv.forward(x)
    grad = rng.standard_normal(out.shape)
    got = conv.weights_matvec(x.shape[1:])(grad.reshape(3, -1)).reshape(x.shape)
    want = torch.nn.grad.conv2d_input(x.shape, torch.from_numpy(conv.weight.copy()), torch.from_numpy(grad),
                                      stride=conv.stride, padding=conv._pads[::2], dilation=conv.dilation,
                                      groups=conv.groups).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_non_finite_gradients_propagate():
    """A NaN or inf in g reaches exactly the inputs its non-zero weights tap, like the SpMV."""
    conv = pruned_conv(GEOMETRIES[0], np.float64, 0.04, seed=1)
    x = np.zeros((2, 3, 9, 9))
    grad = np.zeros((2, conv.forward(x)[0].size))
    grad[1, 40], grad[0, 7] = np.nan, np.inf
    got = conv.weights_matvec(x.shape[1:])(grad)
    jt = conv.transposed_jacobian(x).to_scipy(0)
    for s in range(2):
        hit = jt[:, np.flatnonzero(~np.isfinite(grad[s]))].getnnz(axis=1) > 0
        np.testing.assert_array_equal(~np.isfinite(got[s]), hit)
