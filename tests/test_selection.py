"""Products with a max-pool JT: gathers over live entries, checked against dense products."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_scan.engine.products import plan_product
from sparse_scan.engine.run import multiply
from sparse_scan.layers import Conv2d, MaxPool2d, ReLU

# (arguments, whether windows overlap)
POOLS = [
    (dict(kernel_size=2), False),
    (dict(kernel_size=3), False),
    (dict(kernel_size=2, padding=1), False),
    (dict(kernel_size=(2, 3), stride=(2, 3), ceil_mode=True), False),
    (dict(kernel_size=2, stride=1), True),
    (dict(kernel_size=3, stride=2, padding=1), True),
    (dict(kernel_size=3, stride=2, ceil_mode=True), True),
    (dict(kernel_size=(1, 2), dilation=(1, 2)), True),
]


def dense(values, pattern):
    """Per-sample dense matrices of ``(B, nnz)`` values on ``pattern`` (explicit zeros kept)."""
    out = np.zeros((values.shape[0],) + pattern.shape)
    rows = np.repeat(np.arange(pattern.shape[0]), np.diff(pattern.indptr))
    out[:, rows, pattern.indices] = values
    return out


def pool_and_conv(pool_kwargs, seed, pool_first):
    """A max-pool JT and a neighbouring conv JT (per sample, via a ReLU scaling, or shared)."""
    rng = np.random.default_rng(seed)
    pool = MaxPool2d(**pool_kwargs)
    if pool_first:  # the scan's product JT(pool) @ JT(next conv): pool on the left
        x = rng.standard_normal((3, 2, 7, 8))
        y = pool.forward(x)
        conv = Conv2d(2, 3, 3, padding=1, dtype=np.float64, rng=seed)
        return pool.transposed_jacobian(x), conv.transposed_jacobian(y)
    conv = Conv2d(3, 2, 3, padding=1, dtype=np.float64, rng=seed)  # JT(conv) @ JT(pool after it)
    x = rng.standard_normal((3, 3, 7, 8))
    return conv.transposed_jacobian(x), pool.transposed_jacobian(conv.forward(x))


@pytest.mark.parametrize("pool_kwargs, overlapping", POOLS)
@pytest.mark.parametrize("pool_first", [True, False])
@pytest.mark.parametrize("per_sample_other", [False, True])
@pytest.mark.parametrize("live_values", ["ones", "scaled"])
def test_gather_equals_the_dense_product_with_the_general_pattern(pool_kwargs, overlapping, pool_first,
                                                                   per_sample_other, live_values):
    a, b = pool_and_conv(pool_kwargs, 3, pool_first)
    a_data, b_data = a.data, b.data
    if live_values == "scaled":  # a selection whose live entries are not ones
        factor = np.random.default_rng(5).uniform(0.5, 2.0, (3, (a if pool_first else b).nnz))
        a_data, b_data = (a_data * factor, b_data) if pool_first else (a_data, b_data * factor)
    if per_sample_other:  # e.g. a conv already scaled by a ReLU: values differ per sample
        scale = np.random.default_rng(4).standard_normal((3, (b if pool_first else a).nnz))
        b_data, a_data = (b_data * scale, a_data) if pool_first else (b_data, a_data * scale)
    kinds = ("selection", "general") if pool_first else ("general", "selection")
    plan = plan_product(a.pattern, b.pattern, *kinds)
    general = plan_product(a.pattern, b.pattern, "general", "general")
    # an input that is the maximum of two windows sums two live products: no gather on the left
    assert plan.method == ("general" if overlapping and pool_first else "gather")
    assert plan.out.same_as(general.out)  # the full symbolic pattern, explicit zeros included
    got = multiply(plan, a_data, b_data)
    want = dense(np.broadcast_to(a_data, (3, a.nnz)), a.pattern) @ dense(
        np.broadcast_to(b_data, (3, b.nnz)), b.pattern)
    np.testing.assert_allclose(dense(got, plan.out), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got, multiply(general, a_data, b_data), rtol=1e-12, atol=1e-14)
    assert plan.flops_live <= plan.flops == general.flops


def test_dead_entries_are_never_read():
    # JT(conv) @ JT(pool): columns of JT(conv) at inputs no window picks only meet dead pool entries;
    # a NaN there poisons every multiply-add that reads it, but the gather never does
    a, b = pool_and_conv(dict(kernel_size=2), 5, pool_first=False)
    picked = np.zeros((3, b.pattern.shape[0]), dtype=bool)
    rows = np.repeat(np.arange(b.pattern.shape[0]), np.diff(b.pattern.indptr))
    picked[:, rows] = b.data != 0  # per sample, the pool inputs some window picks
    a_data = np.broadcast_to(a.data, (3, a.nnz)).copy()
    a_data[~picked[:, a.pattern.indices]] = np.nan
    plan = plan_product(a.pattern, b.pattern, "general", "selection")
    got = multiply(plan, a_data, b.data)
    assert np.isfinite(got).all()
    clean = multiply(plan, np.where(np.isnan(a_data), 0.0, a_data), b.data)
    np.testing.assert_array_equal(got, clean)
    assert np.isnan(multiply(plan_product(a.pattern, b.pattern, "general", "general"), a_data,
                             b.data)).any()


def test_live_flops_of_a_non_overlapping_pool_are_a_quarter():
    a, b = pool_and_conv(dict(kernel_size=2), 6, pool_first=True)
    plan = plan_product(a.pattern, b.pattern, "selection", "general")
    # 2x2 windows, one live input each; every input of a window carries the same conv row
    assert plan.flops_live * 4 == plan.flops


def test_scalings_and_blocks_are_not_gathers():
    relu = ReLU()
    x = np.random.default_rng(0).standard_normal((2, 1, 4, 4))
    pool = MaxPool2d(2)
    plan = plan_product(relu.pattern(x.shape[1:]), pool.pattern(x.shape[1:]), "diagonal", "selection")
    assert plan.method == "scale_rows" and plan.flops_live == plan.flops


def test_gather_plans_within_budget_only():
    # a pool on the right: C entries sum a window's multiply-adds, so the gather needs its tables
    a, b = pool_and_conv(dict(kernel_size=2), 8, pool_first=False)
    general = plan_product(a.pattern, b.pattern, "general", "general")
    tight = plan_product(a.pattern, b.pattern, "general", "selection",
                         budget_bytes=general.multiply_adds * 13)
    assert tight.method == "general"
    roomy = plan_product(a.pattern, b.pattern, "general", "selection")
    assert roomy.method == "gather" and roomy.selection is not None


def test_one_multiply_add_gathers_build_no_tables():
    # a pool on the left: one multiply-add per C entry, streamed by every backend; only counted
    a, b = pool_and_conv(dict(kernel_size=2), 8, pool_first=True)
    general = plan_product(a.pattern, b.pattern, "general", "general")
    plan = plan_product(a.pattern, b.pattern, "selection", "general", budget_bytes=general.multiply_adds * 13)
    assert plan.method == "gather" and plan.selection is None and plan.starts is None
    assert plan.nbytes == general.nbytes and plan.flops_live * 4 == plan.flops
