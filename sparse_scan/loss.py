"""Softmax cross-entropy: the loss and its gradient w.r.t. the logits (PyTorch's CrossEntropyLoss).

Examples
--------
>>> import numpy as np
>>> loss, grad = softmax_cross_entropy(np.zeros((2, 4)), np.array([0, 3]))
>>> round(loss, 6), grad.shape
(1.386294, (2, 4))
"""

from __future__ import annotations

import numpy as np

from ._types import Array

__all__ = ["softmax_cross_entropy"]


def softmax_cross_entropy(logits: Array, labels: Array) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of ``softmax(logits)`` against integer ``labels``, and its gradient.

    Parameters
    ----------
    logits : ndarray, shape (N, classes)
    labels : ndarray of int, shape (N,)

    Returns
    -------
    loss : float
        ``mean_n -log softmax(logits_n)[labels_n]``, computed in float64.
    grad : ndarray, shape (N, classes)
        ``(softmax(logits) - onehot(labels)) / N`` in the logits' dtype.

    Raises
    ------
    ValueError
        ``logits`` not ``(N, classes)`` floats with ``N >= 1``, or ``labels`` not ``N`` integers in
        ``0 .. classes - 1`` (a label of -1 would silently pick the last class).
    """
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.ndim != 2 or logits.shape[0] < 1 or logits.dtype.kind != "f":
        raise ValueError(f"logits: expected floats of shape (N, classes) with N >= 1, got "
                         f"{logits.dtype} of shape {logits.shape}")
    if labels.shape != (logits.shape[0],) or labels.dtype.kind not in "iu":
        raise ValueError(f"labels: expected {logits.shape[0]} integer labels, got {labels.dtype} of shape "
                         f"{labels.shape}")
    if labels.min() < 0 or labels.max() >= logits.shape[1]:
        raise ValueError(f"labels: must lie in 0..{logits.shape[1] - 1}, got {labels.min()}..{labels.max()}")
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = float(-log_p[rows, labels].mean())
    grad = np.exp(log_p)
    grad[rows, labels] -= 1
    return loss, (grad / len(labels)).astype(logits.dtype)
