"""Library calls with bad arguments: a ValueError naming the argument, before anything changes."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from sparse_scan import Sequential, SpecError, load_model
from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU
from sparse_scan.recurrent import RNN
from sparse_scan.weights import read_npz

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def small():
    model = Sequential(Conv2d(1, 2, 3, rng=0), ReLU(), Flatten(), Linear(2 * 4 * 4, 3, rng=1))
    x = np.random.default_rng(0).standard_normal((2, 1, 6, 6)).astype(np.float32)
    return model, model.forward(x)


@pytest.mark.parametrize("method, levels, message", [
    ("hybrid", 1.5, "hybrid needs levels in 0..3 for 4 layers; got 1.5"),
    ("hybrid", True, "hybrid needs levels"),
    ("hybrid", "two", "hybrid needs levels"),
    ("linear", 1, "levels applies to method='hybrid' only"),
])
def test_scan_levels_are_ints_of_hybrid_only(method, levels, message):
    model, out = small()
    with pytest.raises(ValueError, match=message):
        model.backward(np.ones_like(out), method=method, levels=levels)


@pytest.mark.parametrize("call", ["backward", "plan"])
def test_an_unknown_method_is_refused_naming_every_schedule_auto_first(call):
    model, out = small()
    message = r"^method must be one of auto, linear, blelloch, hybrid; got 'scan'$"
    with pytest.raises(ValueError, match=message):
        if call == "backward":
            model.backward(np.ones_like(out), method="scan")
        else:
            model.plan((1, 6, 6), "scan")


def test_recurrent_levels_count_time_steps_and_apply_to_hybrid_only():
    rnn = RNN(1, 3)
    rnn.forward(np.zeros((2, 5, 1)))
    with pytest.raises(ValueError, match="levels applies to method='hybrid' only"):
        rnn.backward(np.ones((2, 5, 3)), method="linear", levels=1)
    with pytest.raises(ValueError, match="for 5 time steps"):
        rnn.backward(np.ones((2, 5, 3)), method="hybrid", levels=9)


def test_a_complex_gradient_is_refused():
    model, out = small()
    with pytest.raises(ValueError, match="grad_out: expected real numbers, got complex"):
        model.backward(np.ones(out.shape, dtype=complex))


def test_a_gradient_of_another_float_dtype_is_refused_like_an_input():
    model, out = small()  # float32 layers
    with pytest.raises(ValueError, match="grad_out: dtype float64 does not match the output's float32"):
        model.backward(np.ones(out.shape, dtype=np.float64))
    with pytest.raises(ValueError, match="dtype float64 does not match the parameters' float32"):
        model.forward(np.ones((2, 1, 6, 6)))  # the forward's own refusal, for comparison
    model.forward(np.ones((2, 1, 6, 6), np.float32))
    assert model.backward(np.ones(out.shape, dtype=np.float32))[0].dtype == np.float32


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 1),
                                            ("auto", None)])
def test_a_batch_of_scalars_through_elementwise_layers(method, levels):
    from sparse_scan.layers import Sigmoid, Tanh

    model = Sequential(Tanh(), ReLU(), Sigmoid(), Tanh())
    x = np.linspace(-2, 2, 5)
    out = model.forward(x)
    assert out.shape == (5,)
    grads = model.backward(np.ones(5), method=method, levels=levels)
    reference = model.backward(np.ones(5), method="linear")
    assert [g.shape for g in grads] == [(5,)] * 5
    for got, want in zip(grads, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_weight_and_bias_keep_one_dtype():
    conv = Conv2d(1, 2, 3, rng=0)
    with pytest.raises(ValueError, match="layer Conv2d: weight: dtype float64 differs from the bias'"):
        conv.weight = conv.weight.astype(np.float64)
    with pytest.raises(ValueError, match="layer Conv2d: bias: dtype float64 differs"):
        conv.bias = conv.bias.astype(np.float64)
    assert conv.astype(np.float64).weight.dtype == conv.bias.dtype == np.float64


def test_load_model_names_a_bad_dtype():
    with pytest.raises(ValueError, match="layer load_model: dtype: must be float32 or float64"):
        load_model(DATA / "tiny.yaml", dtype="foo")


@pytest.mark.parametrize("content, message", [
    (b"", "an empty file"), (b"just some text\n", "not a zip archive"),
    (b"\x93NUMPY\x01\x00", "single array"),
])
def test_read_npz_says_what_the_file_is(tmp_path, content, message):
    path = tmp_path / "w.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_npz(path)
    spec = tmp_path / "m.yaml"
    spec.write_text("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n")
    with pytest.raises(SpecError, match=f"field 'weights': .*{message}"):
        load_model(spec)


def test_empty_batches_and_non_positive_sizes_name_the_layer():
    from sparse_scan.layers import MaxPool2d

    with pytest.raises(ValueError, match="layer ReLU: input: per-sample sizes must be positive"):
        ReLU().pattern((3, -1, 8))
    for layer, shape in ((ReLU(), (0, 3)), (MaxPool2d(2), (0, 1, 4, 4))):
        message = f"layer {type(layer).__name__}: input: expected a batch of at least"
        with pytest.raises(ValueError, match=message):
            layer.transposed_jacobian(np.zeros(shape, np.float32))


def test_inputs_like_an_accepted_one_skip_the_checks_and_no_other_does():
    """A layer remembers the (type, dtype, shape) of inputs it accepted: after a good call, a bad
    dtype, batch, size or non-array of the same shape is still refused, each with its own message."""
    from sparse_scan.layers import MaxPool2d

    layer = MaxPool2d(2)
    good = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    assert layer.transposed_jacobian(good).nnz == 3 * 16
    assert len(layer._valid_inputs) == 1  # the memo the next call hits
    assert layer.transposed_jacobian(good.copy()).nnz == 3 * 16
    assert len(layer._valid_inputs) == 1
    refused = [(good.astype(np.int32), "dtype must be float32 or float64"),
               (good[:0], "expected a batch of at least one sample"),
               (good[:, :, :1, :1], "window"),
               (good.tolist(), "expected an ndarray")]
    for bad, message in refused:
        with pytest.raises(ValueError, match=message):
            layer.transposed_jacobian(bad)
    assert len(layer._valid_inputs) == 1


def test_recurrent_training_arguments_are_checked():
    from sparse_scan.optim import Adam
    from sparse_scan.recurrent import Bitstream, RecurrentClassifier
    from sparse_scan.train import train_iterations

    for kwargs, message in [({"steps": 2.5}, "steps: must be an int >= 1"), ({"steps": 3, "classes": 11},
                            "classes: must be an int >= 1 and <= 10")]:
        with pytest.raises(ValueError, match=message):
            Bitstream(**kwargs)
    data = Bitstream(steps=4, samples=8)
    model, other = RecurrentClassifier(RNN(1, 3, rng=0), 10, rng=1), RecurrentClassifier(RNN(1, 3), 10)
    for kwargs, message in [({"batch_size": 0}, "batch_size: must be an int >= 1"),
                            ({"batch_size": 9}, r"<= 8 \(the data's samples\)"),
                            ({"iterations": -1}, "iterations: must be an int >= 0")]:
        with pytest.raises(ValueError, match=message):
            train_iterations(model, data, Adam(model), **{"iterations": 1, "batch_size": 4, **kwargs})
    with pytest.raises(ValueError, match="optimizer: built on another model"):
        train_iterations(model, data, Adam(other), iterations=1, batch_size=4)
