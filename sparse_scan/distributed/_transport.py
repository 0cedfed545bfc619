"""How device arrays move between GPU ranks: CUDA-aware MPI, NCCL, or host staging through pinned buffers.

A message of :class:`~sparse_scan.distributed._mpi.Channel` is a Python object; on CPU ranks its NumPy
arrays travel inside the pickled message (``"mpi"``). On GPU ranks every CuPy array in it is taken out
(:func:`split`), the rest is pickled as before, and the arrays follow by the run's transport, chosen
once per run with every rank (:func:`connect`, :func:`choose`), in the order of preference:

- ``"cuda-aware"``: mpi4py passes the device buffers to a CUDA-aware MPI (``Isend``/``Irecv`` of CuPy
  arrays through ``__cuda_array_interface__``), where every rank's MPI says it is one
  (``MPIX_Query_cuda_support``, or ``SPARSE_SCAN_CUDA_AWARE_MPI=1`` to assert it, ``=0`` to deny it);
- ``"nccl"``: NCCL's point-to-point ``send``/``recv`` through ``cupy.cuda.nccl``, where CuPy has NCCL
  and every rank has a device of its own (no two ranks on one host share a device); a pair's messages
  are matched in the order they were posted, and every combine receives them in the order they were
  sent;
- ``"staging"``: each array is copied into a pinned host buffer and sent by plain MPI; the receiver
  copies it up to its device (one wait for the upload per message, so that the buffer may go).

Asking for a transport that is not available here is a :class:`TransportUnavailableError` naming why,
on every rank alike (the facts it is decided from are gathered from every rank first).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _environment

__all__ = ["GPU_TRANSPORTS", "Moved", "Rank", "Slot", "Transport", "TransportUnavailableError", "choose",
           "connect", "devices", "facts", "join", "slots", "split"]

GPU_TRANSPORTS = ("cuda-aware", "nccl", "staging")
"""The transports of GPU ranks, in the order of preference."""
CUDA_AWARE_VARIABLE = _environment.CUDA_AWARE_MPI.name


class TransportUnavailableError(ValueError):
    """The transport asked for cannot run with these ranks (the message says why)."""


@dataclass(frozen=True)
class Slot:
    """Where a device array was taken out of a message: its position among the arrays, shape, dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: str


def _on_device(value: Any) -> bool:
    return type(value).__module__.startswith("cupy") and hasattr(value, "__cuda_array_interface__")


def split(obj: Any, arrays: list[Any] | None = None) -> tuple[Any, list[Any]]:
    """``obj`` with every CuPy array in it replaced by a :class:`Slot`, and those arrays in order.

    It walks tuples, lists, dicts and dataclass instances (a slice matrix); anything else stays.
    """
    arrays = [] if arrays is None else arrays
    before = len(arrays)
    if _on_device(obj):
        arrays.append(obj)
        return Slot(before, tuple(obj.shape), obj.dtype.str), arrays
    if isinstance(obj, (tuple, list)):
        out: Any = type(obj)(split(item, arrays)[0] for item in obj)
    elif isinstance(obj, dict):
        out = {key: split(value, arrays)[0] for key, value in obj.items()}
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: split(getattr(obj, f.name), arrays)[0] for f in dataclasses.fields(obj)}
        out = dataclasses.replace(obj, **changes) if len(arrays) > before else obj
    else:
        out = obj
    return (out if len(arrays) > before else obj), arrays


def join(skeleton: Any, arrays: list[Any]) -> Any:
    """The inverse of :func:`split`: ``skeleton`` with its slots filled from ``arrays``."""
    if isinstance(skeleton, Slot):
        return arrays[skeleton.index]
    if isinstance(skeleton, (tuple, list)):
        return type(skeleton)(join(item, arrays) for item in skeleton)
    if isinstance(skeleton, dict):
        return {key: join(value, arrays) for key, value in skeleton.items()}
    if dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        changes = {f.name: join(getattr(skeleton, f.name), arrays) for f in dataclasses.fields(skeleton)
                   if slots(getattr(skeleton, f.name))}
        return dataclasses.replace(skeleton, **changes) if changes else skeleton
    return skeleton


def slots(skeleton: Any) -> list[Slot]:
    """The :class:`Slot` objects in a message that :func:`split` made, in the order of their arrays."""
    if isinstance(skeleton, Slot):
        return [skeleton]
    if isinstance(skeleton, (tuple, list)):
        items: Any = skeleton
    elif isinstance(skeleton, dict):
        items = skeleton.values()
    elif dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        items = [getattr(skeleton, f.name) for f in dataclasses.fields(skeleton)]
    else:
        return []
    return sorted((slot for item in items for slot in slots(item)), key=lambda slot: slot.index)


