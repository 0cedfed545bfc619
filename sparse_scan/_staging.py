"""A descriptor table in pinned host memory and its device copy, patched and uploaded without a host
synchronisation.

The GPU executors keep one table of launch descriptors per workspace; at every call a few entries
(the pointers of the caller's arrays) change. Copying from pageable host memory makes CUDA wait for the
copy before returning (a hidden synchronisation in every backward); from pinned memory the copy is
queued on the current stream like the kernels after it. The price is that the pinned buffer must not
change while a queued copy may still read it: :meth:`StagedTable.patch` asks the event recorded after
the previous upload whether it has passed (``cudaEventQuery``, no wait) and only waits for it when it
has not, i.e. when the same workspace is called again before the GPU reached the previous call's
upload. That is the one synchronisation a backward may make, and only then.

CuPy is imported lazily: this module imports on machines without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels

__all__ = ["StagedTable"]


class StagedTable:
    """``rows`` (int64) in pinned host memory, with a copy on the current device.

    Parameters
    ----------
    rows : numpy.ndarray of int64
        The table's initial contents; the device copy is made from it once (a synchronous upload,
        while the workspace is built).

    Attributes
    ----------
    host : numpy.ndarray
        The pinned host table (write only through :meth:`patch`).
    device : cupy.ndarray
        Its device copy, as of the last :meth:`patch`.
    """

    def __init__(self, rows: np.ndarray) -> None:
        import cupyx  # noqa: PLC0415 - GPU code only

        self.host = cupyx.empty_pinned(rows.shape, dtype=np.int64)
        self.host[...] = rows
        self.device = _kernels.cupy_module().asarray(rows)
        self._uploaded: Any = None

    def patch(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Set ``host[positions] = values`` and queue the table's upload on the current stream."""
        cupy = _kernels.cupy_module()
        if self._uploaded is not None and not self._uploaded.done:
            self._uploaded.synchronize()  # sync: only while the previous call's upload is still queued
        self.host[positions] = values
        stream = cupy.cuda.get_current_stream()
        self.device.set(self.host, stream=stream)
        self._uploaded = cupy.cuda.Event(disable_timing=True)
        self._uploaded.record(stream)
