"""Recurrent models as specs: export_torch of a PyTorch recurrent classifier round-trips to a
RecurrentClassifier equal to PyTorch (outputs and every gradient, every schedule), the spec's bad input
is one SpecError line naming the file, the layer and the field, and the schedules the classifier
states."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan import SpecError, export_torch, load_model
from sparse_scan.engine.dense_plan import build_dense_plan
from sparse_scan.engine.figures import totals
from sparse_scan.engine.schedule import depth
from sparse_scan.flops import analyse
from sparse_scan.layers import Linear
from sparse_scan.recurrent import GRU, LSTM, RNN, Bitstream, RecurrentClassifier

SCHEDULES = [("linear", None), ("blelloch", None), ("hybrid", 1), ("hybrid", "auto"), ("auto", None)]

CONFIGS = {
    "rnn-tanh": ("RNN", {}),
    "rnn-relu-stacked-bidirectional": ("RNN", {"nonlinearity": "relu", "num_layers": 2,
                                               "bidirectional": True}),
    "gru-batch-first-no-bias": ("GRU", {"batch_first": True, "bias": False}),
    "gru-stacked-bidirectional-dropout": ("GRU", {"num_layers": 3, "bidirectional": True, "dropout": 0.3}),
    "lstm": ("LSTM", {"batch_first": True}),
    "lstm-projected-stacked-bidirectional": ("LSTM", {"num_layers": 2, "bidirectional": True,
                                                      "proj_size": 3}),
}


def classifier(kind: str, arguments: dict, classes: int = 4):
    """A PyTorch module as users write one: a recurrent layer, a linear head on its last output."""
    torch = pytest.importorskip("torch")

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(3, 5, **arguments)
            width = (2 if self.rnn.bidirectional else 1) * (self.rnn.proj_size or self.rnn.hidden_size)
            self.fc = torch.nn.Linear(width, classes)

        def forward(self, x):  # x batch-first, whatever the recurrent layer's layout
            output, _ = self.rnn(x if self.rnn.batch_first else x.transpose(0, 1))
            return self.fc(output[:, -1] if self.rnn.batch_first else output[-1])

    torch.manual_seed(0)
    return Classifier().double().eval()  # eval: no dropout, as a loaded spec


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_round_trip_equals_pytorch_outputs_and_every_gradient(tmp_path, config):
    torch = pytest.importorskip("torch")
    net = classifier(*CONFIGS[config])
    steps = 6
    spec = export_torch(net, (steps, 3), tmp_path / "net.yaml")
    model = load_model(spec, dtype=np.float64)
    assert isinstance(model, RecurrentClassifier) and model.input_shape == (steps, 3)
    assert sorted(model.state_dict()) == sorted(name for name, _ in net.named_parameters())
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal((2, steps, 3)), rng.standard_normal((2, 4))
    inputs = torch.from_numpy(x).requires_grad_(True)
    logits = net(inputs)
    logits.backward(torch.from_numpy(g))
    np.testing.assert_allclose(model.forward(x), logits.detach().numpy(), rtol=1e-10, atol=1e-13)
    for method, levels in SCHEDULES:
        grads = model.backward(g, method, levels)
        parameters = model.parameter_gradients(grads)
        label = f"{method} {levels}"
        np.testing.assert_allclose(grads[0], inputs.grad.numpy(), rtol=1e-10, atol=1e-13, err_msg=label)
        np.testing.assert_array_equal(grads[2], g)
        for name, parameter in net.named_parameters():
            np.testing.assert_allclose(parameters[name], parameter.grad.numpy(), rtol=1e-10, atol=1e-13,
                                       err_msg=f"{label}: {name}")


def test_the_spec_written_carries_every_argument(tmp_path):
    pytest.importorskip("torch")
    net = classifier("LSTM", {"num_layers": 2, "bidirectional": True, "proj_size": 3, "batch_first": True,
                              "dropout": 0.25, "bias": False})
    text = export_torch(net, (7, 3), tmp_path / "net.yaml").read_text()
    assert ("{name: rnn, type: lstm, input_size: 3, hidden_size: 5, num_layers: 2, bias: false,\n"
            "  batch_first: true, dropout: 0.25, bidirectional: true, proj_size: 3}") in text
    model = load_model(tmp_path / "net.yaml")
    recurrent = model.recurrent
    assert (recurrent.num_layers, recurrent.bidirectional, recurrent.proj_size, recurrent.batch_first,
            recurrent.dropout, recurrent.bias, recurrent.training) == (2, True, 3, True, 0.25, False, False)
    rnn = classifier("RNN", {"nonlinearity": "relu"})
    text = export_torch(rnn, (4, 3), tmp_path / "rnn.yaml").read_text()
    assert "type: rnn, nonlinearity: relu, input_size: 3" in text and "proj_size" not in text


def test_export_refuses_recurrent_modules_it_cannot_represent(tmp_path):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    cases = [(nn.Sequential(nn.Linear(3, 3), nn.LSTM(3, 4)),
              r"node '_1' \(module '1'\): LSTM must read the forward's input"),
             (nn.Sequential(nn.GRU(3, 4), nn.Linear(4, 2), nn.ReLU()),  # nn.Linear given the GRU's pair
              r"node '_1' \(module '1'\) fails on a batch of the input shape \[4, 3\]: TypeError"),
             (nn.Sequential(nn.RNN(3, 4), nn.ReLU()), r"node '_1' \(module '1'\) fails on a batch"),
             (classifier("GRU", {"num_layers": 2, "dropout": 0.5}).train(),
              r"node 'rnn' \(module 'rnn'.*the GRU's dropout between layers is active \(training mode\)")]
    for index, (module, fragment) in enumerate(cases):
        path = tmp_path / f"m{index}.yaml"
        with pytest.raises(ValueError, match=fragment):
            export_torch(module, (4, 3), path)
        assert not path.exists() and not path.with_suffix(".npz").exists()


GOOD = """input_shape: [5, 2]
{extra}layers:
  - {{name: rnn, type: {kind}, hidden_size: 3{arguments}}}
  - {{name: fc, type: linear, out_features: 4}}