class Moved:
    """One array on its way: ``test()`` says whether it arrived (or left); ``value`` is the received one.

    Parameters
    ----------
    test : callable
        Returns True once the transfer completed (it never blocks).
    finish : callable, optional
        Called once on completion; returns the received array (or None for a send).
    keep : object, optional
        What must stay alive until completion (a pinned buffer, the sent array).
    """

    def __init__(self, test: Callable[[], bool], finish: Callable[[], Any] | None = None,
                 keep: Any = None) -> None:
        self._test, self._finish, self._keep = test, finish, keep
        self.value: Any = None
        self.done = False

    def test(self) -> bool:
        """Whether the transfer completed (it finishes it the first time: the upload of a staged one)."""
        if not self.done and self._test():
            self.done = True
            self.value = self._finish() if self._finish is not None else None
            self._keep = None
        return self.done


@dataclass(frozen=True)
class Rank:
    """What one rank says about itself when the transport is chosen.

    Attributes
    ----------
    host : str
    devices : int
        CUDA devices it sees.
    device : int or None
        The device it asked for (None: ``local rank % devices``).
    cuda_aware : bool
        Its MPI library is CUDA-aware.
    nccl : bool
        Its CuPy has NCCL.
    """

    host: str
    devices: int
    device: int | None
    cuda_aware: bool
    nccl: bool


def _cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library takes device buffers: ``SPARSE_SCAN_CUDA_AWARE_MPI`` where set (1,
    true, yes, on; 0, false, no, off; anything else is an error), else its ``MPIX_Query_cuda_support()``
    (Open MPI, MPICH), else no."""
    setting = _environment.CUDA_AWARE_MPI.read()
    if setting is not None:
        return setting
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libmpi" in line.rsplit("/", 1)[-1]})
        for path in paths:
            query = getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD), "MPIX_Query_cuda_support", None)
            if query is not None:
                return bool(query())
    except OSError:  # no /proc (not Linux), or a library that cannot be opened again
        return False
    return False


def _nccl(xp: Any) -> Any:
    """CuPy's NCCL module where it is usable, else None."""
    try:
        with warnings.catch_warnings():  # CuPy warns where the NCCL library is missing: available says so
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl  # noqa: PLC0415 - only on GPU ranks
    except ImportError:
        return None
    return nccl if getattr(nccl, "available", False) and xp.cuda.is_available() else None


def facts(xp: Any, device: int | None) -> Rank:
    """This rank's :class:`Rank` (``xp``: the CuPy module; ``device``: the device asked for)."""
    return Rank(socket.gethostname(), int(xp.cuda.runtime.getDeviceCount()), device, _cuda_aware_mpi(),
                _nccl(xp) is not None)


def devices(ranks: list[Rank]) -> list[int]:
    """Each rank's device: the one it asked for, else its local rank (among the ranks on its host)
    modulo the devices it sees."""
    chosen = []
    for index, rank in enumerate(ranks):
        local = sum(1 for other in ranks[:index] if other.host == rank.host)
        chosen.append(rank.device if rank.device is not None else local % max(rank.devices, 1))
    return chosen


def _why_not(name: str, ranks: list[Rank]) -> str | None:
    """Why transport ``name`` cannot run with these ranks, or None."""
    if name == "cuda-aware":
        denied = [index for index, rank in enumerate(ranks) if not rank.cuda_aware]
        return (f"the MPI library of rank {denied[0]} is not CUDA-aware (MPIX_Query_cuda_support() is 0 or "
                f"missing; set {CUDA_AWARE_VARIABLE}=1 where it is)") if denied else None
    if name == "nccl":
        lacking = [index for index, rank in enumerate(ranks) if not rank.nccl]
        if lacking:
            return f"CuPy has no usable NCCL on rank {lacking[0]} (cupy.cuda.nccl.available is False)"
        places = list(zip((rank.host for rank in ranks), devices(ranks), strict=True))
        shared = [index for index, place in enumerate(places) if places.index(place) != index]
        if shared:
            first = places.index(places[shared[0]])
            return (f"NCCL needs a device per rank; ranks {first} and {shared[0]} share device "
                    f"{places[first][1]} of {places[first][0]}")
    return None


def choose(requested: str, ranks: list[Rank]) -> str:
    """The transport for these ranks: ``requested`` where it can run (else the error says why), or the
    first of :data:`GPU_TRANSPORTS` that can for ``"auto"``."""
    if requested == "auto":
        return next(name for name in GPU_TRANSPORTS if _why_not(name, ranks) is None)
    if requested not in GPU_TRANSPORTS:
        raise TransportUnavailableError(f"transport must be one of auto, {', '.join(GPU_TRANSPORTS)}; "
                                        f"got {requested!r}")
    reason = _why_not(requested, ranks)
    if reason is not None:
        raise TransportUnavailableError(f"transport {requested!r} is not available: {reason}")
    return requested


