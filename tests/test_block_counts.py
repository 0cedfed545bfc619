"""A block's planning figures (issues 38 and 46), counted from its layers' structure without planning a
product or forming the union (``sparse_scan/layers/_block_counts.py``), equal the built plan's: the
union's entries and the fill FLOPs. On the bundled ResNet-20 specs, and on random blocks of every join
(sums of two and three branches, concatenations with the identity among them, products broadcast over
the pixels, the channels or nothing), nested in each other (a squeeze-and-excitation block in a
residual one, a concatenation in a concatenation), over images and flat features, of every layer a
block holds: convolutions (strided, dilated, grouped, rectangular, pruned), diagonals, max and average
pooling (padded, strided, ceil mode), adaptive pooling to 1x1 and to coarse windows, upsampling
(nearest and bilinear), layer norms over the channels and over the last axes, a selection of channels
and a channel shuffle, flattening, linear layers (pruned) and softmax."""

from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest

from sparse_scan import load_model
from sparse_scan.layers import (
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm2d,
    Block,
    ChannelShuffle,
    Conv2d,
    Dropout,
    Flatten,
    LayerNorm,
    LayerScale,
    Linear,
    MaxPool2d,
    Narrow,
    ReLU,
    Residual,
    Sigmoid,
    Softmax,
    Tanh,
    Upsample,
    _block_counts,
)
from sparse_scan.layers._joins import fill_flops

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def blocks_within(block: Block, shape: tuple[int, ...]) -> list[tuple[Block, tuple[int, ...]]]:
    """``block`` and every block nested in its branches, each with its input shape."""
    found = [(block, shape)]
    for chain, shapes in zip(block.branches, block._layout(shape).branches, strict=True):
        for layer, layer_shape in zip(chain, shapes, strict=False):
            if isinstance(layer, Block):
                found += blocks_within(layer, layer_shape)
    return found


def planned_figures(block: Block, shape: tuple[int, ...]) -> tuple[int, int]:
    """The block's entries and fill FLOPs read from its built symbolic plan: the union's entries; the
    join's FLOPs over the terms' planned entries, the chains' planned product steps and the layers' own
    fills (a nested block's)."""
    symbolic = block._plan(shape)
    flops = fill_flops(block.join, [int(position.shape[0]) for position in symbolic.positions])
    for chain, layers, shapes in zip(symbolic.chains, block.branches, block._layout(shape).branches,
                                     strict=True):
        if chain is not None:
            flops += sum(step.flops for step in chain.steps) + sum(
                layer.jacobian_fill_flops(s) for layer, s in zip(layers, shapes[:-1], strict=True))
    return int(symbolic.union.nnz), flops


def assert_counted_exactly(block: Block, shape: tuple[int, ...]) -> None:
    """Every block within ``block`` counts its figures with no product planned and no union formed, and
    they equal its built plan's."""
    within = blocks_within(block, shape)
    counted = [(inner.pattern_nnz(s), inner.jacobian_fill_flops(s)) for inner, s in within]
    for inner, _ in within:
        assert inner.plan_builds == 0 and not inner._symbolic, f"{inner.label}: the counts planned it"
    for (inner, s), figures in zip(within, counted, strict=True):
        assert figures == planned_figures(inner, s), inner.label
        assert inner.pattern(s).nnz == figures[0]
        assert (inner.pattern_nnz(s), inner.jacobian_fill_flops(s)) == figures  # after the plan


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


def random_conv(rng: np.random.Generator, cin: int, cout: int, kernel, pruned: bool, dtype=np.float64,
                **geometry) -> Conv2d:
    """A convolution with random weights, a random ~60 % of them zero (pruned where ``pruned``, else
    kept in the pattern)."""
    conv = Conv2d(cin, cout, kernel, bias=False, dtype=dtype, rng=int(rng.integers(2**31)),
                  prune_pattern=pruned, **geometry)
    conv.weight = conv.weight * (rng.random(conv.weight.shape) > 0.6)
    return conv


def random_residual(seed: int, pruned: bool, stride: int, downsample: bool, dtype) -> tuple[Residual, tuple]:
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
def test_random_residual_blocks_are_counted_exactly(seed, pruned, stride, downsample, dtype):
    assert_counted_exactly(*random_residual(seed, pruned, stride, downsample, dtype))


