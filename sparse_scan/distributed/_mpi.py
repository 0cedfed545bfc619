"""MPI plumbing for :mod:`sparse_scan.distributed`: imports, launchers and polled messages.

Every wait polls a nonblocking probe or request against a deadline, and checks for a failure notice
from any rank meanwhile, so that a failed or stuck rank ends the others with an error naming it
instead of a hang. ``mpi4py`` is imported only here, lazily. On GPU ranks a message's device arrays
follow it by the run's transport (:mod:`sparse_scan.distributed._transport`), polled alike.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import time
from typing import Any, Callable

import numpy as np

from ._transport import Transport, join, slots, split

__all__ = ["Channel", "DistributedError", "MPIUnavailableError", "RankTimeoutError", "RemoteRankError",
           "abort", "import_mpi", "launched", "launcher", "payload_bytes"]

TAG_ERROR = 99
TAG_GATHER_IN, TAG_GATHER_OUT = 98, 97  # the polled allgather
DATA_TAG = 100  # a message's device arrays follow it with its tag plus this
ABORT_GRACE_S = 1.0  # time for the launcher to forward what was printed before MPI_Abort kills it
INSTALL_HINT = "pip install 'sparse-scan[mpi]' (mpi4py and the mpich wheel)"
# set by MPICH's hydra and PMI launchers, Open MPI's mpirun and PMIx launchers such as srun
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


class MPIUnavailableError(RuntimeError):
    """mpi4py, an MPI library or an MPI launcher is missing."""


class DistributedError(RuntimeError):
    """A distributed backward pass failed; ``rank`` is the rank at fault.

    Parameters
    ----------
    message : str
    rank : int
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeoutError(DistributedError):
    """A rank sent nothing (or took nothing) within the timeout; ``rank`` is that rank."""


class RemoteRankError(DistributedError):
    """Another rank failed and said so; ``rank`` is the rank at fault.

    ``timed_out`` is true when the other rank gave up waiting (``rank`` is then the one it waited
    for, which may be stuck: end the job with :func:`abort`).
    """

    def __init__(self, message: str, rank: int, timed_out: bool = False) -> None:
        super().__init__(message, rank)
        self.timed_out = timed_out


