"""A residual block's planning figures counted without its symbolic product (issue 38) equal the
figures of the built plan: the union's entries and the fill FLOPs, on the bundled ResNet-20 specs
and on random small blocks."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from sparse_scan import load_model
from sparse_scan.layers import BatchNorm2d, Conv2d, Dropout, MaxPool2d, ReLU, Residual
from sparse_scan.layers._residual_counts import block_counts

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def planned_figures(block: Residual, shape: tuple[int, ...]) -> tuple[int, int]:
    """The block's entries and fill FLOPs read from its built symbolic plan, as the block counted them
    before issue 38: the union's entries; one add per shortcut entry, the chains' product steps and
    the layers' own fills."""
    symbolic = block._plan(shape)
    flops = int(symbolic.positions[1].shape[0])
    for chain, layers, shapes in zip(symbolic.chains, block.branches, block._layout(shape).branches,
                                     strict=True):
        if chain is not None:
            flops += sum(step.flops for step in chain.steps) + sum(
                layer.jacobian_fill_flops(s) for layer, s in zip(layers, shapes[:-1], strict=True))
    return int(symbolic.union.nnz), flops


def assert_counted_exactly(block: Residual, shape: tuple[int, ...]) -> None:
    """The block's counts come without a plan and equal the plan's figures."""
    counted = (block.pattern_nnz(shape), block.jacobian_fill_flops(shape))
    assert block.plan_builds == 0, "the counts planned the block"
    assert counted == planned_figures(block, shape)
    assert (block.pattern_nnz(shape), block.jacobian_fill_flops(shape)) == counted  # from the plan now


@pytest.mark.parametrize("spec", ["resnet20.yaml", "resnet20-pruned.yaml"])
def test_every_block_of_the_bundled_resnets_is_counted_exactly(spec):
    model = load_model(DATA / spec)
    shape, blocks = tuple(model.input_shape), 0
    for layer in model.layers:
        if isinstance(layer, Residual):
            assert_counted_exactly(layer, shape)
            blocks += 1
        shape = tuple(layer.output_shape(shape))
    assert blocks == 9


def random_conv(rng: np.random.Generator, cin: int, cout: int, kernel: int, pruned: bool, dtype,
                **geometry) -> Conv2d:
    """A convolution with random weights, a random ~60 % of them pruned (kept in the pattern as zeros
    where not ``pruned``)."""
    conv = Conv2d(cin, cout, kernel, bias=False, dtype=dtype, rng=int(rng.integers(2**31)),
                  prune_pattern=pruned, **geometry)
    conv.weight = conv.weight * (rng.random(conv.weight.shape) > 0.6)
    return conv


def random_block(seed: int, pruned: bool, stride: int, downsample: bool, dtype) -> tuple[Residual, tuple]:
    """A BasicBlock-like block of random odd sizes: conv, batch norm, ReLU, conv, batch norm, and the
    identity or a strided 1x1 convolution and a batch norm."""
    rng = np.random.default_rng(seed)
    cin, height, width = int(rng.integers(1, 6)), int(rng.integers(3, 10)), int(rng.integers(3, 10))
    cout = int(rng.integers(1, 6)) if downsample else cin
    stride = stride if downsample else 1
    inner = [random_conv(rng, cin, cout, 3, pruned, dtype, stride=stride, padding=1),
             BatchNorm2d(cout, training=False, dtype=dtype), ReLU(),
             random_conv(rng, cout, cout, int(rng.choice([1, 3, 5])), pruned, dtype, padding="same"),
             BatchNorm2d(cout, training=False, dtype=dtype)]
    shortcut = ([random_conv(rng, cin, cout, 1, pruned, dtype, stride=stride),
                 BatchNorm2d(cout, training=False, dtype=dtype)] if downsample else None)
    return Residual(*inner, shortcut=shortcut), (cin, height, width)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("downsample", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_random_blocks_are_counted_exactly(seed, pruned, stride, downsample, dtype):
    assert_counted_exactly(*random_block(seed, pruned, stride, downsample, dtype))


@pytest.mark.parametrize("seed", range(4))
def test_other_chains_of_convolutions_and_diagonals_are_counted_exactly(seed):
    rng = np.random.default_rng(100 + seed)
    dtype = np.float64
    block = Residual(ReLU(), random_conv(rng, 4, 6, 3, True, dtype, padding=2, dilation=2),
                     Dropout(0.5), random_conv(rng, 6, 6, (3, 1), seed % 2 == 0, dtype, padding=(1, 0),
                                               groups=2),
                     ReLU(), random_conv(rng, 6, 4, 3, True, dtype, padding=1, groups=2),
                     shortcut=[ReLU(), random_conv(rng, 4, 4, 1, True, dtype)])
    assert_counted_exactly(block, (4, 7, 6))


def test_blocks_the_counts_do_not_know_are_planned():
    block = Residual(Conv2d(2, 2, 3, padding=1, rng=0), MaxPool2d(3, stride=1, padding=1))
    assert block_counts("sum", block.branches, block._layout((2, 5, 5)).branches) is None
    assert block.pattern_nnz((2, 5, 5)) == planned_figures(block, (2, 5, 5))[0]
    assert block.jacobian_fill_flops((2, 5, 5)) == planned_figures(block, (2, 5, 5))[1]
    assert block.plan_builds == 1
    diagonals = Residual(ReLU(), BatchNorm2d(2, training=False))
    assert diagonals.pattern_nnz((2, 3, 3)) == 18 and diagonals.plan_builds == 1
