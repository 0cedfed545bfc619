"""The stand-in's ``cupy.cuda``: its devices, one stream, events, pinned memory, the runtime's probes
and NCCL.

Work runs when it is launched, so there is nothing to wait for; what would wait on a GPU is still
recorded in :data:`~._array.STATS` (``Stream.synchronize``, ``Event.synchronize``,
``Device.synchronize``, ``runtime.deviceSynchronize``). ``Event.done`` asks without waiting, as
``cudaEventQuery`` does.

One device by default; ``SPARSE_SCAN_STANDIN_DEVICES=N`` makes ``N`` (all of them the host's memory:
which one is current only names it). ``cupy.cuda.nccl`` is what CuPy has without the NCCL library
(``available`` False), unless ``SPARSE_SCAN_STANDIN_NCCL=1``: then its point-to-point ``send`` and
``recv`` move the bytes between the processes of ``MPI.COMM_WORLD`` (mpi4py), in the order they were
posted per pair, as NCCL matches them; a ``recv`` completes when it is launched, as all work here.
"""

from __future__ import annotations

import ctypes
import os
import types
from typing import Any

import numpy as np

from ._array import STATS, pin, timer

DEVICES = max(1, int(os.environ.get("SPARSE_SCAN_STANDIN_DEVICES", "1")))

AVAILABLE = {"value": False}
"""Whether ``is_available()`` says yes: the conftest turns the device on for ``gpu`` tests only, so
that ``device="auto"`` elsewhere stays on the CPU as on a machine without a GPU."""

PROPERTIES = {
    "name": b"CuPy stand-in (CPU)", "major": 9, "minor": 0, "multiProcessorCount": 132,
    "maxThreadsPerBlock": 1024, "sharedMemPerBlock": 48 * 1024, "totalGlobalMem": 80 * 2**30,
    "warpSize": 32, "maxGridSize": (2**31 - 1, 65535, 65535), "maxThreadsDim": (1024, 1024, 64),
}


class CUDARuntimeError(RuntimeError):
    """What CuPy raises for a failed runtime call."""


def is_available() -> bool:
    return AVAILABLE["value"]


class Device:
    """``cupy.cuda.Device``: ``DEVICES`` of them (one by default); no argument names the current one."""

    def __init__(self, device: Any = None) -> None:
        device = _CURRENT_DEVICE["id"] if device is None else int(device)
        if not 0 <= device < DEVICES:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal (the stand-in has "
                                   f"{DEVICES})")
        self.id = device

    compute_capability = property(lambda self: "90")

    def __enter__(self) -> "Device":
        self._previous = _CURRENT_DEVICE["id"]
        _CURRENT_DEVICE["id"] = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT_DEVICE["id"] = self._previous

    def synchronize(self) -> None:
        STATS.sync("Device.synchronize")

    def use(self) -> None:
        _CURRENT_DEVICE["id"] = self.id

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Device", self.id))


_CURRENT_DEVICE = {"id": 0}


