"""Model specs: bundled models load, weights round-trip, and every bad input is one clear SpecError."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from sparse_scan import SpecError, load_model
from sparse_scan.layers import AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"

TINY = """input_shape: [1, 6, 6]
{extra}layers:
  - {{name: conv, type: conv2d, out_channels: 2, kernel_size: 3}}
  - {{name: act, type: relu}}
  - {{name: flat, type: flatten}}
  - {{name: fc, type: linear, out_features: 3}}
"""


BN = "input_shape: [2, 4, 4]\ninit: {{seed: 0}}\nlayers: [{{name: bn, type: batchnorm2d, {args}}}]\n"
DROPOUT = "input_shape: [2, 4, 4]\nlayers: [{{name: d, type: dropout, {args}}}]\n"
POOL = "input_shape: [2, 4, 4]\nlayers: [{{name: a, type: adaptive_avgpool2d, {args}}}]\n"
BN_WEIGHTS = "input_shape: [2, 4, 4]\nweights: w.npz\nlayers: [{name: bn, type: batchnorm2d}]\n"
STATISTICS = {"bn.weight": np.array([2.0, 3.0]), "bn.bias": np.array([0.5, -0.5]),
              "bn.running_mean": np.array([1.0, -1.0]), "bn.running_var": np.array([4.0, 0.25])}

NORMALISED = """input_shape: [1, 6, 6]
{extra}layers:
  - {{name: conv, type: conv2d, out_channels: 2, kernel_size: 3}}
  - {{name: bn, type: batchnorm2d{bn}}}
  - {{name: act, type: relu}}
  - {{name: pool, type: adaptive_avgpool2d, output_size: [2, null]}}
  - {{name: flat, type: flatten}}
  - {{name: drop, type: dropout, p: 0.5{drop}}}
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
    # batchnorm2d, dropout and adaptive_avgpool2d: every field
    (BN.format(args="num_features: 3"), {}, ["layer 'bn' (layers[0])", "field 'num_features'",
                                             "input to this layer has 2"]),
    (BN.format(args="eps: 0"), {}, ["layer 'bn' (layers[0])", "field 'eps'", "> 0"]),
    (BN.format(args="eps: small"), {}, ["field 'eps'", "finite number"]),
    (BN.format(args="momentum: 1.5"), {}, ["layer 'bn' (layers[0])", "field 'momentum'", "None or between"]),
    (BN.format(args="momentum: fast"), {}, ["field 'momentum'", "finite number"]),
    (BN.format(args="momentum: true"), {}, ["field 'momentum'", "finite number"]),
    (BN.format(args="affine: 'yes'"), {}, ["layer 'bn' (layers[0])", "field 'affine'", "true or false"]),
    (BN.format(args="bias: 1"), {}, ["field 'bias'", "true or false"]),
    (BN.format(args="track_running_stats: false"), {},
     ["layer 'bn' (layers[0])", "field 'track_running_stats'", "couples the samples"]),
    (BN.format(args="track_running_stats: 'true'"), {}, ["field 'track_running_stats'", "true or false"]),
    (BN.format(args="training: true"), {},
     ["layer 'bn' (layers[0])", "field 'training'", "every sample of the batch",
      "training: false (the default)"]),
    (BN.format(args="training: 'no'"), {}, ["field 'training'", "true or false"]),
    (BN.format(args="dtype: float64"), {}, ["field 'dtype'", "unknown argument of batchnorm2d"]),
    ("input_shape: [4]\ninit: {seed: 0}\nlayers: [{name: bn, type: batchnorm2d}]\n", {},
     ["layer 'bn' (layers[0])", "field 'input'", "(C, H, W)"]),
    (DROPOUT.format(args="p: 1.5"), {}, ["layer 'd' (layers[0])", "field 'p'", "between 0 and 1"]),
    (DROPOUT.format(args="p: -0.1"), {}, ["field 'p'", ">= 0"]),
    (DROPOUT.format(args="p: half"), {}, ["field 'p'", "finite number"]),
    (DROPOUT.format(args="training: 1"), {}, ["layer 'd' (layers[0])", "field 'training'", "true or false"]),
    (DROPOUT.format(args="rng: 0"), {},
     ["field 'rng'", "unknown argument of dropout (allowed: p, training)"]),
    (DROPOUT.format(args="inplace: true"), {}, ["field 'inplace'", "unknown argument of dropout"]),
    (POOL.format(args="output_size: [2]"), {},
     ["layer 'a' (layers[0])", "field 'output_size'", "(h, w) pair"]),
    (POOL.format(args="output_size: 0"), {}, ["field 'output_size'", "positive int"]),
    (POOL.format(args="output_size: [2, 0]"), {}, ["field 'output_size'"]),
    (POOL.format(args="output_size: [2, 1.5]"), {}, ["field 'output_size'"]),
    (POOL.format(args="output_size: two"), {}, ["field 'output_size'"]),
    (POOL.format(args="output_size: null"), {}, ["field 'output_size'"]),
    (POOL.format(args="kernel_size: 2"), {},
     ["field 'kernel_size'", "unknown argument of adaptive_avgpool2d"]),
    ("input_shape: [2, 4, 4]\nlayers: [{name: a, type: adaptive_avgpool2d}]\n", {},
     ["layer 'a' (layers[0])", "field 'output_size'", "missing (required by adaptive_avgpool2d)"]),
    ("input_shape: [8]\nlayers: [{name: a, type: adaptive_avgpool2d, output_size: 1}]\n", {},
     ["layer 'a' (layers[0])", "field 'input'", "(C, H, W)"]),
    # batch-norm parameters and statistics from the weights file
    (BN_WEIGHTS, {"w.npz": dict(STATISTICS, **{"bn.running_var": np.array([1.0, -1.0])})},
     ["layer 'bn' (layers[0])", "field 'running_var'", "non-negative"]),
    (BN_WEIGHTS, {"w.npz": dict(STATISTICS, **{"bn.running_mean": np.zeros(3)})},
     ["layer 'bn' (layers[0])", "field 'running_mean'", "expected shape (2,)"]),
    (BN_WEIGHTS, {"w.npz": dict(STATISTICS, **{"bn.running_mean": np.array([np.inf, 0])})},
     ["field 'running_mean'", "NaN or Inf"]),
    (BN_WEIGHTS, {"w.npz": {k: v for k, v in STATISTICS.items() if k != "bn.running_var"}},
     ["layer 'bn' (layers[0])", "field 'running_var'",
      "no 'bn.running_var' in the weights file and no init"]),
    (BN_WEIGHTS.replace("batchnorm2d", "batchnorm2d, affine: false"), {"w.npz": STATISTICS},
     ["field 'weights'", "'bn.bias' in the weights file matches no layer parameter"]),
    (BN_WEIGHTS.replace("batchnorm2d", "batchnorm2d, bias: false"), {"w.npz": STATISTICS},
     ["field 'weights'", "'bn.bias'", "matches no layer parameter"]),
    # a bias for a layer without one is not silently dropped
    ("input_shape: [4]\nweights: w.npz\nlayers: [{name: fc, type: linear, out_features: 2, bias: false}]\n",
     {"w.npz": {"fc.weight": np.ones((2, 4)), "fc.bias": np.ones(2)}},
     ["field 'weights'", "'fc.bias'", "matches no layer parameter"]),
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


