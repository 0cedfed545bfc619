"""Live FLOPs (``sparse_scan.flops.live``, issue 21) against brute force on random small chains.

The brute force multiplies each sample's JTs as SciPy matrices with their explicit zeros eliminated,
eliminates the zeros of every product again (as the paper's artifact does) and counts each product's
multiply-adds on those operands. For ``ours`` it walks the plan's steps; for ``paper`` it runs the
artifact's own hybrid Blelloch scan (its up-sweep, its linear middle over the segment roots and its
down-sweep, written here from its description) and counts as its analysis does: 2 FLOPs for every
pair of operand entries meeting in a non-zero entry of the product.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from sparse_scan import Sequential
from sparse_scan.engine.plan import ScanMemoryError
from sparse_scan.engine.schedule import Element, depth
from sparse_scan.flops import CONVENTIONS, analyse, live
from sparse_scan.layers import (
    AdaptiveAvgPool2d,
    Block,
    Conv2d,
    Flatten,
    LeakyReLU,
    Linear,
    MaxPool2d,
    ReLU,
    Sigmoid,
    Tanh,
)


def chain(kind: str) -> tuple[Sequential, tuple[int, ...]]:
    """Small random chains of 5 to 9 layers (n + 1 a multiple of 2 and 4 among them)."""
    f64 = {"dtype": np.float64}
    if kind == "conv-pool":  # n = 7: n + 1 = 8
        layers = [Conv2d(2, 3, 3, padding=1, rng=0, **f64), ReLU(), MaxPool2d(2),
                  Conv2d(3, 4, 3, padding=1, rng=1, **f64), ReLU(), Flatten(),
                  Linear(4 * 3 * 3, 5, rng=2, **f64)]
        return Sequential(*layers, input_shape=(2, 6, 6)), (2, 6, 6)
    if kind == "deep":  # n = 9, a pruned convolution (explicit zero weights in the pattern)
        conv = Conv2d(3, 4, 3, padding=1, rng=3, **f64)
        conv.weight[np.abs(conv.weight) < 0.2] = 0.0
        layers = [Conv2d(1, 3, 3, padding=1, rng=4, **f64), ReLU(), conv, Tanh(), MaxPool2d(2),
                  Conv2d(4, 2, 3, padding=1, rng=5, **f64), ReLU(), Flatten(),
                  Linear(2 * 4 * 4, 3, rng=6, **f64)]
        return Sequential(*layers, input_shape=(1, 8, 8)), (1, 8, 8)
    if kind == "pool-overlap":  # n = 6, overlapping pool windows
        layers = [Conv2d(1, 2, 2, rng=10, **f64), ReLU(), MaxPool2d(3, stride=1), Flatten(),
                  Linear(2 * 3 * 3, 4, rng=11, **f64), ReLU()]
        return Sequential(*layers, input_shape=(1, 6, 6)), (1, 6, 6)
    # "mlp", n = 6: a leaky ReLU (a diagonal without zeros)
    layers = [Linear(12, 10, rng=7, **f64), ReLU(), Linear(10, 9, rng=8, **f64), LeakyReLU(0.1),
              Linear(9, 6, rng=9, **f64), ReLU()]
    return Sequential(*layers, input_shape=(12,)), (12,)


SCHEDULES = [("linear", None), ("hybrid", 1), ("hybrid", 2), ("hybrid", 3), ("hybrid", 4), ("blelloch", None)]
"""Hybrid 3 and 4 reach depth(n) on some chains: one up-sweep level more than blelloch's."""
CHAINS = ["conv-pool", "deep", "mlp", "pool-overlap"]


def sample_matrices(model: Sequential, sample: int) -> list[sp.csr_matrix]:
    """Each layer's JT for one sample (layer order), zeros eliminated."""
    out = []
    for jt in model.transposed_jacobians():
        matrix = jt.to_scipy(sample).tocsr().copy()  # to_scipy shares the cached pattern's arrays
        matrix.eliminate_zeros()
        out.append(matrix)
    return out


def multiply_adds(right: sp.csr_matrix, left: sp.csr_matrix) -> int:
    """``sum_k nnzcol_right(k) * nnzrow_left(k)`` of zero-free operands."""
    return int(np.bincount(right.indices, minlength=right.shape[1]) @ np.diff(left.tocsr().indptr))


