"""A corpus of PyTorch models as people write them, for ``sparse_scan.export_torch``'s torch.fx capture
of a module's ``forward()`` (``tests/test_export_corpus.py`` runs it).

Every model is a small ``nn.Module`` built seeded (``torch.manual_seed(0)``) in float64, its
BatchNorm2d statistics and affine parameters randomised (:func:`oracles.randomize_batch_norms`) and
in eval mode unless its :class:`Case` says otherwise. Two of them are written at their real sizes:
PyTorch's "Training a classifier" tutorial net (CIFAR-10, input ``(3, 32, 32)``) and the MNIST net of
pytorch/examples (input ``(1, 28, 28)``); every other one takes inputs like ``(3, 8, 8)`` or
``(1, 12, 12)`` and has a few channels, so that the whole corpus runs in seconds.

The contract each case states
-----------------------------
Accepted (``fragment`` None):
    ``export_torch(module, input_shape, path)`` writes a spec whose model, loaded in float64, gives
    PyTorch's forward and, for ``method="linear"`` and ``"blelloch"``, autograd's gradient with respect
    to the input and to every parameter (by PyTorch's names, the set of names equal to
    ``module.named_parameters()``'s but those the case's ``renamed`` lists; in PyTorch's shapes but where
    the spec's layer holds the weight with other axes of size 1: a Linear between ConvNeXt's permutes as a
    1x1 convolution's ``(out, in, 1, 1)``, a scale per channel as ``(C, 1, 1)``) within ``1e-10``
    relative. A recurrent model's spec
    ``input_shape`` is ``(T, input_size)`` and the loaded model takes batch-first ``(B, T,
    input_size)`` whatever the torch module's layout (:func:`torch_input` transposes for a time-major
    one).
Refused (``fragment`` a regular expression):
    ``export_torch`` raises a one-line ``ValueError`` that names the graph node as ``node '<name>'``
    (torch.fx's names: a ``call_module`` node after its target with dots made underscores, a function
    or method node after the function, ``_1``, ``_2`` on repeats), matches ``fragment``, and writes
    nothing. ``what`` records the reason in words; the exact wording is the exporter's.

``fragment`` is built by :func:`expect` from the node's name (a regular expression matching the whole
name, checked against ``torch.fx.symbolic_trace`` by the harness where the model traces) and a
keyword, each optional, in any order in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from oracles import randomize_batch_norms
from resnet_blocks import BasicBlock
from torch import nn

__all__ = ["CORPUS", "Case", "expect", "recurrent_layer", "sample", "torch_input"]


def expect(node: str | None = None, keyword: str | None = None) -> str:
    """The regular expression a refusal's message must match: ``node '<node>'`` (``node`` a regular
    expression matching the whole name) and ``keyword``, each where given, in either order."""
    parts = ([rf"node '(?:{node})'"] if node is not None else []) + ([keyword] if keyword is not None else [])
    if not parts:
        raise ValueError("expect: give node, keyword or both")
    return "".join(f"(?=.*(?:{part}))" for part in parts)


@dataclass(frozen=True)
class Case:
    """One model of the corpus.

    Attributes
    ----------
    name : str
        The test's id.
    build : callable
        Returns the module (unseeded, any dtype): :meth:`module` seeds, converts and sets its mode.
    input_shape : tuple of int
        One sample's shape, export_torch's ``input_shape``: ``(T, input_size)`` for a recurrent model.
    what : str
        Accepted: what the model exercises. Refused: why it must be refused.
    node, keyword : str or None
        Refused only: the graph node the message names (a regular expression matching the whole fx
        node name; None where tracing itself fails) and a keyword (a regular expression) it contains.
    training : bool
        Build the module in training mode (a refused BatchNorm2d in training mode); else eval mode.
    inputs : int
        Arguments ``forward`` takes (a refused two-input model has 2).
    vocabulary : int or None
        The input is integer ids in ``[0, vocabulary)`` (an ``nn.Embedding`` first), else floats.
    renamed : tuple of (str, str)
        Accepted only: parameters whose spec weight has another name, (PyTorch's name, the spec's): a
        ``layer_scale``'s weight is ``<layer>.gamma``, so a scale that is no module's ``gamma``
        (torchvision's ConvNeXt block's own ``layer_scale``) is the layer ``<its name>`` and the weight
        ``<its name>.gamma``.
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    what: str
    node: str | None = None
    keyword: str | None = None
    training: bool = False
    inputs: int = 1
    vocabulary: int | None = None
    renamed: tuple[tuple[str, str], ...] = ()

    @property
    def accepted(self) -> bool:
        return self.node is None and self.keyword is None

    @property
    def fragment(self) -> str | None:
        """The regular expression a refusal's message matches (:func:`expect`); None if accepted."""
        return None if self.accepted else expect(self.node, self.keyword)

    def module(self) -> nn.Module:
        """The model: seeded, float64, batch norms randomised, eval mode (or training, as stated)."""
        torch.manual_seed(0)
        net = self.build().double()
        randomize_batch_norms(net)
        return net.train(self.training)


def recurrent_layer(module: nn.Module) -> nn.RNNBase | None:
    """The model's ``nn.RNN``/``nn.GRU``/``nn.LSTM``, or None."""
    return next((m for m in module.modules() if isinstance(m, nn.RNNBase)), None)


def sample(case: Case, batch: int, seed: int) -> list[np.ndarray]:
    """Seeded inputs, one per argument of ``forward``, batch first (``(B, T, input_size)`` for a
    recurrent model, whatever its layout): standard normal floats, or integer ids."""
    rng = np.random.default_rng(seed)
    shape = (batch, *case.input_shape)
    if case.vocabulary is not None:
        return [rng.integers(0, case.vocabulary, shape) for _ in range(case.inputs)]
    return [rng.standard_normal(shape) for _ in range(case.inputs)]