"""


def write(tmp_path, text, name="model.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_text(kind="lstm", arguments="", extra="init: {seed: 0}\n"):
    return GOOD.format(kind=kind, arguments=arguments, extra=extra)


def test_a_recurrent_spec_loads_seeded_and_with_stored_weights(tmp_path):
    a = load_model(write(tmp_path, spec_text(arguments=", num_layers: 2")), dtype=np.float64)
    b = load_model(tmp_path / "model.yaml", dtype=np.float64)
    assert a.recurrent.num_layers == 2 and a.recurrent.input_size == 2 and a.fc.in_features == 3
    assert a.recurrent.dtype == np.float64 and a.fc.weight.dtype == np.float64
    for key, value in a.state_dict().items():
        np.testing.assert_array_equal(value, b.state_dict()[key])  # seeded: reproducible
    stored = {key: np.full_like(value, 0.5) for key, value in a.state_dict().items()}
    np.savez(tmp_path / "w.npz", **stored)
    text = spec_text(arguments=", num_layers: 2", extra="weights: w.npz\n")
    c = load_model(write(tmp_path, text, "w.yaml"))
    assert all((value == 0.5).all() and value.dtype == np.float32 for value in c.state_dict().values())
    assert c.shapes(c.input_shape) == [(5, 2), (5, 3), (4,)]


def write_weights(tmp_path, changes):
    """The seeded spec's weights with ``changes`` (None: left out) as ``w.npz``."""
    model = load_model(write(tmp_path, spec_text(), "seeded.yaml"))
    weights = {key: np.asarray(value) for key, value in model.state_dict().items()} | changes
    np.savez(tmp_path / "w.npz", **{key: value for key, value in weights.items() if value is not None})


