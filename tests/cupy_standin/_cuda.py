"""The stand-in's ``cupy.cuda``: one device, one stream, events, pinned memory and the runtime's probes.

Work runs when it is launched, so there is nothing to wait for; what would wait on a GPU is still
recorded in :data:`~._array.STATS` (``Stream.synchronize``, ``Event.synchronize``,
``Device.synchronize``, ``runtime.deviceSynchronize``). ``Event.done`` asks without waiting, as
``cudaEventQuery`` does.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from ._array import STATS, pin, timer

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
    """``cupy.cuda.Device``: only device 0 exists."""

    def __init__(self, device: Any = None) -> None:
        device = 0 if device is None else int(device)
        if device != 0:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal (the stand-in has one)")
        self.id = device

    compute_capability = property(lambda self: "90")

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def synchronize(self) -> None:
        STATS.sync("Device.synchronize")

    def use(self) -> None:
        return None

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Device", self.id))


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
    runtime.getDeviceCount = lambda: 1
    runtime.getDevice = lambda: 0
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


def module() -> types.ModuleType:
    """The ``cupy.cuda`` module of the stand-in."""
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = _runtime()
    for value in (is_available, Device, Stream, ExternalStream, Event, get_current_stream, get_elapsed_time,
                  MemoryPool,
                  set_allocator, set_pinned_memory_allocator, PinnedMemoryPointer, alloc_pinned_memory):
        setattr(cuda, value.__name__, value)
    cuda.CUDARuntimeError = CUDARuntimeError
    return cuda
