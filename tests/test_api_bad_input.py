"""Library calls with bad arguments: a ValueError naming the argument, before anything changes."""

from __future__ import annotations

import functools
import os
import pathlib
import zipfile

import numpy as np
import pytest
from limits import fails_rather_than_hangs

from sparse_scan import Sequential, SpecError, load_model
from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU
from sparse_scan.recurrent import RNN
from sparse_scan.weights import as_float_array, read_npz

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


# --- issue 47: nothing rounded silently, nothing unbounded, no hang ---------------------------------------

def spec_file(tmp_path, text, name="m.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("dtype, integer, value", [
    (np.float32, np.int64, 2**24 + 1), (np.float32, np.int32, -(2**24) - 1),
    (np.float32, np.uint64, 2**64 - 1), (np.float64, np.int64, 2**53 + 1), (np.float64, np.int64, 2**63 - 1),
    (np.float64, np.uint64, 2**64 - 1),
])
def test_integers_a_float_does_not_hold_exactly_are_refused_not_rounded(dtype, integer, value):
    array = np.array([[0, value]], dtype=integer)
    name = np.dtype(dtype).name
    message = rf"^x: holds integers {name} does not hold exactly \({value} would be -?\d+ at index \[0, 1\]\)"
    with pytest.raises(ValueError, match=message + ": give floats, or use float64"):
        as_float_array(array, dtype, "x")


def test_integers_a_float_holds_are_cast_exactly_whatever_their_type():
    for dtype, top in ((np.float32, 2**24), (np.float64, 2**53)):
        exact = np.array([-top, -1, 0, top, 2**40, -(2**62)], dtype=np.int64)  # powers of two: exact
        np.testing.assert_array_equal(as_float_array(exact, dtype, "x"), exact.astype(dtype))
    assert as_float_array(np.array([True, False]), np.float32, "x").tolist() == [1.0, 0.0]
    assert as_float_array(np.arange(-128, 128, dtype=np.int8), np.float32, "x").dtype == np.float32
    with pytest.raises(ValueError, match="x: holds NaN or Inf"):
        as_float_array(np.array([1e39]), np.float32, "x")
    with pytest.raises(ValueError, match="x: dtype <U1, expected numbers"):
        as_float_array(np.array(["a"]), np.float32, "x")


@pytest.fixture
def small_budget(monkeypatch):
    """A memory budget of 64 MiB: every refusal below is of gigabytes, estimated, never allocated."""
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "64M")


def never_built(monkeypatch, cls):
    @functools.wraps(cls.__init__)  # the spec reads the arguments' names from its signature
    def build(*args, **kwargs):
        raise AssertionError(f"{cls.__name__} built (its parameters allocated) before the budget refused it")

    monkeypatch.setattr(cls, "__init__", build)


@pytest.mark.parametrize("shape, layer, cls, where, size", [
    ([40000], "{name: fc, type: linear, out_features: 40000}", Linear,
     r"layer 'fc' \(layers\[0\]\), field 'out_features': the model up to its 1,600,000,000 parameters",
     "17.9 GiB"),
    ([4096, 4, 4], "{name: conv, type: conv2d, out_channels: 4096, kernel_size: 3, padding: 1}", Conv2d,
     r"layer 'conv' \(layers\[0\]\), field 'out_channels': the model up to its 150,994,944 parameters",
     "1.7 GiB"),
    ([10, 1], "{name: rnn, type: lstm, hidden_size: 40000}", RNN,
     r"layer 'rnn' \(layers\[0\]\), field 'hidden_size': the model up to its 6,400,480,000 parameters",
     "71.5 GiB"),
])
def test_parameters_over_the_memory_budget_are_refused_before_they_are_made(tmp_path, monkeypatch,
                                                                           small_budget, shape, layer, cls,
                                                                           where, size):
    from sparse_scan.recurrent import LSTM

    never_built(monkeypatch, LSTM if cls is RNN else cls)
    head = "\n  - {name: fc, type: linear, out_features: 2}" if cls is RNN else ""
    path = spec_file(tmp_path, f"input_shape: {shape}\ninit: {{seed: 0}}\nlayers:\n  - {layer}{head}\n")
    with pytest.raises(SpecError, match=rf"{where} would take ~{size} \(estimated before allocating it\), "
                       r"over the memory budget of 64.0 MiB \(raise it with SPARSE_SCAN_MEMORY_BUDGET\)$"):
        load_model(path)


@pytest.mark.parametrize("shape, layer, message", [
    ([1, 30000, 30000], "{name: conv, type: conv2d, out_channels: 4, kernel_size: 3}",
     r"field 'input_shape': the model up to one sample's input \(\[1, 30000, 30000\] per sample\) would take "
     r"~10.1 GiB"),
    ([1, 2000, 2000], "{name: conv, type: conv2d, out_channels: 64, kernel_size: 3}",
     r"layer 'conv' \(layers\[0\]\), field 'out_channels': the model up to its output "
     r"\(\[64, 1998, 1998\] per sample\) would take ~2.9 GiB"),
    ([1, 2000, 2000], "{name: act, type: relu}",
     r"layer 'act' \(layers\[0\]\), field 'input': the model up to its output "
     r"\(\[1, 2000, 2000\] per sample\)"),
])
def test_activations_over_the_memory_budget_are_refused_when_the_spec_loads(tmp_path, small_budget, shape,
                                                                          layer, message):
    path = spec_file(tmp_path, f"input_shape: {shape}\ninit: {{seed: 0}}\nlayers:\n  - {layer}\n")
    with pytest.raises(SpecError, match=message + ".*over the memory budget of 64.0 MiB"):
        load_model(path)


