"""Calibration of the cost model: the backend's constants measured on this machine (issue 38).

:func:`calibrate` times the backward of a fixed set of small models (:func:`workloads`: a chain of
activations, deep narrow, wide and pruned MLPs (the deepest one's gradient vanishing through
subnormal values, :mod:`sparse_scan.engine.subnormals`), three small CNNs and a 97%-pruned one, a small
residual network dense and pruned, four RNNs and three LSTMs), each under several schedules and at
batch 1 and 16, and fits the seconds per unit of every feature (:mod:`sparse_scan.engine.cost`) to
those times by non-negative least squares on the relative error, so that a prediction errs by a
ratio, not by a number of seconds. It takes about ten seconds; :func:`sparse_scan.engine.cost.save`
caches the result per machine and library version, where :func:`sparse_scan.engine.cost.current`
finds it (``sparse-scan calibrate`` does both). Features the workloads do not exercise keep their defaults.

The fit is a measurement of this machine under its load at the time: a noisy machine gives noisy
constants. Tests never use it for a decision they assert (they run with
``SPARSE_SCAN_COST_MODEL=defaults``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import numpy as np
import scipy.optimize

from ._sequential import Sequential
from .engine.cost import DEFAULTS, FEATURES, CostModel, current
from .layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Tanh
from .model import Model
from .recurrent import LSTM, RNN, RecurrentClassifier
from .spec import model_from_spec

__all__ = ["Measurement", "calibrate", "fit", "measure", "workloads"]

_BATCHES = (1, 16)

PRIOR_WEIGHT = 0.1
"""How strongly :func:`fit` pulls each constant towards its default (one measurement weighs 1)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed backward: what ran, its features and its median seconds."""

    workload: str
    method: str
    levels: int | None
    batch: int
    features: dict[str, float]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields."""
        return dataclasses.asdict(self)


def _mlp(width: int, blocks: int, activation: Callable[[], Any], prune: float = 0.0) -> Sequential:
    rng = np.random.default_rng(0)
    layers = []
    for index in range(blocks):
        linear = Linear(width, width, rng=index, prune_pattern=prune > 0)
        if prune > 0:
            weight = np.array(linear.weight)
            weight[rng.random(weight.shape) < prune] = 0
            linear.weight = weight
        layers += [linear, activation()]
    return Sequential(*layers, input_shape=(width,))