def torch_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch first) in the layout ``module`` takes: time-major ``(T, B, F)`` for a recurrent
    layer without ``batch_first``."""
    recurrent = recurrent_layer(module)
    return x.transpose(0, 1) if recurrent is not None and not recurrent.batch_first else x


# --- reference nets, written from their descriptions -----------------------------------------------
class TutorialNet(nn.Module):
    """PyTorch's "Training a classifier" CIFAR-10 net: one MaxPool2d module used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class MnistNet(nn.Module):
    """pytorch/examples' MNIST net: functional ReLUs and pooling, Dropout modules, log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# --- plain chains: modules, functions, methods -----------------------------------------------------
def sequential_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5))


def sequential_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def nested_sequential() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh()),
        nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(3 * 4 * 4, 8), nn.Sigmoid())),
        nn.Linear(8, 3))


def every_activation_module() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(12, 10), nn.ReLU6(), nn.Linear(10, 10), nn.LeakyReLU(0.2), nn.ELU(0.7),
        nn.GELU(), nn.SiLU(), nn.Linear(10, 10), nn.Hardtanh(-0.6, 0.8), nn.Softplus(1.5, 10.0),
        nn.Sigmoid(), nn.Identity(), nn.Tanh(), nn.Dropout(0.2), nn.Linear(10, 4), nn.LogSoftmax(dim=1))


class FunctionalMLP(nn.Module):
    """fc layers with F.relu between them, the input flattened with torch.flatten(x, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 12)
        self.fc2 = nn.Linear(12, 8)
        self.fc3 = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class FlatInputMLP(nn.Module):
    """A flat ``(B, n)`` input, every ReLU spelling, a softmax head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 9)
        self.fc2 = nn.Linear(9, 8)
        self.fc3 = nn.Linear(8, 7)
        self.fc4 = nn.Linear(7, 4)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = self.fc2(x).relu()
        x = F.relu(self.fc3(x))
        return F.softmax(self.fc4(x), dim=1)


class FunctionalActivations(nn.Module):
    """Every functional activation, some with arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = F.relu6(self.fcs[0](x * 3.0))
        x = F.leaky_relu(self.fcs[1](x), 0.1)
        x = F.elu(self.fcs[2](x), alpha=0.5)
        x = F.gelu(x)
        x = F.gelu(self.fcs[3](x), approximate="tanh")
        x = F.silu(x)
        x = F.hardtanh(self.fcs[4](x), -0.5, 0.5)
        x = F.softplus(self.fcs[5](x), beta=2.0)
        return F.log_softmax(self.head(x), dim=1)


class MethodActivations(nn.Module):
    """torch.sigmoid / x.sigmoid(), torch.tanh / x.tanh() and a Softmax module on dim -1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 8)
        self.fc4 = nn.Linear(8, 5)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        x = torch.sigmoid(self.fc1(x.flatten(1)))
        x = self.fc2(x).sigmoid()
        x = torch.tanh(self.fc3(x)).tanh()
        return self.softmax(self.fc4(x))


class ReusedTanh(nn.Module):
    """One nn.Tanh module called after every hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 10)
        self.fc2 = nn.Linear(10, 10)
        self.fc3 = nn.Linear(10, 3)
        self.act = nn.Tanh()

    def forward(self, x):
        x = self.act(self.fc1(torch.flatten(x, 1)))
        x = self.act(self.fc2(x))
        return self.fc3(x)


class ReusedPool(nn.Module):
    """``self.pool = nn.MaxPool2d(2)`` used twice, an inplace ReLU module, x.view(x.size(0), -1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        return self.fc(x)


class OutOfOrder(nn.Module):
    """Children registered head first, used in forward's order."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4 * 2 * 2, 3)
        self.act = nn.ELU()
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.AvgPool2d(2)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        x = self.pool(x)
        return self.fc(torch.flatten(x, 1))


class ModuleListLoop(nn.Module):
    """A ModuleList of Linear layers looped over, F.relu between them."""

    def __init__(self) -> None:
        super().__init__()
        sizes = [16, 12, 10, 8, 6]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


class ConvBlock(nn.Module):
    """A custom submodule: conv, batch norm, ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class CustomBlocks(nn.Module):
    """Custom submodules traced through, a ModuleList of them and a head module of another class."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d((2, 2))
            self.fc = nn.Linear(5 * 2 * 2, 4)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(x), 1))

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBlock(3, 4)
        self.blocks = nn.ModuleList([ConvBlock(4, 5), ConvBlock(5, 5)])
        self.head = self.Head()

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FunctionalPools(nn.Module):
    """F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d and pooling modules."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.adaptive = nn.AdaptiveAvgPool2d(3)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.adaptive(self.avg(x))
        x = F.avg_pool2d(torch.tanh(self.conv2(x)), 2, stride=1)
        x = F.adaptive_avg_pool2d(x, (2, 2))
        return self.fc(torch.flatten(x, 1))


class ViewMinusOne(nn.Module):
    """x.view(-1, N), N the per-sample size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3)
        self.conv2 = nn.Conv2d(3, 2, 3)
        self.fc = nn.Linear(2 * 2 * 2, 3)

    def forward(self, x):
        x = self.conv2(F.relu(self.conv1(x)))
        return self.fc(x.view(-1, 2 * 2 * 2))


class ReshapeShape(ViewMinusOne):
    """x.reshape(x.shape[0], -1)."""

    def forward(self, x):
        x = self.conv2(F.relu(self.conv1(x)))
        return self.fc(F.elu(x.reshape(x.shape[0], -1)))


class GlobalMeanPool(nn.Module):
    """Global average pooling as x.mean((2, 3))."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


class GlobalMeanPoolDim(GlobalMeanPool):
    """Global average pooling as x.mean(dim=[2, 3])."""

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).mean(dim=[2, 3]))


class InPlace(nn.Module):
    """F.relu(x, inplace=True), x.relu_() and nn.ReLU(inplace=True) on tensors nothing else uses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.conv2 = nn.Conv2d(3, 3, 3)
        self.fc1 = nn.Linear(3 * 8 * 8, 6)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        x = F.relu(self.conv1(x), inplace=True)
        x = self.conv2(x).relu_()
        x = self.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class ConstantScalings(nn.Module):
    """x * 2.0, 2.0 * x, x / 4, -x between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x):
        x = self.fc1(torch.flatten(x, 1)) * 2.0
        x = torch.tanh(2.0 * x)
        x = self.fc2(x / 4)
        x = -x
        return self.fc3(F.silu(x))


class ConstantShifts(nn.Module):
    """x + 1, 1 + x, x - 0.5, 1 - x between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x):
        x = self.fc1(torch.flatten(x, 1) + 1)
        x = torch.sigmoid(1 + x)
        x = self.fc2(x - 0.5)
        return self.fc3(1 - x)


class ScaledHead(nn.Module):
    """``self.fc(x) * 2.0``: a constant scaling as the last operation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.fc = nn.Linear(2 * 6 * 6, 4)

    def forward(self, x):
        x = torch.flatten(F.relu(self.conv(x)), 1)
        return self.fc(x) * 2.0


class FunctionalDropout(nn.Module):
    """F.dropout(x, p, training=self.training) and nn.Dropout: the mode is the module's at export."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 10)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x):
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        x = F.dropout(x, 0.5, training=self.training)
        return self.fc2(self.drop(x))


# --- residual sums written inline -----------------------------------------------------------------
class InlineResidual(nn.Module):
    """``f(x) + x`` with f a conv and a functional ReLU, then ``x + self.proj(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.proj = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(self.conv(x)) + x
        x = x + self.proj(x)
        x = F.max_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))


class DifferenceResidual(nn.Module):
    """``f(x) - x`` on a flat input, f two Linear layers with a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(12, 8)
        self.f1 = nn.Linear(8, 8)
        self.f2 = nn.Linear(8, 8)
        self.fc_out = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.tanh(self.fc_in(torch.flatten(x, 1)))
        x = self.f2(F.relu(self.f1(x))) - x
        return self.fc_out(x)


