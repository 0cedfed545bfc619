"""Recurrent networks through BPPSA: the state chain as a scan over dense blocks.

:class:`RNN` (Elman, paper Eq. 7), :class:`GRU` (paper Eq. 8) and :class:`LSTM` mirror PyTorch's
``nn.RNN``/``nn.GRU``/``nn.LSTM``: constructor, call ``(output, h_n) = module(input, h0)``, layouts
(stacked layers, bidirectional, ``batch_first``, unbatched input, dropout between layers, the LSTM's
projection) and parameter names, so state_dicts copy over. Their backward runs, per layer and
direction, :func:`sparse_scan.engine.run.dense_scan` with the sparse engine's schedules (``H×H``
blocks; the LSTM's ``(h, c)`` state gives ``(H_out+H)×(H_out+H)`` blocks), or, on back-propagation's
schedule on the CPU, the blocks in factored form (no block filled).
:class:`RecurrentClassifier` adds the paper's output layer (linear + softmax cross-entropy on the last
hidden state; a model spec whose first layer is recurrent loads as one), a
:class:`~sparse_scan.model.Model` as a :class:`~sparse_scan.Sequential` is; :class:`RecurrentPlan`
states its schedule (its predicted time reads the :class:`Horizon` where a last-state
back-propagation last stopped) and :class:`Bitstream` is the paper's synthetic task (trained with
:func:`sparse_scan.train.train_iterations`, or split into a dataset for :func:`sparse_scan.train.train`).
:class:`RNNCell`, :class:`GRUCell` and :class:`LSTMCell` are one step each; :class:`CellSequence`
back-propagates a user's loop over a cell with the same scan.
"""

from ._base import Horizon, chain_through_factors
from ._bitstream import Bitstream
from ._cells import CellSequence, GRUCell, LSTMCell, RNNCell
from ._classifier import REDUCTIONS, RecurrentClassifier, RecurrentPlan
from ._gru import GRU
from ._lstm import LSTM
from ._rnn import RNN

__all__ = ["GRU", "LSTM", "REDUCTIONS", "RNN", "Bitstream", "CellSequence", "GRUCell", "Horizon", "LSTMCell",
           "RNNCell", "RecurrentClassifier", "RecurrentPlan", "chain_through_factors"]