def test_the_bundled_specs_load_within_a_small_budget(monkeypatch):
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "8M")  # everything but the VGG-11 stack fits in it
    for name in ("tiny", "lenet5", "cnn-bn", "resnet20", "lstm-bitstream"):
        load_model(DATA / f"{name}.yaml")


def test_a_yaml_alias_bomb_is_refused_before_it_is_walked(tmp_path):
    """Seven levels of nine aliases: 4.8 million nodes expanded from 400 bytes (the ten levels of the
    issue's were gigabytes once an error message wrote them out)."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    path = spec_file(tmp_path, f"input_shape: [4]\ninit: {{seed: [{', '.join(levels)}]}}\n"
                     "layers: [{type: relu}]\n")
    with pytest.raises(SpecError, match=r"m.yaml: more than 1,000,000 YAML nodes once its aliases are "
                       "expanded"):
        load_model(path)
    shared = spec_file(tmp_path, "input_shape: &shape [4]\nlayers: [{type: relu}]\ninit: {seed: 0}\n"
                       "prune: {amount: 0.5}\n", "aliases.yaml")
    assert load_model(shared).input_shape == (4,)  # a few aliases are fine


@pytest.mark.parametrize("text, message", [
    ("input_shape: [4]\nlayers: &x [*x]\n", r"m.yaml: the node at line 2, column 9 holds an alias of itself"),
    ("input_shape: [4]\nlayers: " + "[" * 3000 + "]" * 3000 + "\n", "YAML nested too deeply"),
])
def test_yaml_without_end_is_refused(tmp_path, text, message):
    with pytest.raises(SpecError, match=message):
        load_model(spec_file(tmp_path, text))


def test_a_spec_file_over_the_size_limit_is_refused_unparsed(tmp_path, monkeypatch):
    import sparse_scan.spec as spec_module

    monkeypatch.setattr(spec_module, "MAX_SPEC_BYTES", 64)
    path = spec_file(tmp_path, "input_shape: [4]\nlayers: [{type: relu}]\n" + "# padding\n" * 5)
    with pytest.raises(SpecError, match=r"m.yaml: larger than 64 B, not a model spec"):
        load_model(path)
    assert spec_module.MAX_SPEC_BYTES < (DATA / "resnet20.yaml").stat().st_size  # the real limit: 4 MiB


@pytest.mark.parametrize("where", ["spec", "weights", "read_npz"])
@pytest.mark.parametrize("kind, message", [("named pipe", r"not a regular file \(a named pipe\)"),
                                           ("symlink loop", "a symlink loop"),
                                           ("directory", r"not a regular file \(a directory\)")])
def test_files_that_are_no_regular_file_are_refused_without_blocking(tmp_path, where, kind, message):
    bad = tmp_path / "bad.npz"
    if kind == "named pipe":
        os.mkfifo(bad)  # nobody writes to it: reading it would block forever
    elif kind == "symlink loop":
        bad.symlink_to(tmp_path / "other.npz")
        (tmp_path / "other.npz").symlink_to(bad)
    else:
        bad.mkdir()
    with fails_rather_than_hangs():
        if where == "read_npz":
            with pytest.raises(ValueError, match=message):
                read_npz(bad)
        elif where == "weights":
            spec = spec_file(tmp_path, "input_shape: [4]\nweights: bad.npz\nlayers: [{type: relu}]\n")
            with pytest.raises(SpecError, match=f"m.yaml: field 'weights': {message}: {bad}"):
                load_model(spec)
        else:
            with pytest.raises(SpecError, match=f"^{bad}: {message}$"):
                load_model(bad)


@pytest.mark.parametrize("member", ["fc.weight", "notes.txt"])
def test_an_npz_member_that_is_no_array_is_named(tmp_path, member):
    path = tmp_path / "w.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, b"some bytes")
        with archive.open("fc.bias.npy", "w") as stream:
            np.lib.format.write_array(stream, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=rf"^member '{member}' is not an array \(.npy\): write the file with "
                       "numpy.savez$"):
        read_npz(path)
    spec = spec_file(tmp_path, "input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, "
                     "out_features: 2}]\n")
    with pytest.raises(SpecError, match=rf"field 'weights': {path} is not a readable .npz: "
                       f"member '{member}'"):
        load_model(spec)


def test_an_npz_over_the_memory_budget_is_refused_from_its_headers(tmp_path, monkeypatch):
    path = tmp_path / "w.npz"
    np.savez(path, a=np.zeros((512, 512)), b=np.zeros(10))
    assert set(read_npz(path, 3 * 2**20)) == {"a", "b"}
    with pytest.raises(ValueError, match=r"^its 2 arrays would take ~2.0 MiB \(estimated before allocating "
                       r"it\), over the memory budget of 1.0 MiB \(raise it with "
                       r"SPARSE_SCAN_MEMORY_BUDGET\)$"):
        read_npz(path, 2**20)
    monkeypatch.setenv("SPARSE_SCAN_MEMORY_BUDGET", "1M")  # what a spec's weights: file is held to
    spec = spec_file(tmp_path, "input_shape: [4]\nweights: w.npz\nlayers: [{type: relu}]\n")
    with pytest.raises(SpecError, match=r"field 'weights': .* its 2 arrays would take ~2.0 MiB"):
        load_model(spec)