def _cnn(channels: int = 8, size: int = 16) -> Sequential:
    return Sequential(Conv2d(3, channels, 3, padding=1, rng=0), ReLU(), MaxPool2d(2),
                      Conv2d(channels, 2 * channels, 3, padding=1, rng=1), ReLU(), MaxPool2d(2), Flatten(),
                      Linear(2 * channels * (size // 4) ** 2, 10, rng=2), input_shape=(3, size, size))


def _residual(channels: int, side: int, prune: float | None = None) -> Model:
    """A stem convolution and two residual blocks (convolution, batch norm, ReLU, convolution, batch
    norm) of ``channels`` on ``side×side``, then a linear head; ``prune``: that share of every
    convolution's and the head's weights magnitude-pruned (the spec's ``prune``)."""
    def conv() -> dict[str, Any]:
        return {"type": "conv2d", "out_channels": channels, "kernel_size": 3, "padding": 1, "bias": False}

    block = {"type": "residual", "layers": [conv(), {"type": "batchnorm2d"}, {"type": "relu"}, conv(),
                                            {"type": "batchnorm2d"}]}
    spec: dict[str, Any] = {
        "input_shape": [3, side, side], "init": {"seed": 0},
        "layers": [conv(), {"type": "batchnorm2d"}, {"type": "relu"}, block, {"type": "relu"}, block,
                   {"type": "relu"}, {"type": "flatten"}, {"type": "linear", "out_features": 10}]}
    if prune:
        spec["prune"] = {"amount": prune}
    return model_from_spec(spec)


def _pruned_cnn(channels: int, side: int, amount: float) -> Model:
    """Three 3x3 convolutions (``channels``, then twice as many), ReLUs and two max-pools, with
    ``amount`` of the weights pruned: heavily pruned, the convolutions multiply by CSR weights."""
    def conv(out: int) -> dict[str, Any]:
        return {"type": "conv2d", "out_channels": out, "kernel_size": 3, "padding": 1}

    pool = {"type": "maxpool2d", "kernel_size": 2}
    return model_from_spec({
        "input_shape": [3, side, side], "init": {"seed": 0}, "prune": {"amount": amount},
        "layers": [conv(channels), {"type": "relu"}, conv(2 * channels), {"type": "relu"}, pool,
                   conv(2 * channels), {"type": "relu"}, pool, {"type": "flatten"},
                   {"type": "linear", "out_features": 10}]})


def workloads() -> list[tuple[str, Model, tuple[tuple[str, int | None], ...]]]:
    """The calibration's models, each with the schedules timed: ``(name, model, ((method, levels),
    ...))``. Most recurrent classifiers whose back-propagation is timed pool every hidden state
    (``reduction="mean"``), so that it runs every step; from a loss on the last state alone it stops
    where the gradient underflows to zero (the LSTM over 3,000 steps: after about 200), and its
    features are read after the timed runs, as far as it went (:class:`sparse_scan.recurrent.Horizon`);
    so are the subnormal values a chain's gradients were seen to hold (the 512-layer MLP's: 1,810 at
    batch 1, 28,967 at batch 16, over 76-84 of its 513 gradients)."""
    deep = (("linear", None), ("hybrid", 1), ("hybrid", 3), ("blelloch", None))
    shallow = (("linear", None), ("hybrid", 1), ("blelloch", None))
    rnn = RecurrentClassifier(RNN(1, 16, rng=0), 4, rng=1, input_shape=(200, 1))
    return [("tanh 48x64", Sequential(*[Tanh() for _ in range(48)], input_shape=(64,)), deep),
            ("mlp 32x(16,tanh)", _mlp(16, 32, Tanh), deep),
            ("mlp 128x(8,tanh)", _mlp(8, 128, Tanh), deep),
            ("mlp 256x(32,tanh)", _mlp(32, 256, Tanh), (("linear", None), ("hybrid", 1))),
            ("mlp 6x(128,relu)", _mlp(128, 6, ReLU), shallow),
            ("mlp 3x(1024,relu)", _mlp(1024, 3, ReLU), (("linear", None),)),
            ("mlp 4x(256,relu) 90% pruned", _mlp(256, 4, ReLU, prune=0.9), shallow),
            ("cnn 3x8x8", _cnn(4, 8), shallow),
            ("cnn 3x16x16", _cnn(), (("linear", None), ("hybrid", 1), ("hybrid", 2), ("blelloch", None))),
            ("rnn T=200 H=16", rnn, (("linear", None), ("hybrid", 2), ("blelloch", None))),
            ("rnn T=100 H=64", RecurrentClassifier(RNN(1, 64, rng=2), 4, rng=3, input_shape=(100, 1)),
             (("linear", None), ("blelloch", None))),
            ("rnn T=1000 H=20", RecurrentClassifier(RNN(1, 20, rng=10), 4, rng=11, input_shape=(1000, 1)),
             (("hybrid", 1),)),
            ("rnn T=2000 H=20 mean", RecurrentClassifier(RNN(1, 20, rng=4), 4, rng=5, input_shape=(2000, 1),
                                                          reduction="mean"), (("linear", None),)),
            ("lstm T=200 H=12", RecurrentClassifier(LSTM(1, 12, rng=6), 4, rng=7, input_shape=(200, 1)),
             (("hybrid", 2), ("blelloch", None))),
            ("lstm T=3000 H=20", RecurrentClassifier(LSTM(1, 20, rng=12), 4, rng=13, input_shape=(3000, 1)),
             (("linear", None),)),
            ("lstm T=300 H=20 mean",
             RecurrentClassifier(LSTM(1, 20, rng=8), 4, rng=9, input_shape=(300, 1), reduction="mean"),
             (("linear", None), ("hybrid", 3))),
            ("cnn 8x32x32", _cnn(8, 32), (("linear", None), ("hybrid", 1), ("blelloch", None))),
            ("resnet 2 blocks 16x8x8", _residual(16, 8), (("linear", None), ("hybrid", 1))),
            ("resnet 2 blocks 16x8x8 90% pruned", _residual(16, 8, 0.9), (("linear", None), ("hybrid", 1))),
            ("cnn 32x16x16 97% pruned", _pruned_cnn(32, 16, 0.97), (("linear", None), ("hybrid", 1)))]


def measure(model: Model, method: str, levels: int | None, batch: int, repeats: int = 5,
            device: str = "cpu", threads: int = 1) -> tuple[dict[str, float], float]:
    """The features of a backward of ``model`` under ``method``/``levels`` for ``batch`` random samples
    (read after the runs: a recurrent back-propagation's as far as it went) and its median seconds over
    ``repeats`` runs after a warm-up (the forward not timed)."""
    rng = np.random.default_rng(batch)
    shape = tuple(model.input_shape)
    plan = model.plan(shape, method, levels, batch=batch, device=device)
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = model.forward(x)
    grad = rng.standard_normal(y.shape).astype(y.dtype)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model.backward(grad, method, levels)
        times.append(time.perf_counter() - start)
    return plan.features(batch, threads), statistics.median(times[1:])


def _measurements(repeats: int, device: str, threads: int) -> Iterator[Measurement]:
    for name, model, schedules in workloads():
        for batch in _BATCHES:
            for method, levels in schedules:
                features, seconds = measure(model, method, levels, batch, repeats, device, threads)
                yield Measurement(name, method, levels, batch, features, seconds)


def fit(measurements: list[Measurement], device: str = "cpu", threads: int = 1,
        prior_weight: float = PRIOR_WEIGHT) -> CostModel:
    """The constants that best predict ``measurements`` (least squares on the ratio, non-negative,
    each constant pulled towards its default with ``prior_weight``); a feature no measurement
    exercises keeps its default. ``plan_unit`` (planning) keeps its default."""
    defaults = dict(DEFAULTS[device])
    seen = [name for name in FEATURES if name != "plan_unit"
            and any(m.features.get(name, 0) > 0 for m in measurements)]
    # each row: a measurement's features over its seconds (the fit is on the ratio); then a weak pull
    # of every constant towards its default, so that one the workloads hardly tell apart from others
    # (a throughput where fixed costs dominate) stays near it instead of at 0
    matrix = np.array([[m.features.get(name, 0.0) / m.seconds for name in seen] for m in measurements]
                      + [[prior_weight / defaults[name] if name == other and defaults[name] > 0 else 0.0
                          for other in seen] for name in seen])
    target = np.concatenate([np.ones(len(measurements)),
                             [prior_weight if defaults[name] > 0 else 0.0 for name in seen]])
    scale = np.maximum(matrix.max(axis=0), 1e-300)  # columns of similar size for the solver
    solution, _ = scipy.optimize.nnls(matrix / scale, target)
    fitted = dict(defaults) | {name: float(value / s) for name, value, s in zip(seen, solution, scale,
                                                                              strict=True)}
    return CostModel(device, threads, tuple(fitted.items()),
                     f"calibrated {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")


def calibrate(device: str = "cpu", repeats: int = 5,
              progress: Callable[[str, int, int], None] | None = None) -> tuple[CostModel, list[Measurement]]:
    """Measure this machine's constants for ``device`` (only ``cpu`` can be timed here; the GPU's
    need a GPU and its arrays, see docs/gpu.md): time :func:`workloads` (``repeats`` runs each, the
    median) and :func:`fit` them.

    Returns
    -------
    (CostModel, list of Measurement)
        The fitted model (not saved: :func:`sparse_scan.engine.cost.save` caches it) and what was
        timed, each measurement with its features.
    """
    if device != "cpu":
        raise ValueError(f"calibrate: only the CPU can be calibrated by this function, not {device!r}")
    threads = current(device).threads
    measurements = []
    total = sum(len(schedules) for _, _, schedules in workloads()) * len(_BATCHES)
    for measurement in _measurements(repeats, device, threads):
        measurements.append(measurement)
        if progress is not None:
            progress("calibration", len(measurements), total)
    return fit(measurements, device, threads), measurements
