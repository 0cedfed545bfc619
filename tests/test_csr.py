"""Batched CSR: index dtype choice, dense/scipy conversions, explicit zeros, byte accounting."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse

from sparse_scan import backend, csr
from sparse_scan.csr import INT32_MAX, BatchedCSR, Pattern, choose_index_dtype


def random_pattern(rows, cols, density, seed, index_dtype=np.int32):
    """A random CSR pattern (sorted, unique columns per row) and its scipy matrix of ones."""
    rng = np.random.default_rng(seed)
    mask = rng.random((rows, cols)) < density
    m = scipy.sparse.csr_matrix(mask.astype(np.float64))
    m.sort_indices()
    pattern = Pattern(m.indptr.astype(index_dtype), m.indices.astype(index_dtype), (rows, cols))
    return pattern, m


# --- choose_index_dtype ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nnz", "ncols", "expected"),
    [
        (0, 0, np.int32),
        (10, 10, np.int32),
        (INT32_MAX, 5, np.int32),
        (5, INT32_MAX, np.int32),
        (INT32_MAX + 1, 5, np.int64),
        (5, INT32_MAX + 1, np.int64),
        (2**40, 2**40, np.int64),
    ],
)
def test_index_dtype_int32_while_it_fits(nnz, ncols, expected):
    assert choose_index_dtype(nnz, ncols) == np.dtype(expected)


@pytest.mark.parametrize("requested", [np.int64, "int64", np.dtype(np.int64)])
def test_index_dtype_int64_can_be_forced(requested):
    assert choose_index_dtype(10, 10, requested) == np.dtype(np.int64)


def test_index_dtype_int32_can_be_requested_when_it_fits():
    assert choose_index_dtype(INT32_MAX, INT32_MAX, np.int32) == np.dtype(np.int32)


@pytest.mark.parametrize(("nnz", "ncols"), [(INT32_MAX + 1, 1), (1, INT32_MAX + 1)])
def test_forcing_int32_on_overflow_is_an_error(nnz, ncols):
    with pytest.raises(ValueError, match="int32 cannot hold"):
        choose_index_dtype(nnz, ncols, np.int32)


@pytest.mark.parametrize("requested", [np.int16, np.uint32, np.float64, "int8"])
def test_other_index_dtypes_are_rejected(requested):
    with pytest.raises(ValueError, match="index_dtype must be int32 or int64"):
        choose_index_dtype(10, 10, requested)


def test_layer_pattern_forced_int64_and_int32_overflow():
    from sparse_scan.layers import ReLU

    relu = ReLU()
    p64 = relu.pattern((3, 4, 5), index_dtype=np.int64)
    assert p64.index_dtype == np.int64 and p64.indptr.dtype == np.int64
    assert relu.pattern((3, 4, 5)).index_dtype == np.int32
    x = np.linspace(-1, 1, 2 * 60).reshape(2, 3, 4, 5)
    jt64 = relu.transposed_jacobian(x, index_dtype=np.int64)
    jt32 = relu.transposed_jacobian(x)
    assert jt64.indices.dtype == np.int64
    np.testing.assert_array_equal(jt64.todense(), jt32.todense())
    # forcing int32 on a pattern too large for it fails before anything is allocated
    with pytest.raises(ValueError, match="int32 cannot hold"):
        relu.pattern((2**31,), index_dtype=np.int32)


# --- Pattern -----------------------------------------------------------------------------------
def test_pattern_basics():
    p = Pattern(np.array([0, 2, 2, 3], np.int32), np.array([0, 3, 1], np.int32), (3, 4))
    assert p.nnz == 3
    assert p.index_dtype == np.int32
    assert p.nbytes == 4 * 4 + 3 * 4
    assert p.density == pytest.approx(3 / 12)
    assert p.sparsity == pytest.approx(1 - 3 / 12)
    assert p.to("cpu") is p
    assert p.same_as(Pattern(p.indptr.astype(np.int64), p.indices.copy(), (3, 4)))
    assert not p.same_as(Pattern(p.indptr, p.indices, (3, 5)))
    assert not p.same_as(Pattern(p.indptr, np.array([0, 2, 1], np.int32), (3, 4)))


def test_empty_pattern_density():
    p = Pattern(np.zeros(1, np.int32), np.zeros(0, np.int32), (0, 0))
    assert p.nnz == 0 and p.density == 0.0


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_row_of_entries(index_dtype):
    indptr = np.array([0, 2, 2, 3, 6], index_dtype)  # row 1 is empty
    p = Pattern(indptr, np.array([0, 3, 1, 0, 1, 2], index_dtype), (4, 4))
    rows = p.row_of_entries()
    np.testing.assert_array_equal(rows, [0, 0, 2, 3, 3, 3])
    assert rows.dtype == np.dtype(index_dtype)


def test_row_of_entries_matches_scipy():
    p, m = random_pattern(37, 23, 0.2, seed=1)
    np.testing.assert_array_equal(p.row_of_entries(), m.tocoo().row)


# --- BatchedCSR: conversions -------------------------------------------------------------------
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shared_values_todense_and_scipy(index_dtype, dtype):
    p, m = random_pattern(17, 29, 0.15, seed=2, index_dtype=index_dtype)
    values = np.random.default_rng(3).standard_normal(p.nnz).astype(dtype)
    jt = BatchedCSR(p, values)
    expected = scipy.sparse.csr_matrix((values, m.indices, m.indptr), shape=m.shape).toarray()
    assert jt.shared and jt.batch_size is None
    dense = jt.todense()
    assert dense.shape == (17, 29) and dense.dtype == dtype
    np.testing.assert_array_equal(dense, expected)
    for sample in (0, 5, -1):  # shared values serve every sample
        np.testing.assert_array_equal(jt.to_scipy(sample).toarray(), expected)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_batched_values_todense_and_scipy(index_dtype):
    p, m = random_pattern(19, 11, 0.3, seed=4, index_dtype=index_dtype)
    batch = np.random.default_rng(5).standard_normal((3, p.nnz))
    jt = BatchedCSR(p, batch)
    assert not jt.shared and jt.batch_size == 3
    dense = jt.todense()
    assert dense.shape == (3, 19, 11)
    for b in range(3):
        expected = scipy.sparse.csr_matrix((batch[b], m.indices, m.indptr), shape=m.shape)
        np.testing.assert_array_equal(dense[b], expected.toarray())
        got = jt.to_scipy(b)
        assert isinstance(got, scipy.sparse.csr_matrix)
        np.testing.assert_array_equal(got.toarray(), expected.toarray())
        np.testing.assert_array_equal(got.indptr, m.indptr)
        np.testing.assert_array_equal(got.indices, m.indices)
    np.testing.assert_array_equal(jt.to_scipy(-1).toarray(), dense[2])


def test_structure_properties_forward_to_the_pattern():
    p, _ = random_pattern(5, 6, 0.5, seed=6)
    jt = BatchedCSR(p, np.ones((2, p.nnz), np.float32))
    assert jt.indptr is p.indptr and jt.indices is p.indices
    assert jt.shape == (5, 6) and jt.nnz == p.nnz and jt.dtype == np.float32


def test_explicit_zeros_are_kept():
    p, m = random_pattern(8, 9, 0.4, seed=7)
    data = np.ones((2, p.nnz))
    data[0, ::2] = 0.0  # input-dependent zeros, e.g. ReLU's off units
    data[1, :] = 0.0
    jt = BatchedCSR(p, data)
    for b in range(2):
        s = jt.to_scipy(b)
        assert s.nnz == p.nnz  # scipy's nnz counts stored entries: nothing was dropped
        np.testing.assert_array_equal(s.data, data[b])
        np.testing.assert_array_equal(s.indices, p.indices)
    assert jt.todense()[1].sum() == 0.0


def test_sample_out_of_range_is_a_clear_error():
    p, _ = random_pattern(4, 4, 0.5, seed=8)
    jt = BatchedCSR(p, np.ones((2, p.nnz)))
    for sample in (2, -3):
        with pytest.raises(IndexError, match="out of range for batch of 2"):
            jt.to_scipy(sample)


# --- BatchedCSR: memory accounting -------------------------------------------------------------
def test_nbytes_shared():
    p, _ = random_pattern(30, 40, 0.1, seed=9)
    jt = BatchedCSR(p, np.zeros(p.nnz, np.float32))
    assert jt.nbytes_pattern == 31 * 4 + p.nnz * 4
    assert jt.nbytes_values == p.nnz * 4
    assert jt.nbytes_dense == 30 * 40 * 4


def test_nbytes_batched_int64():
    p, _ = random_pattern(30, 40, 0.1, seed=9, index_dtype=np.int64)
    jt = BatchedCSR(p, np.zeros((5, p.nnz), np.float64))
    assert jt.nbytes_pattern == 31 * 8 + p.nnz * 8  # the pattern is stored once for the batch
    assert jt.nbytes_values == 5 * p.nnz * 8
    assert jt.nbytes_dense == 5 * 30 * 40 * 8


def test_todense_refuses_large_allocations():
    p = Pattern(np.zeros(100_001, np.int32), np.zeros(0, np.int32), (100_000, 100_000))
    jt = BatchedCSR(p, np.zeros(0, np.float32))
    assert jt.nbytes_dense == 4 * 10**10
    with pytest.raises(ValueError, match="todense would allocate 40000000000 bytes"):
        jt.todense()
    small, _ = random_pattern(10, 10, 0.5, seed=10)
    jt = BatchedCSR(small, np.ones(small.nnz))
    with pytest.raises(ValueError, match=r"limit 799\)"):
        jt.todense(limit_bytes=799)
    assert jt.todense(limit_bytes=800).shape == (10, 10)


# --- BatchedCSR: bad data ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape", [(), (3,), (6,), (2, 3), (2, 5), (1, 2, 4), (4, 1)]
)
def test_bad_data_shape_is_a_value_error(shape):
    p = Pattern(np.array([0, 2, 4], np.int32), np.array([0, 1, 0, 1], np.int32), (2, 2))
    with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) or \(B, nnz\) with nnz=4"):
        BatchedCSR(p, np.zeros(shape))


# --- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_to_cupyx_and_device_round_trip():
    cupy = pytest.importorskip("cupy")
    p, _ = random_pattern(12, 7, 0.3, seed=11)
    batch = np.random.default_rng(12).standard_normal((2, p.nnz)).astype(np.float32)
    gp = p.to("gpu")
    assert gp.same_as(p) and gp.to("gpu") is gp
    jt = BatchedCSR(gp, cupy.asarray(batch))
    for b in range(2):
        np.testing.assert_array_equal(jt.to_cupyx(b).toarray().get(), jt.to_scipy(b).toarray())
    np.testing.assert_array_equal(jt.todense().get(), BatchedCSR(p, batch).todense())
    np.testing.assert_array_equal(gp.row_of_entries().get(), p.row_of_entries())


def test_row_of_entries_twins_agree_with_empty_rows():
    """The GPU twin searches the row ends on the device (NumPy stands in for CuPy here)."""
    rng = np.random.default_rng(5)
    for index_dtype in (np.int32, np.int64):
        counts = rng.integers(0, 4, 30)
        counts[[0, 7, 29]] = 0
        indptr = np.concatenate(([0], np.cumsum(counts))).astype(index_dtype)
        stand_in = backend.Backend("gpu", np, scipy.sparse)
        got = csr._row_of_entries.twins["gpu"](stand_in, indptr, 30, int(indptr[-1]), np.dtype(index_dtype))
        want = csr._row_of_entries.twins["cpu"](backend.get("cpu"), indptr, 30, int(indptr[-1]),
                                                np.dtype(index_dtype))
        assert got.dtype == want.dtype == index_dtype
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(want, np.repeat(np.arange(30), counts))
