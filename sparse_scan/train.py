"""Training a model with BPPSA gradients: datasets, the mini-batch loop, BP comparison.

:func:`load_dataset` reads a ``.npz`` (``x_train, y_train, x_test, y_test``) or the built-in
``digits`` (scikit-learn's bundled 8×8 handwritten digits, scaled to [0, 1], zero-padded to the model's
input, the grey level repeated in every channel of a three-channel model such as ResNet-20, split 80/20
with a fixed seed). Any :class:`~sparse_scan.model.Model` trains (a CNN, a recurrent classifier), in
one training loop: per batch a forward, the loss, the scan's backward, the parameter gradients and an
optimizer step. :func:`train` runs it over epochs of a :class:`Dataset` with SGD/Adam and the
gradients of a scan (any method), scoring the test set after every step and, optionally, running the
same steps with back-propagation (the linear scan) on an identical copy of the model, batch for batch,
so that the two loss curves can be compared; :func:`train_iterations` runs it for a number of
iterations over a sampled task (the paper's §4.1 training on
:class:`~sparse_scan.recurrent.Bitstream`), recording the losses alone.

Training that diverges stops at once with a :class:`DivergenceError` naming the iteration and what went
non-finite (the model's outputs, the loss, a parameter's gradient, a weight after the optimizer's step,
the test loss), never with NumPy's warnings or an error of a layer further on: every step checks them,
and the diverging iteration's step is undone, so the model keeps the weights of the last iteration that
stayed finite (the last one recorded).

Examples
--------
>>> import numpy as np
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Flatten, Linear
>>> from sparse_scan.optim import SGD
>>> rng = np.random.default_rng(0)
>>> data = Dataset(rng.standard_normal((20, 4)).astype(np.float32), rng.integers(0, 3, 20),
...                rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6))
>>> model = Sequential(Linear(4, 3, rng=0))
>>> records = train(model, data, SGD(model, lr=0.1), epochs=2, batch_size=8)
>>> len(records), list(records[0]) == list(RECORD_KEYS)
(6, True)
>>> sorted(evaluate(model, data.x_test, data.y_test))
['accuracy', 'loss', 'samples']
>>> epoch_summary(records[3:])["epoch"]
1
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from . import backend as _backend
from ._checks import integer
from ._sequential import default_memory_budget
from .loss import softmax_cross_entropy
from .optim import check_built_on
from .weights import as_float_array, every_layer, read_npz

__all__ = ["RECORD_KEYS", "DataError", "Dataset", "DivergenceError", "epoch_summary", "evaluate",
           "load_dataset", "train", "train_iterations"]

KEYS = ("x_train", "y_train", "x_test", "y_test")

RECORD_KEYS = ("epoch", "iteration", "samples", "train_loss", "train_accuracy", "test_loss", "test_accuracy",
               "elapsed_s")
"""The fields of :func:`train`'s records, in order (a baseline adds ``bp_`` + the loss and accuracy
fields)."""

_FIGURES = ("train_loss", "train_accuracy", "test_loss", "test_accuracy")


class DataError(ValueError):
    """A dataset is unusable for the model: the message names the file and the array."""


class DivergenceError(FloatingPointError):
    """Training went non-finite: the iteration's step is undone, so the model keeps the weights of the
    last iteration that stayed finite (the last one of :attr:`records`).

    Attributes
    ----------
    iteration : int
        The iteration that diverged, counted from 0 as the records' ``iteration``.
    what : str
        What went non-finite (``the loss is nan``, ``the gradient of 'fc.weight' holds NaN or Inf (3 of
        84 entries)``, ...).
    copy : str
        ``""``, or ``"bp_"`` where it was :func:`train`'s back-propagation baseline.
    records : list of dict
        The records of the iterations done before it.
    """

    def __init__(self, iteration: int, what: str, copy: str = "",
                 records: list[dict[str, Any]] | None = None) -> None:
        self.iteration, self.what, self.copy = iteration, what, copy
        self.records = [] if records is None else records
        whose = "the back-propagation baseline's " if copy else ""
        super().__init__(f"training diverged at iteration {iteration}: {whose}{what}; the model keeps the "
                         "weights of the last finite iteration (lower the learning rate?)")


class _NonFinite(Exception):
    """A value of a training step that is NaN or Inf (its message says which): :func:`_steps` makes it a
    :class:`DivergenceError` with the iteration."""


def _check_finite(values: Any, what: str) -> None:
    """Raise :class:`_NonFinite` where ``values`` (an array or a number) hold NaN or Inf."""
    values = np.asarray(values)
    bad = values.size - int(np.count_nonzero(np.isfinite(values)))
    if bad:
        raise _NonFinite(f"{what} is {values.item()}" if values.ndim == 0
                         else f"{what} holds NaN or Inf ({bad} of {values.size} entries)")


@dataclass(frozen=True)
class Dataset:
    """Training and test arrays: inputs ``(N, *input_shape)`` float, labels ``(N,)`` int."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def __post_init__(self) -> None:
        for part in ("train", "test"):
            x, y = getattr(self, f"x_{part}"), getattr(self, f"y_{part}")
            if len(x) != len(y) or not len(x):
                raise ValueError(f"Dataset: x_{part} has {len(x)} samples and y_{part} {len(y)} labels")


