"""The paper's recurrent classifier (§4.1): a recurrent layer, then softmax over a linear map of the
last hidden state, trained with cross-entropy; and its training loop.

Examples
--------
>>> import numpy as np
>>> from sparse_scan.optim import Adam
>>> from sparse_scan.recurrent import RNN, Bitstream
>>> model = RecurrentClassifier(RNN(1, 8, rng=0), classes=10, rng=1)
>>> sorted(model.state_dict())[:3]
['fc.bias', 'fc.weight', 'rnn.bias_hh_l0']
>>> records = train_recurrent(model, Bitstream(steps=30, samples=64), Adam(model, lr=1e-2), iterations=3,
...                           batch_size=16)
>>> [r["iteration"] for r in records]
[0, 1, 2]
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._checks import integer
from .._types import Array
from ..layers import Linear
from ..layers._weighted import RngLike
from ..loss import softmax_cross_entropy
from ..optim import check_built_on
from ..weights import state_dict
from ._module import RecurrentModule

__all__ = ["RecurrentClassifier", "train_recurrent"]


class RecurrentClassifier:
    """``logits = fc(h_T)`` after a recurrent layer ``rnn``; loss is softmax cross-entropy.

    Parameters
    ----------
    recurrent : RNN, GRU or LSTM
        Named ``"rnn"`` in the state_dict unless it has a name; run in its layer form (batch-first),
        the head reads the top layer's last output (both directions of a bidirectional one).
    classes : int
    rng : numpy.random.Generator or int, optional
        Initialisation of ``fc`` (PyTorch's).

    Attributes
    ----------
    layers : list
        ``[recurrent, fc]``: what :mod:`sparse_scan.optim` and :mod:`sparse_scan.weights` walk.
    """

    def __init__(self, recurrent: RecurrentModule, classes: int, rng: RngLike = None) -> None:
        recurrent.name = recurrent.name or "rnn"
        self.recurrent = recurrent
        self.fc = Linear(recurrent.num_directions * recurrent.output_size, classes, dtype=recurrent.dtype,
                         rng=rng)
        self.fc.name = "fc"
        self.layers = [recurrent, self.fc]

    def state_dict(self) -> dict[str, Array]:
        """Every parameter by ``"<layer>.<name>"`` (not copies)."""
        return state_dict(self)

    def loss_and_gradients(self, x: Array, labels: Array, method: str = "blelloch",
                           levels: int | str | None = None) -> tuple[float, dict[str, Array]]:
        """Forward, loss and every parameter's gradient (the hidden-state chain by the scan).

        Returns
        -------
        loss : float
            Mean cross-entropy over the batch.
        grads : dict
            By state_dict name, summed like PyTorch's (the loss is a mean).
        """
        hidden = self.recurrent.forward(x)
        last = hidden[:, -1]
        logits = self.fc.forward(last)
        be = _backend.of(logits)
        loss, grad_logits = softmax_cross_entropy(be.to_host(logits), be.to_host(labels))
        grad_logits = be.asarray(grad_logits)
        weight = be.asarray(self.fc.weight)
        grads = {"fc.weight": grad_logits.T @ last, "fc.bias": grad_logits.sum(axis=0)}
        recurrent = self.recurrent.backward(grad_logits @ weight, method=method, levels=levels)
        for key in self.recurrent.parameter_names:
            grads[f"{self.recurrent.name}.{key}"] = recurrent[self.recurrent.layer_form_key(key)]
        return loss, grads


def train_recurrent(model: RecurrentClassifier, data: Any, optimizer: Any, iterations: int, batch_size: int,
                    method: str = "blelloch", levels: int | str | None = None, seed: int = 0,
                    device: str = "cpu",
                    progress: Callable[[int, int, float], None] | None = None) -> list[dict[str, Any]]:
    """Mini-batch training; one record per iteration.

    Parameters
    ----------
    model : RecurrentClassifier
    data : Bitstream or any object with ``len(data)`` and ``data.batch(indices) -> (x, labels)``
    optimizer : sparse_scan.optim.Optimizer
        Built on ``model``.
    iterations, batch_size : int
    method, levels
        Of the scan (``linear`` is back-propagation through time).
    seed : int
        Batch order (a permutation per pass over the data): the same seed gives the same batches.
    device : {"cpu", "gpu", "auto"}
        Where the forward and the scan run (parameters stay NumPy arrays for the optimizer).
    progress : callable, optional
        ``progress(iteration, iterations, loss)`` after each iteration.

    Returns
    -------
    list of dict
        ``{"iteration", "loss"}`` per iteration (the batch's loss before the update).
    """
    integer(iterations, "iterations", 0)
    integer(batch_size, "batch_size", 1, len(data), note=" (the data's samples)")
    check_built_on(optimizer, model)
    be = _backend.get(device)
    order = np.random.default_rng(seed)
    permutation, position, records = order.permutation(len(data)), 0, []
    for iteration in range(iterations):
        if position + batch_size > len(permutation):
            permutation, position = order.permutation(len(data)), 0
        x, labels = data.batch(permutation[position:position + batch_size])
        position += batch_size
        loss, grads = model.loss_and_gradients(be.asarray(x), labels, method=method, levels=levels)
        optimizer.step({key: be.to_host(value) for key, value in grads.items()})
        records.append({"iteration": iteration, "loss": loss})
        if progress is not None:
            progress(iteration + 1, iterations, loss)
    return records