class Transport:
    """Moves device arrays between the ranks of ``comm`` (mpi4py) by transport ``name``.

    Parameters
    ----------
    name : {"cuda-aware", "nccl", "staging"}
    comm : mpi4py communicator
    xp : module
        CuPy.
    nccl_comm : cupy.cuda.nccl.NcclCommunicator, optional
        For ``"nccl"``.

    Attributes
    ----------
    sent_bytes, received_bytes : int
        Bytes of the device arrays it sent and received (what it handed to MPI or NCCL).
    """

    def __init__(self, name: str, comm: Any, xp: Any, nccl_comm: Any = None) -> None:
        self.name, self.comm, self.xp, self.nccl_comm = name, comm, xp, nccl_comm
        self.sent_bytes = self.received_bytes = 0
        if name == "nccl":
            self._streams = (xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True))

    def send(self, array: Any, dest: int, tag: int) -> Moved:
        """Start sending ``array`` to rank ``dest``."""
        array = self.xp.ascontiguousarray(array)
        self.sent_bytes += int(array.nbytes)
        if self.name == "staging":
            host = self._pinned(array.shape, array.dtype)
            array.get(out=host)  # waits for the copy: the buffer is whole before MPI reads it
            request = self.comm.Isend(host, dest=dest, tag=tag)
            return Moved(request.Test, keep=host)
        if self.name == "cuda-aware":
            self.xp.cuda.get_current_stream().synchronize()  # MPI reads the buffer outside the stream
            request = self.comm.Isend(array, dest=dest, tag=tag)
            return Moved(request.Test, keep=array)
        return self._nccl(array, dest, sending=True)

    def recv(self, shape: tuple[int, ...], dtype: str, source: int, tag: int) -> Moved:
        """Start receiving an array of ``shape`` and ``dtype`` from rank ``source``; the
        :class:`Moved`'s ``value`` holds it on this rank's device."""
        xp = self.xp
        self.received_bytes += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if self.name == "staging":
            host = self._pinned(shape, dtype)
            request = self.comm.Irecv(host, source=source, tag=tag)

            def upload() -> Any:
                out = xp.empty(shape, dtype=dtype)
                out.set(host)
                xp.cuda.get_current_stream().synchronize()  # the pinned buffer may go after this
                return out

            return Moved(request.Test, upload, keep=host)
        out = xp.empty(shape, dtype=dtype)
        if self.name == "cuda-aware":
            request = self.comm.Irecv(out, source=source, tag=tag)
            return Moved(request.Test, lambda: out, keep=out)
        return self._nccl(out, source, sending=False)

    def _pinned(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        import cupyx  # noqa: PLC0415 - only on GPU ranks

        return cupyx.empty_pinned(shape, dtype=dtype)

    def _nccl(self, array: Any, peer: int, sending: bool) -> Moved:
        """NCCL's send or recv of ``array`` (as bytes) on this transport's send or receive stream, after
        the work queued on the current stream; complete when the event behind it has passed."""
        from cupy.cuda import nccl  # noqa: PLC0415 - only with NCCL

        stream = self._streams[0 if sending else 1]
        stream.wait_event(self.xp.cuda.get_current_stream().record())
        operation = self.nccl_comm.send if sending else self.nccl_comm.recv
        operation(array.data.ptr, int(array.nbytes), nccl.NCCL_UINT8, peer, stream.ptr)
        event = stream.record()
        return Moved(lambda: event.done, None if sending else (lambda: array), keep=array)


_NCCL_COMMUNICATORS: dict[tuple[Any, ...], Any] = {}
"""NCCL communicators made so far, by communicator handle and devices (made once, they are costly)."""


def connect(comm: Any, xp: Any, requested: str, device: int | None,
            gather: Callable[[Any], list[Any]]) -> Transport:
    """Choose the transport with every rank of ``comm``, move this process to its device and connect.

    Parameters
    ----------
    comm : mpi4py communicator
    xp : module
        CuPy.
    requested : str
        ``"auto"`` or one of :data:`GPU_TRANSPORTS`.
    device : int or None
        The device this rank asks for (None: ``local rank % devices``).
    gather : callable
        ``gather(obj)`` returns every rank's ``obj`` in rank order (a polled allgather, on every rank).

    Returns
    -------
    Transport
        On every rank the same transport; this process's current device is its rank's.
    """
    ranks = gather(facts(xp, device))
    chosen = devices(ranks)
    rank = comm.Get_rank()
    for index, (facts_of, chosen_device) in enumerate(zip(ranks, chosen, strict=True)):
        if not 0 <= chosen_device < facts_of.devices:
            raise TransportUnavailableError(f"rank {index} asked for device {chosen_device} but sees "
                                            f"{facts_of.devices} device(s)")
    xp.cuda.Device(chosen[rank]).use()
    name = choose(requested, ranks)
    if name != "nccl":
        return Transport(name, comm, xp)
    key = (comm.py2f(), tuple(chosen), tuple(rank.host for rank in ranks))
    if key not in _NCCL_COMMUNICATORS:
        from cupy.cuda import nccl  # noqa: PLC0415 - only with NCCL

        unique = gather(nccl.get_unique_id() if rank == 0 else None)[0]
        _NCCL_COMMUNICATORS[key] = nccl.NcclCommunicator(comm.Get_size(), unique, rank)
    return Transport(name, comm, xp, _NCCL_COMMUNICATORS[key])