def _digits(input_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    try:
        from sklearn.datasets import load_digits  # noqa: PLC0415 - optional extra
    except ImportError:
        raise DataError("digits: the built-in dataset needs scikit-learn (pip install "
                        "'sparse-scan[digits]')") from None
    digits = load_digits()
    images = (digits.images / 16.0)[:, None]  # (N, 1, 8, 8) in [0, 1]
    if len(input_shape) != 3 or input_shape[0] not in (1, 3) or input_shape[1] < 8 or input_shape[2] < 8:
        raise DataError(f"digits: 1x8x8 images do not fit the model's input {list(input_shape)} "
                        "(it needs one channel, or three for RGB models, and at least 8x8)")
    top, left = (input_shape[1] - 8) // 2, (input_shape[2] - 8) // 2
    x = np.zeros((len(images),) + tuple(input_shape))
    x[:, :, top:top + 8, left:left + 8] = images  # the grey level in every channel
    order = np.random.default_rng(0).permutation(len(x))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return {"x_train": x[train], "y_train": digits.target[train], "x_test": x[test],
            "y_test": digits.target[test]}


def load_dataset(name_or_path: str | pathlib.Path, input_shape: tuple[int, ...], classes: int,
                 dtype: Any = np.float32) -> Dataset:
    """``"digits"`` or a ``.npz`` with ``x_train, y_train, x_test, y_test``, checked against the model.

    Raises
    ------
    DataError
        Missing file or key, arrays over the memory budget (``SPARSE_SCAN_MEMORY_BUDGET``, from the
        file's headers, before reading them), inputs not ``(N, *input_shape)``, not finite or integers
        ``dtype`` does not hold exactly, labels not integers in ``0 .. classes - 1`` or not one per
        input.
    """
    if str(name_or_path) == "digits":
        arrays, source = _digits(tuple(input_shape)), "digits"
    else:
        source = str(name_or_path)
        try:
            arrays = read_npz(name_or_path, default_memory_budget())
        except FileNotFoundError:
            raise DataError(f"{source}: no such file") from None
        except (OSError, ValueError) as error:
            raise DataError(f"{source}: not a readable .npz: {error}") from None
    for key in KEYS:
        if key not in arrays:
            raise DataError(f"{source}: missing array {key!r} (needs {', '.join(KEYS)})")
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        if tuple(x.shape[1:]) != tuple(input_shape) or x.dtype.kind not in "fiu":
            raise DataError(f"{source}: x_{part} has shape {list(x.shape)} of {x.dtype}; the model "
                            f"takes numbers of shape (N, {', '.join(map(str, input_shape))})")
        if not len(x):
            raise DataError(f"{source}: x_{part} holds no samples")
        try:  # nothing rounded, overflowing or not finite
            x = arrays[f"x_{part}"] = as_float_array(x, dtype, f"{source}: x_{part}")
        except ValueError as error:
            raise DataError(str(error)) from None
        if y.shape != (len(x),) or y.dtype.kind not in "iu":
            raise DataError(f"{source}: y_{part} must hold {len(x)} integer labels, got shape "
                            f"{list(y.shape)} of {y.dtype}")
        if y.min() < 0 or y.max() >= classes:
            raise DataError(f"{source}: y_{part} has labels outside 0..{classes - 1} "
                            f"(the model has {classes} outputs)")
    return Dataset(*(arrays[k] if k.startswith("x") else arrays[k].astype(np.int64) for k in KEYS))


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == labels))


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Every layer in training mode (nested ones included) in eval mode, each restored after."""
    training = [layer for layer in every_layer(model) if getattr(layer, "training", False)]
    for layer in training:
        layer.training = False
    try:
        yield
    finally:
        for layer in training:
            layer.training = True


_EVALUATION_BATCH = 128
"""Samples per forward pass of :func:`evaluate` by default. Larger batches only cost: on 2 cores the
360 test digits take 1.46 s through ResNet-20 at 512 samples a pass against 0.87 s at 128 (convolution
columns of a few MB stay in cache), and LeNet-5's 4.8 ms against 2.6 ms."""