def product(right: sp.csr_matrix, left: sp.csr_matrix) -> sp.csr_matrix:
    out = (right @ left).tocsr()
    out.eliminate_zeros()
    return out


def artifact_flops(right: sp.csr_matrix, left: sp.csr_matrix) -> tuple[int, sp.csr_matrix]:
    """The artifact's count: 2 per pair of entries meeting in a non-zero entry of the product."""
    out = product(right, left)
    meeting = (right != 0).astype(np.int64).toarray() @ (left != 0).astype(np.int64).toarray()
    return 2 * int(meeting[out.toarray() != 0].sum()), out


def brute_ours(model: Sequential, x: np.ndarray, method: str, levels: int | None) -> np.ndarray:
    """Per step (plan order) and sample, the FLOPs of the plan's steps on zero-free SciPy products."""
    plan = model.plan(x.shape[1:], method, levels)
    model.forward(x)
    n = len(model.layers)
    diagonal = [layer.jacobian_kind == "diagonal" for layer in model.layers]
    out = np.zeros((len(plan.steps), len(x)), dtype=np.int64)
    for sample in range(len(x)):
        jts = sample_matrices(model, sample)
        values = {Element(j, j): jts[n - j] for j in range(1, n + 1)}
        values[Element(0, 0)] = sp.csr_matrix(np.ones((jts[-1].shape[1], 1)))
        for index, step in enumerate(plan.steps):
            right, left = values[step.right], values[step.left]
            scaling = not step.left.is_vector and any(
                all(diagonal[n - j] for j in range(e.lo, e.hi + 1)) for e in (step.left, step.right))
            out[index, sample] = (1 if scaling else 2) * multiply_adds(right, left)
            values[step.out] = product(right, left)
    return out


def brute_bp(model: Sequential, sample: int, convention: str) -> list[int]:
    """Back-propagation's FLOPs per layer (layer order) for one sample."""
    jts = sample_matrices(model, sample)
    if convention == "paper":
        return [m.shape[0] + m.nnz if layer.jacobian_kind == "diagonal"
                else sum(m.shape) if layer.jacobian_kind == "selection" else 2 * m.nnz
                for layer, m in zip(model.layers, jts, strict=True)]
    vector, flops = sp.csr_matrix(np.ones((jts[-1].shape[1], 1))), []
    for matrix in reversed(jts):
        flops.append(2 * multiply_adds(matrix, vector))
        vector = product(matrix, vector)
    return flops[::-1]


class Identity:
    """The artifact's identity element: combining with it forms no product."""


def artifact_scan(elements: list, up_levels: float) -> tuple[list[list[int]], list[int]]:
    """The artifact's hybrid Blelloch scan over ``elements`` (``[g, JT_1, ..., JT_n]``): the FLOPs of
    every product of each up-/down-sweep level, and of the linear middle (all on the critical path)."""
    a, n = list(elements), len(elements) - 1
    levels: list[list[int]] = []
    middle: list[int] = []

    def op(left, right, record: list[int]):
        if isinstance(left, Identity):
            return right
        if isinstance(right, Identity):
            return left
        flops, out = artifact_flops(right, left)
        record.append(flops)
        return out

    up = int(min(math.ceil(math.log2(n + 1)) - 1, up_levels))
    for d in range(up):
        levels.append([])
        for i in range(0, n - 2**d + 1, 2 ** (d + 1)):
            left, right = i + 2**d - 1, min(i + 2 ** (d + 1) - 1, n)
            a[right] = op(a[left], a[right], levels[-1])
    reduction, width = Identity(), 2**up
    for i in range(0, n - width + 1, width):  # the segment roots before the last one
        root = i + width - 1
        previous, reduction = reduction, op(reduction, a[root], middle)
        a[root] = previous
    a[n] = reduction
    for d in reversed(range(up)):
        levels.append([])
        for i in range(0, n - 2**d + 1, 2 ** (d + 1)):
            left, right = i + 2**d - 1, min(i + 2 ** (d + 1) - 1, n)
            a[left], a[right] = a[right], op(a[right], a[left], levels[-1])
    return levels, middle