class Stream:
    """``cupy.cuda.Stream``: work is done at launch, so a stream only orders what tests count."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int = 0) -> None:
        self.ptr = 0 if null else id(self)

    def synchronize(self) -> None:
        STATS.sync("Stream.synchronize")

    @property
    def done(self) -> bool:
        return True

    def use(self) -> "Stream":
        _CURRENT["stream"] = self
        return self

    def __enter__(self) -> "Stream":
        self._previous = _CURRENT["stream"]
        _CURRENT["stream"] = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT["stream"] = self._previous

    def record(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: "Event") -> None:
        """Order this stream after ``event`` (work is done at launch: nothing to wait for)."""
        return None


class ExternalStream(Stream):
    """``cupy.cuda.ExternalStream(ptr)``: a stream another library made (PyTorch's current stream)."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__()
        self.ptr = int(ptr)


Stream.null = Stream(null=True)
_CURRENT: dict[str, Stream] = {"stream": Stream.null}


def get_current_stream(device_id: int = -1) -> Stream:
    return _CURRENT["stream"]


class Event:
    """``cupy.cuda.Event``: records the host time (work is already done when it is recorded)."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = timer()

    @property
    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        STATS.sync("Event.synchronize")


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    if start.time is None or end.time is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: an event was not recorded")
    return (end.time - start.time) * 1e3


class MemoryPool:
    """``cupy.get_default_memory_pool()`` and friends: nothing to pool on the host."""

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream: Any = None) -> None:
        return None

    def malloc(self, size: int) -> Any:
        raise NotImplementedError("the CuPy stand-in allocates through cupy.empty only")


def set_allocator(allocator: Any = None) -> None:
    return None


def set_pinned_memory_allocator(allocator: Any = None) -> None:
    return None


class PinnedMemoryPointer:
    """``cupy.cuda.alloc_pinned_memory(nbytes)``: a host buffer marked as pinned (a buffer protocol)."""

    def __init__(self, nbytes: int) -> None:
        self._buffer = pin(np.empty(max(int(nbytes), 1), dtype=np.uint8))
        self.ptr = self._buffer.__array_interface__["data"][0]
        self.size = int(nbytes)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._buffer)[: self.size]


def alloc_pinned_memory(nbytes: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(nbytes)


def _runtime() -> types.ModuleType:
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.is_hip = False
    runtime.CUDARuntimeError = CUDARuntimeError
    runtime.getDeviceCount = lambda: DEVICES
    runtime.getDevice = lambda: _CURRENT_DEVICE["id"]
    runtime.runtimeGetVersion = lambda: 13000
    runtime.driverGetVersion = lambda: 13000

    def get_properties(device: int) -> dict:
        Device(device)
        return dict(PROPERTIES)

    def device_synchronize() -> None:
        STATS.sync("runtime.deviceSynchronize")

    runtime.getDeviceProperties = get_properties
    runtime.deviceSynchronize = device_synchronize
    return runtime


NCCL_UINT8 = 1  # ncclUint8, as cupy.cuda.nccl names it


class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)`` over ``MPI.COMM_WORLD`` (a duplicate of it:
    made by every rank together, as NCCL's communicators are); ``send`` and ``recv`` of ``count`` items of
    ``datatype`` (bytes only) from and to device pointers."""

    def __init__(self, ndev: int, commId: tuple, rank: int) -> None:  # noqa: N803 - CuPy's names
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = MPI.COMM_WORLD.Dup()
        if (self._comm.Get_size(), self._comm.Get_rank()) != (ndev, rank):
            raise RuntimeError("NCCL error: ndev and rank must be COMM_WORLD's size and rank here")
        if not (isinstance(commId, tuple) and len(commId) == 128):
            raise TypeError("commId must be the tuple of get_unique_id()")
        self._sends: list[tuple[Any, bytes]] = []

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        if datatype != NCCL_UINT8:
            raise NotImplementedError("the stand-in's NCCL moves bytes (NCCL_UINT8) only")
        data = ctypes.string_at(sendbuf, count)  # the bytes now: work is done at launch
        self._sends = [(request, kept) for request, kept in self._sends if not request.Test()]
        self._sends.append((self._comm.Isend([data, self._mpi.BYTE], dest=peer, tag=0), data))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        if datatype != NCCL_UINT8:
            raise NotImplementedError("the stand-in's NCCL moves bytes (NCCL_UINT8) only")
        target = (ctypes.c_char * count).from_address(recvbuf)
        self._comm.Recv([target, self._mpi.BYTE], source=peer, tag=0)


def _nccl() -> types.ModuleType:
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = os.environ.get("SPARSE_SCAN_STANDIN_NCCL") == "1"
    if nccl.available:
        nccl.NCCL_UINT8 = NCCL_UINT8
        nccl.NcclCommunicator = NcclCommunicator
        nccl.get_unique_id = lambda: tuple(int(b) for b in os.urandom(128))
    return nccl


def module() -> types.ModuleType:
    """The ``cupy.cuda`` module of the stand-in."""
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = _runtime()
    cuda.nccl = _nccl()
    for value in (is_available, Device, Stream, ExternalStream, Event, get_current_stream, get_elapsed_time,
                  MemoryPool,
                  set_allocator, set_pinned_memory_allocator, PinnedMemoryPointer, alloc_pinned_memory):
        setattr(cuda, value.__name__, value)
    cuda.CUDARuntimeError = CUDARuntimeError
    return cuda