class TopLevelResidual(nn.Module):
    """``torch.relu(self.conv(x)) + x`` at the top level of the module, on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 5 * 5, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x)) + x
        return self.fc(torch.flatten(x, 1))


class Residual(nn.Module):
    """A custom residual module: ``x + body(x)``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class NestedResiduals(nn.Module):
    """A residual whose branch holds a residual, both as modules and written inline."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(2, 3, 3, padding=1)
        self.outer = Residual(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh(),
                                            Residual(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()))))
        self.a = nn.Conv2d(3, 3, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 6 * 6, 3)

    def forward(self, x):
        x = self.outer(F.relu(self.conv_in(x)))
        x = x + self.b(F.relu(self.a(x) + x))
        return self.fc(torch.flatten(x, 1))


class SmallResNet(nn.Module):
    """torchvision's ResNet shape, tiny: stem, BasicBlocks (``out += identity``, one with a downsample
    nn.Sequential), global average pooling, torch.flatten, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(4, 4, inplace=True))
        self.layer2 = nn.Sequential(BasicBlock(4, 6, 2, inplace=True), BasicBlock(6, 6, inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# --- recurrent classifiers ------------------------------------------------------------------------
class Recurrent(nn.Module):
    """A recurrent layer on the input, a head selection, optionally an eval-mode Dropout, one Linear.

    Parameters
    ----------
    kind : {"RNN", "GRU", "LSTM"}
    head : str
        ``"last"`` (``out[:, -1]``, or ``out[-1]`` time-major), ``"last3"`` (``out[:, -1, :]``),
        ``"h_n"`` (``h_n[-1]``), ``"squeeze"`` (``h_n.squeeze(0)``), ``"mean"`` (``out.mean(dim=1)``,
        or ``out.mean(0)`` time-major), ``"relu"`` (``F.relu(out[:, -1])``: refused), ``"sequence"``
        (the whole ``out``: refused).
    dropout : bool
        An nn.Dropout between the selection and the Linear.
    **arguments
        The recurrent layer's.
    """

    def __init__(self, kind: str, head: str, dropout: bool = False, **arguments) -> None:
        super().__init__()
        self.head = head
        self.encoder = getattr(nn, kind)(3, 4, **arguments)
        width = 4 * (2 if self.encoder.bidirectional else 1)
        self.drop = nn.Dropout(0.4) if dropout else None
        self.fc = nn.Linear(width, 3)

    def forward(self, x):
        out, state = self.encoder(x)
        first = self.encoder.batch_first
        if self.head in ("h_n", "squeeze"):
            h_n = state[0] if isinstance(self.encoder, nn.LSTM) else state
        if self.head == "last":
            z = out[:, -1] if first else out[-1]
        elif self.head == "last3":
            z = out[:, -1, :]
        elif self.head == "h_n":
            z = h_n[-1]
        elif self.head == "squeeze":
            z = h_n.squeeze(0)
        elif self.head == "mean":
            z = out.mean(dim=1) if first else out.mean(0)
        elif self.head == "relu":
            z = F.relu(out[:, -1])
        else:
            return out
        if self.drop is not None:
            z = self.drop(z)
        return self.fc(z)


class LSTMClassifier(nn.Module):
    """The common LSTM classifier: ``self.fc(out.mean(dim=1))`` over a batch-first LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out.mean(dim=1))


class LSTMLastState(nn.Module):
    """``_, (h_n, _) = self.lstm(x)`` and ``self.fc(h_n.squeeze(0))``: a one-layer LSTM's final state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        _, (h_n, _) = self.lstm(x)
        return self.fc(h_n.squeeze(0))


class BidirectionalLSTM(nn.Module):
    """``h_n[-1]`` of a bidirectional LSTM: the reverse direction's final state only."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        _, (h_n, _) = self.lstm(x)
        return self.fc(h_n[-1])


# --- refused --------------------------------------------------------------------------------------
class WeightTying(nn.Module):
    """The same nn.Linear(8, 8) applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(12, 8)
        self.shared = nn.Linear(8, 8)
        self.fc_out = nn.Linear(8, 3)

    def forward(self, x):
        x = F.relu(self.fc_in(torch.flatten(x, 1)))
        x = F.relu(self.shared(x))
        x = F.relu(self.shared(x))
        return self.fc_out(x)


class WithLayerNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(torch.flatten(x, 1)))))


class EmbeddingBag(nn.Module):
    """An nn.Embedding of integer ids as the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(6 * 4, 3)

    def forward(self, ids):
        return self.fc(torch.flatten(self.embed(ids), 1))


class Attention(nn.Module):
    """nn.MultiheadAttention over a ``(B, T, E)`` sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(5 * 4, 3)

    def forward(self, x):
        out, _ = self.attn(x, x, x)
        return self.fc(torch.flatten(out, 1))


class HandAttention(nn.Module):
    """Scaled dot-product attention written with torch.matmul and torch.bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.key = nn.Linear(4, 4)
        self.value = nn.Linear(4, 4)
        self.fc = nn.Linear(5 * 4, 3)

    def forward(self, x):
        scores = torch.matmul(self.query(x), self.key(x).transpose(1, 2)) / 2.0
        out = torch.bmm(torch.softmax(scores, dim=-1), self.value(x))
        return self.fc(torch.flatten(out, 1))


class WithConv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.fc = nn.Linear(3 * 6, 3)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.conv(x)), 1))


class DataDependent(nn.Module):
    """``if x.sum() > 0:``: a branch chosen by the input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 3)
        self.b = nn.Linear(12, 3)

    def forward(self, x):
        x = torch.flatten(x, 1)
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class TrainingBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))


class ParameterScale(nn.Module):
    """``x * self.scale`` with ``scale`` an nn.Parameter (a learnt scaling)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 6)
        self.scale = nn.Parameter(torch.full((6,), 1.5))
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.fc1(torch.flatten(x, 1)) * self.scale)


class Permute(nn.Module):
    """Channels-last by x.permute(0, 2, 3, 1) before the flattening."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.fc = nn.Linear(2 * 6 * 6, 3)

    def forward(self, x):
        x = self.conv(x).permute(0, 2, 3, 1)
        return self.fc(torch.flatten(x, 1))


class Transpose(Permute):
    def forward(self, x):
        x = self.conv(x).transpose(2, 3)
        return self.fc(torch.flatten(x, 1))


class SplitView(nn.Module):
    """x.view(x.size(0), 2, -1): a reshape that is no flattening of trailing axes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(2, 3)

    def forward(self, x):
        x = self.conv(x)
        x = x.view(x.size(0), 2, -1)
        x = x.mean(2)
        return self.fc(x)


class FlattenBatch(nn.Module):
    """torch.flatten(x): the batch axis flattened with the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)

    def forward(self, x):
        return torch.flatten(F.relu(self.conv(x)))