def _fitting_schedules() -> list[tuple[str, str, int | None]]:
    """``(kind, method, levels)`` for every chain and every schedule its depth allows."""
    return [(kind, method, levels) for kind in CHAINS for method, levels in SCHEDULES
            if levels is None or levels <= depth(len(chain(kind)[0].layers))]


CASES = _fitting_schedules()


@pytest.mark.parametrize("kind, method, levels", CASES)
def test_ours_equals_brute_force(kind, method, levels):
    model, shape = chain(kind)
    x = np.random.default_rng(1).standard_normal((3,) + shape)
    report = live(model, x, method, levels)
    expected = brute_ours(model, x, method, levels)
    assert [step["live"]["samples"] for step in report["steps"]] == expected.tolist()
    plan = model.plan(shape, method, levels)
    assert [step["static"] for step in report["steps"]] == [step.flops for step in plan.steps]
    static = analyse(model, method, levels)["totals"]
    totals = report["totals"]
    assert totals["critical_flops"]["static"] == static["critical_flops"] == plan.critical_flops
    assert totals["work_flops"]["static"] == static["work_flops"]
    assert totals["bp_flops"]["static"] == static["bp_flops"]
    assert totals["work_flops"]["live"]["samples"] == expected.sum(axis=0).tolist()
    by_level = {}
    for step, flops in zip(plan.steps, expected, strict=True):
        by_level[step.level] = np.maximum(by_level.get(step.level, 0), flops)
    assert totals["critical_flops"]["live"]["samples"] == sum(by_level.values()).tolist()
    bp = np.array([brute_bp(model, sample, "ours") for sample in range(3)]).T
    assert [layer["live"]["samples"] for layer in report["bp"]] == bp.tolist()
    assert totals["bp_flops"]["live"]["samples"] == np.sum(bp, axis=0).tolist()


@pytest.mark.parametrize("kind, method, levels", CASES)
def test_paper_equals_the_artifacts_scan(kind, method, levels):
    model, shape = chain(kind)
    x = np.random.default_rng(2).standard_normal((2,) + shape)
    report = live(model, x, method, levels, convention="paper")
    up_levels = {"linear": 0, "blelloch": math.inf}.get(method, levels)
    for sample in range(2):
        jts = sample_matrices(model, sample)
        elements = [sp.csr_matrix(np.ones((jts[-1].shape[1], 1)))] + jts[::-1]
        sweeps, middle = artifact_scan(elements, up_levels)
        ours = sorted(step["live"]["samples"][sample] for step in report["steps"])
        assert ours == sorted([flops for level in sweeps for flops in level] + middle)
        totals = report["totals"]
        assert totals["critical_flops"]["live"]["samples"][sample] == (
            sum(max(level) for level in sweeps if level) + sum(middle))
        assert totals["work_flops"]["live"]["samples"][sample] == sum(ours)
        bp = [layer["live"]["samples"][sample] for layer in report["bp"]]
        assert bp == brute_bp(model, sample, "paper")
    # the artifact computes no dL/dx_0; its up-sweep forms every pair's product
    assert all(step["phase"] != "final" for step in report["steps"])
    plan = model.plan(shape, method, levels)
    assert sum(step["in_plan"] for step in report["steps"]) == len(plan.steps) - 1


def test_the_paper_convention_counts_scalings_twice_and_keeps_every_other_figure():
    model, shape = chain("conv-pool")
    x = np.random.default_rng(3).standard_normal((2,) + shape)
    ours, paper = live(model, x, "hybrid", 1), live(model, x, "hybrid", 1, "paper")
    plan = model.plan(shape, "hybrid", 1)
    rows = {(tuple(step["left"]), tuple(step["right"])): step for step in paper["steps"]}
    for step, row in zip(plan.steps, ours["steps"], strict=True):
        if step.phase == "final":
            continue
        other = rows[(step.left.lo, step.left.hi), (step.right.lo, step.right.hi)]
        factor = 2 if step.method.startswith("scale_") else 1
        assert other["static"] == factor * row["static"]
        assert other["live"]["samples"] == [factor * value for value in row["live"]["samples"]]


