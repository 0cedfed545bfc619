"""The numeric phase skips dead work (issue 21): products whose ``A`` carries a batch's zeros (ReLU's
off units, max-pool's non-maxima, and products of them) skip those entries' rows of ``B``.

Checked in float64 against an independent oracle (SciPy's SpGEMM per sample, which sums every
entry's terms from zero in the same ``A``-entry order, so equality is exact) and against the previous
behaviour (every stored multiply-add summed: :func:`sparse_scan.engine._kernels.stored_products`), bit
for bit; the pattern is the plan's, dead entries exactly zero even in a reused buffer full of garbage.
The GPU twin (which tests every term's per-sample factor) is checked through the CuPy stand-in.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from test_scan import random_chain, schedules

from sparse_scan import Sequential, backend
from sparse_scan._host_kernels import rows2d
from sparse_scan.csr import BatchedCSR, Pattern
from sparse_scan.engine import _cpu as host
from sparse_scan.engine import _gpu
from sparse_scan.engine._kernels import stored_products
from sparse_scan.engine.products import plan_product
from sparse_scan.engine.run import multiply
from sparse_scan.layers import Conv2d, MaxPool2d, ReLU


def random_pattern(rng: np.random.Generator, rows: int, cols: int, per_row: int) -> Pattern:
    """Up to ``per_row`` random columns per row (sorted, distinct); some rows empty."""
    indptr, indices = [0], []
    for _ in range(rows):
        count = int(rng.integers(0, per_row + 1))
        indices.extend(sorted(rng.choice(cols, size=min(count, cols), replace=False)))
        indptr.append(len(indices))
    return Pattern(np.asarray(indptr, np.int32), np.asarray(indices, np.int32), (rows, cols))


def live_values(rng: np.random.Generator, pattern: Pattern, batch: int, dead: str) -> np.ndarray:
    """``(batch, nnz)`` values with the zeros of a ReLU scaling (whole columns: ``A @ D``), of a
    selection (whole rows: ``S @ B``, three of four dead) or scattered entries."""
    data = rng.standard_normal((batch, pattern.nnz))
    rows = np.repeat(np.arange(pattern.shape[0]), np.diff(pattern.indptr))
    if dead == "columns":
        off = rng.random((batch, pattern.shape[1])) < 0.5
        data[off[:, pattern.indices]] = 0.0
    elif dead == "rows":
        off = rng.random((batch, pattern.shape[0])) < 0.75
        data[off[:, rows]] = 0.0
    else:
        data[rng.random(data.shape) < 0.6] = 0.0
    return data


def scipy_oracle(plan, a_data: np.ndarray, b_data: np.ndarray, a: Pattern, b: Pattern) -> np.ndarray:
    """Per sample, SciPy's ``A @ B`` densified (zeros dropped by SciPy read back as 0)."""
    batch = max(x.shape[0] if x.ndim == 2 else 1 for x in (a_data, b_data))
    out = np.zeros((batch,) + plan.out.shape)
    for s in range(batch):
        left = sp.csr_matrix((a_data[s] if a_data.ndim == 2 else a_data, a.indices, a.indptr), shape=a.shape)
        right = sp.csr_matrix((b_data[s] if b_data.ndim == 2 else b_data, b.indices, b.indptr),
                              shape=b.shape)
        out[s] = (left @ right).toarray()
    return out


def densify(plan, values: np.ndarray) -> np.ndarray:
    rows = np.repeat(np.arange(plan.out.shape[0]), np.diff(plan.out.indptr))
    out = np.zeros((values.shape[0],) + plan.out.shape)
    out[:, rows, plan.out.indices] = values
    return out


