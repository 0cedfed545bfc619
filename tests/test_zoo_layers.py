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
from oracles import finite_difference_jt, torch_jt, torch_mirror

from sparse_scan import Sequential, backend, flops
from sparse_scan.layers import Conv2d, Hardsigmoid, Hardswish, Mish
from sparse_scan.spec import model_from_spec

DTYPES = [np.float32, np.float64]
PLANE = (3, 4, 5)

CASES = {  # id: (layer factory of the dtype, per-sample input shape, its spec entry)
    "hardswish": (lambda d: Hardswish(), PLANE, {"type": "hardswish"}),
    "hardsigmoid": (lambda d: Hardsigmoid(), PLANE, {"type": "hardsigmoid"}),
    "mish": (lambda d: Mish(), PLANE, {"type": "mish"}),
}
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
        np.testing.assert_allclose(value, parameters[name], rtol=1e-10, atol=1e-12 * np.abs(value).max())


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