@pytest.mark.parametrize("seed", range(4))
def test_other_chains_of_convolutions_and_diagonals_are_counted_exactly(seed):
    rng = np.random.default_rng(100 + seed)
    block = Residual(ReLU(), random_conv(rng, 4, 6, 3, True, padding=2, dilation=2),
                     Dropout(0.5), random_conv(rng, 6, 6, (3, 1), seed % 2 == 0, padding=(1, 0), groups=2),
                     ReLU(), random_conv(rng, 6, 4, 3, True, padding=1, groups=2),
                     shortcut=[ReLU(), random_conv(rng, 4, 4, 1, True)])
    assert_counted_exactly(block, (4, 7, 6))


# --- random blocks of every join, nested ---------------------------------------------------------------
class Draw:
    """Random layers over ``(C, H, W)`` images that keep ``H × W`` (after an optional strided first
    layer), and over flat features, for random blocks."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def integer(self, low: int, high: int) -> int:
        return int(self.rng.integers(low, high + 1))

    def conv(self, cin: int, cout: int, **geometry) -> Conv2d:
        """A random convolution keeping the size: odd or rectangular kernels, dilated, grouped, pruned."""
        kernel = [(1, 1), (3, 3), (1, 3), (3, 1), (5, 5)][self.integer(0, 4)]
        dilation = self.integer(1, 2) if max(kernel) == 3 else 1
        groups = max(g for g in (1, 2, 3)
                     if cin % g == 0 and cout % g == 0 and (g == 1 or self.integer(0, 1)))
        padding = geometry.pop("padding", tuple(dilation * (k - 1) // 2 for k in kernel))
        return random_conv(self.rng, cin, cout, kernel, bool(self.integer(0, 1)), padding=padding,
                           dilation=dilation, groups=groups, **geometry)

    def strided(self, channels: int) -> tuple[list, int]:
        """A first layer halving the size, three ways alike: ``floor((n + 2 - 3) / 2) + 1``."""
        kind = self.integer(0, 2)
        if kind == 0:
            cout = self.integer(1, 5)
            pruned = bool(self.integer(0, 1))
            return [random_conv(self.rng, channels, cout, 3, pruned, stride=2, padding=1)], cout
        include = bool(self.integer(0, 1))
        pool = MaxPool2d(3, 2, 1) if kind == 1 else AvgPool2d(3, 2, 1, count_include_pad=include)
        return [pool], channels

    def layer(self, channels: int, size: tuple[int, int], nest: int) -> tuple[list, int]:
        """One to three layers over ``(channels, *size)`` keeping the size, and their output channels."""
        height, width = size
        kind = self.integer(0, 12 if nest else 11)
        if kind == 0:
            cout = self.integer(1, 5)
            return [self.conv(channels, cout)], cout
        if kind == 1:
            return [[ReLU(), Sigmoid(), Tanh(), BatchNorm2d(channels, training=False), Dropout(0.3),
                     LayerScale(channels)][self.integer(0, 5)]], channels
        if kind == 2:
            pools = [MaxPool2d(3, 1, 1), MaxPool2d(5, 1, 2), MaxPool2d(2, 1, 1, dilation=2)]
            return [pools[self.integer(0, 2)]], channels
        if kind == 3:
            return [AvgPool2d(3, 1, 1, count_include_pad=bool(self.integer(0, 1)))], channels
        if kind == 4:  # coarse windows, then back up: pixels of one window alike
            coarse = (max(1, height // 2), self.integer(1, width))
            mode = ["nearest", "bilinear"][self.integer(0, 1)]
            return [AdaptiveAvgPool2d(coarse), Upsample(size=size, mode=mode)], channels
        if kind == 5:  # up and down again, with a ceil-mode pool over odd sizes
            mode = ["nearest", "bilinear", "nearest-exact"][self.integer(0, 2)]
            up = Upsample(scale_factor=2, mode=mode, align_corners=True if mode == "bilinear" and
                          self.integer(0, 1) else None)
            return [up, MaxPool2d(2) if self.integer(0, 1) else AvgPool2d(2)], channels
        if kind == 6:
            return [LayerNorm(channels, data_format="channels_first")], channels
        if kind == 7:
            return [LayerNorm((width,)) if self.integer(0, 1) else LayerNorm((height, width))], channels
        if kind == 8 and channels > 1:
            length = self.integer(1, channels - 1)
            return [Narrow(self.integer(0, channels - length), length)], length
        if kind == 9 and channels % 2 == 0:
            return [ChannelShuffle(2)], channels
        if kind == 10:
            return [MaxPool2d(3, 1, 1, dilation=1, ceil_mode=True), ReLU()], channels
        if kind == 11:
            pruned = bool(self.integer(0, 1))
            return [AdaptiveAvgPool2d(1), random_conv(self.rng, channels, channels, 1, pruned),
                    Upsample(size=size)], channels
        if kind == 12:
            block, cout = self.block(channels, size, nest - 1)
            return [block], cout
        return [ReLU()], channels

    def chain(self, channels: int, size: tuple[int, int], nest: int, out: int | None) -> tuple[list, int]:
        """Zero to three draws, then a convolution to ``out`` channels where they differ."""
        layers = []
        for _ in range(self.integer(0, 3)):
            more, channels = self.layer(channels, size, nest)
            layers += more
        if out is not None and channels != out:
            layers.append(self.conv(channels, out))
            channels = out
        return layers, channels

    def gate(self, channels: int, size: tuple[int, int]) -> list:
        """A squeeze-and-excitation gate ``(C, 1, 1)``, a row gate ``(C, 1, W)``, a pixel gate ``(1, H,
        W)`` or a full one."""
        kind = self.integer(0, 4)
        if kind < 2:
            hidden = self.integer(1, 3)
            return [AdaptiveAvgPool2d(1), random_conv(self.rng, channels, hidden, 1, False), ReLU(),
                    random_conv(self.rng, hidden, channels, 1, bool(self.integer(0, 1))), Sigmoid()]
        if kind == 2:
            return [AdaptiveAvgPool2d((1, None)), random_conv(self.rng, channels, channels, (1, 3), True,
                                                              padding=(0, 1)), Sigmoid()]
        if kind == 3:
            return self.chain(channels, size, 0, 1)[0] + [Sigmoid()]
        return self.chain(channels, size, 0, channels)[0]

    def block(self, channels: int, size: tuple[int, int], nest: int,
              stride: bool = False) -> tuple[Block, int]:
        """A random block over ``(channels, *size)`` (halving the size first in every branch where
        ``stride``) and its output channels."""
        join = ["sum", "concat", "product"][self.integer(0, 2)]
        first = [self.strided(channels) for _ in range(3)] if stride else [([], channels)] * 3
        in_shape = (channels,) + tuple(size)
        if stride:
            size = tuple((n - 1) // 2 + 1 for n in size)
        out = self.integer(1, 5)
        branches = []
        if join == "product":
            head, c = first[0]
            body, c = self.chain(c, size, nest, out)
            gate_head, gc = first[1]
            gate_head = gate_head + ([self.conv(gc, out)] if gc != out else [])
            branches = [head + body, gate_head + self.gate(out, size)]
        else:
            for index in range(self.integer(2, 3)):
                head, c = first[index]
                identity = not stride and index == 0 and (join == "concat" or c == out) and self.integer(0, 1)
                body, c = ([], c) if identity else self.chain(c, size, nest, out if join == "sum" else None)
                branches.append(head + body)
        block = Block(*branches, join=join)
        return block, block.output_shape(in_shape)[0]

    def flat_block(self) -> tuple[Block, tuple[int, ...]]:
        """A block over flat features or one that flattens an image: linear layers (pruned), softmax,
        layer norms, a product with a ``(1,)`` gate."""
        join = ["sum", "concat", "product"][self.integer(0, 2)]
        if self.integer(0, 1):  # an image flattened in every branch
            shape = (self.integer(1, 3), self.integer(2, 4), self.integer(2, 4))
            size = int(np.prod(shape))
            starts = [[Flatten()], [self.conv(shape[0], 2), ReLU(), Flatten()],
                      [AdaptiveAvgPool2d(1), Flatten()]]
            widths = [size, 2 * size // shape[0], shape[0]]
        else:
            shape = (self.integer(2, 9),)
            starts, widths = [[], [Tanh()], [LayerNorm(shape)]], [shape[0]] * 3
        out = self.integer(1, 6)
        branches = []
        for index in range(2 if join == "product" else self.integer(2, 3)):
            pick = self.integer(0, 2)
            layers, width = list(starts[pick]), widths[pick]
            if self.integer(0, 1):
                layers += [Linear(width, 4, rng=self.integer(0, 99), prune_pattern=bool(self.integer(0, 1))),
                           [ReLU(), Softmax()][self.integer(0, 1)]]
                width = 4
            target = 1 if join == "product" and index == 1 and self.integer(0, 1) else out
            if join != "concat" and width != target:
                pruned = bool(self.integer(0, 1))
                linear = Linear(width, target, rng=self.integer(0, 99), prune_pattern=pruned)
                linear.weight = linear.weight * (self.rng.random(linear.weight.shape) > 0.3)
                layers.append(linear)
            branches.append(layers)
        return Block(*branches, join=join), shape


@pytest.mark.parametrize("seed", range(40))
def test_random_blocks_of_every_join_nested_are_counted_exactly(seed):
    draw = Draw(seed)
    channels, size = draw.integer(1, 4), (draw.integer(2, 6), draw.integer(2, 6))
    block, _ = draw.block(channels, size, nest=2, stride=seed % 4 == 3)
    assert_counted_exactly(block, (channels,) + size)


@pytest.mark.parametrize("seed", range(12))
def test_random_blocks_of_flat_features_are_counted_exactly(seed):
    assert_counted_exactly(*Draw(1000 + seed).flat_block())


def squeeze_excitation(channels: int, hidden: int, seed: int) -> Block:
    gate = [AdaptiveAvgPool2d(1), Conv2d(channels, hidden, 1, rng=seed), ReLU(),
            Conv2d(hidden, channels, 1, rng=seed + 1), Sigmoid()]
    return Block([], gate, join="product", names=[None, None])


def test_a_squeeze_and_excitation_residual_block_is_counted_exactly():
    """RegNet-Y's: a grouped convolution, the gate, a projection; the shortcut strided."""
    block = Residual(Conv2d(4, 6, 1, rng=0), BatchNorm2d(6, training=False), ReLU(),
                     Conv2d(6, 6, 3, stride=2, padding=1, groups=3, rng=1), ReLU(),
                     squeeze_excitation(6, 2, 2), Conv2d(6, 6, 1, rng=4),
                     shortcut=[Conv2d(4, 6, 1, stride=2, rng=5)])
    assert_counted_exactly(block, (4, 7, 7))


