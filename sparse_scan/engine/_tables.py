"""The machinery both GPU executors share: descriptor tables, launch records, workspaces.

The GPU executors (:mod:`._gpu` for a :class:`~sparse_scan.engine.plan.ScanPlan`, :mod:`._dense_gpu`
for a :class:`~sparse_scan.engine.dense_plan.DenseScanPlan`) run a plan as a few kernel launches, each
over consecutive rows of one table of int64 launch descriptors; each kernel file fixes the fields of
its rows. What does not depend on the kernel is written here once:

- :class:`TableBuilder` collects the rows. A field is an integer, a device array (its pointer) or a
  :class:`Patch`: a pointer known only at call time. :meth:`TableBuilder.build` makes the
  :class:`DescriptorTable`, whose :meth:`~DescriptorTable.rows` are the tables of the launches
  (:class:`Level`) and whose :meth:`~DescriptorTable.bind` sets the per-call pointers.
- The table lives in pinned host memory with a copy on the device (:class:`StagedTable`). Copying
  from pageable host memory makes CUDA wait for the copy before returning (a hidden synchronisation in
  every backward); from pinned memory the copy is queued on the current stream like the kernels after
  it. The price is that the pinned buffer must not change while a queued copy may still read it:
  :meth:`StagedTable.patch` asks the event recorded after the previous upload whether it has passed
  (``cudaEventQuery``, no wait) and only waits for it when it has not, i.e. when the same workspace is
  called again before the GPU reached the previous call's upload. That is the one synchronisation a
  backward may make, and only then. A table whose per-call pointers did not move is not uploaded again.
- :func:`allocate` gives the intermediate values their buffers; a value's memory is reused, best fit,
  from the level after its last read.
- :func:`cached_workspace` caches what a plan needs on the device (table, buffers), per call shape and
  device, as long as the plan lives. A workspace serves one stream: calls that share one are ordered by
  the current stream.

CuPy is imported lazily: this module imports on machines without a GPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence, TypeAlias, TypeVar

import numpy as np
from numpy.typing import DTypeLike

from .. import _gpu_kernels
from .._types import Array

__all__ = ["VALUE_DTYPES", "DescriptorTable", "Field", "Level", "Patch", "StagedTable", "TableBuilder",
           "allocate", "cached_workspace", "value_dtype", "workspaces"]

VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""The value dtypes the kernels are instantiated for (:data:`sparse_scan._gpu_kernels.INSTANTIATIONS`)."""

_WORKSPACES: dict[int, dict[Hashable, Any]] = {}

Workspace = TypeVar("Workspace")
Key = TypeVar("Key", bound=Hashable)


def value_dtype(what: str, *dtypes: DTypeLike) -> np.dtype:
    """The dtype ``dtypes`` promote to, which must be one of :data:`VALUE_DTYPES`.

    Raises
    ------
    TypeError
        It is not; the message says that ``what`` runs in float32 or float64.

    Examples
    --------
    >>> import numpy as np
    >>> value_dtype("the GPU scan", np.float32, np.float64)
    dtype('float64')
    """
    dtype = np.result_type(*dtypes)
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"{what} runs in float32 or float64; its values promote to {dtype}")
    return dtype


# --- descriptor tables ------------------------------------------------------------------------------
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
        self.device = _gpu_kernels.cupy_module().asarray(rows)
        self._uploaded: Any = None

    def patch(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Set ``host[positions] = values`` and queue the table's upload on the current stream."""
        cupy = _gpu_kernels.cupy_module()
        if self._uploaded is not None and not self._uploaded.done:
            self._uploaded.synchronize()  # sync: only while the previous call's upload is still queued
        self.host[positions] = values
        stream = cupy.cuda.get_current_stream()
        self.device.set(self.host, stream=stream)
        self._uploaded = cupy.cuda.Event(disable_timing=True)
        self._uploaded.record(stream)


@dataclass(frozen=True)
class Patch:
    """A descriptor field set at every call: per-call pointer ``slot`` plus ``offset`` bytes."""

    slot: int
    offset: int = 0


Field: TypeAlias = "int | np.integer | Array | Patch"
"""A descriptor field as :meth:`TableBuilder.add` takes it."""


class TableBuilder:
    """Collects the rows of a descriptor table, ``fields`` int64s each (a row is padded with zeros).

    A field is an integer, a device array (its pointer; the array is kept alive with the table) or a
    :class:`Patch` (set by :meth:`DescriptorTable.bind` at every call).

    Attributes
    ----------
    rows : list of list of int
    patches : list of (int, int, int)
        ``(position in the flat table, slot, offset)`` of every :class:`Patch`.
    keep : list
        The device arrays whose pointers the rows hold.

    Examples
    --------
    >>> builder = TableBuilder(4)
    >>> builder.add([7, Patch(0, 8)])
    >>> builder.add([1, 2, Patch(1)])
    >>> builder.host().tolist(), builder.patches
    ([7, 0, 0, 0, 1, 2, 0, 0], [(1, 0, 8), (6, 1, 0)])
    """

    def __init__(self, fields: int) -> None:
        self.fields = fields
        self.rows: list[list[int]] = []
        self.patches: list[tuple[int, int, int]] = []
        self.keep: list[Array] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Sequence[Field]) -> None:
        """Append one descriptor."""
        values = []
        for column, value in enumerate(row):
            if isinstance(value, Patch):
                self.patches.append((len(self.rows) * self.fields + column, value.slot, value.offset))
                value = 0
            elif not isinstance(value, (int, np.integer)):
                self.keep.append(value)
                value = _gpu_kernels.device_pointer(value)
            values.append(int(value))
        self.rows.append(values + [0] * (self.fields - len(values)))

    def host(self) -> np.ndarray:
        """The rows as one flat int64 host array (patched fields 0)."""
        return np.array(self.rows, dtype=np.int64).reshape(-1)

    def build(self) -> DescriptorTable:
        """The table in pinned memory and on the current device (one synchronous upload)."""
        return DescriptorTable(self)


