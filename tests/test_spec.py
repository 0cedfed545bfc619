"""Model specs: bundled models load, weights round-trip, and every bad input is one clear SpecError."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from sparse_scan import SpecError, load_model
from sparse_scan.layers import Conv2d, MaxPool2d

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"

TINY = """input_shape: [1, 6, 6]
{extra}layers:
  - {{name: conv, type: conv2d, out_channels: 2, kernel_size: 3}}
  - {{name: act, type: relu}}
  - {{name: flat, type: flatten}}
  - {{name: fc, type: linear, out_features: 3}}
"""


def write(tmp_path, text, name="model.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_bundled_models_load_with_the_papers_shapes():
    vgg = load_model(DATA / "vgg11.yaml")
    assert vgg.input_shape == (3, 32, 32) and len(vgg) == 21
    assert vgg.shapes(vgg.input_shape)[-1] == (512, 1, 1)
    conv1 = vgg.layers[0].pattern((3, 32, 32))
    assert conv1.nnz == 1_696_512  # paper Table 1
    pruned = load_model(DATA / "vgg11-pruned.yaml")
    for layer in pruned.layers:
        if isinstance(layer, Conv2d):
            assert layer.prune_pattern
            assert np.mean(layer.weight == 0) == pytest.approx(0.97, abs=1e-3)
    tiny = load_model(DATA / "tiny.yaml")
    x = np.random.default_rng(0).standard_normal((2,) + tiny.input_shape).astype(np.float32)
    assert tiny.forward(x).shape == (2, 10)


def test_inferred_channels_seeded_init_and_float64(tmp_path):
    path = write(tmp_path, TINY.format(extra="init: {seed: 3}\n"))
    a, b = load_model(path, dtype=np.float64), load_model(path, dtype=np.float64)
    assert a.layers[0].in_channels == 1 and a.layers[3].in_features == 2 * 4 * 4
    assert a.layers[0].weight.dtype == np.float64
    np.testing.assert_array_equal(a.layers[0].weight, b.layers[0].weight)  # seeded: reproducible


def test_weights_from_npz_are_used_exactly(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"conv.weight": rng.standard_normal((2, 1, 3, 3)), "conv.bias": rng.standard_normal(2),
               "fc.weight": rng.standard_normal((3, 32)), "fc.bias": rng.standard_normal(3)}
    np.savez(tmp_path / "w.npz", **weights)
    model = load_model(write(tmp_path, TINY.format(extra="weights: w.npz\n")), dtype=np.float64)
    np.testing.assert_array_equal(model.layers[0].weight, weights["conv.weight"])
    np.testing.assert_array_equal(model.layers[3].bias, weights["fc.bias"])


def test_weights_from_safetensors(tmp_path):
    numpy_io = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    weights = {"conv.weight": rng.standard_normal((2, 1, 3, 3)), "conv.bias": rng.standard_normal(2),
               "fc.weight": rng.standard_normal((3, 32)), "fc.bias": rng.standard_normal(3)}
    numpy_io.save_file(weights, str(tmp_path / "w.safetensors"))
    model = load_model(write(tmp_path, TINY.format(extra="weights: w.safetensors\n")), dtype=np.float64)
    np.testing.assert_array_equal(model.layers[3].weight, weights["fc.weight"])
    (tmp_path / "bad.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(SpecError, match="field 'weights': .*not a readable .safetensors"):
        load_model(write(tmp_path, TINY.format(extra="weights: bad.safetensors\n"), "bad.yaml"))


def test_prune_zeroes_the_smallest_weights_and_drops_them_from_the_pattern(tmp_path):
    model = load_model(write(tmp_path, TINY.format(extra="init: {seed: 0}\nprune: {amount: 0.5}\n")))
    conv = model.layers[0]
    assert np.mean(conv.weight == 0) == pytest.approx(0.5, abs=0.1)
    dense = Conv2d(1, 2, 3, rng=0)
    assert conv.pattern((1, 6, 6)).nnz < dense.pattern((1, 6, 6)).nnz


def test_pooling_arguments_pass_through(tmp_path):
    text = """input_shape: [2, 7, 9]
layers:
  - {name: p, type: maxpool2d, kernel_size: [2, 3], stride: 2, padding: 1, ceil_mode: true}