def import_mpi() -> Any:
    """``mpi4py.MPI`` (initialises MPI), or :class:`MPIUnavailableError` in one line."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as error:
        raise MPIUnavailableError(f"mpi4py is not usable ({error}); {INSTALL_HINT}") from None
    return MPI


def launcher() -> str:
    """The path of ``mpiexec`` (or ``mpirun``): next to this Python first, then on ``PATH``."""
    here = pathlib.Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        local = here / name
        if local.is_file() and os.access(local, os.X_OK):
            return str(local)
        found = shutil.which(name)
        if found:
            return found
    raise MPIUnavailableError(f"no MPI launcher (mpiexec or mpirun) next to {sys.executable} or on PATH; "
                              f"{INSTALL_HINT}")


def launched() -> bool:
    """Whether this process was started by an MPI launcher."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def abort(comm: Any, code: int, grace: float = ABORT_GRACE_S) -> None:
    """End every rank of ``comm`` with exit status ``code`` (some may be stuck), keeping what was printed.

    MPI_Abort kills the launcher's output forwarding too: a message printed just before it can be
    lost under load. So flush both streams and wait ``grace`` seconds first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(grace)
    comm.Abort(code)


def payload_bytes(obj: Any) -> int:
    """Bytes of the arrays inside a message (tuples, lists, dicts and objects with ``nbytes``)."""
    if isinstance(obj, np.ndarray) or hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    if isinstance(obj, (tuple, list)):
        return sum(payload_bytes(item) for item in obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(item) for item in obj.values())
    return 0


class Channel:
    """Polled point-to-point messages on ``comm`` with a per-wait ``timeout`` (seconds).

    With a ``transport`` (GPU ranks), the CuPy arrays of a message are taken out of it and move by
    the transport after it (:func:`~sparse_scan.distributed._transport.split`).

    Attributes
    ----------
    sent_bytes : int
        Array payload bytes sent by this rank (:func:`payload_bytes`), device arrays included.
    messages : int
        Messages sent.
    transport : Transport or None
    """

    def __init__(self, comm: Any, timeout: float, transport: Transport | None = None) -> None:
        self.comm = comm
        self._any_source = import_mpi().ANY_SOURCE
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.transport = transport
        self.sent_bytes = 0
        self.messages = 0
        self._pending: list[tuple[Callable[[], bool], int, str]] = []

    def count(self, obj: Any) -> None:
        """Account for one message of ``obj`` sent by this rank."""
        self.sent_bytes += payload_bytes(obj)
        self.messages += 1

    def send(self, obj: Any, dest: int, tag: int, what: str) -> None:
        """Start sending ``obj`` to ``dest``; :meth:`flush` waits for completion."""
        self.count(obj)
        if self.transport is None:
            self._pending.append((self.comm.isend(obj, dest=dest, tag=tag).Test, dest, what))
            return
        skeleton, arrays = split(obj)
        self._pending.append((self.comm.isend(skeleton, dest=dest, tag=tag).Test, dest, what))
        for array in arrays:
            self._pending.append((self.transport.send(array, dest, tag + DATA_TAG).test, dest, what))

    def _poll(self, ready: Callable[[], Any], rank: int, what: str, hops: int = 1) -> Any:
        deadline = time.monotonic() + self.timeout * hops
        pause = 1e-4
        while True:
            self.check_failures()
            result = ready()
            if result is not None:
                return result
            if time.monotonic() > deadline:
                raise RankTimeoutError(
                    f"rank {self.rank}: {what} rank {rank} did not complete within {self.timeout * hops:g} s "
                    f"(rank {rank} failed, is stuck or needs a longer timeout)", rank)
            time.sleep(pause)
            pause = min(2 * pause, 0.005)

    def recv(self, source: int, tag: int, what: str, hops: int = 1) -> Any:
        """Receive one message from ``source``, or :class:`RankTimeoutError` naming it.

        ``hops``: how many ranks' work the message waits for, one after another (the wait may take
        ``hops * timeout``), so that the rank nearest a stuck one times out first and names it.
        """
        message = self._poll(lambda: self.comm.improbe(source=source, tag=tag), source,
                             f"receiving {what} from", hops)
        obj = message.recv()
        if self.transport is None:
            return obj
        arrays = []
        for slot in slots(obj):
            moved = self.transport.recv(slot.shape, slot.dtype, source, tag + DATA_TAG)
            arrays.append(self._poll(lambda moved=moved: moved.value if moved.test() else None, source,
                                     f"receiving {what} (its arrays) from"))
        return join(obj, arrays)

    def flush(self) -> None:
        """Wait (polled) until every started send completed."""
        while self._pending:
            test, dest, what = self._pending[0]
            self._poll(lambda test=test: True if test() else None, dest, f"sending {what} to")
            self._pending.pop(0)

    def allgather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank: a polled star through rank 0 (host objects
        only), so that no rank waits in a collective alone."""
        if self.rank == 0:
            gathered = [obj] + [self.recv(rank, TAG_GATHER_IN, what) for rank in range(1, self.size)]
            for rank in range(1, self.size):
                self.send(gathered, rank, TAG_GATHER_OUT, what)
        else:
            self.send(obj, 0, TAG_GATHER_IN, what)
            gathered = self.recv(0, TAG_GATHER_OUT, what)
        self.flush()
        return gathered

    def check_failures(self) -> None:
        """Raise :class:`RemoteRankError` if another rank reported a failure."""
        message = self.comm.improbe(source=self._any_source, tag=TAG_ERROR)
        if message is not None:
            rank, text, stuck = message.recv()
            if stuck is None:
                raise RemoteRankError(f"rank {rank} failed: {text}", rank)
            raise RemoteRankError(text, stuck, timed_out=True)

    def notify_failure(self, error: BaseException, grace: float = 1.0) -> None:
        """Tell every other rank that this one failed (best effort, waiting at most ``grace`` s)."""
        if isinstance(error, RankTimeoutError):
            notice = (self.rank, str(error), error.rank)
        else:
            notice = (self.rank, f"{type(error).__name__}: {error}", None)
        requests = [self.comm.isend(notice, dest=rank, tag=TAG_ERROR)
                    for rank in range(self.size) if rank != self.rank]
        deadline = time.monotonic() + grace
        while requests and time.monotonic() < deadline:
            requests = [request for request in requests if not request.Test()]
            time.sleep(1e-3)

