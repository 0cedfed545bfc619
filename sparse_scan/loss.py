"""Softmax cross-entropy: the loss and its gradient w.r.t. the logits (PyTorch's CrossEntropyLoss).

Examples
--------
>>> import numpy as np
>>> loss, grad = softmax_cross_entropy(np.zeros((2, 4)), np.array([0, 3]))
>>> round(loss, 6), grad.shape
(1.386294, (2, 4))
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["softmax_cross_entropy"]


def softmax_cross_entropy(logits: Any, labels: Any) -> tuple[float, np.ndarray]:
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
    """
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = float(-log_p[rows, labels].mean())
    grad = np.exp(log_p)
    grad[rows, labels] -= 1
    return loss, (grad / len(labels)).astype(logits.dtype)
