"""Layers with analytic sparse transposed Jacobians; PyTorch's arguments, defaults and shapes.

Every layer offers ``forward(x)`` (batched, NCHW), ``pattern(in_shape)`` (the CSR structure of its
transposed Jacobian, cached per shape) and ``transposed_jacobian(x)`` (a :class:`~sparse_scan.csr.
BatchedCSR`: the cached pattern plus this batch's values).
"""

from ._base import Layer
from .activation import ELU, GELU, Hardtanh, Identity, LeakyReLU, ReLU, Sigmoid, SiLU, Softplus, Tanh
from .conv import Conv2d
from .flatten import Flatten
from .linear import Linear
from .pooling import AvgPool2d, MaxPool2d

__all__ = [
    "AvgPool2d",
    "Conv2d",
    "ELU",
    "Flatten",
    "GELU",
    "Hardtanh",
    "Identity",
    "Layer",
    "LeakyReLU",
    "Linear",
    "MaxPool2d",
    "ReLU",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "Tanh",
]
