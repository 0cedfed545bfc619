"""What the capture of a PyTorch forward added to the engine, against independent oracles.

- ``Affine`` (``x * c``, ``x + c``), ``LogSoftmax`` and ``Softmax``: forward and transposed Jacobians
  against float64 finite differences and PyTorch autograd, on the CPU and the GPU (the same body);
  whole models holding them: their scan equals back-propagation.
- Inline residual blocks (``Residual(..., scoped=False)``): their layers keep their own names in the
  scope holding the block (state_dict, parameter gradients, nested blocks), and a spec says so with
  ``scoped: false`` (bad values refused with one line naming the field).
- The recurrent head's ``reduction: mean``: the classifier's gradients equal autograd's through
  ``fc(out.mean(dim=1))``, for every schedule; bad values refused.
- ``model_from_spec``: the spec mapping and weights in memory give the model ``load_model`` gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from oracles import finite_difference_jt

from sparse_scan import Sequential, SpecError, load_model
from sparse_scan.layers import Affine, Conv2d, Flatten, Linear, LogSoftmax, ReLU, Residual, Softmax, Tanh
from sparse_scan.recurrent import LSTM, RecurrentClassifier
from sparse_scan.spec import model_from_spec


def sample(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


LAYERS = [
    (Affine(scale=2.5), lambda x: 2.5 * x, "affine-scale"),
    (Affine(shift=-1.5), lambda x: x - 1.5, "affine-shift"),
    (Affine(scale=-1.0, shift=1.0), lambda x: 1 - x, "affine-both"),
    (LogSoftmax(dim=1), lambda x: np.log(softmax(x)), "log_softmax"),
    (Softmax(dim=-1), softmax, "softmax"),
]


@pytest.mark.parametrize("layer, definition, _id", LAYERS, ids=[case[2] for case in LAYERS])
def test_forward_and_transposed_jacobian_equal_finite_differences(be, layer, definition, _id):
    x = sample((3, 7))
    out = layer.forward(be.asarray(x))
    np.testing.assert_allclose(be.to_host(out), definition(x), rtol=1e-13, atol=1e-14)
    jt = layer.transposed_jacobian(be.asarray(x))
    dense = np.broadcast_to(be.to_host(jt.todense()), (3, 7, 7))  # a shared JT: one matrix
    for b in range(3):
        np.testing.assert_allclose(dense[b], finite_difference_jt(definition, x[b]), atol=1e-8)


@pytest.mark.parametrize("layer, module, _id", [
    (LogSoftmax(dim=1), "LogSoftmax", "log_softmax"), (Softmax(dim=1), "Softmax", "softmax")],
    ids=["log_softmax", "softmax"])
def test_softmaxes_equal_pytorch_forward_and_backward(layer, module, _id):
    torch = pytest.importorskip("torch")
    x = sample((4, 10), seed=3) * 5
    g = sample((4, 10), seed=4)
    inputs = torch.from_numpy(x).requires_grad_(True)
    y = getattr(torch.nn, module)(dim=1)(inputs)
    y.backward(torch.from_numpy(g))
    np.testing.assert_allclose(layer.forward(x), y.detach().numpy(), rtol=1e-14, atol=1e-15)
    jt = layer.transposed_jacobian(x).todense()
    np.testing.assert_allclose(np.einsum("bij,bj->bi", jt, g), inputs.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_softmaxes_refuse_what_they_do_not_compute():
    with pytest.raises(ValueError, match="dim: must be 1 or -1"):
        Softmax(dim=0)
    with pytest.raises(ValueError, match=r"LogSoftmax runs over the features of a flat sample .* \[2, 3\]"):
        LogSoftmax(1).forward(np.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="scale: must be a finite number"):
        Affine(scale=float("nan"))


@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 1)])
def test_a_classifier_ending_in_log_softmax_scans_like_back_propagation(method, levels):
    """Affine, LogSoftmax: the scan's every gradient equals layer-by-layer back-propagation through each
    layer's dense JT (an independent computation)."""
    model = Sequential(Conv2d(1, 2, 3, dtype=np.float64, rng=0), Tanh(), Affine(scale=0.5, shift=1.0),
                       Flatten(), Linear(2 * 4 * 4, 5, dtype=np.float64, rng=1), LogSoftmax(1),
                       input_shape=(1, 6, 6))
    x, g = sample((3, 1, 6, 6)), sample((3, 5), seed=1)
    model.forward(x)
    grads = model.backward(g, method=method, levels=levels)
    expected = g.reshape(3, -1)
    for index in range(len(model.layers) - 1, -1, -1):
        np.testing.assert_allclose(grads[index + 1].reshape(3, -1), expected, rtol=1e-10, atol=1e-13)
        dense = model.layers[index].transposed_jacobian(model._activations[index]).todense()
        expected = np.einsum("bij,bj->bi", np.broadcast_to(dense, (3,) + dense.shape[-2:]), expected)
    np.testing.assert_allclose(grads[0].reshape(3, -1), expected, rtol=1e-10, atol=1e-13)