class NoGradRegion(nn.Module):
    """A layer run under torch.no_grad(): PyTorch gives it (and what feeds it) no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        with torch.no_grad():
            features = self.fc1(torch.flatten(x, 1))
        return self.fc2(features)


class Detached(NoGradRegion):
    """``.detach()``: no gradient through it."""

    def forward(self, x):
        return self.fc2(self.fc1(torch.flatten(x, 1)).detach())


class AliasedInPlace(NoGradRegion):
    """``z = y; z += 1`` changes ``y`` in place, which torch.fx records as an out-of-place sum."""

    def forward(self, x):
        y = self.fc1(torch.flatten(x, 1))
        z = y
        z += 1.0
        return self.fc2(y)


class Stateful(NoGradRegion):
    """The forward counts its calls and scales by the count: another function every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))) * self.calls


class DoubledBranch(NoGradRegion):
    """``y + y``: twice the branch, an affine layer."""

    def forward(self, x):
        y = self.fc1(torch.flatten(x, 1))
        return self.fc2(y + y)


class TupleOutput(nn.Module):
    """forward returns the logits and the features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        features = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(features), features


class TwoInputs(nn.Module):
    """forward(x, y): two inputs summed after their own layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fx = nn.Linear(12, 3)
        self.fy = nn.Linear(12, 3)

    def forward(self, x, y):
        return self.fx(torch.flatten(x, 1)) + self.fy(torch.flatten(y, 1))


# --- joins of branches (issue 46): concatenations and products ------------------------------------
class Concat(nn.Module):
    """torch.cat of two convolution branches along the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        x = torch.cat([self.a(x), self.b(x)], 1)
        return self.fc(torch.flatten(x, 1))


class BranchProduct(nn.Module):
    """``self.a(x) * self.b(x)``: a gated product of two branches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 6)
        self.b = nn.Linear(12, 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.fc(self.a(x) * self.b(x))


class Fire(nn.Module):
    """SqueezeNet's fire module: a squeeze 1x1 conv, then torch.cat of a 1x1 and a 3x3 expand branch."""

    def __init__(self, cin: int = 3, squeeze: int = 2, expand: int = 3) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 3, 3), nn.ReLU(inplace=True), Fire(),
                                      nn.MaxPool2d(2, ceil_mode=True), Fire(6, 2, 2))
        self.classifier = nn.Sequential(nn.Conv2d(4, 3, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


class InceptionLike(nn.Module):
    """GoogLeNet's inception module: torch.cat of a 1x1, a 1x1-3x3, a pool-projection branch and the
    input itself, written with F.max_pool2d and torch.cat(outputs, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch1 = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2), nn.ReLU())
        self.branch2 = nn.Sequential(nn.Conv2d(3, 2, 1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1))
        self.branch4 = nn.Conv2d(3, 1, 1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        outputs = [self.branch1(x), self.branch2(x), self.branch4(F.max_pool2d(x, 3, 1, 1)), x]
        x = F.relu(torch.cat(outputs, 1))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class DenseLayer(nn.Module):
    """torchvision's _DenseLayer (no bottleneck): BN-ReLU-conv of the concatenation of every earlier
    feature map."""

    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, growth, 3, padding=1, bias=False)

    def forward(self, features):
        return self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))


class DenseNetLike(nn.Module):
    """torchvision's _DenseBlock: features = [x]; each layer reads torch.cat(features, 1) and appends its
    output; the block returns torch.cat(features, 1); a transition, a head."""

    def __init__(self, growth: int = 2, layers: int = 3) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.denselayers = nn.ModuleList([DenseLayer(3 + index * growth, growth) for index in range(layers)])
        channels = 3 + layers * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, 4, 1),
                                        nn.AvgPool2d(2))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        features = [self.conv0(x)]
        for layer in self.denselayers:
            features.append(layer(features))
        x = self.transition(torch.cat(features, 1))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: scale = sigmoid(fc2(relu(fc1(avgpool(x))))); scale * x."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class SEResNetLike(nn.Module):
    """A BasicBlock whose residual branch ends in a squeeze-and-excitation module (SE-ResNet, RegNet-Y),
    ``out += identity``; a gate over the rows alone (``x * torch.sigmoid(pool(x))``, ``(B, C, H, 1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.se = SqueezeExcitation(4, 2)
        self.downsample = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4))
        self.rows = nn.AdaptiveAvgPool2d((None, 1))
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        identity = self.downsample(x)
        out = self.se(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        out += identity
        out = F.relu(out)
        out = out * torch.sigmoid(self.rows(out))
        return self.fc(torch.flatten(out, 1))


class NestedJoins(nn.Module):
    """A concatenation inside a residual sum inside a concatenation; torch.cat([x, x], 1); x * x."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 1, 1)
        self.b = nn.Conv2d(2, 1, 3, padding=1)
        self.c = nn.Conv2d(2, 2, 1)
        self.fc = nn.Linear(8 * 3 * 3, 3)

    def forward(self, x):
        inner = x + torch.cat([self.a(x), torch.tanh(self.b(x))], 1)
        x = torch.cat([inner, self.c(x)], 1)
        x = torch.cat([x, x], 1) * torch.cat([x, x], 1)
        return self.fc(torch.flatten(x, 1))


def channel_shuffle(x, groups: int):
    """torchvision's ShuffleNetV2 channel shuffle, as written there."""
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, num_channels, height, width)


class ShuffleUnit(nn.Module):
    """torchvision's ShuffleNetV2 InvertedResidual: stride 1 splits the channels with x.chunk(2, dim=1)
    and keeps the first half; stride 2 runs two branches; then torch.cat and a channel shuffle."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = cout // 2
        if stride > 1:
            self.branch1 = nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
                                         nn.BatchNorm2d(cin), nn.Conv2d(cin, half, 1, bias=False),
                                         nn.BatchNorm2d(half), nn.ReLU(inplace=True))
        inputs = cin if stride > 1 else half
        self.branch2 = nn.Sequential(nn.Conv2d(inputs, half, 1, bias=False), nn.BatchNorm2d(half),
                                     nn.ReLU(inplace=True),
                                     nn.Conv2d(half, half, 3, stride, 1, groups=half, bias=False),
                                     nn.BatchNorm2d(half), nn.Conv2d(half, half, 1, bias=False),
                                     nn.BatchNorm2d(half), nn.ReLU(inplace=True))

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.stage2 = nn.Sequential(ShuffleUnit(4, 8, 2), ShuffleUnit(8, 8, 1))
        self.shuffle = nn.ChannelShuffle(4)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.shuffle(self.stage2(self.conv1(x)))
        return self.fc(x.mean((2, 3)))


# --- issue 46's layers: Hardswish, Mish, LayerNorm, layer scales, upsampling, stochastic depth ------
def torchvision():
    """torchvision, imported beside the CPU torch as ``tests/torchvision_models.py`` does; the case is
    skipped where it is not installed (CI installs it: docs/testing.md)."""
    import pytest  # noqa: PLC0415 - only a case built without torchvision needs it
    import torchvision_models  # noqa: PLC0415

    if not torchvision_models.installed():
        pytest.skip("torchvision is not installed")
    return torchvision_models.load()


def randomized(net: nn.Module) -> nn.Module:
    """``net`` with random LayerNorm weights and biases and random layer scales (seeded by the caller):
    their initial ones and zeros would hide a wrong transposed Jacobian."""
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.LayerNorm) and module.weight is not None:
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_()
        for name, parameter in net.named_parameters():
            if name.rpartition(".")[2] in ("gamma", "layer_scale"):
                parameter.uniform_(0.5, 1.5)
    return net


class NewActivations(nn.Module):
    """nn.Hardswish, nn.Hardsigmoid, nn.Mish and F.hardswish, F.hardsigmoid, F.mish (in place too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.hardswish = nn.Hardswish()
        self.fc2 = nn.Linear(8, 8)
        self.hardsigmoid = nn.Hardsigmoid(inplace=True)
        self.mish = nn.Mish()
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x):
        x = self.mish(self.hardsigmoid(self.fc2(self.hardswish(self.fc1(torch.flatten(x, 1) * 4.0)))))
        x = F.mish(F.hardsigmoid(F.hardswish(x * 6.0 - 3.0), inplace=True))
        return self.fc3(x)


class SqueezeExcitationV3(nn.Module):
    """torchvision.ops.SqueezeExcitation as MobileNetV3 makes it: ReLU, then Hardsigmoid as the gate."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class MobileNetV3Block(nn.Module):
    """MobileNetV3's inverted residual: a 1x1 expansion, a depthwise 3x3, both with Hardswish, a
    squeeze-and-excitation gate with Hardsigmoid, a 1x1 projection, ``result += input``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                                  nn.Hardswish())
        self.block = nn.Sequential(
            nn.Sequential(nn.Conv2d(4, 8, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8),
                          nn.Hardswish()),
            SqueezeExcitationV3(8, 4),
            nn.Sequential(nn.Conv2d(8, 4, 1, bias=False), nn.BatchNorm2d(4)))
        self.classifier = nn.Sequential(nn.Linear(4, 6), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(6, 3))

    def forward(self, x):
        x = self.stem(x)
        result = self.block(x)
        result += x
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(result, 1), 1))


