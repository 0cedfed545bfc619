"""VGG-11's convolutional stack on 3x32x32 (the paper's micro-benchmark model), from the bundled specs."""

from __future__ import annotations

import pathlib

import numpy as np

from sparse_scan import Sequential, load_model

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def vgg11_features(pruned: bool = False, dtype=np.float32) -> Sequential:
    """``data/vgg11.yaml``, or ``data/vgg11-pruned.yaml`` (97% of every conv's weights
    magnitude-pruned and dropped from the Jacobians' patterns, the paper's §4.3): 21 layers, seeded
    PyTorch-style initialisation."""
    return load_model(DATA / ("vgg11-pruned.yaml" if pruned else "vgg11.yaml"), dtype=dtype)