# --- inline residual blocks ---------------------------------------------------------------------
def inline_model():
    """``conv1 -> [fc.. inline block: conv2, relu, (nested inline: conv3) + shortcut proj] -> flatten``,
    layers named as a module's children would be."""
    conv = [Conv2d(2, 2, 3, padding=1, dtype=np.float64, rng=seed) for seed in range(4)]
    for layer, name in zip(conv, ["conv1", "conv2", "conv3", "proj"], strict=True):
        layer.name = name
    nested = Residual(conv[2], scoped=False)
    nested.name = "add"
    block = Residual(conv[1], ReLU(), nested, shortcut=[conv[3]], scoped=False)
    block.name = "add_1"
    block.layers[1].name = "relu"
    return Sequential(conv[0], block, Flatten(), input_shape=(2, 4, 4))


def test_an_inline_blocks_layers_keep_their_names():
    model = inline_model()
    assert list(model.state_dict()) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                        "conv3.weight", "conv3.bias", "proj.weight", "proj.bias"]
    x, g = sample((2, 2, 4, 4)), sample((2, 32), seed=1)
    model.forward(x)
    grads = model.parameter_gradients(model.backward(g, method="blelloch"))
    assert sorted(grads) == sorted(model.state_dict())
    scoped = Sequential(Residual(Conv2d(2, 2, 1, rng=0), shortcut=Conv2d(2, 2, 1, rng=1)))
    assert list(scoped.state_dict()) == ["0.0.weight", "0.0.bias", "0.shortcut.weight", "0.shortcut.bias"]


def test_an_inline_blocks_parameter_gradients_equal_pytorch():
    torch = pytest.importorskip("torch")
    model = inline_model()
    x, g = sample((2, 2, 4, 4)), sample((2, 32), seed=1)
    model.forward(x)
    grads = model.parameter_gradients(model.backward(g, method="linear"))
    weights = {name: torch.from_numpy(value.copy()).requires_grad_(True)
               for name, value in model.state_dict().items()}

    def conv(name, h):
        return torch.nn.functional.conv2d(h, weights[f"{name}.weight"], weights[f"{name}.bias"], padding=1)

    inputs = torch.from_numpy(x)
    h = conv("conv1", inputs)
    inner = conv("conv2", h).relu()
    out = (conv("conv3", inner) + inner) + conv("proj", h)
    out.reshape(2, -1).backward(torch.from_numpy(g))
    for name, tensor in weights.items():
        np.testing.assert_allclose(grads[name], tensor.grad.numpy(), rtol=1e-10, atol=1e-13, err_msg=name)


INLINE_SPEC = """input_shape: [2, 4, 4]
init: {{seed: 0}}
layers:
  - {{name: conv1, type: conv2d, out_channels: 2, kernel_size: 3, padding: 1}}
  - name: add
    type: residual
{fields}    layers:
      - {{name: conv2, type: conv2d, out_channels: 2, kernel_size: 3, padding: 1}}
    shortcut: {{name: proj, type: conv2d, out_channels: 2, kernel_size: 1}}
"""


def test_a_spec_writes_an_inline_block_with_scoped_false(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(INLINE_SPEC.format(fields="    scoped: false\n"))
    model = load_model(path)
    assert list(model.state_dict()) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                        "proj.weight", "proj.bias"]
    path.write_text(INLINE_SPEC.format(fields="").replace("name: proj, ", ""))  # scoped: the default
    assert list(load_model(path).state_dict())[2:] == ["add.conv2.weight", "add.conv2.bias",
                                                       "add.shortcut.weight", "add.shortcut.bias"]


