"""``sparse-scan run --distributed``: the backward scan with the layers split over MPI ranks.

Every rank parses the same options and loads the same spec and arrays (so bad input fails on every
rank alike); rank 0 alone prints (the other ranks' stderr is silenced) and writes ``--out``. A rank
that fails tells the others (:mod:`sparse_scan.distributed`); a rank that is stuck makes the others
time out, and rank 0 then ends the job with ``MPI_Abort``. With ``--device gpu`` every rank runs its
slice on a GPU (:class:`GPURanks`: the transport and the device), and rank 0 brings the gradients to
the host to print and write them.

Importing this module costs only click: :mod:`sparse_scan.distributed` (NumPy, mpi4py) is imported
inside the functions, so that ``sparse-scan run`` can import this module before ``--threads`` is read.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import click

from ._common import check_line, echo_error, fail, plural, schedule_label, write_gradients, write_or_fail

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GPURanks", "parse_split", "run_distributed", "world"]


@dataclass(frozen=True)
class GPURanks:
    """Where the ranks run: ``device`` (``cpu`` or ``gpu``), and on GPU ranks ``--transport`` and
    ``--gpu-device`` (None: local rank modulo the visible devices)."""

    device: str
    transport: str = "auto"
    gpu_device: int | None = None


def world() -> Any:
    """``MPI.COMM_WORLD``, or a one-line error (exit 2) when mpi4py or a launcher is missing.

    Ranks other than 0 stop writing to stderr: rank 0 reports for all.
    """
    from sparse_scan import distributed  # noqa: PLC0415 - imports NumPy

    try:
        if not distributed.launched():
            distributed.launcher()  # one process would run, but a launcher is how to start several
        mpi = distributed.import_mpi()
    except distributed.MPIUnavailableError as error:
        fail(f"--distributed: {error}")
    comm = mpi.COMM_WORLD
    if comm.Get_rank() != 0:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - for the process' life
    return comm


def parse_split(split: str | None) -> list[int] | None:
    """``--split 3,4,5`` (layers per rank) as a list, or a one-line error."""
    if split is None:
        return None
    try:
        return [int(part) for part in split.split(",")]
    except ValueError:
        fail(f"--split must be comma-separated layer counts per rank, e.g. 3,4,5; got {split!r}")


def _abort(comm: Any, message: str) -> NoReturn:
    """Rank 0: print ``message`` and end every rank (some may be stuck)."""
    from sparse_scan import distributed  # noqa: PLC0415 - imports NumPy

    echo_error(message)
    distributed.abort(comm, 2)
    raise SystemExit(2)  # not reached: Abort ends this process too


def run_distributed(comm: Any, model_path: pathlib.Path, network: Any, x: np.ndarray,
                    upstream: Callable[[np.ndarray], tuple[np.ndarray, float | None]], method: str,
                    levels: Any, dtype: str, split: list[int] | None, combine: str, timeout: float,
                    check: bool, out: pathlib.Path | None, as_json: bool,
                    ranks: GPURanks = GPURanks("cpu")) -> None:
    """Run the distributed backward pass and report on rank 0 (arguments as ``sparse-scan run``)."""
    from sparse_scan import backend, distributed  # noqa: PLC0415 - imports NumPy

    rank, size = comm.Get_rank(), comm.Get_size()
    losses: list[float | None] = []
    host = backend.get("cpu").asarray

    def grad_out(output: Any) -> np.ndarray:
        grad, loss = upstream(host(output))
        losses.append(loss)
        return grad

    try:
        result = distributed.backward(network, x if rank == 0 else None, grad_out, comm, split, method,
                                      levels, combine, timeout, device=ranks.device,
                                      transport=ranks.transport, gpu_device=ranks.gpu_device)
    except distributed.TransportUnavailableError as error:
        fail(f"--transport {ranks.transport}: {error}")
    except distributed.DistributedError as error:
        stuck = isinstance(error, distributed.RankTimeoutError) or getattr(error, "timed_out", False)
        if rank == 0 and stuck:
            _abort(comm, str(error))  # a stuck rank would never exit
        if rank != 0 and stuck and error.rank == 0:  # rank 0 cannot report itself
            echo_error(str(error), file=sys.__stderr__)
        fail(str(error))  # silent on ranks other than 0
    except Exception as error:  # noqa: BLE001 - one line on rank 0; the other ranks were told
        fail(f"{model_path}: {error}" if isinstance(error, ValueError)
             else f"{model_path}: {type(error).__name__}: {error}")
    if rank != 0:
        return
    result.grads = [host(g) for g in result.grads]
    result.parameters = {name: host(g) for name, g in result.parameters.items()}
    transport = result.stats["transport"]
    report: dict[str, Any] = {
        "model": str(model_path), "method": method, "levels": levels, "device": ranks.device, "dtype": dtype,
        "batch": int(x.shape[0]), "distributed": {
            "ranks": size, "combine": combine, "transport": transport,
            "layers": [list(bound) for bound in result.bounds], "per_rank": result.stats["ranks"]}}
    if losses and losses[0] is not None:
        report["loss"] = losses[0]
    if check:
        reference = network.backward(upstream(network.forward(x))[0], "linear")
        report["check"] = {
            "computed": f"{schedule_label(method, levels)} on {plural(size, 'MPI rank')}",
            "reference": "one process", "max_rel_error": max(
                float(abs(g - r).max()) / max(float(abs(r).max()), 1e-30)
                for g, r in zip(result.grads, reference, strict=True))}
    if out is not None:
        write_or_fail("--out", out,
                      lambda: write_gradients(out, network.layers, result.grads, result.parameters))
        report["out"] = str(out)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    where = "" if ranks.device == "cpu" else f", GPU ranks, {transport} transport"
    click.echo(f"{model_path}: {schedule_label(method, levels)} on {plural(size, 'MPI rank')} "
               f"({combine}{where}), batch {x.shape[0]}, {dtype}")
    for stats in result.stats["ranks"]:
        times = stats["timings"]
        first, last = stats["layers"]
        click.echo(f"  rank {stats['rank']}: layers {first}..{last - 1}, "
                   + ", ".join(f"{name[:-2]} {value * 1e3:.2f} ms" for name, value in times.items())
                   + f", sent {stats['sent_bytes']} B"
                   + ("" if ranks.device == "cpu" else f" ({stats['device']})"))
    if "loss" in report:
        click.echo(f"  loss {report['loss']:.6g}")
    if check:
        click.echo(check_line(report["check"]))
    if out is not None:
        click.echo(f"  gradients written to {out}")
