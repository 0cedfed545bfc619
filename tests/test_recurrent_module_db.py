"""Every RNN/GRU/LSTM/cell configuration of PyTorch's own ``module_db`` (its ``module_inputs_func``,
device cpu, float64, training and eval mode): outputs, final states and the gradients w.r.t. the input,
the initial state and every parameter equal PyTorch autograd to 1e-10 (relative to the largest value)
for every schedule. One forward per configuration serves all its schedules."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from sparse_scan import recurrent
from sparse_scan.engine.schedule import depth

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")

NAMES = ("RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell")
EXPECTED_CONFIGURATIONS = {"RNN": 32, "GRU": 16, "LSTM": 32, "RNNCell": 3, "GRUCell": 2, "LSTMCell": 2}


def schedules(steps: int) -> list[tuple[str, int | str | None]]:
    return [("linear", None), ("blelloch", None), ("hybrid", "auto")] + [
        ("hybrid", k) for k in range(depth(steps) + 1)]


@pytest.fixture(scope="module")
def module_infos():
    with warnings.catch_warnings():  # it warns when the optional hypothesis is missing
        warnings.simplefilter("ignore", ImportWarning)
        from torch.testing._internal.common_modules import module_db  # noqa: PLC0415 - 3 s to import

    return {info.module_cls.__name__: info for info in module_db if info.module_cls.__name__ in NAMES}


def numpy_of(value):
    if isinstance(value, tuple):
        return tuple(numpy_of(v) for v in value)
    return value.detach().numpy()


def flat(value):
    return list(value) if isinstance(value, tuple) else [value]


def check(label, got, want, rtol=1e-10):
    want = want.detach().numpy() if hasattr(want, "detach") else want
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=label)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", NAMES)
def test_module_db_configurations_equal_pytorch_autograd(module_infos, name, training):
    info = module_infos[name]
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                      training=training)
    assert len(samples) == EXPECTED_CONFIGURATIONS[name]
    cell = name.endswith("Cell")
    checked = 0
    for index, sample in enumerate(samples):
        args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        torch.manual_seed(index)
        module = info.module_cls(*args, **kwargs).to(torch.float64)
        module.train(training)
        ours = getattr(recurrent, name)(*args, **kwargs, dtype=np.float64)
        ours.load_state_dict(module.state_dict())
        if not cell:
            ours.train(training)
        inputs = sample.forward_input.args
        x_t, hx_t = inputs[0], inputs[1] if len(inputs) > 1 else None
        label = f"{name} #{index} {args} {kwargs} training={training}"

        want = module(x_t, hx_t)
        got = ours(numpy_of(x_t), None if hx_t is None else numpy_of(hx_t))
        want_parts = flat(want) if cell else [want[0]] + flat(want[1])
        got_parts = flat(got) if cell else [got[0]] + flat(got[1])
        rng = np.random.default_rng(index)
        seeds = [rng.standard_normal(tuple(part.shape)) for part in want_parts]
        for k, (a, b) in enumerate(zip(got_parts, want_parts, strict=True)):
            check(f"{label} forward part {k}", a, b, 1e-12)
        module.zero_grad()
        loss = sum((part * torch.tensor(seed)).sum() for part, seed in zip(want_parts, seeds, strict=True))
        loss.backward()
        expected = {"input": x_t.grad}
        for field, value in zip(("h0", "c0"), flat(hx_t) if hx_t is not None else [], strict=False):
            expected[field] = value.grad
        expected.update({key: value.grad for key, value in module.named_parameters()})
        steps = 1 if cell else x_t.shape[0 if x_t.ndim == 2 or not kwargs.get("batch_first") else 1]
        for method, levels in schedules(steps):
            if cell:
                grads = ours.backward(tuple(seeds) if len(seeds) > 1 else seeds[0], method, levels)
            else:
                state = tuple(seeds[1:]) if len(seeds) > 2 else seeds[1]
                grads = ours.backward(seeds[0], method, levels, grad_state=state)
            for key, value in expected.items():
                check(f"{label} {method} {levels} {key}", grads[key], value)
            checked += 1
        x_t.grad = None
        for value in flat(hx_t) if hx_t is not None else []:
            value.grad = None
    assert checked >= len(samples) * 4