@pytest.mark.parametrize("fields, fragment", [
    ("    scoped: no_thanks\n", "layer 'add' (layers[1]), field 'scoped': must be true or false"),
    ("    scoped: false\n    shortcut_name: down\n", "field 'shortcut_name': names the shortcut's layers"),
])
def test_bad_inline_block_fields_are_one_line(tmp_path, fields, fragment):
    path = tmp_path / "m.yaml"
    path.write_text(INLINE_SPEC.format(fields=fields))
    with pytest.raises(SpecError) as error:
        load_model(path)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_an_inline_blocks_names_must_be_unique_in_its_scope(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(INLINE_SPEC.format(fields="    scoped: false\n").replace("name: conv2", "name: conv1"))
    with pytest.raises(SpecError, match=r"layer 'conv1' \(layers\[1\]\.layers\[0\]\), field 'name': used by"):
        load_model(path)


# --- the recurrent head's reduction -----------------------------------------------------------------
@pytest.mark.parametrize("method, levels", [("linear", None), ("blelloch", None), ("hybrid", 2),
                                            ("auto", None)])
def test_a_mean_head_equals_autograd(method, levels):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    lstm, fc = torch.nn.LSTM(3, 5, num_layers=2, batch_first=True).double(), torch.nn.Linear(5, 4).double()
    recurrent = LSTM(3, 5, num_layers=2, batch_first=True, dtype=np.float64)
    recurrent.load_state_dict({name: value.detach().numpy() for name, value in lstm.state_dict().items()})
    head = Linear(5, 4, dtype=np.float64)
    head.weight, head.bias = fc.weight.detach().numpy().copy(), fc.bias.detach().numpy().copy()
    model = RecurrentClassifier(recurrent, head=head, reduction="mean")
    x, g = sample((2, 9, 3)), sample((2, 4), seed=1)
    inputs = torch.from_numpy(x).requires_grad_(True)
    logits = fc(lstm(inputs)[0].mean(dim=1))
    logits.backward(torch.from_numpy(g))
    np.testing.assert_allclose(model.forward(x), logits.detach().numpy(), rtol=1e-12)
    grads = model.backward(g, method=method, levels=levels)
    np.testing.assert_allclose(grads[0], inputs.grad.numpy(), rtol=1e-10, atol=1e-13)
    parameters = model.parameter_gradients(grads)
    for name, tensor in [*(("rnn." + n, p) for n, p in lstm.named_parameters()),
                         *(("fc." + n, p) for n, p in fc.named_parameters())]:
        np.testing.assert_allclose(parameters[name], tensor.grad.numpy(), rtol=1e-10, atol=1e-13,
                                   err_msg=name)


def test_the_heads_reduction_in_a_spec(tmp_path):
    path = tmp_path / "m.yaml"
    text = ("input_shape: [6, 2]\ninit: {{seed: 0}}\nlayers:\n  - {{name: rnn, type: gru, hidden_size: 3}}\n"
            "  - {{name: fc, type: linear, out_features: 2{extra}}}\n")
    path.write_text(text.format(extra=", reduction: mean"))
    assert load_model(path).reduction == "mean"
    path.write_text(text.format(extra=""))
    assert load_model(path).reduction == "last"
    path.write_text(text.format(extra=", reduction: max"))
    with pytest.raises(SpecError, match=r"'fc' \(layers\[1\]\), field 'reduction': .*one of last, mean"):
        load_model(path)
    with pytest.raises(ValueError, match="reduction: must be one of last, mean"):
        RecurrentClassifier(LSTM(2, 3), classes=2, reduction="first")


# --- model_from_spec ------------------------------------------------------------------------------
def test_model_from_spec_builds_what_load_model_reads(tmp_path):
    spec = {"input_shape": [1, 6, 6], "layers": [
        {"name": "conv", "type": "conv2d", "out_channels": 2, "kernel_size": 3}, {"type": "relu"},
        {"type": "flatten"}, {"name": "fc", "type": "linear", "out_features": 3},
        {"type": "log_softmax", "dim": 1}]}
    weights = {"conv.weight": sample((2, 1, 3, 3)), "conv.bias": sample(2, 1),
               "fc.weight": sample((3, 32), 2), "fc.bias": sample(3, 3)}
    model = model_from_spec(spec, weights, dtype=np.float64)
    np.savez(tmp_path / "w.npz", **weights)
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(dict(spec, weights="w.npz")))
    loaded = load_model(tmp_path / "m.yaml", dtype=np.float64)
    x = sample((2, 1, 6, 6), 4)
    np.testing.assert_array_equal(model.forward(x), loaded.forward(x))
    with pytest.raises(SpecError, match=r"^here: field 'layers': missing"):
        model_from_spec({"input_shape": [1]}, source="here")
