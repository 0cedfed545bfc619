"""Batched CSR: one sparsity pattern shared by a batch, values per sample or shared.

A transposed Jacobian ``JT`` of a layer has shape ``(in_size, out_size)`` so that
``grad_in = JT @ grad_out``. Its pattern (``indptr``, ``indices``, ``shape``) is fixed by the architecture
and the input shape; its ``data`` is ``(B, nnz)`` when the Jacobian depends on the sample (ReLU,
max-pool) or ``(nnz,)`` when it does not (conv, linear). Input-dependent zeros stay explicit, so the
pattern never changes between batches.

Examples
--------
>>> import numpy as np
>>> from sparse_scan.csr import BatchedCSR, Pattern
>>> p = Pattern(np.array([0, 1, 2], np.int32), np.array([1, 0], np.int32), (2, 2))
>>> jt = BatchedCSR(p, np.array([[2.0, 0.0], [3.0, 4.0]]))
>>> jt.todense()[1]
array([[0., 3.],
       [4., 0.]])
>>> jt.to_scipy(sample=0).nnz  # the explicit zero is kept
2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import backend as _backend
from ._types import Array

__all__ = ["BatchedCSR", "Pattern", "choose_index_dtype"]

INT32_MAX = np.iinfo(np.int32).max
DENSE_LIMIT_BYTES = 2 * 2**30


def choose_index_dtype(nnz: int, ncols: int, requested: Any = None) -> np.dtype:
    """Pick the CSR index dtype: int32 while it fits, int64 beyond.

    Parameters
    ----------
    nnz, ncols : int
        The largest values the ``indptr`` and ``indices`` arrays must hold.
    requested : dtype-like, optional
        Force ``int32`` or ``int64``. Forcing ``int32`` where it would overflow is an error.

    Returns
    -------
    numpy.dtype

    Examples
    --------
    >>> choose_index_dtype(10, 10), choose_index_dtype(2**31, 10)
    (dtype('int32'), dtype('int64'))
    """
    fits32 = max(nnz, ncols) <= INT32_MAX
    if requested is None:
        return np.dtype(np.int32 if fits32 else np.int64)
    dtype = np.dtype(requested)
    if dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise ValueError(f"index_dtype must be int32 or int64; got {dtype}")
    if dtype == np.int32 and not fits32:
        raise ValueError(f"index_dtype int32 cannot hold nnz={nnz}, ncols={ncols}; use int64")
    return dtype


def _row_of_entries_cpu(be: _backend.Backend, indptr: Array, rows: int, nnz: int, dtype: np.dtype) -> Array:
    """NumPy twin: each row's index repeated over its entries."""
    return np.repeat(np.arange(rows, dtype=dtype), np.diff(indptr))


def _row_of_entries_gpu(be: _backend.Backend, indptr: Array, rows: int, nnz: int, dtype: np.dtype) -> Array:
    """CuPy twin: entry ``k``'s row is the number of rows ending at or before ``k`` (a search on the
    device; ``cupy.repeat`` takes no device array of counts before CuPy 14.1)."""
    cp = be.xp
    return cp.searchsorted(indptr[1:], cp.arange(nnz, dtype=dtype), side="right").astype(dtype, copy=False)


_row_of_entries = _backend.twin(cpu=_row_of_entries_cpu, gpu=_row_of_entries_gpu)