def test_dense_joins_stay_a_few_pairs_of_classes_at_any_resolution():
    """A squeeze-and-excitation block's JT is dense, so is a residual block's holding one: a pair of
    classes each (and the dense formula), counted in well under a second where the JT holds 1.0e10
    entries and its fill 9e11 FLOPs, which no plan could enumerate."""
    channels, side = 8, 112
    size = channels * side * side
    se = squeeze_excitation(channels, 2, 0)
    block = Residual(Conv2d(channels, channels, 3, padding=1, groups=2, rng=3), ReLU(), se,
                     Conv2d(channels, channels, 1, rng=4))
    started = time.perf_counter()
    assert se.pattern_nnz((channels, side, side)) == size**2
    assert block.pattern_nnz((channels, side, side)) == size**2
    assert block.jacobian_fill_flops((channels, side, side)) > 5 * 10**11
    assert time.perf_counter() - started < 10  # a loose bound for a shared machine: ~0.2 s
    for counted in (se, block):
        structure = counted.jt_structure((channels, side, side))
        assert len(structure.rows) == 1 and structure.classes == (1, 1)
    assert se.plan_builds == block.plan_builds == 0


def test_a_hash_collision_regroups_with_new_salts(monkeypatch):
    """The sets of members are grouped by salted hashes and checked member by member: hashes that
    collide (all zero, the first time) are caught, and the grouping is redone."""
    calls = []
    real = _block_counts._set_hash

    def colliding(member, starts, salt):
        calls.append(salt)
        return np.zeros(len(starts) - 1, dtype=np.uint64) if len(calls) <= 2 else real(member, starts, salt)

    monkeypatch.setattr(_block_counts, "_set_hash", colliding)
    owner = np.array([0, 0, 1, 1, 2, 2])
    group, first = _block_counts._equal_sets(owner, np.array([1, 2, 1, 3, 1, 2]), 3)
    assert group[0] == group[2] != group[1] and len(first) == 2 and len(calls) == 4
    assert len({int(salt) for salt in calls}) == 4


def test_max_pools_and_flat_blocks_are_counted_without_a_plan():
    block = Residual(Conv2d(2, 2, 3, padding=1, rng=0), MaxPool2d(3, stride=1, padding=1))
    assert_counted_exactly(block, (2, 5, 5))
    diagonals = Residual(ReLU(), BatchNorm2d(2, training=False))
    assert diagonals.pattern_nnz((2, 3, 3)) == 18 and diagonals.plan_builds == 0
