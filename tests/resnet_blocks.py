"""torchvision's ResNet ``BasicBlock`` in plain PyTorch (torchvision is not a dependency): the one
reference the tests (``test_export.py``, ``test_resnet_spec.py``) and ``bench/resnet20.py`` build their
residual networks from.

Imports torch: a test imports it after ``pytest.importorskip("torch")``; ``bench/resnet20.py`` puts
this folder on its path (the tests' folder is no package).
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """``torchvision.models.resnet.BasicBlock`` (expansion 1, one group, no dilation): ``relu(bn2(conv2(
    relu(bn1(conv1(x))))) + downsample(x))``, ``downsample`` a strided 1x1 conv and a batch norm where
    the shape changes, else the identity.

    Its submodules and so its ``state_dict`` keys are torchvision's (``conv1``, ``bn1``, ``relu``,
    ``conv2``, ``bn2``, ``downsample.0``, ``downsample.1``), and ``torch.fx`` traces ``forward`` to
    torchvision's graph (the sum an in-place ``out += identity``, one ReLU module called twice).

    Parameters
    ----------
    inplanes : int
        Input channels.
    planes : int
        Output channels (of both 3x3 convolutions).
    stride : int, default 1
        Of the first 3x3 convolution and of ``downsample``.
    inplace : bool, default False
        The ReLU's: torchvision's block has ``True``. False keeps the sum before the final ReLU a tensor
        of its own (forward hooks on ``relu`` see it, autograd can differentiate with respect to it).
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1, inplace: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """The block before its final ReLU (a spec's ``residual`` layer): torchvision's forward up to
        ``out += identity``.

        Parameters
        ----------
        x : torch.Tensor, shape (N, inplanes, H, W)

        Returns
        -------
        torch.Tensor, shape (N, planes, H', W')
            ``H' = (H - 1) // stride + 1``, likewise ``W'``.
        """
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """torchvision's forward: :meth:`residual`, then the ReLU (its shapes)."""
        return self.relu(self.residual(x))