def evaluate(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int = _EVALUATION_BATCH,
             device: str = "cpu") -> dict[str, Any]:
    """Mean softmax cross-entropy and accuracy of ``model`` on inputs ``x`` with labels ``y``.

    Parameters
    ----------
    model : Model
        A :class:`~sparse_scan.model.Model` with a flat ``(classes,)`` output.
    x, y : ndarray
        ``(N, *input_shape)`` inputs and ``N`` integer labels.
    batch_size : int
        Samples per forward pass (bounds the memory).
    device : {"cpu", "gpu", "auto"}

    Returns
    -------
    dict
        ``loss`` (mean over the samples, like PyTorch's ``cross_entropy``), ``accuracy`` (fraction of
        samples whose largest output is the label) and ``samples``. Layers with a training mode
        (Dropout) run in eval mode, as PyTorch users evaluate, and get their mode back after.
    """
    integer(batch_size, "batch_size", 1)
    be = _backend.get(device)
    with _eval_mode(model):  # as PyTorch users evaluate: no dropout
        return _scores(model, be, x, y, batch_size)


def _scores(model: Any, be: _backend.Backend, x: np.ndarray, y: np.ndarray,
            batch_size: int) -> dict[str, Any]:
    """:func:`evaluate`'s figures, the model in its current mode."""
    total_loss, correct = 0.0, 0.0
    for start in range(0, len(x), batch_size):
        logits = be.to_host(model.forward(be.asarray(x[start:start + batch_size])))
        labels = y[start:start + batch_size]
        total_loss += softmax_cross_entropy(logits, labels)[0] * len(labels)
        correct += _accuracy(logits, labels) * len(labels)
    return {"loss": total_loss / len(x), "accuracy": correct / len(x), "samples": int(len(x))}


