"""Layers with analytic sparse transposed Jacobians; PyTorch's arguments, defaults and shapes.

Every layer offers ``forward(x)`` (batched, NCHW), ``pattern(in_shape)`` (the CSR structure of its
transposed Jacobian, cached per shape) and ``transposed_jacobian(x)`` (a :class:`~sparse_scan.csr.
BatchedCSR`: the cached pattern plus this batch's values).
"""

from ._activation import (
    ELU,
    GELU,
    Affine,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    LeakyReLU,
    Mish,
    ReLU,
    Sigmoid,
    SiLU,
    Softplus,
    Tanh,
)
from ._adaptive_pool import AdaptiveAvgPool2d
from ._base import Layer
from ._block import Block
from ._channels import ChannelShuffle, Narrow
from ._conv import Conv2d
from ._dropout import Dropout
from ._flatten import Flatten
from ._layer_norm import LayerNorm
from ._layer_scale import LayerScale
from ._linear import Linear
from ._normalization import BatchNorm2d
from ._pooling import AvgPool2d, MaxPool2d
from ._residual import Residual
from ._softmax import LogSoftmax, Softmax
from ._stochastic_depth import DropPath, StochasticDepth
from ._upsample import Upsample

__all__ = [
    "AdaptiveAvgPool2d",
    "Affine",
    "AvgPool2d",
    "BatchNorm2d",
    "Block",
    "ChannelShuffle",
    "Conv2d",
    "DropPath",
    "Dropout",
    "ELU",
    "Flatten",
    "GELU",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "Identity",
    "Layer",
    "LayerNorm",
    "LayerScale",
    "LeakyReLU",
    "Linear",
    "LogSoftmax",
    "MaxPool2d",
    "Narrow",
    "Mish",
    "ReLU",
    "Residual",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "StochasticDepth",
    "Tanh",
    "Upsample",
]