class MBConv(nn.Module):
    """EfficientNet's MBConv as torchvision writes it: expansion, depthwise conv, squeeze-and-excitation
    (SiLU, Sigmoid), projection, torchvision.ops.StochasticDepth(p, "row"), ``result += input``."""

    def __init__(self, channels: int, p: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Sequential(nn.Conv2d(channels, 2 * channels, 1, bias=False), nn.BatchNorm2d(2 * channels),
                          nn.SiLU()),
            nn.Sequential(nn.Conv2d(2 * channels, 2 * channels, 3, padding=1, groups=2 * channels,
                                    bias=False), nn.BatchNorm2d(2 * channels), nn.SiLU()),
            SqueezeExcitation(2 * channels, 2),
            nn.Sequential(nn.Conv2d(2 * channels, channels, 1, bias=False), nn.BatchNorm2d(channels)))
        self.stochastic_depth = torchvision().ops.StochasticDepth(p, "row")

    def forward(self, x):
        result = self.stochastic_depth(self.block(x))
        result += x
        return result


class EfficientNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.SiLU())
        self.blocks = nn.Sequential(MBConv(4, 0.1), MBConv(4, 0.2))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class ConvNeXtLike(nn.Module):
    """torchvision's ConvNeXt blocks (``CNBlock``: a depthwise 7x7 conv, permute(0, 2, 3, 1), LayerNorm,
    Linear, GELU, Linear, permute(0, 3, 1, 2), ``layer_scale * y``, StochasticDepth, ``+= input``),
    torchvision's ``LayerNorm2d`` after the stem and in the head, its downsampling."""

    def __init__(self) -> None:
        super().__init__()
        convnext = torchvision().models.convnext
        norm = convnext.LayerNorm2d
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), norm(4, eps=1e-6))
        self.stage1 = nn.Sequential(convnext.CNBlock(4, 0.5, 0.1), convnext.CNBlock(4, 0.5, 0.2))
        self.downsample = nn.Sequential(norm(4, eps=1e-6), nn.Conv2d(4, 6, 2, stride=2))
        self.stage2 = convnext.CNBlock(6, 0.5, 0.3)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(norm(6, eps=1e-6), nn.Flatten(1), nn.Linear(6, 3))
        randomized(self)

    def forward(self, x):
        x = self.stage2(self.downsample(self.stage1(self.stem(x))))
        return self.classifier(self.avgpool(x))


def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """timm's ``drop_path`` (``timm/layers/drop.py``), as written there."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    """timm's ``DropPath``, as written there."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class LayerScale(nn.Module):
    """timm's channels-last ``LayerScale`` (gamma ``(C,)`` over the last axis)."""

    def __init__(self, dim: int, init_values: float = 1e-5, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class LayerScale2d(nn.Module):
    """timm's ``LayerScale2d`` (gamma ``(C,)`` viewed ``(1, C, 1, 1)`` over an NCHW batch)."""

    def __init__(self, dim: int, init_values: float = 1e-5, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        gamma = self.gamma.view(1, -1, 1, 1)
        return x.mul_(gamma) if self.inplace else x * gamma


class LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``: F.layer_norm over the channels between two permutes."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Mlp(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.fc2 = nn.Linear(hidden, channels)

    def forward(self, x):
        return self.fc2(self.drop1(self.act(self.fc1(x))))


class TimmConvNeXtBlock(nn.Module):
    """timm's ConvNeXtBlock: channels last (permute, nn.LayerNorm, Mlp, channels-last LayerScale,
    permute back) or ``conv_mlp`` (LayerNorm2d, 1x1 convolutions, LayerScale2d), then DropPath and the
    shortcut."""

    def __init__(self, channels: int, conv_mlp: bool, drop_path_rate: float) -> None:
        super().__init__()
        self.conv_mlp = conv_mlp
        self.conv_dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        if conv_mlp:
            self.norm = LayerNorm2d(channels, eps=1e-6)
            self.mlp = nn.Sequential(nn.Conv2d(channels, 2 * channels, 1), nn.GELU(),
                                     nn.Conv2d(2 * channels, channels, 1))
            self.ls = LayerScale2d(channels, 1e-6)
        else:
            self.norm = nn.LayerNorm(channels, eps=1e-6)
            self.mlp = Mlp(channels, 2 * channels)
            self.ls = LayerScale(channels, 1e-6, inplace=True)
        self.drop_path = DropPath(drop_path_rate)

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x)
        if self.conv_mlp:
            x = self.ls(self.mlp(self.norm(x)))
        else:
            x = x.permute(0, 2, 3, 1)
            x = self.ls(self.mlp(self.norm(x)))
            x = x.permute(0, 3, 1, 2)
        return self.drop_path(x) + shortcut


class TimmConvNeXtLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), LayerNorm2d(4, eps=1e-6))
        self.stages = nn.Sequential(TimmConvNeXtBlock(4, False, 0.1), TimmConvNeXtBlock(4, True, 0.2))
        self.head = nn.Linear(4, 3)
        randomized(self)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``, abridged: F.batch_norm with the module's own statistics and affine
    parameters, then its activation module."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        bn_training = True if self.training else (self.running_mean is None) and (self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, bn_training, 0.0 if self.momentum is None else self.momentum,
                         self.eps)
        return self.act(x)