"""
    model = load_model(write(tmp_path, text))
    pool = model.layers[0]
    # PyTorch's rule: ceil_mode drops a last window that would start in the padding
    assert isinstance(pool, MaxPool2d) and model.shapes((2, 7, 9))[-1] == (2, 4, 5)


BAD = [
    # (spec text or None for a missing file, files to write, expected message fragments)
    ("input_shape: [1, 6, 6]\nlayers: [\n", {}, ["malformed YAML", "line"]),
    ("- 1\n- 2\n", {}, ["expected a mapping"]),
    ("input_shape: [1, 6, 6]\n", {}, ["field 'layers'", "missing"]),
    ("input_shape: [1, 6, 6]\nlayer: []\nlayers: []\n", {}, ["field 'layer'", "unknown key"]),
    ("input_shape: [1, -6, 6]\nlayers: [{type: relu}]\n", {}, ["field 'input_shape'", "positive ints"]),
    ("input_shape: [1, 6, 6]\nlayers: []\n", {}, ["field 'layers'", "non-empty"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: c, type: conv3d}]\n", {},
     ["layer 'c' (layers[0])", "field 'type'", "unknown layer type"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, out_channels: 2, "
     "kernel_size: 3, paddding: 1}]\n", {},
     ["layer 'c' (layers[0])", "field 'paddding'", "unknown argument"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, out_channels: 2, "
     "kernel_size: 9}]\n", {}, ["layer 'c' (layers[0])", "field 'kernel_size'"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, in_channels: 3, "
     "out_channels: 2, kernel_size: 3}]\n", {}, ["field 'in_channels'", "input to this layer has 1"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, out_channels: 2, "
     "kernel_size: 3, stride: 0}]\n", {}, ["field 'stride'"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: c, type: conv2d, out_channels: 2, kernel_size: 3}]\n", {},
     ["field 'weight'", "no init"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: a, type: relu}, {name: a, type: tanh}]\n", {},
     ["layer 'a' (layers[1])", "field 'name'"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: -1}\nlayers: [{type: relu}]\n", {}, ["field 'init.seed'"]),
    ("input_shape: [1, 6, 6]\nprune: {amount: 1.5}\nlayers: [{type: relu}]\n", {}, ["field 'prune.amount'"]),
    ("input_shape: [1, 6, 6]\nweights: missing.npz\nlayers: [{type: relu}]\n", {},
     ["field 'weights'", "no such file"]),
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": {"fc.weight": np.ones((2, 5)), "fc.bias": np.ones(2)}},
     ["layer 'fc' (layers[0])", "field 'weight'", "(2, 4)"]),
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": {"fc.weight": np.full((2, 4), np.nan), "fc.bias": np.ones(2)}}, ["field 'weight'", "NaN"]),
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": {"fc.weight": np.ones((2, 4), dtype=np.int64), "fc.bias": np.ones(2)}},
     ["field 'weight'", "dtype int64"]),
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": {"fc.weight": np.ones((2, 4)), "fc.bias": np.ones(2), "fc2.weight": np.ones(1)}},
     ["field 'weights'", "'fc2.weight'", "matches no layer"]),
    (None, {}, ["no such file"]),
    # strings and numbers are not coerced: booleans must be booleans, ints ints
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, out_channels: 2, "
     "kernel_size: 3, bias: 'false'}]\n", {}, ["layer 'c' (layers[0])", "field 'bias'", "true or false"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: p, type: maxpool2d, kernel_size: 3, stride: 2, "
     "ceil_mode: 'false'}]\n", {}, ["layer 'p' (layers[0])", "field 'ceil_mode'", "true or false"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: p, type: avgpool2d, kernel_size: 2, "
     "count_include_pad: x}]\n", {}, ["field 'count_include_pad'"]),
    ("input_shape: [4]\ninit: {seed: 0}\nlayers: [{name: fc, type: linear, out_features: 10.5}]\n", {},
     ["layer 'fc' (layers[0])", "field 'out_features'", "must be an int"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, out_channels: true, "
     "kernel_size: 3}]\n", {}, ["field 'out_channels'", "must be an int"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: f, type: flatten, start_dim: 1.7}]\n", {},
     ["field 'start_dim'"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: r, type: [relu]}]\n", {}, ["field 'type'", "unknown layer"]),
    ("input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: c, type: conv2d, kernel_size: 3}]\n", {},
     ["layer 'c' (layers[0])", "field 'out_channels'", "missing"]),
    ("input_shape: [1, 6, 6]\nlayers: [{name: l, type: leaky_relu, negative_slope: foo}]\n", {},
     ["field 'negative_slope'", "finite number"]),
    # weights files that are no .npz, and values float32 cannot hold
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": b""}, ["field 'weights'", "not a readable .npz"]),
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": b"PK\x03\x04 truncated"}, ["field 'weights'", "not a readable .npz"]),
    ("input_shape: [4]\nweights: w.npy\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npy": np.ones(3)}, ["field 'weights'", "not a readable .npz", "single array"]),
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2}]\n",
     {"w.npz": {"fc.weight": np.full((2, 4), 1e300), "fc.bias": np.ones(2)}},
     ["layer 'fc' (layers[0])", "field 'weight'", "too large for float32"]),
    (b"\xff\xfe\x00binary", {}, ["not a YAML text file"]),
    ("input_shape: [4]\ninput_shape: [5]\nlayers: [{type: relu}]\n", {},
     ["malformed YAML at line 2", "key 'input_shape' repeated"]),
    ("input_shape: [4]\nlayers: [{type: relu, type: tanh}]\n", {}, ["key 'type' repeated"]),
    ("input_shape: [4]\nlayers: [{name: [a], type: relu}]\n", {}, ["layers[0]", "field 'name'", "string"]),
    ("input_shape: [4]\nlayers: [{name: null, type: relu}]\n", {}, ["field 'name'", "got None"]),
]


@pytest.mark.parametrize("text, files, fragments", BAD)
def test_bad_specs_are_one_clear_error_naming_file_layer_and_field(tmp_path, text, files, fragments):
    for name, arrays in files.items():
        if isinstance(arrays, bytes):
            (tmp_path / name).write_bytes(arrays)
        elif isinstance(arrays, np.ndarray):
            np.save(tmp_path / name, arrays)
        else:
            np.savez(tmp_path / name, **arrays)
    if isinstance(text, bytes):
        path = tmp_path / "model.yaml"
        path.write_bytes(text)
    else:
        path = tmp_path / "model.yaml" if text is None else write(tmp_path, text)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SpecError) as error:
        load_model(path)
    message = str(error.value)
    assert message.startswith(str(path)) and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written


def test_linear_input_must_be_flat(tmp_path):
    text = "input_shape: [1, 6, 6]\ninit: {seed: 0}\nlayers: [{name: fc, type: linear, out_features: 2}]\n"
    with pytest.raises(SpecError, match="layer 'fc' .*field 'input': .*add a flatten layer"):
        load_model(write(tmp_path, text))
