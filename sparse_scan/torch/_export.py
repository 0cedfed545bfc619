"""``export_torch``: a PyTorch module, as its ``forward()`` computes it, written as a model spec (YAML)
plus its weights (``.npz``), or refused before anything is written."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import yaml

from ..weights import write_atomically, write_npz_atomically
from ._capture import capture

__all__ = ["export_torch"]


def export_torch(module: Any, input_shape: Sequence[int], path: str | pathlib.Path) -> pathlib.Path:
    """Write ``path`` (YAML spec) and ``path`` with suffix ``.npz`` (weights) for ``module``.

    The module's ``forward()`` is captured with torch.fx (:mod:`sparse_scan.torch`): every operation
    the output depends on becomes a layer, in graph order, whatever the order its children were
    registered in. Supported are PyTorch's layers (Conv2d with zeros padding, Linear, MaxPool2d,
    AvgPool2d, AdaptiveAvgPool2d, Flatten, ReLU, ReLU6, LeakyReLU, Tanh, Sigmoid, Identity, SiLU,
    GELU, ELU, Hardtanh, Softplus, Hardswish, Hardsigmoid, Mish, BatchNorm2d in eval mode, LayerNorm,
    Upsample, Dropout with its mode, LogSoftmax and Softmax over a flat batch, ChannelShuffle) as modules
    and in their functional and method forms (``F.relu``, ``torch.relu``, ``x.relu()``, ``F.max_pool2d``,
    ``F.dropout(x, p, training=self.training)``, ``F.interpolate``, ...); ``F.conv2d``, ``F.linear``,
    ``F.batch_norm`` and ``F.layer_norm`` given a module's own tensors; ConvNeXt's blocks (the layers
    between ``permute(0, 2, 3, 1)`` and ``permute(0, 3, 1, 2)`` over the channels, ``layer_scale * y``),
    torchvision's ``StochasticDepth`` and timm's ``DropPath`` (docs/torch.md);
    reshapes that keep the batch axis (``x.view(x.size(0), -1)``, ``torch.flatten(x, 1)``) and the
    global mean ``x.mean((2, 3))``; constant scalings and shifts (``x * 2.0``, ``1 - x``); residual
    sums written inline (``f(x) + x``, ``out += identity``, a torchvision ``BasicBlock``), concatenations
    of branches along the channels (``torch.cat([f(x), g(x), x], 1)``, DenseNet's growing
    ``torch.cat(features, 1)``) and products of two branches (a squeeze-and-excitation gate's ``scale *
    x``), nested;
    parameter-free modules called more than once (one layer per call); ``ModuleList`` loops and
    custom submodules (traced through); and recurrent classifiers: an ``nn.RNN``, ``nn.GRU`` or
    ``nn.LSTM`` reading the input, its head's selection (``out[:, -1]``, ``out[-1]``, ``h_n[-1]``,
    ``out.mean(dim=1)``) and one ``nn.Linear``. Anything else is refused with a ``ValueError``
    (:class:`~sparse_scan.torch.CaptureError`) naming the graph node, its operation and the line of
    the forward it comes from. Last, the model the spec describes runs beside the module's forward on
    a probe batch in float64 (dropout off): any difference refuses the export, naming the first layer
    that differs.

    Layer names are the module's paths (``layer1.0.conv1``; a function's layer: its graph node's name,
    ``relu_1``), so the weights keep PyTorch's state_dict names (BatchNorm2d's ``running_mean`` and
    ``running_var`` included, ``num_batches_tracked`` left out; a pruned layer's effective ``weight``).

    Parameters
    ----------
    module : torch.nn.Module
    input_shape : sequence of int
        One sample's shape, no batch axis: ``(time steps, input_size)`` for a recurrent classifier
        (whose loaded model takes batch-first input whatever the module's ``batch_first``).
    path : str or path-like
        The spec to write; neither it nor the weights file may exist.

    Returns
    -------
    pathlib.Path
        The spec's path (load it with :func:`sparse_scan.load_model`).

    Raises
    ------
    ValueError
        The module cannot be captured exactly (:class:`~sparse_scan.torch.CaptureError`), or ``path``
        names no spec of its own; nothing is written.
    FileExistsError, FileNotFoundError
        ``path`` or its weights file exists; its folder does not.
    """
    path = pathlib.Path(path)
    weights_path = path.with_suffix(".npz")
    if weights_path == path:
        raise ValueError(f"{path}: the spec needs a name of its own (e.g. model.yaml); its weights go to "
                         f"{weights_path.name}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: no such directory {path.parent}")
    for target in (path, weights_path):
        if target.exists():
            raise FileExistsError(f"{target} exists; export_torch never overwrites")
    captured = capture(module, input_shape)
    spec = {"input_shape": captured.spec["input_shape"], "weights": weights_path.name,
            "layers": captured.spec["layers"]}
    arrays = {key: tensor.detach().cpu().numpy() for key, tensor in captured.weights.items()}
    text = yaml.safe_dump(spec, sort_keys=False, default_flow_style=None)
    write_npz_atomically(weights_path, arrays)
    try:
        write_atomically(path, lambda stream: stream.write(text.encode()))
    except BaseException:
        weights_path.unlink()
        raise
    return path