class FunctionalConv(nn.Module):
    """A convolution module written with F.conv2d over its own weight and bias."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin, 3, 3) / 3)
        self.bias = nn.Parameter(torch.randn(cout))
        self.stride, self.padding = stride, 1

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)


class FunctionalHead(nn.Module):
    """F.layer_norm and F.linear over the module's own parameters."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.weight = nn.Parameter(torch.randn(classes, features) / 3)
        self.bias = nn.Parameter(torch.randn(classes))

    def forward(self, x):
        x = F.layer_norm(x, (x.shape[1],), self.norm.weight, self.norm.bias, 1e-6)
        return F.linear(x, self.weight, self.bias)


class FusedNormAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = FunctionalConv(3, 4)
        self.bn1 = BatchNormAct2d(4)
        self.conv2 = FunctionalConv(4, 4, stride=2)
        self.bn2 = BatchNormAct2d(4)
        self.head = FunctionalHead(16, 3)
        randomized(self)

    def forward(self, x):
        x = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.head(torch.flatten(x, 1))


class UNetLike(nn.Module):
    """A U-Net's levels: a pooled path upsampled back (nn.Upsample bilinear with align_corners, then
    F.interpolate nearest) and concatenated with its skip connection; UpsamplingNearest2d and
    UpsamplingBilinear2d before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = nn.Sequential(nn.Conv2d(6, 4, 3, padding=1), nn.ReLU())
        self.up_nearest = nn.UpsamplingNearest2d(scale_factor=2)
        self.up_bilinear = nn.UpsamplingBilinear2d(size=(6, 7))
        self.fc = nn.Linear(8 * 6 * 7, 3)

    def forward(self, x):
        x1 = self.inc(x)
        x = self.conv(torch.cat([x1, self.up(self.down(x1))], dim=1))
        x = torch.cat([x, F.interpolate(F.max_pool2d(x, 2), scale_factor=2, mode="nearest")], 1)
        x = self.up_bilinear(self.up_nearest(F.avg_pool2d(x, 4)))
        return self.fc(torch.flatten(x, 1))


# refused: attention, in-place writes, what no layer computes
class DotProductAttention(nn.Module):
    """F.scaled_dot_product_attention of three projections of a (B, T, E) sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.fc = nn.Linear(5 * 4, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.fc(torch.flatten(F.scaled_dot_product_attention(q, k, v), 1))


class EinsumAttention(nn.Module):
    """Attention scores by torch.einsum of queries and keys (MaxViT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.key = nn.Linear(4, 4)
        self.fc = nn.Linear(5 * 5, 3)

    def forward(self, x):
        scores = torch.einsum("bid,bjd->bij", self.query(x), self.key(x))
        return self.fc(torch.flatten(scores.softmax(-1), 1))


class IndexedWrite(nn.Module):
    """``y[:, 0] = 0``: a write into an activation (torch.fx cannot trace it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        y = self.fc1(torch.flatten(x, 1))
        y[:, 0] = 0.0
        return self.fc2(y)


class InPlaceClamp(IndexedWrite):
    """``y.clamp_(min=0)``: an in-place method whose result nothing reads, changing what fc2 reads."""

    def forward(self, x):
        y = self.fc1(torch.flatten(x, 1))
        y.clamp_(min=0.0)
        return self.fc2(y)


class TokenLayerScale(nn.Module):
    """A transformer's channels-last layer scale: (B, N, C) tokens times gamma (C,)."""

    def __init__(self) -> None:
        super().__init__()
        self.ls = LayerScale(4, 0.5)
        self.fc = nn.Linear(5 * 4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.ls(x), 1))


class ScaledWeight(FunctionalConv):
    """F.conv2d given ``self.weight * 2.0``: a parameter in an expression."""

    def forward(self, x):
        return torch.flatten(F.conv2d(x, self.weight * 2.0, self.bias, 1, 1), 1)


class RenamedLinear(nn.Module):
    """F.linear given parameters named ``w`` and ``b``: a linear layer's weights are named weight, bias."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 12))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return F.linear(torch.flatten(x, 1), self.w, self.b)


class Bicubic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bicubic")
        self.fc = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.up(x), 1))


class Antialiased(Bicubic):
    def forward(self, x):
        return self.fc(torch.flatten(F.interpolate(x, size=(4, 4), mode="bilinear", antialias=True), 1))


class TrainingFusedNorm(nn.Module):
    """BatchNormAct2d (F.batch_norm) in training mode: the batch's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = BatchNormAct2d(3)
        self.fc = nn.Linear(3 * 2 * 2, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.bn(x), 1))


def recurrent(kind: str, head: str, dropout: bool = False, **arguments) -> Callable[[], nn.Module]:
    return lambda: Recurrent(kind, head, dropout, **arguments)


CALLED_TWICE = r"called 2 times|called twice|more than once"