def epoch_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One epoch's figures from its iteration records (:func:`train`): ``epoch``, ``iterations``,
    ``train_loss`` and ``train_accuracy`` (over the epoch's batches, each before its step, weighted by
    their samples), ``test_loss`` and ``test_accuracy`` (after the epoch's last step), ``elapsed_s``
    (since training began); with a baseline the same ``bp_`` figures."""
    last = records[-1]
    samples = sum(r["samples"] for r in records)
    out: dict[str, Any] = {"epoch": last["epoch"], "iterations": len(records)}
    for prefix in ("", "bp_") if "bp_train_loss" in last else ("",):
        for key in ("train_loss", "train_accuracy"):
            out[prefix + key] = sum(r[prefix + key] * r["samples"] for r in records) / samples
        for key in ("test_loss", "test_accuracy"):
            out[prefix + key] = last[prefix + key]
    out["elapsed_s"] = last["elapsed_s"]
    return out


def train(model: Any, data: Dataset, optimizer: Any, epochs: int, batch_size: int,
          method: str = "auto", levels: int | str | None = None, seed: int = 0,
          baseline: tuple[Any, Any] | None = None, device: str = "cpu",
          on_iteration: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Mini-batch training with scan gradients; returns one record per iteration.

    Parameters
    ----------
    model : Model
        A :class:`~sparse_scan.model.Model` with a flat ``(classes,)`` output.
    data : Dataset
    optimizer : sparse_scan.optim.Optimizer
        Built on ``model``.
    epochs, batch_size : int
    method, levels
        The scan (as in the model's ``backward``; ``auto`` chooses one).
    seed : int
        Shuffling of the training set, per epoch.
    baseline : (model, optimizer), optional
        A copy of the model (same weights) and its optimizer, trained on the same batches with
        back-propagation (the linear scan): records then hold the ``bp_`` losses and accuracies.
    device : {"cpu", "gpu", "auto"}
        Where the forward and the scan run (parameters and optimizer state stay on the host).
    on_iteration : callable, optional
        Called with each record as it is made (progress, logs, checkpoints).

    Returns
    -------
    list of dict
        :data:`RECORD_KEYS`: ``epoch``, ``iteration``, ``samples`` (of the batch), ``train_loss`` and
        ``train_accuracy`` (the batch's, before the step), ``test_loss`` and ``test_accuracy`` (after
        the step, on the whole test set), ``elapsed_s`` (wall seconds since training began), plus the
        ``bp_`` losses and accuracies with a baseline. :func:`epoch_summary` sums up an epoch.

    Raises
    ------
    DivergenceError
        An iteration's outputs, loss, gradients, updated weights or test loss went non-finite (either
        run's); its steps are undone (both models keep the weights of the last iteration recorded), and
        the error holds the records so far.
    """
    integer(epochs, "epochs", 0)
    integer(batch_size, "batch_size", 1)
    for run_model, run_optimizer in [(model, optimizer)] + ([] if baseline is None else [baseline]):
        check_built_on(run_optimizer, run_model)
    be = _backend.get(device)
    runs = [("", (model, optimizer, method, levels))]
    if baseline is not None:
        runs.append(("bp_", (baseline[0], baseline[1], "linear", None)))
    batches = _epochs(len(data.x_train), batch_size, epochs, np.random.default_rng(seed))
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for iteration, (epoch, labels, results) in enumerate(_steps(
            runs, batches, lambda batch: (data.x_train[batch], data.y_train[batch]), be, records)):
        record: dict[str, Any] = {"epoch": epoch, "iteration": iteration, "samples": len(labels)}
        for (prefix, (net, *_)), (loss, logits, _) in zip(runs, results, strict=True):
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # its loss is checked
                test = evaluate(net, data.x_test, data.y_test, device=device)
            if not math.isfinite(test["loss"]):
                _undo(runs, results)
                raise DivergenceError(iteration, f"the test loss is {test['loss']}", prefix, records)
            record.update({f"{prefix}train_loss": loss, f"{prefix}train_accuracy": _accuracy(logits, labels),
                           f"{prefix}test_loss": test["loss"], f"{prefix}test_accuracy": test["accuracy"]})
        record["elapsed_s"] = time.perf_counter() - started
        records.append({key: record[key] for key in RECORD_KEYS} | {
            key: value for key, value in record.items() if key not in RECORD_KEYS})
        if on_iteration is not None:
            on_iteration(record)
    return records


def train_iterations(model: Any, data: Any, optimizer: Any, iterations: int, batch_size: int,
                     method: str = "auto", levels: int | str | None = None, seed: int = 0,
                     device: str = "cpu",
                     progress: Callable[[int, int, float], None] | None = None) -> list[dict[str, Any]]:
    """Mini-batch training for ``iterations`` steps over a sampled task, the losses alone recorded
    (no test set is scored: the paper's §4.1 training, on :class:`~sparse_scan.recurrent.Bitstream`).

    Parameters
    ----------
    model : Model
        A :class:`~sparse_scan.model.Model` with a flat ``(classes,)`` output.
    data : Bitstream or any object with ``len(data)`` and ``data.batch(indices) -> (x, labels)``
    optimizer : sparse_scan.optim.Optimizer
        Built on ``model``.
    iterations, batch_size : int
    method, levels
        The scan (as in the model's ``backward``; ``linear`` is back-propagation).
    seed : int
        Batch order (a permutation per pass over the data, whose last partial batch is left out): the
        same seed gives the same batches.
    device : {"cpu", "gpu", "auto"}
        Where the forward and the scan run (parameters stay NumPy arrays for the optimizer).
    progress : callable, optional
        ``progress(iteration, iterations, loss)`` after each iteration.

    Returns
    -------
    list of dict
        ``{"iteration", "loss"}`` per iteration (the batch's loss before the update).

    Raises
    ------
    DivergenceError
        An iteration's outputs, loss, gradients or updated weights went non-finite; its step is undone
        (the model keeps the weights of the last iteration recorded), and the error holds the records.
    """
    integer(iterations, "iterations", 0)
    integer(batch_size, "batch_size", 1, len(data), note=" (the data's samples)")
    check_built_on(optimizer, model)
    be = _backend.get(device)
    batches = _passes(len(data), batch_size, iterations, np.random.default_rng(seed))
    records: list[dict[str, Any]] = []
    run = (model, optimizer, method, levels)
    for iteration, _, [(loss, _, _)] in _steps([("", run)], batches, data.batch, be, records):
        records.append({"iteration": iteration, "loss": loss})
        if progress is not None:
            progress(iteration + 1, iterations, loss)
    return records


def _epochs(count: int, batch_size: int, epochs: int,
            rng: np.random.Generator) -> Iterator[tuple[int, np.ndarray]]:
    """``(epoch, sample indices)`` of every batch of :func:`train`: per epoch a permutation of the
    ``count`` samples, cut into batches in order (the last one may be smaller)."""
    for epoch in range(epochs):
        order = rng.permutation(count)
        for start in range(0, count, batch_size):
            yield epoch, order[start:start + batch_size]


def _passes(count: int, batch_size: int, iterations: int,
            rng: np.random.Generator) -> Iterator[tuple[int, np.ndarray]]:
    """``(iteration, sample indices)`` of every batch of :func:`train_iterations`: batches taken in
    order from a permutation of the ``count`` samples, a new permutation when the next batch would
    run past its end."""
    permutation, position = rng.permutation(count), 0
    for iteration in range(iterations):
        if position + batch_size > count:
            permutation, position = rng.permutation(count), 0
        yield iteration, permutation[position:position + batch_size]
        position += batch_size


Runs = list[tuple[str, tuple[Any, Any, str, int | str | None]]]
"""What the training loop trains: ``(prefix, (model, optimizer, method, levels))`` per model."""

Step = tuple[float, np.ndarray, dict[str, np.ndarray]]
"""What :func:`_step` returns: the batch's loss and logits, and the weights before the step."""


def _steps(runs: Runs, batches: Iterable[tuple[Any, np.ndarray]],
           fetch: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], be: _backend.Backend,
           records: list[dict[str, Any]]) -> Iterator[tuple[Any, np.ndarray, list[Step]]]:
    """The training loop: for every batch of ``batches`` (``(key, sample indices)``), ``fetch`` gives
    its inputs and labels, and every run takes one step on it (:func:`_step`). Yields ``(key, labels,
    [the step of each run])`` after the steps; a step gone non-finite raises :class:`DivergenceError`
    with the iteration and ``records``, the batch's steps of the other runs undone too."""
    for iteration, (key, indices) in enumerate(batches):
        x, labels = fetch(indices)
        results: list[Step] = []
        for prefix, run in runs:
            try:
                results.append(_step(be, *run, x, labels))
            except _NonFinite as non_finite:
                _undo(runs, results)
                raise DivergenceError(iteration, str(non_finite), prefix, records) from None
        yield key, labels, results