def test_batchnorm_statistics_and_parameters_load_from_the_weights_file(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"conv.weight": rng.standard_normal((2, 1, 3, 3)), "conv.bias": rng.standard_normal(2),
               "fc.weight": rng.standard_normal((3, 16)), "fc.bias": rng.standard_normal(3),
               **STATISTICS, "bn.num_batches_tracked": np.array(7)}  # PyTorch's state_dict: accepted
    np.savez(tmp_path / "w.npz", **weights)
    model = load_model(write(tmp_path, NORMALISED.format(extra="weights: w.npz\n", bn="", drop="")),
                       dtype=np.float64)
    bn = model.layers[1]
    for key in ("weight", "bias", "running_mean", "running_var"):
        np.testing.assert_array_equal(getattr(bn, key), STATISTICS[f"bn.{key}"])
    assert sorted(model.state_dict()) == sorted(k for k in weights if k != "bn.num_batches_tracked")
    x = np.random.default_rng(1).standard_normal((2, 1, 6, 6))
    conv = model.layers[0].forward(x)
    expected = ((conv - STATISTICS["bn.running_mean"][:, None, None]) / np.sqrt(
        STATISTICS["bn.running_var"][:, None, None] + 1e-5) * STATISTICS["bn.weight"][:, None, None]
        + STATISTICS["bn.bias"][:, None, None])
    np.testing.assert_allclose(bn.forward(conv), expected, rtol=1e-12)