class DescriptorTable:
    """The rows of a :class:`TableBuilder` on the device, with their per-call pointers to bind.

    Parameters
    ----------
    builder : TableBuilder
    """

    def __init__(self, builder: TableBuilder) -> None:
        self.fields = builder.fields
        self.staged = StagedTable(builder.host())
        patches = np.array(builder.patches, dtype=np.int64).reshape(-1, 3)
        self._positions, self._slots, self._offsets = (np.ascontiguousarray(c) for c in patches.T)
        self._keep = builder.keep  # the arrays the rows point at live as long as the table
        self._bound = np.zeros(self._positions.size, dtype=np.int64)  # what the device holds there

    def rows(self, first: int, count: int) -> Array:
        """Rows ``first .. first + count - 1`` on the device: the table of one launch."""
        return self.staged.device[first * self.fields:(first + count) * self.fields]

    def bind(self, pointers: Sequence[int]) -> None:
        """Set every :class:`Patch` to ``pointers[slot] + offset``: one upload queued on the current
        stream, none when the device table holds them already."""
        values = np.asarray(pointers, dtype=np.int64)[self._slots] + self._offsets
        if not np.array_equal(values, self._bound):
            self.staged.patch(self._positions, values)
            self._bound = values


@dataclass(eq=False)
class Level:
    """One launch over consecutive rows of a descriptor table: the rows (on the device), how many,
    and its work (work items, or what else the kernel cuts its work into)."""

    table: Array
    steps: int
    items: int

    @property
    def arguments(self) -> tuple[Array, np.int64, np.int64]:
        """``(table, steps, items)`` as the kernels take them (explicit int64 scalars)."""
        return self.table, np.int64(self.steps), np.int64(self.items)


# --- intermediate buffers ------------------------------------------------------------------------------
def allocate(levels: Iterable[tuple[Sequence[tuple[Key, tuple[int, ...]]], Iterable[Key]]],
             dtype: np.dtype) -> dict[Key, Array]:
    """Device buffers of values computed level by level; a value's memory is reused from the level
    after its last read, best fit.

    Parameters
    ----------
    levels : iterable of (computed, released)
        Per level, in order: the ``(key, shape)`` of each value it computes, and the keys of the values
        it reads for the last time (keys without a buffer here, such as inputs, are passed over).
    dtype : numpy.dtype

    Returns
    -------
    dict
        ``key -> array of its shape``. The values of a level are computed concurrently, so they never
        take memory released in that level, nor share memory with each other.
    """
    xp = _gpu_kernels.cupy_module()
    buffers: dict[Key, Array] = {}
    owners: dict[Key, Array] = {}
    free: list[Array] = []
    for computed, released in levels:
        for key, shape in computed:
            size = int(np.prod(shape))
            fits = [(flat.size, k) for k, flat in enumerate(free) if flat.size >= size]
            flat = free.pop(min(fits)[1]) if fits else xp.empty(size, dtype=dtype)  # best fit
            owners[key], buffers[key] = flat, flat[:size].reshape(shape)
        free += [owners.pop(key) for key in released if key in owners]
    return buffers


# --- the workspace cache ---------------------------------------------------------------------------------
def workspaces(plan: object) -> dict[Hashable, Any]:
    """The workspaces cached for ``plan``, by ``(key, device)``: keyed by the plan's identity and
    dropped when the plan is collected, so device memory lives as long as the plan it was built for."""
    key = id(plan)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = {}
        weakref.finalize(plan, _WORKSPACES.pop, key, None)
    return _WORKSPACES[key]


def cached_workspace(plan: object, key: Hashable, build: Callable[[], Workspace]) -> Workspace:
    """The workspace of ``plan`` for ``key`` on the current device; ``build()`` makes it the first time."""
    cache = workspaces(plan)
    key = (key, _gpu_kernels.current_device())
    if key not in cache:
        cache[key] = build()
    return cache[key]
