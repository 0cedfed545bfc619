"""The paper's synthetic bitstream task (§4.1): class ``c`` in ``0..9``, ``x_t ~ Bernoulli(0.05 + 0.1c)``.

Samples are generated on demand and deterministically from ``(seed, sample index)``, so a training
set of 32,000 sequences of any length costs no memory until a batch is drawn, and nothing is stored.

Examples
--------
>>> data = Bitstream(steps=100, seed=0)
>>> x, y = data.batch([0, 1, 2])
>>> x.shape, x.dtype.name, y.tolist() == data.labels[:3].tolist()
((3, 100, 1), 'float32', True)
>>> bool((Bitstream(steps=100, seed=0).batch([2])[0] == x[2:]).all())
True
>>> dataset = Bitstream(steps=100, samples=50).split(test=10)   # what sparse_scan.train trains on
>>> dataset.x_train.shape, dataset.y_test.shape
((40, 100, 1), (10,))
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._checks import integer
from ..train import Dataset

__all__ = ["Bitstream"]


class Bitstream:
    """Bitstream classification data.

    Parameters
    ----------
    steps : int
        Sequence length ``T``.
    samples : int
        Number of sequences (the paper's training set: 32,000).
    seed : int
        Seed of the labels and of every sequence.
    classes : int
        Number of classes (10 in the paper: probabilities 0.05 .. 0.95).
    dtype : numpy dtype
        Of the sequences.
    """

    def __init__(self, steps: int, samples: int = 32000, seed: int = 0, classes: int = 10,
                 dtype: Any = np.float32) -> None:
        for field, value, maximum in (("steps", steps, None), ("samples", samples, None),
                                      ("classes", classes, 10)):
            integer(value, f"Bitstream: {field}", 1, maximum)
        integer(seed, "Bitstream: seed", 0)
        self.steps, self.samples, self.seed, self.classes = int(steps), int(samples), int(seed), int(classes)
        self.dtype = np.dtype(dtype)
        self.labels = np.random.default_rng([self.seed, 0]).integers(0, classes, self.samples)

    def __len__(self) -> int:
        return self.samples

    def batch(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Sequences ``(len(indices), T, 1)`` and their labels."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and not (0 <= indices.min() and indices.max() < self.samples):
            raise IndexError(f"Bitstream: sample indices must be in 0..{self.samples - 1}")
        x = np.empty((len(indices), self.steps, 1), dtype=self.dtype)
        for row, index in enumerate(indices):
            probability = 0.05 + 0.1 * self.labels[index]
            uniform = np.random.default_rng([self.seed, 1, int(index)]).random(self.steps)
            x[row, :, 0] = uniform < probability
        return x, self.labels[indices]

    def split(self, test: int) -> Dataset:
        """Every sequence, generated now, as a :class:`sparse_scan.train.Dataset`: the last ``test``
        for testing, the others for training (what :func:`sparse_scan.train.train` and the command
        line's ``--data bitstream`` read)."""
        integer(test, "Bitstream: test", 1, self.samples - 1, note=" (samples - 1)")
        x, y = self.batch(np.arange(self.samples))
        cut = self.samples - test
        return Dataset(x[:cut], y[:cut], x[cut:], y[cut:])