def _undo(runs: Runs, steps: list[Step]) -> None:
    """Give each run's model its weights from before its step of ``steps`` (the runs' first steps)."""
    for (_, (model, *_)), (_, _, before) in zip(runs, steps, strict=False):  # steps: the first runs
        model.load_state_dict(before)


def _step(be: _backend.Backend, model: Any, optimizer: Any, method: str, levels: int | str | None,
          x: np.ndarray, labels: np.ndarray) -> Step:
    """One training step of ``model`` on a batch: the forward, softmax cross-entropy (mean over the
    batch), the scan's backward (``method``/``levels``), the parameter gradients (Eq. 2) and the
    optimizer's step. Returns the batch's loss and logits (host), before the step, and copies of the
    weights before it (what undoes it, :func:`_undo`).

    The outputs, the loss, every parameter gradient and every updated weight are checked: the first
    one that holds NaN or Inf raises :class:`_NonFinite` (NumPy's warnings about them are not shown),
    and an update that made a weight non-finite is undone first."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        logits = be.to_host(model.forward(be.asarray(x)))
        _check_finite(logits, "the model's outputs")
        loss, grad = softmax_cross_entropy(logits, labels)
        _check_finite(loss, "the loss")
        grads = model.backward(be.asarray(grad), method=method, levels=levels, input_gradient=False,
                               parameters_beside=True)
        gradients = {key: be.to_host(value) for key, value in model.parameter_gradients(grads).items()}
        for key, value in gradients.items():
            _check_finite(value, f"the gradient of {key!r}")
        before = {key: np.array(value, copy=True) for key, value in model.state_dict().items()}
        optimizer.step(gradients)
        for key, value in model.state_dict().items():
            if not np.isfinite(value).all():
                model.load_state_dict(before)
                raise _NonFinite(f"{key!r} holds NaN or Inf after the optimizer's step (undone)")
    return loss, logits, before