CORPUS: list[Case] = [
    # accepted -------------------------------------------------------------------------------------
    Case("sequential_mlp", sequential_mlp, (1, 4, 4), "nn.Sequential of Flatten, Linear, ReLU, Linear"),
    Case("sequential_cnn", sequential_cnn, (3, 8, 8),
         "nn.Sequential of Conv2d, BatchNorm2d (eval), ReLU, MaxPool2d, Flatten, Linear"),
    Case("nested_sequential", nested_sequential, (2, 6, 6), "nn.Sequential inside nn.Sequential, twice"),
    Case("every_activation_module", every_activation_module, (3, 2, 2),
         "every activation module, Identity, Dropout (eval) and a LogSoftmax(dim=1) head"),
    Case("tutorial_cifar_net", TutorialNet, (3, 32, 32),
         "PyTorch's 'Training a classifier' net: MaxPool2d module used twice, F.relu, torch.flatten"),
    Case("examples_mnist_net", MnistNet, (1, 28, 28),
         "pytorch/examples' MNIST net: F.relu, F.max_pool2d, Dropout modules, F.log_softmax(dim=1)"),
    Case("functional_mlp", FunctionalMLP, (1, 4, 4), "fc layers with F.relu between, torch.flatten(x, 1)"),
    Case("flat_input_mlp", FlatInputMLP, (10,),
         "a flat input, torch.relu / x.relu() / F.relu, F.softmax(dim=1) head"),
    Case("functional_activations", FunctionalActivations, (8,),
         "F.relu6, F.leaky_relu, F.elu, F.gelu (both), F.silu, F.hardtanh, F.softplus, x * 3.0"),
    Case("method_activations", MethodActivations, (3, 2, 2),
         "torch.sigmoid, x.sigmoid(), torch.tanh, x.tanh(), x.flatten(1), Softmax(dim=-1) module"),
    Case("reused_tanh", ReusedTanh, (3, 2, 2), "one nn.Tanh module called twice: one layer per call"),
    Case("reused_pool_view", ReusedPool, (1, 12, 12),
         "self.pool = nn.MaxPool2d(2) and nn.ReLU(inplace=True) used twice, x.view(x.size(0), -1)"),
    Case("out_of_order_registration", OutOfOrder, (3, 4, 4),
         "children registered head first; BatchNorm2d, ELU, AvgPool2d"),
    Case("module_list_loop", ModuleListLoop, (1, 4, 4), "a ModuleList of Linear layers looped over"),
    Case("custom_blocks", CustomBlocks, (3, 6, 6),
         "custom submodules (conv-bn-relu, a head class) traced through, a ModuleList of them"),
    Case("functional_pools", FunctionalPools, (1, 8, 8),
         "F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, AvgPool2d and AdaptiveAvgPool2d modules"),
    Case("view_minus_one", ViewMinusOne, (2, 6, 6), "x.view(-1, N), N the per-sample size"),
    Case("reshape_shape", ReshapeShape, (2, 6, 6), "x.reshape(x.shape[0], -1), then F.elu"),
    Case("global_mean_pool", GlobalMeanPool, (3, 5, 5), "global average pooling as x.mean((2, 3))"),
    Case("global_mean_pool_dim", GlobalMeanPoolDim, (3, 5, 5),
         "global average pooling as x.mean(dim=[2, 3])"),
    Case("in_place", InPlace, (1, 12, 12), "F.relu(x, inplace=True), x.relu_(), nn.ReLU(inplace=True)"),
    Case("constant_scalings", ConstantScalings, (3, 2, 2), "x * 2.0, 2.0 * x, x / 4, -x"),
    Case("constant_shifts", ConstantShifts, (3, 2, 2), "x + 1, 1 + x, x - 0.5, 1 - x"),
    Case("doubled_branch", DoubledBranch, (3, 2, 2), "y + y of one branch: an affine layer"),
    Case("scaled_head", ScaledHead, (3, 8, 8), "self.fc(x) * 2.0 as the last operation"),
    Case("functional_dropout", FunctionalDropout, (3, 2, 2),
         "F.dropout(x, 0.5, training=self.training) and nn.Dropout, eval mode"),
    Case("inline_residual", InlineResidual, (3, 8, 8), "F.relu(self.conv(x)) + x, then x + self.proj(x)"),
    Case("difference_residual", DifferenceResidual, (3, 2, 2), "f(x) - x, f two Linear layers and F.relu"),
    Case("top_level_residual", TopLevelResidual, (2, 5, 5),
         "torch.relu(self.conv(x)) + x at the top level, on the forward's input"),
    Case("nested_residuals", NestedResiduals, (2, 6, 6),
         "a residual module whose branch holds a residual module; x + b(relu(a(x) + x)) inline"),
    Case("small_resnet", SmallResNet, (3, 8, 8),
         "torchvision-style ResNet: BasicBlocks with out += identity, with and without downsample"),
    Case("lstm_mean_classifier", LSTMClassifier, (6, 3), "self.fc(out.mean(dim=1)) over a batch-first LSTM"),
    Case("rnn_last_batch_first", recurrent("RNN", "last", batch_first=True), (5, 3),
         "nn.RNN batch_first, out[:, -1]"),
    Case("gru_last_slice", recurrent("GRU", "last3", batch_first=True, num_layers=2), (5, 3),
         "stacked nn.GRU batch_first, out[:, -1, :]"),
    Case("lstm_last_time_major", recurrent("LSTM", "last"), (5, 3),
         "nn.LSTM time-major (T, B, F), out[-1]"),
    Case("gru_h_n_last", recurrent("GRU", "h_n", batch_first=True, num_layers=2), (5, 3),
         "stacked unidirectional nn.GRU, h_n[-1]"),
    Case("lstm_h_n_squeeze", LSTMLastState, (5, 3),
         "one-layer nn.LSTM, h_n.squeeze(0)"),
    Case("rnn_h_n_squeeze_time_major", recurrent("RNN", "squeeze", nonlinearity="relu"), (5, 3),
         "one-layer nn.RNN (relu) time-major, h_n.squeeze(0)"),
    Case("rnn_mean_time_major", recurrent("RNN", "mean"), (5, 3), "nn.RNN time-major, out.mean(0)"),
    Case("gru_last_dropout", recurrent("GRU", "last", dropout=True, batch_first=True), (5, 3),
         "nn.GRU batch_first, out[:, -1], nn.Dropout (eval), Linear"),
    Case("bidirectional_gru_last", recurrent("GRU", "last", batch_first=True, bidirectional=True), (5, 3),
         "bidirectional nn.GRU batch_first, out[:, -1] (both directions)"),
    Case("concat_branches", Concat, (2, 4, 4), "torch.cat([self.a(x), self.b(x)], 1): a concat block"),
    Case("branch_product", BranchProduct, (3, 2, 2),
         "self.a(x) * self.b(x) of flat features: a product block"),
    Case("squeezenet_fire", SqueezeNetLike, (3, 8, 8),
         "SqueezeNet's fire modules: a squeeze conv, torch.cat of two expand branches, in-place ReLUs"),
    Case("inception_module", InceptionLike, (3, 5, 5),
         "GoogLeNet-style torch.cat(outputs, 1) of three conv branches (F.max_pool2d in one) and the input"),
    Case("densenet_block", DenseNetLike, (2, 4, 4),
         "torchvision's dense block: torch.cat(features, 1) of a growing list, read as cat([x, f(x)])"),
    Case("se_resnet_block", SEResNetLike, (3, 5, 5),
         "squeeze-and-excitation (scale * x, a (B, C, 1, 1) gate) in a BasicBlock, a (B, C, H, 1) gate"),
    Case("nested_joins", NestedJoins, (2, 3, 3),
         "a concatenation in a sum in a concatenation; torch.cat([x, x], 1); a product of two cats"),
    Case("shufflenet_units", ShuffleNetLike, (3, 6, 6),
         "ShuffleNetV2 units: x.chunk(2, dim=1), torch.cat, view-transpose-view shuffles, nn.ChannelShuffle"),
    Case("layer_norm", WithLayerNorm, (3, 2, 2), "nn.LayerNorm over the features of a flat batch"),
    Case("new_activations", NewActivations, (3, 2, 2),
         "nn.Hardswish, nn.Hardsigmoid(inplace=True), nn.Mish, F.hardswish, F.hardsigmoid, F.mish"),
    Case("mobilenet_v3_block", MobileNetV3Block, (3, 6, 6),
         "MobileNetV3's inverted residual: Hardswish, a squeeze-and-excitation gate with Hardsigmoid"),
    Case("efficientnet_mbconv", EfficientNetLike, (3, 6, 6),
         "EfficientNet's MBConv: SiLU, squeeze-and-excitation, torchvision.ops.StochasticDepth, += input"),
    Case("convnext_blocks", ConvNeXtLike, (3, 8, 8),
         "torchvision's CNBlock (permute, LayerNorm, Linear, GELU, Linear, permute, layer_scale * y, "
         "StochasticDepth) and LayerNorm2d", renamed=(("stage1.0.layer_scale", "stage1.0.layer_scale.gamma"),
                                                      ("stage1.1.layer_scale", "stage1.1.layer_scale.gamma"),
                                                      ("stage2.layer_scale", "stage2.layer_scale.gamma"))),
    Case("timm_convnext_blocks", TimmConvNeXtLike, (3, 8, 8),
         "timm's ConvNeXt blocks: channels-last LayerScale (in place) and Mlp between permutes, LayerNorm2d "
         "(F.layer_norm), LayerScale2d, DropPath"),
    Case("fused_norm_act", FusedNormAct, (3, 4, 4),
         "F.batch_norm, F.conv2d, F.layer_norm and F.linear given their modules' own tensors"),
    Case("unet_upsample", UNetLike, (2, 8, 8),
         "a U-Net's upsampled paths concatenated with their skips: nn.Upsample, F.interpolate, "
         "UpsamplingNearest2d, UpsamplingBilinear2d"),
    # refused --------------------------------------------------------------------------------------
    Case("weight_tying", WeightTying, (3, 2, 2),
         "one nn.Linear with parameters applied twice: a spec cannot share a layer's weights",
         node=r"shared(_1)?", keyword=CALLED_TWICE),
    Case("embedding_ids", EmbeddingBag, (6,), "nn.Embedding takes integer ids: no spec layer, no gradient",
         node="embed", keyword="Embedding", vocabulary=10),
    Case("multihead_attention", Attention, (5, 4), "nn.MultiheadAttention has no spec layer",
         node="attn", keyword="MultiheadAttention"),
    Case("hand_attention", HandAttention, (5, 4),
         "attention by torch.matmul/bmm: products of activations (and a Linear on a 3-D input, a "
         "transpose, one input used by three branches)",
         node=r"query|key|value|transpose|matmul|bmm|x"),
    Case("conv1d", WithConv1d, (2, 8), "nn.Conv1d has no spec layer", node="conv", keyword="Conv1d"),
    Case("data_dependent_control_flow", DataDependent, (3, 2, 2),
         "`if x.sum() > 0:` branches on the input's values: torch.fx cannot trace it",
         keyword="control flow"),
    Case("batchnorm_training", TrainingBatchNorm, (3, 8, 8),
         "BatchNorm2d in training mode couples the samples of a batch", node="bn", keyword="training",
         training=True),
    Case("parameter_scale", ParameterScale, (3, 2, 2),
         "x * self.scale with scale an nn.Parameter: a parameter outside any supported layer",
         node=r"mul|scale"),
    Case("permute", Permute, (3, 8, 8), "x.permute(0, 2, 3, 1) reorders axes", node="permute"),
    Case("transpose", Transpose, (3, 8, 8), "x.transpose(2, 3) reorders axes", node="transpose"),
    Case("split_view", SplitView, (3, 5, 5),
         "x.view(x.size(0), 2, -1) is a reshape that is no flattening of trailing axes", node="view"),
    Case("flatten_batch_axis", FlattenBatch, (3, 5, 5), "torch.flatten(x) flattens the batch axis too",
         node="flatten"),
    Case("bidirectional_lstm_h_n", BidirectionalLSTM, (5, 3),
         "h_n[-1] of a bidirectional LSTM is the reverse direction's final state alone",
         node=r"getitem(_\d+)?", keyword="bidirectional|reverse"),
    Case("recurrent_relu_head", recurrent("GRU", "relu", batch_first=True), (5, 3),
         "a ReLU between the recurrent head selection and the Linear", node="relu"),
    Case("recurrent_returns_sequence", recurrent("LSTM", "sequence", batch_first=True), (5, 3),
         "forward returns the whole sequence out, no Linear head", node=r"output|getitem(_\d+)?|encoder"),
    Case("tuple_output", TupleOutput, (3, 2, 2), "forward returns a tuple (logits, features)",
         node="output"),
    Case("two_inputs", TwoInputs, (3, 2, 2), "forward takes two inputs", node="y", keyword="input",
         inputs=2),
    Case("no_grad_region", NoGradRegion, (3, 2, 2), "a layer under torch.no_grad() passes no gradient",
         node="flatten", keyword="no_grad"),
    Case("detached", Detached, (3, 2, 2), ".detach() passes no gradient", node="detach"),
    Case("aliased_in_place", AliasedInPlace, (3, 2, 2),
         "z = y; z += 1 changes y in place, unseen by torch.fx: the float64 check sees it",
         keyword="differ from its traced graph"),
    Case("stateful_forward", Stateful, (3, 2, 2), "a forward that changes with each call",
         keyword="differ from its traced graph"),
    Case("dot_product_attention", DotProductAttention, (5, 4), "F.scaled_dot_product_attention",
         node="scaled_dot_product_attention", keyword="attention"),
    Case("einsum_attention", EinsumAttention, (5, 4), "torch.einsum of queries and keys",
         node="einsum", keyword="attention"),
    Case("indexed_write", IndexedWrite, (3, 2, 2), "y[:, 0] = 0 writes into an activation in place",
         keyword="item assignment"),
    Case("in_place_method", InPlaceClamp, (3, 2, 2),
         "y.clamp_(min=0) writes into an activation in place, its result unused", node="clamp_",
         keyword="in place"),
    Case("token_layer_scale", TokenLayerScale, (5, 4),
         "a channels-last layer scale of (B, N, C) tokens: no layer scales the last axis", node="mul",
         keyword="scale per channel"),
    Case("scaled_weight", lambda: ScaledWeight(3, 2), (3, 2, 2), "F.conv2d given self.weight * 2.0",
         node="weight", keyword="in an expression"),
    Case("renamed_linear", RenamedLinear, (3, 2, 2),
         "F.linear given parameters named w and b: the spec's weights would not keep their names",
         node="linear", keyword="state_dict names"),
    Case("upsample_bicubic", Bicubic, (3, 2, 2), "nn.Upsample(mode='bicubic')", node="up",
         keyword="bicubic"),
    Case("interpolate_antialias", Antialiased, (3, 2, 2), "F.interpolate(..., antialias=True)",
         node="interpolate", keyword="antialias"),
    Case("fused_norm_training", TrainingFusedNorm, (3, 2, 2),
         "F.batch_norm in training mode (a fused norm module's batch statistics)", node="batch_norm",
         keyword="training", training=True),
]
"""Every model, accepted first."""