def test_without_relu_or_pool_every_entry_is_live():
    # no ReLU, no pool: every JT entry is live, the live figures are the static ones
    model = Sequential(Linear(6, 5, rng=0), Tanh(), Linear(5, 4, rng=1), input_shape=(6,))
    report = live(model, np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32), "blelloch")
    for step in report["steps"]:
        assert step["live"]["samples"] == [step["static"]] * 2
    assert report["totals"]["bp_flops"]["live"]["mean"] == report["totals"]["bp_flops"]["static"]


def test_conventions_and_bad_input():
    assert CONVENTIONS == ("ours", "paper")
    model, shape = chain("mlp")
    x = np.zeros((1,) + shape)
    with pytest.raises(ValueError, match="convention must be one of ours, paper; got 'artifact'"):
        live(model, x, "linear", convention="artifact")
    with pytest.raises(ValueError, match=r"x: samples of shape \[3\], the model takes \[12\]"):
        live(model, np.zeros((2, 3)), "linear")
    with pytest.raises(ValueError, match="x: expected a NumPy array"):
        live(model, np.zeros((0,) + shape), "linear")


def test_jts_over_the_memory_budget_are_refused_before_any_is_built(monkeypatch):
    """A squeeze-and-excitation block's JT is dense: (C·H·W)² entries. Counted from the layers'
    structure, the JTs' values and indices for the batch are held to the model's memory budget before
    any JT is built (the live count and run --check's layer-by-layer reference build them all); within
    it, the report is made."""
    gate = [AdaptiveAvgPool2d(1), Conv2d(4, 2, 1, rng=0), ReLU(), Conv2d(2, 4, 1, rng=1), Sigmoid()]
    model = Sequential(Conv2d(1, 4, 3, padding=1, rng=2), Block([], gate, join="product", names=[None, None]),
                       input_shape=(1, 8, 8))
    x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)
    conv, block = (size.nnz for size in model.jacobian_sizes())
    needed = conv * (4 + 8) + block * (3 * 4 + 8)  # the convolution's values are shared by the batch
    built = []
    monkeypatch.setattr(Block, "transposed_jacobian", lambda self, batch: built.append(batch))
    monkeypatch.setattr(Conv2d, "transposed_jacobian", lambda self, batch: built.append(batch))
    model.memory_budget = needed - 1
    with pytest.raises(ScanMemoryError, match=r"the JTs of every layer for a batch of 3 \(the largest, layer "
                                              r"'1' \(Block\), 65,536 entries\) would take ~1\.\d+ MiB"):
        live(model, x, "linear")
    with pytest.raises(ScanMemoryError, match="the JTs of every layer for a batch of 3"):
        model.reference_backward(np.ones((3, 4, 8, 8), np.float32))
    assert not built
    monkeypatch.undo()
    model.memory_budget = needed
    assert live(model, x, "linear")["samples"] == 3


@pytest.mark.gpu
def test_a_backward_holds_the_values_it_fills_to_the_budget():
    """The GPU scan fills every JT its mv steps read, a squeeze-and-excitation block's dense one too:
    held to the budget before any is filled, naming the block. The host's backward applies the block
    through its branches (no values) and runs under the same budget."""
    from sparse_scan import backend

    gate = [AdaptiveAvgPool2d(1), Conv2d(4, 2, 1, rng=0), ReLU(), Conv2d(2, 4, 1, rng=1), Sigmoid()]
    model = Sequential(Conv2d(1, 4, 3, padding=1, rng=2), Block([], gate, join="product", names=[None, None]),
                       input_shape=(1, 8, 8))
    x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)
    grad = np.ones((3, 4, 8, 8), np.float32)
    conv, block = (size.nnz for size in model.jacobian_sizes())
    model.memory_budget = conv * (4 + 8) + block * (3 * 4 + 8) - 1
    gpu = backend.get("gpu")
    model.forward(gpu.asarray(x))
    with pytest.raises(ScanMemoryError, match=r"the JT values this backward fills for a batch of 3 \(the "
                                              r"largest, layer '1' \(Block\), 65,536 entries\)"):
        model.backward(gpu.asarray(grad), "linear")
    model.forward(x)
    assert model.backward(grad, "linear")[0].shape == (3, 1, 8, 8)
