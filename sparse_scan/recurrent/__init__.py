"""Recurrent networks through BPPSA: the hidden-state chain as a scan over dense ``H×H`` blocks.

:class:`RNN` (Elman, paper Eq. 7) and :class:`GRU` (paper Eq. 8) mirror PyTorch's one-layer,
batch-first ``nn.RNN``/``nn.GRU`` (same parameter names and gate layout, so state_dicts copy over);
their backward runs :func:`sparse_scan.dense_scan.dense_scan` with the sparse engine's schedules, or,
on back-propagation's schedule, :func:`chain_through_factors` (no block filled).
:class:`RecurrentClassifier` adds the paper's output layer (linear + softmax cross-entropy on the last
hidden state), :class:`Bitstream` the paper's synthetic task and :func:`train_recurrent` training.
"""

from ._base import chain_through_factors
from .bitstream import Bitstream
from .classifier import RecurrentClassifier, train_recurrent
from .gru import GRU
from .rnn import RNN

__all__ = ["GRU", "RNN", "Bitstream", "RecurrentClassifier", "chain_through_factors", "train_recurrent"]