BAD = [
    (spec_text(arguments=", hiden_size: 3"),
     "layer 'rnn' (layers[0]), field 'hiden_size': unknown argument of lstm (allowed: input_size, "
     "hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size, training)"),
    (spec_text(kind="gru", arguments=", proj_size: 2"), "field 'proj_size': unknown argument of gru"),
    (spec_text(arguments=", dtype: float64"), "field 'dtype': unknown argument of lstm"),
    (spec_text(arguments=", proj_size: 3"),
     "field 'proj_size': must be an int >= 0 and <= 2 (hidden_size - 1)"),
    (spec_text(arguments=", num_layers: 0"),
     "layer 'rnn' (layers[0]), field 'num_layers': must be an int >= 1"),
    (spec_text(arguments=", bidirectional: 'yes'"), "field 'bidirectional': must be true or false"),
    (spec_text(arguments=", dropout: 1.5"), "field 'dropout': must be a probability in [0, 1]"),
    (spec_text(kind="rnn", arguments=", nonlinearity: sigmoid"),
     "field 'nonlinearity': must be 'tanh' or 'relu'"),
    (spec_text(arguments=", input_size: 3"), "field 'input_size': is 3 but the input has 2 features"),
    (spec_text().replace("hidden_size: 3", "num_layers: 1"),
     "field 'hidden_size': missing (required by lstm)"),
    (spec_text().replace("[5, 2]", "[5, 2, 1]"),
     "field 'input_shape': a recurrent model takes [time steps, input_size] per sample, got [5, 2, 1]"),
    (spec_text(extra="init: {seed: 0}\nprune: {amount: 0.5}\n"),
     "field 'prune': applies to the conv2d and linear"),
    (spec_text() + "  - {name: out, type: relu}\n",
     "layer 'rnn' (layers[0]), field 'layers': a recurrent layer is followed by exactly one linear layer"),
    (spec_text().replace("type: linear", "type: relu"),
     "layer 'fc' (layers[1]), field 'type': the layer after a recurrent layer is its classifier head: "
     "linear, got 'relu'"),
    (spec_text().replace("name: fc", "name: rnn"),
     "layer 'rnn' (layers[1]), field 'name': used by an earlier"),
    (spec_text().replace("out_features: 4", "out_features: 4, in_features: 6"),
     "layer 'fc' (layers[1]), field 'in_features': is 6 but the input to this layer has 3"),
    ("input_shape: [1, 4, 4]\ninit: {seed: 0}\nlayers:\n  - {type: flatten}\n"
     "  - {name: r, type: gru, hidden_size: 3}\n",
     "layer 'r' (layers[1]), field 'type': a recurrent layer (gru) must be the first layer"),
    (spec_text(extra=""),
     "layer 'rnn' (layers[0]), field 'weight_ih_l0': no 'rnn.weight_ih_l0' in the weights file and no "
     "init: seed"),
]


