"""The recurrent backward's compiled host kernels (``sparse_scan.recurrent._kernels``) against the NumPy
expressions of their CuPy twins run on NumPy: BP through factored blocks and the parameter gradients'
sums, every branch (terms, diagonal, direct per step or last only, dtypes, threads), the flushed
subnormals, the skipped zero steps and rows, and NaN kept where a factor is not finite."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan import backend
from sparse_scan.recurrent import GRU, LSTM, RNN, _base

CPU = backend.get("cpu")
chain_cpu, chain_numpy = _base._chain.twins["cpu"], _base._chain.twins["gpu"]
sums_cpu, sums_numpy = _base._gradient_sums.twins["cpu"], _base._gradient_sums.twins["gpu"]


def factors(steps, batch, terms, size, dtype, diagonal, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    weights_t = (scale * rng.standard_normal((terms, size, size)) / np.sqrt(size)).astype(dtype)
    coefficients = rng.uniform(0.2, 1.0, (steps, batch, terms, size)).astype(dtype)
    diag = rng.uniform(0.0, 0.5, (steps, batch, size)).astype(dtype) if diagonal else None
    return weights_t, coefficients, diag


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("terms, diagonal", [(1, False), (3, True), (2, False)])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_chain_equals_the_numpy_twin(monkeypatch, dtype, rtol, terms, diagonal, affine, threads):
    monkeypatch.setenv("SPARSE_SCAN_THREADS", threads)
    steps, batch, size = 13, 5, 7
    weights_t, coefficients, diag = factors(steps, batch, terms, size, dtype, diagonal)
    rng = np.random.default_rng(1)
    direct = rng.standard_normal((steps, batch, size) if affine else (batch, size)).astype(dtype)
    got = chain_cpu(CPU, weights_t, coefficients, diag, direct)
    want = chain_numpy(CPU, weights_t, coefficients, diag, direct)
    assert got.dtype == dtype and got.shape == (steps + 1, batch, size)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vanishing_chain_flushes_subnormals_and_skips_zero_steps(dtype):
    """Totals below the smallest normal number are zeros (as the CUDA twins' -ftz); the rest equal
    the IEEE chain, and the steps after the totals vanish stay exact zeros."""
    steps, batch, size = 3000 if dtype == np.float64 else 400, 3, 6
    weights_t, coefficients, _ = factors(steps, batch, 1, size, dtype, False, scale=0.5)
    direct = np.random.default_rng(2).standard_normal((batch, size)).astype(dtype)
    got = chain_cpu(CPU, weights_t, coefficients, None, direct)
    want = chain_numpy(CPU, weights_t, coefficients, None, direct)
    tiny = np.finfo(dtype).tiny
    assert np.all(got[:3] == 0) and np.any(want != 0)  # vanished, passing through subnormals
    assert np.all((np.abs(got) >= tiny) | (got == 0))
    normal = np.abs(want) >= 1e6 * tiny
    np.testing.assert_allclose(got[normal], want[normal], rtol=1e-3 if dtype == np.float32 else 1e-9)
    assert np.abs(got - want)[~normal].max() < 1e7 * tiny  # the flushed tail differs by tiny amounts


def test_chain_keeps_nan_from_a_non_finite_factor_after_the_totals_vanish():
    steps, batch, size = 400, 2, 5
    weights_t, coefficients, diag = factors(steps, batch, 2, size, np.float32, True, scale=0.5)
    coefficients[3, 1, 0, 2] = np.inf
    direct = np.ones((batch, size), np.float32)
    got = chain_cpu(CPU, weights_t, coefficients, diag, direct)
    with np.errstate(invalid="ignore"):
        want = chain_numpy(CPU, weights_t, coefficients, diag, direct)
    assert np.all(got[4, 1] == 0)  # vanished: the step from 4 to 3 is one the kernel would skip
    assert not np.isnan(got[4:, 1]).any() and np.isnan(got[:4, 1]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("columns", [1, 7])
def test_gradient_sums_equal_numpy(monkeypatch, dtype, threads, columns):
    monkeypatch.setenv("SPARSE_SCAN_THREADS", threads)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((101, 9)).astype(dtype)
    a[10:60] = 0  # vanished gradients: rows skipped
    b = rng.standard_normal((101, columns)).astype(dtype)
    products, sums = sums_cpu(CPU, a, b)
    want_products, want_sums = sums_numpy(CPU, a.astype(np.float64), b.astype(np.float64))
    assert products.dtype == sums.dtype == dtype
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(products, want_products, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(sums, want_sums, rtol=rtol, atol=rtol)


def test_gradient_sums_of_a_zero_row_keep_nan_from_a_non_finite_partner():
    a, b = np.zeros((4, 2)), np.ones((4, 3))
    a[0] = 1.0
    b[2, 1] = np.inf
    products, sums = sums_cpu(CPU, a, b)
    with np.errstate(invalid="ignore"):
        want_products, want_sums = sums_numpy(CPU, a, b)
    np.testing.assert_array_equal(products, want_products)  # inf * 0 = NaN in column 1
    np.testing.assert_array_equal(sums, want_sums)
    assert np.isnan(products[:, 1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("affine, with_diagonal", [(False, False), (True, True)], ids=["plain", "affine-gru"])
def test_chain_through_factors_on_cupy_arrays_equals_the_compiled_host_chain(affine, with_diagonal):
    """The public chain called directly with CuPy arrays runs its CuPy twin (one GEMM per step; BP on
    the GPU fills the blocks instead), equal to the compiled host chain."""
    gpu = backend.get("gpu")
    rng = np.random.default_rng(11)
    steps, batch, terms, size = 9, 3, 2, 5
    weights_t = rng.standard_normal((terms, size, size))
    coefficients = rng.standard_normal((steps, batch, terms, size))
    diagonal = rng.standard_normal((steps, batch, size)) if with_diagonal else None
    direct = rng.standard_normal((steps, batch, size) if affine else (batch, size))
    want = _base.chain_through_factors(weights_t, coefficients, diagonal, direct)
    got = _base.chain_through_factors(*(None if a is None else gpu.asarray(a)
                                        for a in (weights_t, coefficients, diagonal, direct)))
    assert backend.of(got).name == "gpu"
    np.testing.assert_allclose(gpu.to_host(got), want, rtol=1e-12, atol=1e-12)


def previous_bp(layer, direct):
    """The previous implementation of BP's gradients: the factored chain (the compiled chain kernel,
    or the LSTM's NumPy steps), then the gate gradients and the two sums kernels."""
    result = _base._bp_gradients.twins["gpu"](CPU, layer._single_run(), direct, None)
    assert result.pop("horizon") is None  # every step runs
    return result


def recurrent_layer(kind, dtype, steps, batch, seed=0):
    layer = {"rnn-tanh": lambda: RNN(3, 6, dtype=dtype, rng=seed),
             "rnn-relu": lambda: RNN(3, 6, nonlinearity="relu", dtype=dtype, rng=seed),
             "gru": lambda: GRU(3, 6, dtype=dtype, rng=seed),
             "lstm": lambda: LSTM(3, 6, dtype=dtype, rng=seed),
             "lstm-proj": lambda: LSTM(3, 6, proj_size=4, dtype=dtype, rng=seed)}[kind]()
    layer.forward(np.random.default_rng(seed + 1).standard_normal((batch, steps, 3)).astype(dtype))
    return layer


KINDS = ["rnn-tanh", "rnn-relu", "gru", "lstm", "lstm-proj"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_compiled_bp_equals_the_chain_then_the_gradient_sums(monkeypatch, kind, dtype, rtol, affine, threads):
    """Each cell's one-kernel back-propagation (totals, input and every parameter) equals the chain
    followed by the gate gradients and the sums kernels."""
    monkeypatch.setenv("SPARSE_SCAN_THREADS", threads)
    steps, batch = 11, 5
    layer = recurrent_layer(kind, dtype, steps, batch)
    size = layer._single_run().cell.state_size
    rng = np.random.default_rng(4)
    direct = rng.standard_normal((steps, batch, size) if affine else (batch, size)).astype(dtype)
    got = _base._bp_gradients.twins["cpu"](CPU, layer._single_run(), direct, None)
    want = previous_bp(layer, direct)
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key].dtype == dtype and got[key].shape == value.shape, key
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=rtol * np.abs(value).max(), err_msg=key)


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_bp_of_a_vanishing_chain_stops_at_zeros_and_keeps_nan_from_a_non_finite_value(kind):
    """A loss on the last state of a long sequence: the totals vanish (flushed), every earlier total
    and input gradient is an exact zero, and the parameter gradients equal the previous
    implementation's; a non-finite saved value past the vanishing point still gives NaN there, as IEEE
    arithmetic does."""
    steps, batch = 1500, 3
    layer = recurrent_layer(kind, np.float32, steps, batch)
    run = layer._single_run()
    direct = np.random.default_rng(5).standard_normal((batch, run.cell.state_size)).astype(np.float32)
    got = _base._bp_gradients.twins["cpu"](CPU, run, direct, None)
    want = previous_bp(layer, direct)
    assert np.all(got["state"][:10] == 0) and np.all(got["x"][:10] == 0)
    # the steps each sample ran: those whose total (s_1 .. s_T) is not all zero
    ran = (np.abs(got["state"][1:]).sum(axis=2) != 0).sum(axis=0)
    horizon = got.pop("horizon")
    assert horizon.steps == pytest.approx(ran.mean()) and ran.max() < steps and horizon.time_steps == steps
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-6 * np.abs(value).max(), err_msg=key)
    run.saved["x"][3, 1, 0] = np.inf  # the input's gradient there is 0 · inf
    got = _base._bp_gradients.twins["cpu"](CPU, run, direct, None)
    with np.errstate(invalid="ignore"):
        want = previous_bp(layer, direct)
    np.testing.assert_array_equal(np.isnan(got["weight_ih"]), np.isnan(want["weight_ih"]))
    assert np.isnan(got["weight_ih"]).any() and not np.isnan(got["state"]).any()
    # sample 1 runs on to the non-finite row (3 rows before it are finite), the others stop as before
    assert got["horizon"].steps == pytest.approx((ran.sum() - ran[1] + steps - 3) / batch)
