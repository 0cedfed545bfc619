"""Calibration of the cost model: the backend's constants measured on this machine (issue 38).

:func:`calibrate` times the backward of a fixed set of small models (:func:`workloads`: a chain of
activations, deep narrow, wide and pruned MLPs, two small CNNs, three RNNs and an LSTM), each under
several schedules and at batch 1 and
16, and fits the seconds per unit of every feature (:mod:`sparse_scan.engine.cost`) to those times by
non-negative least squares on the relative error, so that a prediction errs by a ratio, not by a
number of seconds. It takes a few seconds; :func:`sparse_scan.engine.cost.save` caches the result per
machine and library version, where :func:`sparse_scan.engine.cost.current` finds it
(``sparse-scan calibrate`` does both). Features the workloads do not exercise keep their defaults.

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


def workloads() -> list[tuple[str, Model, tuple[tuple[str, int | None], ...]]]:
    """The calibration's models, each with the schedules timed: ``(name, model, ((method, levels),
    ...))``."""
    deep = (("linear", None), ("hybrid", 1), ("hybrid", 3), ("blelloch", None))
    shallow = (("linear", None), ("hybrid", 1), ("blelloch", None))
    rnn = RecurrentClassifier(RNN(1, 16, rng=0), 4, rng=1, input_shape=(200, 1))
    return [("tanh 48x64", Sequential(*[Tanh() for _ in range(48)], input_shape=(64,)), deep),
            ("mlp 32x(16,tanh)", _mlp(16, 32, Tanh), deep),
            ("mlp 6x(128,relu)", _mlp(128, 6, ReLU), shallow),
            ("mlp 3x(1024,relu)", _mlp(1024, 3, ReLU), (("linear", None),)),
            ("mlp 4x(256,relu) 90% pruned", _mlp(256, 4, ReLU, prune=0.9), shallow),
            ("cnn 3x16x16", _cnn(), (("linear", None), ("hybrid", 1), ("hybrid", 2), ("blelloch", None))),
            ("rnn T=200 H=16", rnn, (("linear", None), ("hybrid", 2), ("blelloch", None))),
            ("rnn T=100 H=64", RecurrentClassifier(RNN(1, 64, rng=2), 4, rng=3, input_shape=(100, 1)),
             (("linear", None), ("blelloch", None))),
            ("rnn T=2000 H=20", RecurrentClassifier(RNN(1, 20, rng=4), 4, rng=5, input_shape=(2000, 1)),
             (("linear", None),)),
            ("lstm T=200 H=12", RecurrentClassifier(LSTM(1, 12, rng=6), 4, rng=7, input_shape=(200, 1)),
             (("linear", None), ("hybrid", 2), ("blelloch", None))),
            ("cnn 8x32x32", _cnn(8, 32), (("linear", None), ("hybrid", 1), ("blelloch", None)))]


def measure(model: Model, method: str, levels: int | None, batch: int, repeats: int = 5,
            device: str = "cpu", threads: int = 1) -> tuple[dict[str, float], float]:
    """The features of a backward of ``model`` under ``method``/``levels`` for ``batch`` random samples
    and its median seconds over ``repeats`` runs after a warm-up (the forward not timed)."""
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


def calibrate(device: str = "cpu", repeats: int = 3,
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
