"""The stand-in's ``cupyx.scipy.sparse.csr_matrix``: device arrays in, SciPy's arithmetic underneath."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse

from ._array import STATS, host_array_error, ndarray, wrap


class csr_matrix:
    """A CSR matrix on the device: ``csr_matrix((data, indices, indptr), shape=...)`` of device arrays."""

    format = "csr"

    def __init__(self, arg1: Any, shape: Any = None, dtype: Any = None, copy: bool = False) -> None:
        if not (isinstance(arg1, tuple) and len(arg1) == 3):
            raise NotImplementedError("the CuPy stand-in builds csr_matrix((data, indices, indptr)) only")
        for part in arg1:
            if isinstance(part, np.ndarray):
                raise host_array_error(part)
            if not isinstance(part, ndarray):
                raise TypeError(f"csr_matrix parts must be cupy.ndarray; got {type(part)}")
        data, indices, indptr = arg1
        self._matrix = scipy.sparse.csr_matrix((data._array, indices._array, indptr._array), shape=shape,
                                               dtype=dtype, copy=copy)

    shape = property(lambda self: self._matrix.shape)
    nnz = property(lambda self: self._matrix.nnz)
    dtype = property(lambda self: self._matrix.dtype)
    data = property(lambda self: ndarray._of(self._matrix.data))
    indices = property(lambda self: ndarray._of(self._matrix.indices))
    indptr = property(lambda self: ndarray._of(self._matrix.indptr))

    def get(self, stream: Any = None) -> scipy.sparse.csr_matrix:
        STATS.sync("csr_matrix.get")
        return self._matrix.copy()

    def toarray(self, order: Any = None, out: Any = None) -> ndarray:
        return ndarray._of(self._matrix.toarray(order=order))

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, csr_matrix):
            result = self._matrix @ other._matrix
            matrix = csr_matrix.__new__(csr_matrix)
            matrix._matrix = result.tocsr()
            return matrix
        if isinstance(other, np.ndarray):
            raise host_array_error(other)
        if not isinstance(other, ndarray):
            return NotImplemented
        return wrap(np.asarray(self._matrix @ other._array))

    dot = __matmul__


def issparse(x: Any) -> bool:
    return isinstance(x, csr_matrix)