@dataclass(frozen=True, eq=False)
class Pattern:
    """The structure of a CSR matrix: ``indptr``, ``indices`` and ``shape``, without values.

    Column indices are sorted within each row and never repeated.

    Attributes
    ----------
    indptr : array of int32 or int64, shape (rows + 1,)
    indices : array of the same dtype, shape (nnz,)
    shape : tuple of int
        ``(rows, cols)``; for a transposed Jacobian ``(in_size, out_size)``.
    """

    indptr: Array
    indices: Array
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        """Number of stored entries (explicit zeros included)."""
        return int(self.indices.shape[0])

    @property
    def index_dtype(self) -> np.dtype:
        """The dtype of ``indptr`` and ``indices``."""
        return np.dtype(self.indices.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held by ``indptr`` and ``indices``."""
        return int(self.indptr.nbytes + self.indices.nbytes)

    @property
    def density(self) -> float:
        """Stored entries over all entries of the matrix."""
        rows, cols = self.shape
        return self.nnz / (rows * cols) if rows * cols else 0.0

    @property
    def sparsity(self) -> float:
        """Fraction of guaranteed zeros: ``1 - density`` (paper Table 1)."""
        return 1.0 - self.density

    def row_of_entries(self) -> Array:
        """Row index of every stored entry, shape ``(nnz,)``, in the pattern's array module."""
        return _row_of_entries(_backend.of(self.indptr), self.indptr, self.shape[0], self.nnz,
                               self.index_dtype)

    def to(self, device: str) -> "Pattern":
        """Return this pattern on ``device`` (``"cpu"`` or ``"gpu"``)."""
        be = _backend.get(device)
        if _backend.of(self.indptr).name == be.name:
            return self
        return Pattern(be.asarray(self.indptr), be.asarray(self.indices), self.shape)

    def same_as(self, other: "Pattern") -> bool:
        """Return whether two patterns have equal shape, ``indptr`` and ``indices`` (on the host)."""
        host = _backend.of(self.indptr).to_host
        other_host = _backend.of(other.indptr).to_host
        return (
            tuple(self.shape) == tuple(other.shape)
            and np.array_equal(host(self.indptr), other_host(other.indptr))
            and np.array_equal(host(self.indices), other_host(other.indices))
        )


@dataclass(frozen=True, eq=False)
class BatchedCSR:
    """A batch of CSR matrices sharing one :class:`Pattern`.

    Attributes
    ----------
    pattern : Pattern
    data : array, shape (B, nnz) or (nnz,)
        Values per sample, or one set of values shared by every sample of the batch.
    """

    pattern: Pattern
    data: Array

    def __post_init__(self) -> None:
        if self.data.ndim not in (1, 2) or self.data.shape[-1] != self.pattern.nnz:
            raise ValueError(
                f"data must have shape (nnz,) or (B, nnz) with nnz={self.pattern.nnz}; "
                f"got {tuple(self.data.shape)}"
            )

    # --- structure -----------------------------------------------------------------------------
    @property
    def indptr(self) -> Array:
        """Row pointers of the shared pattern."""
        return self.pattern.indptr

    @property
    def indices(self) -> Array:
        """Column indices of the shared pattern."""
        return self.pattern.indices

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one sample's matrix."""
        return self.pattern.shape

    @property
    def nnz(self) -> int:
        """Stored entries per sample."""
        return self.pattern.nnz

    @property
    def dtype(self) -> np.dtype:
        """The value dtype."""
        return np.dtype(self.data.dtype)

    @property
    def shared(self) -> bool:
        """Whether one set of values serves the whole batch (sample-independent Jacobian)."""
        return self.data.ndim == 1

    @property
    def batch_size(self) -> int | None:
        """Number of samples with their own values, or ``None`` when values are shared."""
        return None if self.shared else int(self.data.shape[0])

    # --- memory accounting ---------------------------------------------------------------------
    @property
    def nbytes_pattern(self) -> int:
        """Bytes of ``indptr`` + ``indices`` (stored once for the batch)."""
        return self.pattern.nbytes

    @property
    def nbytes_values(self) -> int:
        """Bytes of ``data`` as stored (once if shared, per sample otherwise)."""
        return int(self.data.nbytes)

    @property
    def nbytes_dense(self) -> int:
        """Bytes the same values would take as dense matrices (one, or one per sample)."""
        rows, cols = self.shape
        copies = 1 if self.shared else self.data.shape[0]
        return int(rows * cols * self.dtype.itemsize * copies)

    # --- conversions ---------------------------------------------------------------------------
    def _sample_values(self, sample: int) -> Array:
        if self.shared:
            return self.data
        if not -self.data.shape[0] <= sample < self.data.shape[0]:
            raise IndexError(f"sample {sample} out of range for batch of {self.data.shape[0]}")
        return self.data[sample]

    def to_scipy(self, sample: int = 0) -> Any:
        """Return one sample's matrix as a ``scipy.sparse.csr_matrix`` (explicit zeros kept)."""
        import scipy.sparse  # noqa: PLC0415

        be = _backend.of(self.data)
        return scipy.sparse.csr_matrix(
            (be.to_host(self._sample_values(sample)), be.to_host(self.indices),
             be.to_host(self.indptr)),
            shape=self.shape,
        )

    def to_cupyx(self, sample: int = 0) -> Any:
        """Return one sample's matrix as a ``cupyx.scipy.sparse.csr_matrix`` (needs a usable GPU)."""
        gpu = _backend.get("gpu")
        return gpu.sparse.csr_matrix(
            (gpu.asarray(self._sample_values(sample)), gpu.asarray(self.indices),
             gpu.asarray(self.indptr)),
            shape=self.shape,
        )

    def todense(self, limit_bytes: int = DENSE_LIMIT_BYTES) -> Array:
        """Return the dense matrices: ``(B, rows, cols)``, or ``(rows, cols)`` when shared.

        Parameters
        ----------
        limit_bytes : int
            Refuse (ValueError) to allocate more than this; dense Jacobians are for small checks.
        """
        if self.nbytes_dense > limit_bytes:
            raise ValueError(
                f"todense would allocate {self.nbytes_dense} bytes (limit {limit_bytes}); "
                "dense Jacobians are for small layers only"
            )
        xp = _backend.of(self.data).xp
        rows = self.pattern.row_of_entries()
        lead = self.data.shape[:-1]
        dense = xp.zeros(lead + tuple(self.shape), dtype=self.data.dtype)
        dense[..., rows, self.indices] = self.data
        return dense
