"""export_torch over the corpus of ``tests/torch_corpus.py``: models as people write them, captured
from their ``forward()`` by torch.fx.

Tests
-----
- Every accepted model exports, loads in float64 and equals PyTorch: the forward, and for the
  ``linear`` and ``blelloch`` schedules the gradient with respect to the input and to every
  parameter (the loaded model's parameter names exactly ``module.named_parameters()``'s, but the
  case's ``renamed``; their shapes PyTorch's up to axes of size 1), within ``1e-10`` of each array's
  largest magnitude. A recurrent model's loaded form takes batch-first
  inputs; a time-major torch module is fed the transpose.
- Every refused model raises a one-line ``ValueError`` naming the graph node (``node '...'``; a
  forward torch.fx cannot trace: the line of the forward) and matching the case's fragment, and leaves
  the folder empty.
- A model's Dropout in training mode is written with its mode (``training: true``), in eval mode with
  ``training: false``; a parameter-free module called twice is two layers (named apart).
- The corpus itself: its size, every model runs in PyTorch on a batch of its input shape and is
  float64 and seeded, every refused node named is one torch.fx names.

Run without PyTorch, the module is skipped.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import yaml

from sparse_scan import export_torch, load_model

torch = pytest.importorskip("torch")

from torch_corpus import CORPUS, Case, sample, torch_input  # noqa: E402 - imports torch, skipped above

ACCEPTED = [case for case in CORPUS if case.accepted]
REFUSED = [case for case in CORPUS if not case.accepted]
METHODS = ("linear", "blelloch")
RTOL = 1e-10
BATCH = 2


def name(case: Case) -> str:
    return case.name


def assert_close(got, want, label: str) -> None:
    """``got`` equals ``want`` within :data:`RTOL` of ``want``'s largest magnitude (a gradient's small
    entries are sums that cancel)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{label}: shape {got.shape}, PyTorch's {want.shape}"
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-300)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=label)


@pytest.mark.parametrize("case", ACCEPTED, ids=name)
def test_accepted_model_round_trips_equal_to_autograd(tmp_path, case):
    net = case.module()
    spec = export_torch(net, case.input_shape, tmp_path / "model.yaml")
    model = load_model(spec, dtype=np.float64)
    (x,) = sample(case, BATCH, seed=1)
    leaf = torch.from_numpy(x).requires_grad_(True)
    y = net(torch_input(net, leaf))
    g = np.random.default_rng(2).standard_normal(tuple(y.shape))
    y.backward(torch.from_numpy(g))
    assert_close(model.forward(x), y.detach().numpy(), f"{case.name}: forward")
    renamed = dict(case.renamed)
    names = {renamed.get(parameter_name, parameter_name) for parameter_name, _ in net.named_parameters()}
    for method in METHODS:
        grads = model.backward(g, method=method)
        assert_close(grads[0], leaf.grad.numpy(), f"{case.name} {method}: dL/dx")
        parameters = model.parameter_gradients(grads)
        assert set(parameters) == names, f"{case.name} {method}"
        for parameter_name, parameter in net.named_parameters():
            ours = parameters[renamed.get(parameter_name, parameter_name)]
            want = parameter.grad.numpy()
            assert [n for n in ours.shape if n != 1] == [n for n in want.shape if n != 1], (
                f"{case.name} {method}: {parameter_name}: shape {ours.shape}, PyTorch's {want.shape}")
            assert_close(ours.reshape(want.shape), want, f"{case.name} {method}: {parameter_name}")


@pytest.mark.parametrize("case", REFUSED, ids=name)
def test_refused_model_names_the_node_and_writes_nothing(tmp_path, case):
    net = case.module()
    with pytest.raises(ValueError) as error:
        export_torch(net, case.input_shape, tmp_path / "model.yaml")
    message = str(error.value)
    assert "\n" not in message, message
    # the graph node; or the line of a forward torch.fx cannot trace (there is no graph); or a forward
    # that is not its graph (state, in-place changes torch.fx does not see), found by the float64 check
    assert ("node '" in message or re.search(r"cannot trace the forward at \w+\.py:\d+: `", message)
            or "differ from its traced graph" in message), message
    assert re.search(case.fragment, message), f"{case.name} ({case.what}): {message!r} does not match " \
        f"{case.fragment!r}"
    assert list(tmp_path.iterdir()) == []


