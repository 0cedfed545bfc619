"""Dense channel-block products: layout detection and block GEMMs against the scalar planned product."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparse_scan.engine import _blocks
from sparse_scan.engine._blocks import block_layout, multiply_blocks, multiply_blocks_host, plan_block_product
from sparse_scan.engine.products import plan_product
from sparse_scan.engine.run import multiply
from sparse_scan.layers import Conv2d, Linear, ReLU


def conv_jt(c_in, c_out, shape, seed, **kwargs):
    conv = Conv2d(c_in, c_out, dtype=np.float64, rng=seed, **kwargs)
    x = np.random.default_rng(seed).standard_normal((3, c_in) + shape)
    return conv, conv.transposed_jacobian(x), conv.forward(x)


def test_layout_of_dense_convolutions_and_linear_layers():
    conv, jt, _ = conv_jt(3, 5, (6, 7), 0, kernel_size=3, padding=1)
    layout = block_layout(jt.pattern, 3, 5)
    assert layout.channels == (3, 5) and layout.pixels == (42, 42)
    dense = jt.todense()  # conv values are shared: one matrix
    for block, (rows, cols) in enumerate(zip(*np.nonzero(
            sp.csr_matrix((np.ones(layout.blocks), layout.pixel_pattern.indices,
                           layout.pixel_pattern.indptr), layout.pixels).toarray()), strict=True)):
        # the block holds JT[c_in * P + rows, c_out * P + cols] for every channel pair
        expected = dense[np.arange(3)[:, None] * 42 + rows, np.arange(5)[None, :] * 42 + cols]
        np.testing.assert_array_equal(jt.data[layout.gather[block]], expected)
    linear = Linear(6, 4, dtype=np.float64, rng=0)
    single = block_layout(linear.pattern((6,)), 6, 4)
    assert single.blocks == 1 and single.pixels == (1, 1)


def test_grouped_pruned_and_misfactored_patterns_have_no_layout():
    _, grouped, _ = conv_jt(4, 4, (5, 5), 1, kernel_size=3, groups=2)
    assert block_layout(grouped.pattern, 4, 4) is None
    pruned = Conv2d(3, 4, 3, dtype=np.float64, rng=2, prune_pattern=True)
    weight = pruned.weight.copy()
    weight[0, 0, 0, 0] = 0.0
    pruned.weight = weight
    assert block_layout(pruned.pattern((3, 5, 5)), 3, 4) is None
    _, jt, _ = conv_jt(3, 4, (5, 5), 3, kernel_size=3)
    assert block_layout(jt.pattern, 5, 4) is None  # rows are not a multiple of 5 channels


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batched", ["none", "left", "right", "both"])
def test_block_product_equals_the_scalar_planned_product(seed, batched):
    rng = np.random.default_rng(seed)
    c1, c2, c3 = (int(c) for c in rng.integers(1, 5, size=3))
    shape = (int(rng.integers(4, 8)), int(rng.integers(4, 8)))
    _, a, h = conv_jt(c1, c2, shape, seed, kernel_size=(3, 2), padding=(1, 0),
                      dilation=int(rng.integers(1, 3)))
    second = Conv2d(c2, c3, kernel_size=2, stride=2, padding=1, dtype=np.float64, rng=seed + 1)
    b = second.transposed_jacobian(h)
    a_data = rng.standard_normal((3, a.nnz)) if batched in ("left", "both") else a.data
    b_data = rng.standard_normal((3, b.nnz)) if batched in ("right", "both") else b.data
    blocks = plan_block_product(block_layout(a.pattern, c1, c2), block_layout(b.pattern, c2, c3))
    scalar = plan_product(a.pattern, b.pattern, "general", "general")
    assert blocks.out.same_as(scalar.out)  # same pattern, explicit zeros included
    expected = multiply(scalar, a_data, b_data)
    for scratch in (1, 2**28):  # one block per GEMM, or whole slots at once
        np.testing.assert_allclose(multiply_blocks(blocks, a_data, b_data, scratch_bytes=scratch),
                                   expected, rtol=1e-12, atol=1e-14)


def test_block_product_keeps_relu_zeros_explicit_and_matches_scipy():
    _, a, h = conv_jt(8, 8, (4, 4), 5, kernel_size=3, padding=1)
    relu = ReLU()
    d = relu.transposed_jacobian(np.maximum(h, 0) * 0 - 1.0)  # every unit off: a zero diagonal
    off = plan_product(a.pattern, d.pattern, "general", "diagonal")
    scaled = multiply(off, a.data, d.data)  # conv JT times an all-zero diagonal: all explicit zeros
    plan = plan_product(off.out, a.pattern, "general", "general", channels=(8, 8, 8))
    assert plan.method == "block"
    values = multiply(plan, scaled, a.data)
    assert values.shape == (3, plan.out.nnz) and not values.any()
    reference = (a.to_scipy() @ a.to_scipy()).tocsr()
    assert plan.out.nnz == reference.nnz  # the symbolic pattern, not a data-dependent one
    live = multiply(plan, a.data, a.data)
    np.testing.assert_allclose(
        sp.csr_matrix((live, plan.out.indices, plan.out.indptr), plan.out.shape).toarray(),
        reference.toarray(), rtol=1e-12, atol=1e-14)


def random_block_product(seed):
    """Two chained convolution JTs of random channels (1..24) and geometries (stride, padding,
    dilation), with their block layouts, plan and shared values."""
    rng = np.random.default_rng(seed)
    c1, c2, c3 = (int(c) for c in rng.integers(1, 25, size=3))
    shape = (int(rng.integers(3, 8)), int(rng.integers(3, 8)))
    k = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    _, a, h = conv_jt(c1, c2, shape, seed, kernel_size=k, padding=(k[0] // 2, int(rng.integers(0, 2))),
                      stride=int(rng.integers(1, 3)))
    second = Conv2d(c2, c3, kernel_size=int(rng.integers(1, 4)), stride=int(rng.integers(1, 3)),
                    padding=int(rng.integers(0, 2)), dilation=int(rng.integers(1, 3)), dtype=np.float64,
                    rng=seed + 1)
    b = second.transposed_jacobian(h)
    plan = plan_block_product(block_layout(a.pattern, c1, c2), block_layout(b.pattern, c2, c3))
    return plan, a, b


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batched", ["none", "left", "right", "both"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_compiled_block_products_equal_the_gemm_path_and_scipy(monkeypatch, seed, batched, batch, dtype,
                                                                rtol):
    plan, a, b = random_block_product(seed)
    rng = np.random.default_rng(seed + 100)
    a_data = rng.standard_normal((batch, a.nnz)) if batched in ("left", "both") else a.data
    b_data = rng.standard_normal((batch, b.nnz)) if batched in ("right", "both") else b.data
    a_data, b_data = a_data.astype(dtype), b_data.astype(dtype)
    gemm = multiply_blocks(plan, a_data, b_data)
    out = plan.out
    rows = np.repeat(np.arange(out.shape[0]), np.diff(np.asarray(out.indptr)))
    samples = gemm.shape[0] if gemm.ndim == 2 else 1
    oracle = np.stack([(sp.csr_matrix((np.broadcast_to(a_data, (samples, a.nnz))[s], a.indices, a.indptr),
                                      a.shape)
                        @ sp.csr_matrix((np.broadcast_to(b_data, (samples, b.nnz))[s], b.indices,
                                         b.indptr), b.shape)).toarray()[rows, out.indices]
                       for s in range(samples)]).reshape(gemm.shape)
    scale = np.abs(oracle).max(initial=0.0)
    for columns in (_blocks.BLOCK_COLUMNS, 5):  # C's block columns in one chunk, or several
        monkeypatch.setattr(_blocks, "BLOCK_COLUMNS", columns)
        for workers in (1, 2, 3):
            got = multiply_blocks_host(plan, a_data, b_data, workers)
            assert got.dtype == dtype and got.shape == gemm.shape
            np.testing.assert_allclose(got, gemm, rtol=rtol, atol=rtol * scale)
            np.testing.assert_allclose(got, oracle, rtol=rtol, atol=rtol * scale)


def test_compiled_block_products_of_an_empty_batch_and_shared_operands():
    plan, a, b = random_block_product(7)
    assert multiply_blocks_host(plan, np.zeros((0, a.nnz)), b.data, 2).shape == (0, plan.out.nnz)
    shared = multiply_blocks_host(plan, a.data, b.data, 3)
    np.testing.assert_allclose(shared, multiply_blocks(plan, a.data, b.data), rtol=1e-12,
                               atol=1e-12 * np.abs(shared).max())
