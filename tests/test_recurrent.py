"""RNN and GRU gradients: float64 finite differences always, PyTorch autograd when installed."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan.engine.dense_plan import auto_levels
from sparse_scan.engine.run import dense_scan
from sparse_scan.engine.schedule import depth
from sparse_scan.recurrent import GRU, RNN, Bitstream, chain_through_factors

CELLS = [("rnn-tanh", lambda i, h, **kw: RNN(i, h, **kw)),
         ("rnn-relu", lambda i, h, **kw: RNN(i, h, nonlinearity="relu", **kw)),
         ("gru", lambda i, h, **kw: GRU(i, h, **kw))]
PARAMETERS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def schedules(steps: int) -> list[tuple[str, int | str | None]]:
    return [("linear", None), ("blelloch", None), ("hybrid", "auto")] + [
        ("hybrid", k) for k in range(depth(steps) + 1)]


def inputs(steps: int, batch: int = 3, size: int = 2, hidden: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, steps, size)), rng.standard_normal((batch, hidden)) / 2,
            rng.standard_normal((batch, steps, hidden)))


@pytest.mark.parametrize("name, make", CELLS, ids=[c[0] for c in CELLS])
@pytest.mark.parametrize("steps", [1, 2, 5, 13])
def test_gradients_match_finite_differences(name, make, steps):
    cell = make(2, 5, dtype=np.float64, rng=steps)
    x, h0, grad_h = inputs(steps)

    def loss() -> float:  # L = sum(grad_h * h): its gradient w.r.t. every h_t directly is grad_h
        return float(np.sum(grad_h * cell.forward(x, h0)))

    cell.forward(x, h0)
    results = {(m, lv): cell.backward(grad_h, m, lv) for m, lv in schedules(steps)}
    reference = results[("linear", None)]
    rng, eps = np.random.default_rng(7), 1e-6
    for key, array in [("x", x), ("h0", h0)] + [(p, getattr(cell, p)) for p in PARAMETERS]:
        direction = rng.standard_normal(array.shape)
        array += eps * direction
        plus = loss()
        array -= 2 * eps * direction
        minus = loss()
        array += eps * direction
        numeric = (plus - minus) / (2 * eps)
        analytic = float(np.sum(reference[key] * direction))
        assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8), key
    for (method, levels), result in results.items():
        for key in ("h", "x", "h0") + PARAMETERS:
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{name} {method} {levels} {key}")


@pytest.mark.parametrize("name, make", CELLS, ids=[c[0] for c in CELLS])
def test_total_hidden_gradients_follow_the_chain_rule(name, make):
    cell = make(3, 4, dtype=np.float64, rng=1)
    x, h0, grad_h = inputs(6, size=3, hidden=4)
    cell.forward(x, h0)
    blocks = cell.transposed_jacobians()
    totals = cell.backward(grad_h, "blelloch")["h"]
    for t in range(5):  # G_t = d_t + (dh_{t+1}/dh_t)^T G_{t+1}
        expected = grad_h[:, t] + np.einsum("bij,bj->bi", blocks[t + 1], totals[:, t + 1])
        np.testing.assert_allclose(totals[:, t], expected, rtol=1e-12)


@pytest.mark.parametrize("name, make", CELLS, ids=[c[0] for c in CELLS])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-10), (np.float32, 2e-4)])
def test_gradients_equal_pytorch_autograd(name, make, dtype, rtol):
    torch = pytest.importorskip("torch")
    steps, batch, size, hidden = 23, 4, 3, 6
    if name == "gru":
        module = torch.nn.GRU(size, hidden, batch_first=True)
    else:
        module = torch.nn.RNN(size, hidden, nonlinearity=name.split("-")[1], batch_first=True)
    module = module.to(torch.float64 if dtype == np.float64 else torch.float32)
    cell = make(size, hidden, dtype=dtype, rng=0)
    cell.load_state_dict(module.state_dict())
    x, h0, grad_h = (a.astype(dtype) for a in inputs(steps, batch, size, hidden))
    x_t = torch.tensor(x, requires_grad=True)
    h0_t = torch.tensor(h0[None], requires_grad=True)
    out, _ = module(x_t, h0_t)
    np.testing.assert_allclose(cell.forward(x, h0), out.detach().numpy(), rtol=rtol, atol=rtol)
    (out * torch.tensor(grad_h)).sum().backward()
    expected = {"x": x_t.grad.numpy(), "h0": h0_t.grad.numpy()[0]}
    expected.update({key[:-3]: value.grad.numpy() for key, value in module.named_parameters()})
    for method, levels in schedules(steps):
        result = cell.backward(grad_h, method, levels)
        for key, value in expected.items():
            scale = np.abs(value).max()
            np.testing.assert_allclose(result[key], value, rtol=rtol, atol=rtol * scale,
                                       err_msg=f"{name} {method} {levels} {key}")


def test_a_loss_on_the_last_state_only_equals_a_full_gradient_with_zeros():
    cell = GRU(2, 5, dtype=np.float64, rng=3)
    x, h0, grad_h = inputs(9)
    cell.forward(x, h0)
    full = np.zeros_like(grad_h)
    full[:, -1] = grad_h[:, -1]
    last_only, with_zeros = cell.backward(grad_h[:, -1], "blelloch"), cell.backward(full, "blelloch")
    for key in with_zeros:
        np.testing.assert_allclose(last_only[key], with_zeros[key], rtol=1e-12, atol=1e-15)


def test_state_dicts_copy_in_with_either_naming_and_bad_ones_are_named():
    rnn = RNN(2, 3, dtype=np.float64, rng=0)
    values = {key: np.full(shape, 0.5) for key, shape in rnn.parameter_shapes().items()}
    assert sorted(values) == ["bias_hh_l0", "bias_ih_l0", "weight_hh_l0", "weight_ih_l0"]
    rnn.load_state_dict(values)
    assert all((value == 0.5).all() for value in rnn.state_dict().values())
    rnn.load_state_dict({key.removesuffix("_l0"): value / 2 for key, value in values.items()})  # short names
    assert (rnn.weight_hh == 0.25).all() and rnn.weight_hh is rnn.weight_hh_l0
    with pytest.raises(ValueError, match=r"weight_hh: expected shape \(3, 3\)"):
        rnn.load_state_dict(dict(values, weight_hh_l0=np.zeros((3, 2))))
    with pytest.raises(ValueError, match="missing"):
        rnn.load_state_dict({"weight_ih": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="bias_ih: values must be finite"):
        rnn.load_state_dict(dict(values, bias_ih_l0=np.full(3, np.nan)))
    assert GRU(2, 3).parameter_shapes()["weight_hh_l0"] == (9, 3)


def test_bad_inputs_name_the_layer_and_the_field():
    gru = GRU(2, 3)
    with pytest.raises(ValueError, match="layer GRU: input: expected"):
        gru.forward(np.zeros((2, 4, 3)))
    with pytest.raises(ValueError, match="layer GRU: input: values must be finite"):
        gru.forward(np.full((2, 4, 2), np.inf))
    with pytest.raises(ValueError, match="layer GRU: h0"):
        gru.forward(np.zeros((2, 4, 2)), h0=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="layer GRU: h0: values must be finite"):
        gru.forward(np.zeros((2, 4, 2)), h0=np.full((2, 3), np.nan))
    with pytest.raises(ValueError, match="layer GRU: input: expected real numbers, got complex128"):
        gru.forward(np.zeros((2, 4, 2), dtype=complex))
    with pytest.raises(ValueError, match="layer GRU: weight_hh: expected real numbers"):
        gru.load_state_dict({**gru.state_dict(), "weight_hh": gru.weight_hh.astype(complex)})
    small = GRU(2, 3)
    assert small.forward([[[0.0, 1.0]]]).shape == (1, 1, 3)  # nested lists are arrays
    assert small.backward([[[0.0, 1.0, 0.0]]])["h"].shape == (1, 1, 3)
    with pytest.raises(RuntimeError, match="call forward before backward"):
        gru.backward(np.zeros((2, 3)))
    gru.forward(np.zeros((2, 4, 2)))
    with pytest.raises(ValueError, match="layer GRU: grad_h"):
        gru.backward(np.zeros((2, 5, 3)))
    with pytest.raises(ValueError, match="nonlinearity"):
        RNN(1, 2, nonlinearity="gelu")
    with pytest.raises(ValueError, match="hidden_size: must be an int >= 1"):
        RNN(1, 0)


def test_bitstream_is_deterministic_and_follows_the_class_probabilities():
    data = Bitstream(steps=4000, samples=200, seed=5)
    x, labels = data.batch(np.arange(200))
    again, _ = Bitstream(steps=4000, samples=200, seed=5).batch([17, 3])
    np.testing.assert_array_equal(again, x[[17, 3]])
    assert set(np.unique(x)) <= {0.0, 1.0}
    rates = x.mean(axis=(1, 2))
    np.testing.assert_allclose(rates, 0.05 + 0.1 * labels, atol=0.03)  # 4000 draws: sd <= 0.008
    other_seed = Bitstream(steps=50, seed=6).batch([0])[0]
    assert not np.array_equal(other_seed, Bitstream(steps=50, seed=5).batch([0])[0])
    with pytest.raises(IndexError):
        data.batch([200])


@pytest.mark.parametrize("name, make", CELLS, ids=[c[0] for c in CELLS])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("last_only", [False, True])
def test_back_propagation_through_the_factors_equals_the_filled_blocks(name, make, dtype, rtol, last_only):
    """BP with every block applied in factored form (one GEMM per step) equals the linear scan of
    the filled blocks, and the backward of the BP schedules fills no block."""
    cell = make(2, 5, dtype=dtype, rng=4)
    x, h0, grad_h = (a.astype(dtype) for a in inputs(11, batch=4))
    cell.forward(x, h0)
    direct = grad_h[:, -1] if last_only else np.ascontiguousarray(grad_h.transpose(1, 0, 2))
    weights_t, coefficients, diagonal = cell.jacobian_factors()
    assert coefficients.shape[:2] == (11, 4) and (diagonal is None) == (name != "gru")
    got = chain_through_factors(weights_t, coefficients, diagonal, direct)
    want = dense_scan(cell.transposed_jacobians(), direct, "linear")
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)

    fills = []
    run = cell._single_run()
    original = run.transposed_jacobians
    run.transposed_jacobians = lambda *a: fills.append(1) or original(*a)
    seed = grad_h[:, -1] if last_only else grad_h
    bp, zero = cell.backward(seed, "linear"), cell.backward(seed, "hybrid", 0)
    assert not fills
    np.testing.assert_allclose(bp["h0"], got[0], rtol=rtol, atol=rtol)
    blelloch = cell.backward(seed, "blelloch")
    assert fills
    for key in ("h", "x", "h0") + PARAMETERS:
        np.testing.assert_allclose(zero[key], bp[key], rtol=rtol, atol=rtol)
        np.testing.assert_allclose(blelloch[key], bp[key], rtol=100 * rtol, atol=100 * rtol)


def test_auto_depth_counts_the_block_fill_that_factored_bp_avoids():
    # on 2 CPU cores BP through the factors wins (measured 7-10x PyTorch at T=1000, B=16): its kernel
    # does the cell's gradients in its loop, a scan after it (an RNN(1, 20): 2·20·(2·1 + 20) + 4·20)
    cell = (2 * 20 * (2 * 1 + 20) + 4 * 20,)
    assert RNN(1, 20).scan_cell_flops() == cell
    assert auto_levels(1000, 16, 20, "cpu", factored=True, cell_flops=cell) == 0
    assert auto_levels(1000, 2, 20, "cpu", factored=True, cell_flops=cell) == 0
    # ... the GPU model keeps the scan's short critical path (its BP fills the blocks too)
    assert auto_levels(1000, 16, 20, "gpu") > 0
    with pytest.raises(ValueError, match="CPU only"):
        auto_levels(1000, 16, 20, "gpu", factored=True)
