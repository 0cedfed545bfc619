"""The compiled host kernels (numba) against independent oracles, and how they are loaded.

Oracles: SciPy's ``A @ B`` per sample (its CSR product sums every entry from zero in the order
(A entry, B entry), as the compiled general and row-wise products do: equal bit for bit), NumPy's
one-shot expressions for scalings, dense products for selection gathers, a reshape-argmax for the
2x2 max-pool values and a plain loop over the windows for the max-pool values of any geometry.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from sparse_scan import _host_kernels
from sparse_scan.csr import Pattern
from sparse_scan.engine import _cpu as host
from sparse_scan.engine import _kernels as engine_kernels
from sparse_scan.engine import _scaled_gather
from sparse_scan.engine.products import plan_product
from sparse_scan.engine.run import multiply
from sparse_scan.layers import Conv2d, MaxPool2d

DTYPES = [np.float32, np.float64]
INDEX_DTYPES = [np.int32, np.int64]


def random_operand(rng, rows, cols, density, index_dtype):
    """A random CSR pattern."""
    m = sp.random(rows, cols, density=density, format="csr", random_state=rng)
    return Pattern(m.indptr.astype(index_dtype), m.indices.astype(index_dtype), m.shape)


def values_for(rng, pattern, batch, per_sample, dtype, zeros=0.2):
    """Values on ``pattern``, shared or per sample, a share of them explicit zeros."""
    shape = (batch, pattern.nnz) if per_sample else (pattern.nnz,)
    values = rng.standard_normal(shape)
    values[rng.random(shape) < zeros] = 0.0  # explicit zeros: they stay in the pattern
    return values.astype(dtype)


def scipy_product(pa, a_values, pb, b_values):
    a = sp.csr_matrix((a_values, pa.indices, pa.indptr), pa.shape)
    b = sp.csr_matrix((b_values, pb.indices, pb.indptr), pb.shape)
    return (a @ b).toarray()


def dense(pattern, values):
    out = np.zeros(pattern.shape, dtype=values.dtype)
    rows = np.repeat(np.arange(pattern.shape[0]), np.diff(np.asarray(pattern.indptr, np.int64)))
    out[rows, pattern.indices] = values
    return out


def sample(values, s):
    return values if values.ndim == 1 else values[s]


def threads(monkeypatch, on):
    if on:  # every call large enough to cut over (more workers than samples, or fewer)
        monkeypatch.setattr(host, "workers_for", lambda work, minimum=None: 3)


@pytest.mark.parametrize("method", ["general", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("per_sample", ["neither", "a", "b", "both"])
@pytest.mark.parametrize("threaded", [False, True])
def test_scalar_products_equal_scipy_bit_for_bit(monkeypatch, method, dtype, index_dtype, per_sample,
                                                 threaded):
    threads(monkeypatch, threaded)
    rng = np.random.default_rng([len(method), np.dtype(dtype).itemsize, np.dtype(index_dtype).itemsize])
    batch = 4
    pa = random_operand(rng, 37, 29, 0.2, index_dtype)
    pb = random_operand(rng, 29, 41, 0.25, index_dtype)
    a_values = values_for(rng, pa, batch, per_sample in ("a", "both"), dtype)
    b_values = values_for(rng, pb, batch, per_sample in ("b", "both"), dtype)
    stored = plan_product(pa, pb, "general", "general", index_dtype=index_dtype)
    plan = stored if method == "general" else plan_product(
        pa, pb, "general", "general", index_dtype=index_dtype, budget_bytes=stored.multiply_adds * 11)
    assert plan.method == method and plan.starts is not None or method == "rowwise"
    assert plan.out.index_dtype == index_dtype
    got = multiply(plan, a_values, b_values)
    assert got.dtype == dtype and got.shape[-1] == plan.out.nnz == stored.out.nnz
    assert got.shape == ((plan.out.nnz,) if per_sample == "neither" else (batch, plan.out.nnz))
    for s in range(1 if got.ndim == 1 else batch):
        want = scipy_product(pa, sample(a_values, s), pb, sample(b_values, s))
        np.testing.assert_array_equal(dense(plan.out, sample(got, s)), want)


def test_explicit_zeros_stay_in_the_pattern():
    a = Pattern(np.array([0, 2]), np.array([0, 1]), (1, 2))
    b = Pattern(np.array([0, 1, 2]), np.array([0, 0]), (2, 1))
    for plan in (plan_product(a, b, "general", "general"),
                 plan_product(a, b, "general", "general", budget_bytes=23)):
        got = multiply(plan, np.array([1.0, -1.0]), np.array([[2.0, 2.0], [0.0, 0.0]]))
        assert plan.out.nnz == 1 and got.shape == (2, 1)
        np.testing.assert_array_equal(got, [[0.0], [0.0]])  # SciPy would drop both


def runs_kernel(monkeypatch, runs):
    """Every scaling and one-multiply-add product through the run kernel, or none."""
    monkeypatch.setattr(_scaled_gather, "RUNS_MIN_LENGTH", 1 if runs else 10**9)


@pytest.mark.parametrize("kind", ["scale_rows", "scale_columns"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("per_sample", ["neither", "diagonal", "other", "both"])
@pytest.mark.parametrize("runs", [False, True])
def test_scalings_equal_the_dense_products(monkeypatch, kind, dtype, index_dtype, per_sample, runs):
    runs_kernel(monkeypatch, runs)
    rng = np.random.default_rng(3)
    batch, n = 3, 23
    other = random_operand(rng, n, n, 0.3, index_dtype)
    diagonal = Pattern(np.arange(n + 1, dtype=index_dtype), np.arange(n, dtype=index_dtype), (n, n))
    d_values = values_for(rng, diagonal, batch, per_sample in ("diagonal", "both"), dtype)
    o_values = values_for(rng, other, batch, per_sample in ("other", "both"), dtype)
    if kind == "scale_rows":
        plan = plan_product(diagonal, other, "diagonal", "general")
        got = multiply(plan, d_values, o_values)
    else:
        plan = plan_product(other, diagonal, "general", "diagonal")
        got = multiply(plan, o_values, d_values)
    assert plan.method == kind and plan.out.same_as(other)
    for s in range(1 if got.ndim == 1 else batch):
        d, o = np.diag(sample(d_values, s)), dense(other, sample(o_values, s))
        want = d @ o if kind == "scale_rows" else o @ d
        np.testing.assert_array_equal(dense(plan.out, sample(got, s)), want)


@pytest.mark.parametrize("pool_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("per_sample_other", [False, True])
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("runs", [False, True])
def test_selection_gathers_equal_the_dense_products(monkeypatch, pool_first, dtype, index_dtype,
                                                    per_sample_other, threaded, runs):
    threads(monkeypatch, threaded)
    runs_kernel(monkeypatch, runs)
    if threaded:
        monkeypatch.setattr(_scaled_gather, "workers_for", lambda work, minimum=None: 3)
        monkeypatch.setattr("sparse_scan.engine._selection.workers_for", lambda work, minimum=None: 3)
    rng = np.random.default_rng(11)
    batch = 5
    pool = MaxPool2d(2)
    if pool_first:
        x = rng.standard_normal((batch, 2, 6, 8)).astype(dtype)
        conv = Conv2d(2, 3, 3, padding=1, dtype=dtype, rng=1)
        a = pool.transposed_jacobian(x, index_dtype=index_dtype)
        b = conv.transposed_jacobian(pool.forward(x), index_dtype=index_dtype)
    else:
        conv = Conv2d(3, 2, 3, padding=1, dtype=dtype, rng=1)
        x = rng.standard_normal((batch, 3, 6, 8)).astype(dtype)
        a = conv.transposed_jacobian(x, index_dtype=index_dtype)
        b = pool.transposed_jacobian(conv.forward(x), index_dtype=index_dtype)
    a_values, b_values = a.data, b.data
    if per_sample_other:
        if pool_first:
            b_values = (np.broadcast_to(b_values, (batch, b.nnz)) * rng.standard_normal((batch, b.nnz))
                        ).astype(dtype)
        else:
            a_values = (np.broadcast_to(a_values, (batch, a.nnz)) * rng.standard_normal((batch, a.nnz))
                        ).astype(dtype)
    kinds = ("selection", "general") if pool_first else ("general", "selection")
    plan = plan_product(a.pattern, b.pattern, *kinds, index_dtype=index_dtype)
    assert plan.method == "gather" and (plan.selection is None) == pool_first
    if pool_first and not runs:  # a pool gathering rows of a convolution's JT: long runs
        monkeypatch.setattr(_scaled_gather, "RUNS_MIN_LENGTH", 8)
        assert _scaled_gather.find_runs(plan.a_pos, plan.b_pos) is not None
        monkeypatch.setattr(_scaled_gather, "RUNS_MIN_LENGTH", 10**9)
    assert plan.out.index_dtype == index_dtype
    got = multiply(plan, a_values, b_values)
    assert got.dtype == dtype and got.shape == (batch, plan.out.nnz)
    for s in range(batch):
        want = dense(a.pattern, sample(a_values, s)) @ dense(b.pattern, sample(b_values, s))
        np.testing.assert_array_equal(dense(plan.out, got[s]), want)  # one product per entry: exact


def test_stored_products_cut_by_multiply_adds_not_entries(monkeypatch):
    threads(monkeypatch, True)
    calls = []
    real = _host_kernels.launch

    def record(kernel, args, pieces):
        calls.append(pieces)
        return real(kernel, args, pieces)

    monkeypatch.setattr(host, "launch", record)
    rows = np.array([0, 30, 31, 32, 33, 34, 35])  # the first row of A is dense: most of the work
    a = Pattern(rows, np.concatenate((np.arange(30), np.zeros(5, int))), (6, 30))
    b = Pattern(np.arange(31), np.zeros(30, int), (30, 1))
    plan = plan_product(a, b, "general", "general")
    assert plan.out.nnz == 6
    got = multiply(plan, np.ones(35), np.ones(30))
    np.testing.assert_array_equal(got, [30, 1, 1, 1, 1, 1])
    assert calls[-1][0][:4] == (0, 1, 0, 1)  # the first entry alone is about a third of the work


def special_values(rng, shape, dtype):
    """Random values with signed zeros, infinities and NaNs among them."""
    values = rng.standard_normal(shape)
    pick = rng.random(shape)
    values[pick < 0.1] = -0.0
    values[(pick >= 0.1) & (pick < 0.2)] = 0.0
    values[(pick >= 0.2) & (pick < 0.22)] = np.inf
    values[(pick >= 0.22) & (pick < 0.24)] = -np.inf
    values[(pick >= 0.24) & (pick < 0.25)] = np.nan
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("per_sample", ["neither", "a", "both"])
def test_first_term_products_equal_the_per_entry_sums_bit_for_bit(dtype, index_dtype, per_sample):
    """Entries of one to many terms, signed zeros (``0 + -0`` is ``+0``), infinities and NaNs, blocks
    and pieces that cut anywhere: the first-term kernel's values are the per-entry loop's, bit for
    bit."""
    rng = np.random.default_rng([np.dtype(dtype).itemsize, np.dtype(index_dtype).itemsize, len(per_sample)])
    pa, pb = random_operand(rng, 50, 40, 0.1, index_dtype), random_operand(rng, 40, 30, 0.1, index_dtype)
    plan = plan_product(pa, pb, "general", "general", index_dtype=index_dtype)
    terms = np.diff(np.append(plan.starts, plan.multiply_adds))
    assert terms.min() == 1 and terms.max() >= 3
    batch, nnz = 3 if per_sample != "neither" else 1, plan.out.nnz
    a = special_values(rng, (batch if per_sample != "neither" else 1, pa.nnz), dtype)
    b = special_values(rng, (batch if per_sample == "both" else 1, pb.nnz), dtype)
    k = engine_kernels
    args = (a, b, plan.a_pos, plan.b_pos, plan.starts, plan.multiply_adds)
    want = np.empty((batch, nnz), dtype)
    k.stored_products(*args, want, 0, batch, 0, nnz, nnz)
    bits = np.int32 if dtype == np.float32 else np.int64
    for pieces in ([(0, batch, 0, nnz)], [(0, batch, 0, 7), (0, batch, 7, nnz - 1), (0, batch, nnz - 1, nnz)],
                   [(0, 1, 0, nnz), (1, batch, 0, nnz)]):
        for block in (1, 5, 8192):
            got = np.full((batch, nnz), np.nan, dtype)
            for piece in pieces:
                k.first_term_products(*args, got, *piece, block)
            assert np.array_equal(got.view(bits), want.view(bits))


def test_stored_products_stream_first_terms_only_where_sums_are_short(monkeypatch):
    kernels_run = []
    real = _host_kernels.launch
    monkeypatch.setattr(host, "launch", lambda kernel, args, pieces: (kernels_run.append(kernel.__name__),
                                                                       real(kernel, args, pieces)))
    rng = np.random.default_rng(4)
    short = plan_product(random_operand(rng, 50, 40, 0.05, np.int32),
                         random_operand(rng, 40, 60, 0.05, np.int32), "general", "general")
    long = plan_product(random_operand(rng, 20, 30, 0.8, np.int32),
                        random_operand(rng, 30, 10, 0.8, np.int32), "general", "general")
    for plan in (short, long):
        assert plan.method == "general" and plan.starts is not None
        multiply(plan, np.ones(plan.operands[0].nnz), np.ones(plan.operands[1].nnz))
    assert short.multiply_adds <= host.FIRST_TERM_MAX_TERMS * short.out.nnz
    assert long.multiply_adds > host.FIRST_TERM_MAX_TERMS * long.out.nnz
    assert kernels_run == ["first_term_products", "stored_products"]


def test_numba_is_not_imported_by_the_package_or_the_cli():
    """Every module of the package (the PyTorch front door's aside: it imports torch) and the command
    line import without numba: the compiled kernels' modules bind numba at their first call."""
    code = ("import importlib, pkgutil, sys, sparse_scan, sparse_scan.cli.app\n"
            "for info in pkgutil.walk_packages(sparse_scan.__path__, 'sparse_scan.'):\n"
            "    if not info.name.startswith('sparse_scan.torch'):\n"
            "        importlib.import_module(info.name)\n"
            "assert 'numba' not in sys.modules, 'numba imported'\n"
            "assert {'sparse_scan.layers._kernels', 'sparse_scan.engine._kernels'} <= set(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_compiled_kernel_binds_its_module_on_its_first_call():
    """The first call compiles through numba: the kernel's module then holds numba dispatchers (so
    kernels calling kernels compile), and the kernel object callers imported calls the same one."""
    code = ("import sys, numpy as np\n"
            "from sparse_scan.layers import _kernels\n"
            "from sparse_scan.layers._kernels import relu_backward\n"
            "from sparse_scan._host_kernels import CompiledKernel\n"
            "assert isinstance(relu_backward, CompiledKernel) and 'numba' not in sys.modules\n"
            "out = np.empty(3)\n"
            "relu_backward(np.array([-1.0, 0.0, 2.0]), np.array([5.0, 6.0, 7.0]), out, 0, 3)\n"
            "assert out.tolist() == [0.0, 0.0, 7.0] and 'numba' in sys.modules\n"
            "assert _kernels.relu_backward is relu_backward.dispatcher() is relu_backward.dispatcher()\n"
            "assert not any(isinstance(value, CompiledKernel) for value in vars(_kernels).values())\n"
            "assert relu_backward.__name__ == 'relu_backward' and relu_backward.__doc__\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cache_directory_falls_back_only_where_numba_could_not_cache(tmp_path, monkeypatch):
    package, cache = tmp_path / "package", tmp_path / "cache"
    package.mkdir()
    environ = {"XDG_CACHE_HOME": str(cache)}
    assert _host_kernels.cache_directory(environ, package) is None  # numba's default: __pycache__ there
    real = _host_kernels._writable
    read_only = [str(package)]
    monkeypatch.setattr(_host_kernels, "_writable",
                        lambda folder: not str(folder).startswith(tuple(read_only)) and real(folder))
    assert _host_kernels.cache_directory(environ, package) is None  # numba's own user cache
    read_only.append(str(cache))
    chosen = _host_kernels.cache_directory(environ, package)
    assert chosen is not None and pathlib.Path(chosen).name.startswith("sparse-scan-numba-")
    assert _host_kernels.cache_directory({"NUMBA_CACHE_DIR": "/x", **environ}, package) is None


def test_kernels_load_from_a_fallback_cache_in_a_fresh_process(tmp_path):
    # numba reads NUMBA_CACHE_DIR: a process pointed at an empty folder compiles there, the next loads
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = ("import numpy as np; from sparse_scan.engine._scaled_gather import scaled_gather; "
            "assert (scaled_gather(np.ones(3), np.arange(2.0), np.array([0, 1, 1])) == [0, 1, 1]).all()")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert any(p.suffix == ".nbi" for p in pathlib.Path(tmp_path).rglob("*"))


def max_pool_oracle(x):
    """1 at each 2x2 window's selected input (row-major order: its last NaN, else its first maximum,
    PyTorch's choice), on the windows' inputs in input order."""
    batch, channels, height, width = x.shape
    ho, wo = height // 2, width // 2
    windows = x[:, :, :2 * ho, :2 * wo].reshape(batch, channels, ho, 2, wo, 2).transpose(0, 1, 2, 4, 3, 5)
    windows = windows.reshape(batch, channels, ho, wo, 4)
    nan = np.isnan(windows)
    first = np.where(nan, -np.inf, windows).argmax(axis=-1)  # argmax: the first maximum
    last_nan = 3 - nan[..., ::-1].argmax(axis=-1)
    ones = np.eye(4, dtype=x.dtype)[np.where(nan.any(axis=-1), last_nan, first)]
    ones = ones.reshape(batch, channels, ho, wo, 2, 2)
    return ones.transpose(0, 1, 2, 4, 3, 5).reshape(batch, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [(8, 8), (7, 9), (4, 34), (2, 2)])
@pytest.mark.parametrize("threaded", [False, True])
def test_two_by_two_max_pool_values_equal_pytorchs_choice(monkeypatch, dtype, size, threaded):
    from sparse_scan.layers import _pooling_jt as pooling

    if threaded:
        monkeypatch.setattr(pooling, "workers_for", lambda work, minimum=None: 3)
    rng = np.random.default_rng(size)
    x = rng.integers(-2, 3, (3, 2) + size).astype(dtype)  # many ties
    x[0, 0, :2, :2] = [[0.0, -0.0], [-0.0, 0.0]]  # signed zeros tie
    layer = MaxPool2d(2)
    got = layer.transposed_jacobian(x).data
    np.testing.assert_array_equal(got, max_pool_oracle(x))
    assert np.signbit(got).sum() == 0
    x[2, 1, size[0] // 2 * 2 - 1, 0] = np.nan
    x[1].reshape(-1)[::3] = np.nan  # NaN at every corner, several in a window
    np.testing.assert_array_equal(layer.transposed_jacobian(x).data, max_pool_oracle(x))


def first_maximum_oracle(layer, x):
    """Dense JTs ``(B, inputs, outputs)``: per output, 1 at the element of its window (window order,
    real elements only) that PyTorch selects: each replaces the one held if strictly greater or NaN
    (the last NaN, else the first maximum), written as a plain loop."""
    batch, channels, height, width = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer._kernel, layer._stride, layer._padding, layer._dilation
    _, ho, wo = layer.output_shape(x.shape[1:])
    out = np.zeros((batch, channels * height * width, channels * ho * wo), dtype=x.dtype)
    for b in range(batch):
        for c in range(channels):
            for oh in range(ho):
                for ow in range(wo):
                    best = None
                    for i in range(kh):
                        for j in range(kw):
                            ih, iw = oh * sh - ph + i * dh, ow * sw - pw + j * dw
                            if 0 <= ih < height and 0 <= iw < width and (
                                    best is None or x[b, c, ih, iw] > x[b, c, best[0], best[1]]
                                    or np.isnan(x[b, c, ih, iw])):
                                best = (ih, iw)
                    out[b, (c * height + best[0]) * width + best[1], (c * ho + oh) * wo + ow] = 1
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threaded", [False, True])
def test_max_pool_values_of_any_window_geometry_equal_the_first_maximum(monkeypatch, dtype, threaded):
    """The window loop (:func:`max_pool_windows`) on overlapping, padded, dilated, clipped and odd
    windows, cut over planes or not, with ties, -inf and NaN."""
    from sparse_scan.layers import _pooling_jt as pooling

    if threaded:
        monkeypatch.setattr(pooling, "workers_for", lambda work, minimum=None: 3)
    rng = np.random.default_rng(11)
    for kwargs, shape in [(dict(kernel_size=3, stride=2, padding=1), (2, 7, 6)),
                          (dict(kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1), ceil_mode=True),
                           (3, 6, 7)),
                          (dict(kernel_size=2, ceil_mode=True), (2, 5, 5)),
                          (dict(kernel_size=2), (2, 5, 4)),
                          (dict(kernel_size=1), (1, 3, 3))]:
        layer = MaxPool2d(**kwargs)
        x = rng.integers(-2, 3, (4,) + shape).astype(dtype)  # many ties
        x[0, 0, :3, :3] = -np.inf
        jt = layer.transposed_jacobian(x)
        np.testing.assert_array_equal(jt.todense(), first_maximum_oracle(layer, x))
        assert np.signbit(jt.data).sum() == 0
        x[3, -1, 0, 0] = np.nan  # in the first window of every geometry here
        x[2].reshape(-1)[::4] = np.nan
        np.testing.assert_array_equal(layer.transposed_jacobian(x).todense(), first_maximum_oracle(layer, x))