def previous(plan, a_data: np.ndarray, b_data: np.ndarray) -> np.ndarray:
    """The numeric phase before issue 21: every stored multiply-add, one piece."""
    batch = max(x.shape[0] if x.ndim == 2 else 1 for x in (a_data, b_data))
    out = np.empty((batch, plan.out.nnz))
    stored_products(rows2d(a_data, out.dtype), rows2d(b_data, out.dtype), plan.a_pos,
                              plan.b_pos, plan.starts, plan.multiply_adds, out, 0, batch, 0, plan.out.nnz,
                              8192)
    return out


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and np.array_equal(x.view(np.int64), y.view(np.int64))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("dead", ["columns", "rows", "scattered"])
@pytest.mark.parametrize("fan_out", [1, 6])
@pytest.mark.parametrize("b_sharing", ["shared", "per-sample"])
def test_products_skipping_dead_rows_equal_the_oracle_and_the_previous_phase_bit_for_bit(
        seed, batch, dead, fan_out, b_sharing):
    rng = np.random.default_rng(seed)
    a, b = random_pattern(rng, 40, 30, 12), random_pattern(rng, 30, 35 if fan_out > 1 else 4, fan_out)
    plan = plan_product(a, b, "general", "general")
    assert plan.method == "general" and plan.starts is not None
    a_data = live_values(rng, a, batch, dead)
    b_data = live_values(rng, b, batch, "scattered")
    if b_sharing == "shared":
        b_data = rng.standard_normal(b.nnz)
    assert host._skips_dead_rows(plan, a_data) == (plan.multiply_adds >= 2 * a.nnz)
    out = np.full((batch, plan.out.nnz), np.nan)  # a reused buffer: garbage in every entry
    got = host.multiply(plan, a_data, b_data, out=out)
    assert got is out
    assert same_bits(got, previous(plan, a_data, b_data))
    assert np.array_equal(densify(plan, got), scipy_oracle(plan, a_data, b_data, a, b))
    # the entries of C that only dead A entries reach are exact zeros
    live_a = (a_data != 0).astype(float)
    reached = scipy_oracle(plan, live_a, np.ones(b.nnz), a, b)
    assert np.all(densify(plan, got)[reached == 0] == 0)
    assert np.any(reached == 0) or dead == "scattered"


def test_only_a_per_sample_a_with_rows_of_b_to_skip_runs_row_by_row():
    rng = np.random.default_rng(3)
    a, b = random_pattern(rng, 20, 15, 4), random_pattern(rng, 15, 12, 5)
    plan = plan_product(a, b, "general", "general")
    per_sample = live_values(rng, a, 2, "rows")
    assert host._skips_dead_rows(plan, per_sample)
    assert not host._skips_dead_rows(plan, per_sample[0])  # shared by the batch: no input zeros
    single = plan_product(a, Pattern(np.arange(16, dtype=np.int32), np.arange(15, dtype=np.int32),
                                     (15, 15)), "general", "general")
    assert single.starts is None and not host._skips_dead_rows(single, per_sample)


def relu_pool_chain(seed: int) -> tuple[Sequential, tuple[int, ...]]:
    """conv, ReLU, max-pool, conv, ReLU, conv, ReLU, max-pool, conv: VGG-11's kinds of products."""
    layers = [Conv2d(2, 4, 3, padding=1, dtype=np.float64, rng=seed), ReLU(), MaxPool2d(2),
              Conv2d(4, 4, 3, padding=1, dtype=np.float64, rng=seed + 1), ReLU(),
              Conv2d(4, 3, 3, padding=1, dtype=np.float64, rng=seed + 2), ReLU(), MaxPool2d(2),
              Conv2d(3, 2, 1, dtype=np.float64, rng=seed + 3)]
    return Sequential(*layers), (2, 8, 8)