def entries_of_type(entries, kind: str) -> list[dict]:
    """Every entry of spec type ``kind`` among a spec's layers, inside blocks too."""
    found = []
    for entry in entries if isinstance(entries, list) else [entries]:
        if isinstance(entry, dict):
            if entry.get("type") == kind:
                found.append(entry)
            for value in entry.values():
                if isinstance(value, (list, dict)):
                    found += entries_of_type(value, kind)
    return found


def case_named(case_name: str) -> Case:
    (case,) = [case for case in CORPUS if case.name == case_name]
    return case


@pytest.mark.parametrize("training", [True, False])
def test_functional_dropout_is_written_with_the_modules_mode(tmp_path, training):
    case = case_named("functional_dropout")
    net = case.module().train(training)
    spec = export_torch(net, case.input_shape, tmp_path / "model.yaml")
    entries = entries_of_type(yaml.safe_load(spec.read_text())["layers"], "dropout")
    assert len(entries) == 2, entries  # F.dropout(x, 0.5, training=self.training), nn.Dropout(0.3)
    assert sorted(entry["p"] for entry in entries) == [0.3, 0.5]
    assert all(entry["training"] is training for entry in entries), entries


@pytest.mark.parametrize("case_name, kind, calls", [("reused_tanh", "tanh", 2),
                                                    ("tutorial_cifar_net", "maxpool2d", 2),
                                                    ("reused_pool_view", "maxpool2d", 2),
                                                    ("reused_pool_view", "relu", 2)])
def test_a_parameter_free_module_called_twice_is_one_layer_per_call(tmp_path, case_name, kind, calls):
    case = case_named(case_name)
    spec = export_torch(case.module(), case.input_shape, tmp_path / "model.yaml")
    entries = entries_of_type(yaml.safe_load(spec.read_text())["layers"], kind)
    assert len(entries) == calls, entries
    assert len({entry["name"] for entry in entries}) == calls, entries


# --- the corpus itself (passes whatever the exporter) ---------------------------------------------
def test_the_corpus_has_enough_models_of_each_kind():
    assert len(CORPUS) >= 25 and len(ACCEPTED) >= 15 and len(REFUSED) >= 8
    assert len({case.name for case in CORPUS}) == len(CORPUS)
    assert all(case.what for case in CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=name)
def test_every_model_runs_in_pytorch_float64_and_seeded(case):
    net = case.module()
    assert all(p.dtype == torch.float64 for p in net.parameters())
    assert net.training is case.training
    inputs = [torch_input(net, torch.from_numpy(x)) for x in sample(case, BATCH, seed=1)]
    with torch.no_grad():
        out = net(*inputs)
        again = case.module()(*inputs)
    outputs = out if isinstance(out, tuple) else (out,)
    assert all(torch.isfinite(o).all() for o in outputs)
    if case.accepted:
        assert out.dtype == torch.float64 and out.dim() == 2 and out.shape[0] == BATCH
        torch.testing.assert_close(again, out, rtol=0, atol=0)  # seeded; dropout (if any) in eval mode


@pytest.mark.parametrize("case", REFUSED, ids=name)
def test_every_refused_node_is_one_torch_fx_names(case):
    """The node a refusal names is in the model's graph (torch.fx.symbolic_trace's names); a model
    that does not trace is refused for the tracer's reason, and one whose forward is not its graph by
    the float64 check, with no node expected by name."""
    net = case.module()
    re.compile(case.fragment)
    try:
        graph = torch.fx.symbolic_trace(net).graph
    except (torch.fx.proxy.TraceError, TypeError):  # control flow; item assignment (Proxy refuses it)
        assert case.node is None, case.name
        return
    if case.keyword == "differ from its traced graph":
        assert case.node is None, case.name
        return
    assert case.node is not None, case.name
    names = [node.name for node in graph.nodes]
    assert any(re.fullmatch(case.node, node_name) for node_name in names), (case.node, names)
