"""GPU paths that the other ``gpu`` tests never launch, each against its NumPy twin: the int64-index
instantiations of ``scan_level`` and of the convolution JT kernels, the block-product fallback of the
GPU scan, grids above the ``MAX_BLOCKS`` cap (every kernel's grid-stride loop wraps), and the
1024-thread chain launch of the dense scan. On the CuPy stand-in the launches themselves are checked
too (grid and block sizes); on a GPU the results are.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STANDIN
from test_dense_scan_kernel import chain
from test_scan import random_chain, schedules
from test_scan_gpu import assert_close

from sparse_scan import _gpu_kernels, backend
from sparse_scan.engine import _dense_gpu, _gpu, _tables, run
from sparse_scan.engine import products as product_planning
from sparse_scan.engine.run import dense_scan
from sparse_scan.layers import Conv2d, MaxPool2d

pytestmark = pytest.mark.gpu


def _backward_on_both(model, in_shape, method, levels, dtype=np.float64, batch=3, seed=0):
    gpu = backend.get("gpu")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch,) + in_shape).astype(dtype)
    grad_out = rng.standard_normal(model.forward(x).shape).astype(dtype)
    want = model.backward(grad_out, method=method, levels=levels, device="cpu")
    model.forward(gpu.asarray(x))
    got = model.backward(gpu.asarray(grad_out), method=method, levels=levels, device="gpu")
    return [gpu.to_host(g) for g in got], want


def test_scan_level_with_int64_indices_equals_the_cpu(monkeypatch):
    monkeypatch.setattr(_gpu, "_index_dtype", lambda plan, layout: np.dtype(np.int64))
    monkeypatch.setattr(_tables, "_WORKSPACES", {})
    model, in_shape = random_chain(8, seed=13, dtype=np.float64)
    for method, levels in schedules(8):
        got, want = _backward_on_both(model, in_shape, method, levels)
        assert_close(got, want, 1e-10)
        plan = model.plan(in_shape, method, levels, batch=3, device="gpu")  # auto: the backward's choice
        assert {w.index_dtype for w in _tables.workspaces(plan).values()} == {np.dtype(np.int64)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_jt_kernels_with_int64_indices_equal_the_cpu(dtype):
    gpu = backend.get("gpu")
    conv = Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2, dtype=dtype, rng=1)
    x = np.random.default_rng(2).standard_normal((2, 4, 9, 7)).astype(dtype)
    want = conv.transposed_jacobian(x, index_dtype=np.int64)
    got = conv.transposed_jacobian(gpu.asarray(x), index_dtype=np.int64)
    assert got.pattern.index_dtype == want.pattern.index_dtype == np.int64
    assert got.pattern.same_as(want.pattern)
    np.testing.assert_array_equal(gpu.to_host(got.data), want.data)


def test_the_block_product_fallback_of_the_gpu_scan(monkeypatch):
    monkeypatch.setattr(product_planning, "BLOCK_MIN_INNER", 1)
    monkeypatch.setattr(product_planning, "BLOCK_MIN_OUTER", 1)
    model, in_shape = random_chain(13, seed=33, dtype=np.float64)
    plan = model.plan(in_shape, "blelloch")
    assert "block" in {step.method for step in plan.steps}
    got, want = _backward_on_both(model, in_shape, "blelloch", None)
    assert_close(got, want, 1e-10)
    gpu = backend.get("gpu")
    for step in (s for s in plan.steps if s.method == "block"):  # spgemm.multiply's GPU twin too
        rng = np.random.default_rng(step.level)
        a = rng.standard_normal((2, step.product.blocks.a.gather.size))
        b = rng.standard_normal(step.product.blocks.b.gather.size)
        np.testing.assert_allclose(gpu.to_host(run.multiply(step.product, gpu.asarray(a), gpu.asarray(b))),
                                   run.multiply(step.product, a, b), rtol=1e-12)


def test_grids_above_the_block_cap_wrap_in_every_kernel(monkeypatch, request):
    """With ``MAX_BLOCKS = 2`` every launch covers its work with a grid-stride loop that wraps."""
    monkeypatch.setattr(_gpu_kernels, "MAX_BLOCKS", 2)
    monkeypatch.setattr(_tables, "_WORKSPACES", {})
    stats = request.getfixturevalue("device_stats") if STANDIN else None
    model, in_shape = random_chain(6, seed=3, dtype=np.float64)
    got, want = _backward_on_both(model, in_shape, "blelloch", None, batch=5)
    assert_close(got, want, 1e-10)
    gpu = backend.get("gpu")
    pool, conv = MaxPool2d(3, stride=2, padding=1), Conv2d(3, 5, 3, padding=1, dtype=np.float64, rng=4)
    x = np.random.default_rng(5).standard_normal((4, 3, 11, 10))
    for layer in (pool, conv):
        got_jt, want_jt = layer.transposed_jacobian(gpu.asarray(x)), layer.transposed_jacobian(x)
        assert got_jt.pattern.same_as(want_jt.pattern)
        np.testing.assert_array_equal(gpu.to_host(got_jt.data), want_jt.data)
    blocks, direct = chain(np.random.default_rng(6), 7, 5, 9, np.float64, True)
    for method, levels in schedules(7):
        assert_close(gpu.to_host(dense_scan(gpu.asarray(blocks), gpu.asarray(direct), method, levels)),
                     dense_scan(blocks, direct, method, levels), 1e-10)
    if stats is not None:
        assert stats.launches and max(grid[0] for _, grid, _ in stats.launches) == 2
        assert {name.split("<")[0] for name, _, _ in stats.launches} >= {
            "scan_level", "pool_row_counts", "pool_fill", "maxpool_values", "conv_jt_fill_pattern",
            "conv_jt_fill_values", "dense_scan_level", "dense_scan_chain"}


def test_the_1024_thread_chain_launch(request):
    size = 1000  # chain_threads rounds 1000 entries up to 1024 threads
    assert _dense_gpu.chain_threads(size) == _dense_gpu.MAX_THREADS == 1024
    stats = request.getfixturevalue("device_stats") if STANDIN else None
    gpu = backend.get("gpu")
    rng = np.random.default_rng(7)
    blocks = (rng.standard_normal((4, 2, size, size)) / np.sqrt(size)).astype(np.float32)  # a chain of 4
    last = rng.standard_normal((2, size)).astype(np.float32)
    got = dense_scan(gpu.asarray(blocks), gpu.asarray(last), "linear")
    assert_close(gpu.to_host(got), dense_scan(blocks, last, "linear"), 1e-4)
    if stats is not None:
        chains = [launch for launch in stats.launches if launch[0].startswith("dense_scan_chain")]
        assert chains and all(block == (1024, 1, 1) for _, _, block in chains)


# --- host synchronisations -----------------------------------------------------------------------------
PARAMETER_UPLOADS = ("sparse_scan/backend.py", "in asarray"), ("sparse_scan/recurrent/_base.py",
                                                              "in _parameters_on")
"""Where a warm backward may wait for the host: parameters live on the host as NumPy arrays, and each
GPU backward uploads the ones it uses (docs/gpu.md, host synchronisation)."""
def _unexpected(syncs, allowed):
    return [s for s in syncs if not any(path in s and where in s for path, where in allowed)]


def test_a_warm_backward_waits_for_the_host_only_where_documented(device_stats):
    from sparse_scan import Sequential
    from sparse_scan.layers import Flatten, Linear, ReLU, Tanh

    gpu = backend.get("gpu")
    model = Sequential(Conv2d(2, 4, 3, padding=1, rng=0), ReLU(), MaxPool2d(2), Conv2d(4, 4, 3, rng=1),
                       Tanh(), Flatten(), Linear(16, 5, rng=2), ReLU(), Linear(5, 3, rng=3))
    rng = np.random.default_rng(0)
    for method, levels in (("linear", None), ("blelloch", None), ("hybrid", 1)):
        for call in range(2):
            x = gpu.asarray(rng.standard_normal((4, 2, 8, 8)).astype(np.float32))
            grad_out = gpu.asarray(rng.standard_normal((4, 3)).astype(np.float32))
            model.forward(x)
            device_stats.clear()
            model.backward(grad_out, method=method, levels=levels)
            if call:  # warm: plan, patterns and workspaces built by the first call
                assert _unexpected(device_stats.syncs, PARAMETER_UPLOADS) == [], method


def test_a_warm_numeric_scan_never_waits_for_the_host(device_stats):
    """The executors themselves: the descriptor table goes up from pinned memory, nothing comes back."""
    gpu = backend.get("gpu")
    model, in_shape = random_chain(8, seed=4, dtype=np.float32)
    rng = np.random.default_rng(1)
    x = gpu.asarray(rng.standard_normal((3,) + in_shape).astype(np.float32))
    grad_out = gpu.asarray(rng.standard_normal(model.forward(x).shape).astype(np.float32)).reshape(3, -1)
    jts = model.transposed_jacobians()[::-1]
    for method, levels in schedules(8):
        plan = model.plan(in_shape, method, levels)
        _gpu.run_plan(plan, grad_out, jts)
        device_stats.clear()
        _gpu.run_plan(plan, grad_out, jts)
        assert device_stats.syncs == [] and device_stats.uploads <= 1, (method, levels)
    blocks, direct = chain(np.random.default_rng(2), 9, 3, 12, np.float32, True)
    blocks, direct = gpu.asarray(blocks), gpu.asarray(direct)
    for method, levels in schedules(9):
        dense_scan(blocks, direct, method, levels)
        device_stats.clear()
        dense_scan(blocks, direct, method, levels)
        assert device_stats.syncs == [], (method, levels)


def test_a_queued_upload_is_waited_for_before_its_pinned_table_changes(monkeypatch, device_stats):
    """``StagedTable.patch`` waits (the one synchronisation it may make) only while the previous
    upload from its pinned buffer has not been reached by the GPU."""
    import cupy

    table = _tables.StagedTable(np.arange(6, dtype=np.int64))  # (built with one synchronous copy)
    device_stats.clear()
    table.patch(np.array([1]), np.array([10]))
    table.patch(np.array([2]), np.array([20]))
    assert device_stats.syncs == [] and device_stats.uploads == 2
    np.testing.assert_array_equal(gpu_table := table.device.get(), [0, 10, 20, 3, 4, 5])
    assert gpu_table.dtype == np.int64
    device_stats.clear()
    if STANDIN:  # the stand-in's events have always passed: make the last one pending
        monkeypatch.setattr(cupy.cuda.Event, "done", property(lambda self: False))
    table.patch(np.array([3]), np.array([30]))
    assert [s.split(" at ")[0] for s in device_stats.syncs] == ["Event.synchronize"]


def test_a_descriptor_table_uploads_its_per_call_pointers_only_when_they_move(device_stats):
    """``DescriptorTable.bind`` sets each ``Patch`` field to its slot's pointer plus its offset, with
    one upload, and none when no pointer moved; a launch's table is a view of its rows."""
    kept = backend.get("gpu").xp.zeros(3)
    builder = _tables.TableBuilder(4)
    builder.add([1, _tables.Patch(0), kept])
    builder.add([2, _tables.Patch(1, 16), _tables.Patch(0, 8)])
    table = builder.build()
    device_stats.clear()
    table.bind([1000, 2000])
    table.bind([1000, 2000])
    assert device_stats.syncs == [] and device_stats.uploads == 1
    table.bind([1000, 3000])
    assert device_stats.syncs == [] and device_stats.uploads == 2
    np.testing.assert_array_equal(table.rows(0, 2).get(), [1, 1000, kept.data.ptr, 0, 2, 3016, 1008, 0])
    np.testing.assert_array_equal(table.rows(1, 1).get(), [2, 3016, 1008, 0])