@pytest.mark.parametrize("chain", ["relu-pool", "random"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batch", [1, 4])
def test_whole_backwards_equal_the_previous_phase_bit_for_bit(monkeypatch, chain, seed, batch):
    """Every schedule of a chain with ReLUs and max-pools, run twice (the second run reuses the
    first's product buffers), against the same plans run with every multiply-add (float64)."""
    model, in_shape = relu_pool_chain(seed) if chain == "relu-pool" else random_chain(9, seed, np.float64)
    rng = np.random.default_rng(seed)
    skipped = []
    live = host._skips_dead_rows

    def recording(plan, a_data):
        skipped.append(live(plan, a_data))
        return skipped[-1]

    for method, levels in schedules(len(model)):
        plan = model.plan(in_shape, method, levels)
        for _ in range(2):
            y = model.forward(rng.standard_normal((batch,) + in_shape))
            jts = model.transposed_jacobians()[::-1]
            grad = rng.standard_normal((batch, int(np.prod(y.shape[1:]))))
            monkeypatch.setattr(host, "_skips_dead_rows", recording)
            got = host.run_plan(plan, grad, jts)
            monkeypatch.setattr(host, "_skips_dead_rows", lambda plan, a_data: False)
            want = host.run_plan(plan, grad, jts)
            assert all(same_bits(g, w) for g, w in zip(got, want, strict=True))
    if chain == "relu-pool":
        assert any(skipped)  # the live path ran


@pytest.mark.gpu
@pytest.mark.parametrize("b_sharing", ["shared", "per-sample"])
def test_gpu_products_write_dead_entries_as_exact_zeros(b_sharing):
    """The GPU twin skips each term whose per-sample factor is zero: dead entries are exact zeros,
    live ones equal the host's."""
    gpu = backend.get("gpu")
    rng = np.random.default_rng(8)
    a, b = random_pattern(rng, 40, 30, 6), random_pattern(rng, 30, 35, 6)
    plan = plan_product(a, b, "general", "general")
    a_data = live_values(rng, a, 3, "rows")
    b_data = rng.standard_normal(b.nnz) if b_sharing == "shared" else live_values(rng, b, 3, "columns")
    want = multiply(plan, a_data, b_data)
    got = gpu.to_host(_gpu.multiply(plan, gpu.asarray(a_data), gpu.asarray(b_data)))
    assert np.array_equal(got == 0, want == 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.gpu
def test_gpu_backward_leaves_no_stale_values_in_its_reused_workspace():
    """A run with no zeros, then one with the batch's zeros, in the same workspace: no entry of the
    first run survives (the scan's results equal the host's, exactly zero where the host's are)."""
    gpu = backend.get("gpu")
    model, in_shape = relu_pool_chain(5)
    rng = np.random.default_rng(5)
    plan = model.plan(in_shape, "blelloch")
    y = model.forward(rng.standard_normal((3,) + in_shape))
    grad = rng.standard_normal((3, int(np.prod(y.shape[1:]))))
    jts = model.transposed_jacobians()[::-1]
    dense = [BatchedCSR(jt.pattern, np.where(jt.data == 0, 1.0, jt.data)) for jt in jts]
    for chain in (dense, jts):
        device = [BatchedCSR(jt.pattern.to("gpu"), gpu.asarray(jt.data)) for jt in chain]
        got = [gpu.to_host(g) for g in _gpu.run_plan(plan, gpu.asarray(grad), device)]
        want = host.run_plan(plan, grad, chain)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g == 0, w == 0)
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_operands_of_the_wrong_size_are_refused_before_any_kernel_reads_them():
    """The compiled kernels do not check their reads: ``run.multiply`` compares the operands' lengths
    with the plan's patterns first."""
    rng = np.random.default_rng(9)
    a, b = random_pattern(rng, 40, 30, 6), random_pattern(rng, 30, 35, 6)
    plan = plan_product(a, b, "general", "general")
    a_data, b_data = rng.standard_normal((3, a.nnz)), rng.standard_normal((3, b.nnz))
    message = f"a_data holds {b.nnz} values per sample; the plan's operand has {a.nnz}"
    with pytest.raises(ValueError, match=message):
        multiply(plan, b_data, a_data)
    with pytest.raises(ValueError, match="b_data holds"):
        multiply(plan, a_data, a_data)