@pytest.mark.parametrize("text, fragment", BAD)
def test_bad_recurrent_specs_are_one_line_naming_file_layer_and_field(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as error:
        load_model(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert fragment in message


@pytest.mark.parametrize("changes, fragment", [
    ({"rnn.weight_hh_l0": np.zeros((12, 2), np.float32)},
     "layer 'rnn' (layers[0]), field 'weight_hh_l0': 'rnn.weight_hh_l0' has shape [12, 2], expected [12, 3]"),
    ({"rnn.bias_ih_l0": np.full(12, np.nan, np.float32)}, "field 'bias_ih_l0': 'rnn.bias_ih_l0' holds NaN"),
    ({"rnn.weight_ih_l0": np.zeros((12, 2), np.int64)},
     "field 'weight_ih_l0': 'rnn.weight_ih_l0' has dtype int64"),
    ({"fc.weight": np.zeros((4, 2), np.float32)}, "layer 'fc' (layers[1]), field 'weight'"),
    ({"rnn.weight_hr_l0": np.zeros((2, 3), np.float32)}, "field 'weights': 'rnn.weight_hr_l0' in the weights "
     "file matches no layer parameter"),
    ({"rnn.weight_hh_l0": None}, "field 'weight_hh_l0': no 'rnn.weight_hh_l0' in the weights file"),
])
def test_bad_recurrent_weights_name_the_layer_and_the_parameter(tmp_path, changes, fragment):
    write_weights(tmp_path, changes)
    path = write(tmp_path, spec_text(extra="weights: w.npz\n"))
    with pytest.raises(SpecError) as error:
        load_model(path)
    assert str(error.value).startswith(f"{path}: ") and fragment in str(error.value)


def test_the_classifier_states_its_schedule_like_a_scan_plan():
    model = RecurrentClassifier(GRU(2, 4, num_layers=2, bidirectional=True, rng=0), 3, rng=1,
                                input_shape=(20, 2))
    plan = model.plan(method="blelloch", batch=8)
    explained = plan.explain(batch=8, itemsize=4)
    assert explained["requested"] == "blelloch" and explained["reason"] == "as requested"
    assert explained["critical_steps"] == 4 * build_dense_plan(20, "blelloch").critical_steps  # 4 scans
    assert plan.scans == ("rnn.l1", "rnn.l1_reverse", "rnn.l0", "rnn.l0_reverse")
    assert plan.affine == (False, True, True, True)  # the top forward scan: a loss on its last state only
    assert plan.report(batch=8)["totals"] == totals(plan, 8, 4)  # a plan's report: every step of the scans
    report = analyse(model, "blelloch", batch=8)  # the same analysis as a Sequential's
    assert report["totals"]["critical_flops"] == sum(s["flops"] for s in report["steps"] if s["critical"])
    assert report["totals"]["critical_steps"] == 1 + max(s["level"] for s in report["steps"])
    assert report["totals"]["bp_flops"] == 4 * 20 * 2 * 4**2 and report["schedule"] == explained
    assert {s["scan"] for s in report["steps"]} == {layer["name"] for layer in report["layers"]} == set(
        plan.scans)
    assert report["layers"][0]["shape"] == [4, 4] and report["layers"][0]["blocks"] == 20
    chosen = model.plan(method="auto", batch=8)
    candidates = chosen.explain(8)["candidates"]
    assert [c["verdict"] for c in candidates].count("chosen") == 1
    assert [(c["method"], c["levels"]) for c in candidates] == (
        [("linear", None)] + [("hybrid", k) for k in range(1, depth(20) - 1)] + [("blelloch", None)])
    depth_choice = model.plan(method="hybrid", batch=8)
    assert depth_choice.method == "hybrid" and len(depth_choice.explain()["candidates"]) == depth(20) + 1
    if chosen.factored():  # back-propagation on the CPU: the T + 1 total gradients only, no block
        assert chosen.explain(8, 4)["peak_bytes"] == 21 * 8 * 4 * 4
    for method, levels, fragment in [("auto", 2, "levels applies to method='hybrid' only"),
                                     ("hybrid", 9, "hybrid needs levels in 0..5 for 20 time steps"),
                                     ("scan", None, "method must be one of")]:
        with pytest.raises(ValueError, match=fragment):
            model.plan(method=method, levels=levels)


def test_the_classifier_checks_its_head_and_shapes():
    with pytest.raises(ValueError, match=r"head: expected a Linear\(8, ...\) of float32"):
        RecurrentClassifier(LSTM(2, 4, bidirectional=True), head=Linear(4, 3))
    with pytest.raises(ValueError, match="give either classes and rng"):
        RecurrentClassifier(RNN(2, 4), classes=5, head=Linear(4, 3))
    with pytest.raises(ValueError, match=r"input_shape: expected \(time steps, 2\)"):
        RecurrentClassifier(RNN(2, 4), 3, input_shape=(5, 3))
    model = RecurrentClassifier(RNN(1, 4, rng=0), 3, rng=0)
    with pytest.raises(ValueError, match="give in_shape"):
        model.plan()
    x, _ = Bitstream(steps=5, samples=2).batch([0, 1])
    model.forward(x)
    first = model.backward(np.ones((2, 3), np.float32), "linear")
    model.backward(np.ones((2, 3), np.float32), "blelloch")
    with pytest.raises(ValueError, match="takes the list the last backward returned"):
        model.parameter_gradients(first)
    with pytest.raises(ValueError, match=r"grad_out: expected floats of shape \(2, 3\)"):
        model.backward(np.ones((2, 4)), "linear")