def test_batchnorm_statistics_from_safetensors(tmp_path):
    numpy_io = pytest.importorskip("safetensors.numpy")
    float32 = {k: v.astype(np.float32) for k, v in STATISTICS.items()}
    numpy_io.save_file(float32, str(tmp_path / "w.safetensors"))
    model = load_model(write(tmp_path, BN_WEIGHTS.replace("w.npz", "w.safetensors")))
    np.testing.assert_array_equal(model.layers[0].running_var, np.float32([4.0, 0.25]))


def test_spec_models_load_in_eval_mode_and_training_dropout_is_seeded(tmp_path):
    model = load_model(write(tmp_path, NORMALISED.format(extra="init: {seed: 0}\n", bn="", drop="")))
    bn, pool, drop = model.layers[1], model.layers[3], model.layers[5]
    assert isinstance(bn, BatchNorm2d) and isinstance(pool, AdaptiveAvgPool2d) and isinstance(drop, Dropout)
    assert bn.num_features == 2 and not bn.training and not drop.training and drop.p == 0.5
    assert model.shapes(model.input_shape)[4] == (2, 2, 4) and model.layers[6].in_features == 16
    np.testing.assert_array_equal(bn.running_mean, [0, 0])  # init: PyTorch's initial statistics
    np.testing.assert_array_equal(bn.weight, [1, 1])
    x = np.random.default_rng(0).standard_normal((4, 1, 6, 6)).astype(np.float32)
    np.testing.assert_array_equal(drop.forward(x), x)

    def masks(seed):
        text = NORMALISED.format(extra=f"init: {{seed: {seed}}}\n", bn=", training: false",
                                 drop=", training: true")
        trained = load_model(write(tmp_path, text, f"drop{seed}.yaml"))
        assert trained.layers[5].training
        return [trained.layers[5].forward(np.ones((4, 16), np.float32)) for _ in range(2)]

    first, again, other = masks(1), masks(1), masks(2)
    np.testing.assert_array_equal(first, again)  # the same seed, the same masks
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[0], other[0])
    assert set(np.unique(first[0]).tolist()) == {0.0, 2.0}


def test_prune_applies_to_conv_and_linear_weights_only(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"conv.weight": rng.standard_normal((2, 1, 3, 3)), "conv.bias": rng.standard_normal(2),
               "fc.weight": rng.standard_normal((3, 16)), "fc.bias": rng.standard_normal(3), **STATISTICS}
    np.savez(tmp_path / "w.npz", **weights)
    text = NORMALISED.format(extra="weights: w.npz\nprune: {amount: 0.5}\n", bn="", drop="")
    model = load_model(write(tmp_path, text), dtype=np.float64)
    for layer in model.layers:
        if isinstance(layer, (Conv2d, Linear)):
            assert layer.prune_pattern and np.mean(layer.weight == 0) == pytest.approx(0.5, abs=0.1)
            np.testing.assert_array_equal(layer.bias, weights[f"{layer.name}.bias"])
    bn = model.layers[1]
    for key in ("weight", "bias", "running_mean", "running_var"):  # no batch-norm scale is zeroed
        np.testing.assert_array_equal(getattr(bn, key), STATISTICS[f"bn.{key}"])


def test_bundled_normalised_cnn_loads_and_runs():
    model = load_model(DATA / "cnn-bn.yaml")
    kinds = [type(layer).__name__ for layer in model.layers]
    assert {"BatchNorm2d", "Dropout", "AdaptiveAvgPool2d"} <= set(kinds)
    assert not any(getattr(layer, "training", False) for layer in model.layers)
    x = np.random.default_rng(0).standard_normal((2,) + model.input_shape).astype(np.float32)
    assert model.forward(x).shape == (2, 10)
