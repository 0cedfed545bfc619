"""The scan across MPI processes: measured for P = 1, 2, 3 here, modelled for P up to 1024.

**Measured** (``mpiexec -bind-to core -n P``, loopback, one core and one BLAS thread per rank, so
that ``P = 3`` shares the 2 cores of the machine this ran on): the median wall time of one distributed pass
(:func:`sparse_scan.distributed.backward`: forward rank to rank, output gradient, slice products,
combine, local scans, parameter gradients, everything gathered on rank 0) and the array bytes each
rank sent, for every combine (``chain``, ``exscan``, ``relay``), next to one process without MPI doing
the same work (forward, ``Sequential.backward``, parameter gradients), with the same local method and
with the linear scan (back-propagation): a rank's local scan covers fewer layers than one process's, so
it may plan a cheaper Blelloch schedule (fewer deep products) as well as run in parallel.

**GPU ranks** (``--device gpu``): ``mpiexec -n P`` ranks that share or split the machine's GPUs (local
rank modulo the devices), for each transport of ``--transports`` (``staging``, ``cuda-aware``, ``nccl``;
one that cannot run here is a row saying why): the median wall time of a distributed pass, each
rank's phases and bytes (those the transport moved too), rank 0's single-process time on its GPU for
the same work, and the largest relative error of every gradient (activations and parameters) against
that one process, in float64 by default; then a ping-pong between ranks 0 and 1 through the transport
(8 B and 16 MiB messages): its latency and bandwidth, the link figures of the model below.

**Modelled** (no run): for ``P = 1, 2, 4, ..., 1024`` ranks, steps on the critical path, the largest
per-rank memory and the largest per-rank communication per batch, for

- the VGG-11 conv stacks (``data/vgg11.yaml``, ``data/vgg11-pruned.yaml``), from the plan's own figures:
  per-layer FLOPs of the linear plan (the balanced split), JT bytes (``ScanPlan.element_bytes`` plus the
  patterns' index bytes), activation and parameter bytes; ``P`` stops at the number of layers (21);
- a recurrent chain of ``T = 30000`` dense ``H×H`` blocks (``H = 20``), analytically: one ``H×H`` JT
  (per sample) and an ``H`` vector per step.

Steps count dependent operations with one sequential worker per rank, as the paper's
``Θ(n/p + log p)`` does (messages on the critical path are counted apart): back-propagation and
``relay`` ``n``;
``chain``: the slowest of the last rank's local scan and the middle ranks' slice products, then one
SpMV per rank down the chain (a local scan for a rank whose slice product does not pay, which relays),
then the local scans; ``exscan``: the same with ``ceil(log2 P)`` rounds
(recursive doubling, as mpi4py's) instead of the ``P - 2`` hops; the paper's bound ``n/P + log2 P``.
Memory per rank: its JTs, activations and parameters, plus its slice product (exact for a slice with
at most one non-diagonal layer, else the dense bound ``in × out``: products of convolution JTs fill in).
Time on the wire per batch, per transport of GPU ranks: ``messages on the critical path × latency +
largest per-rank communication / bandwidth``, from :data:`GPU_LINKS` (documented placeholders, marked
``measured: false``) or from a GPU run's ping-pong (``--links ROWS.jsonl``, ``measured: true``).
GPipe-style pipeline model: ``M = 4P`` micro-batches of the same per-step batch (GPipe's guideline for
a bubble under ~20 %), every stage keeping its layers' activations for all of them (no
re-materialisation): ``(n/P) · 4P = 4n`` activations per stage, constant in ``P``, and
``(M + P - 1) · n/P`` steps.

Prints JSON; ``--out`` and ``--plot`` write it and the figure (never over a file without ``--force``);
``--rows`` appends each measured row as it is measured (bench/common.py's ``Rows``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from common import Rows, machine, read_rows

from sparse_scan import backend, load_model
from sparse_scan.distributed import COMBINES, balanced_split, launcher, layer_costs
from sparse_scan.engine.schedule import Element
from sparse_scan.weights import state_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_PS = [2**k for k in range(11)]
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
MEASURED = [("lenet5.yaml", 16, "blelloch", COMBINES), ("vgg11-pruned.yaml", 4, "linear", ("relay",))]
PING_BYTES = (8, 16 * 2**20)  # the ping-pong's messages: latency, then bandwidth
GPU_LINKS: dict[str, dict[str, Any]] = {
    "staging": {"latency_s": 30e-6, "bandwidth_bytes_per_s": 10e9, "measured": False,
                "source": "placeholder: two pinned PCIe copies (~25 GB/s each) and MPI's host loopback"},
    "cuda-aware": {"latency_s": 15e-6, "bandwidth_bytes_per_s": 20e9, "measured": False,
                   "source": "placeholder: a CUDA-aware MPI over PCIe peer copies"},
    "nccl": {"latency_s": 20e-6, "bandwidth_bytes_per_s": 100e9, "measured": False,
             "source": "placeholder: NCCL point-to-point over NVLink"},
}
"""Per transport, the link the model assumes until a GPU run measures it (``--links``)."""


# --- measured ---------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """Under mpiexec: time ``repeats`` distributed passes after a warm-up; rank 0 prints JSON."""
    from mpi4py import MPI

    from sparse_scan import distributed

    comm = MPI.COMM_WORLD
    model = load_model(ROOT / "data" / args.model, dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((args.batch,) + model.input_shape).astype(np.float32)
    times = []
    for _ in range(args.repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        result = distributed.backward(model, x if comm.rank == 0 else None, np.ones_like, comm,
                                      method=args.method, combine=args.combine)
        comm.Barrier()
        times.append(time.perf_counter() - start)
    if comm.rank == 0:
        ranks = result.stats["ranks"]
        print(json.dumps({"wall_s": statistics.median(times[1:]), "layers": [r["layers"] for r in ranks],
                          "sent_bytes": [r["sent_bytes"] for r in ranks],
                          "messages": [r["messages"] for r in ranks],
                          "timings": [r["timings"] for r in ranks]}))


def single_process(model_name: str, batch: int, method: str, repeats: int) -> float:
    """Median wall time of forward + backward + parameter gradients, one fresh process without MPI
    on one core with one BLAS thread.

    A subprocess: this one must not have imported torch (``machine()`` does), whose OpenMP threads
    slow NumPy work down around them.
    """
    command = [sys.executable, __file__, "--baseline", "--model", model_name, "--batch", str(batch),
               "--method", method, "--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True,
                          env=dict(os.environ, **ONE_THREAD))
    return float(done.stdout)


def baseline(args: argparse.Namespace) -> None:
    """Print the median wall time of forward + backward + parameter gradients in this process."""
    model_name, batch, method, repeats = args.model, args.batch, args.method, args.repeats
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as one rank
    model = load_model(ROOT / "data" / model_name, dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((batch,) + model.input_shape).astype(np.float32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y = model.forward(x)
        model.parameter_gradients(model.backward(np.ones_like(y), method))
        times.append(time.perf_counter() - start)
    print(statistics.median(times[1:]))


def measure(repeats: int, ranks: list[int]) -> list[dict[str, Any]]:
    """Run the worker under ``mpiexec -n P`` for every measured configuration."""
    mpiexec = launcher()
    rows = []
    for model_name, batch, method, combines in MEASURED:
        baseline = single_process(model_name, batch, method, repeats)
        linear = baseline if method == "linear" else single_process(model_name, batch, "linear", repeats)
        for size in ranks:
            for combine in combines:
                # one core and one BLAS thread per rank (MPICH's hydra: -bind-to core), P = 1 too:
                # threads spinning on a busy core make timings erratic on a 2-core machine
                binding = ["-bind-to", "core"]
                command = [mpiexec, *binding, "-n", str(size), sys.executable, __file__, "--worker",
                           "--model", model_name, "--batch", str(batch), "--method", method,
                           "--combine", combine, "--repeats", str(repeats)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True,
                                      env=dict(os.environ, **ONE_THREAD))
                row = {"model": model_name, "batch": batch, "method": method, "ranks": size,
                       "combine": combine, "single_process_s": baseline, "single_process_linear_s": linear,
                       "binding": " ".join(binding), "blas_threads": 1}
                row.update(json.loads(done.stdout))
                row["total_sent_bytes"] = sum(row["sent_bytes"])
                rows.append(row)
                print(f"measured {model_name} P={size} {combine}: {row['wall_s'] * 1e3:.1f} ms, "
                      f"{row['total_sent_bytes']} B", file=sys.stderr)
    return rows


# --- GPU ranks --------------------------------------------------------------------------------------
def gpu_worker(args: argparse.Namespace) -> None:
    """Under mpiexec, GPU ranks: time distributed passes through ``args.transport``, rank 0 checks them
    against one process on its GPU and times that, then ranks 0 and 1 ping-pong; rank 0 prints JSON."""
    from mpi4py import MPI

    from sparse_scan import distributed
    from sparse_scan.distributed._mpi import Channel
    from sparse_scan.distributed._transport import connect

    comm = MPI.COMM_WORLD
    be = backend.get("gpu")
    model = load_model(ROOT / "data" / args.model, dtype=np.dtype(args.dtype))
    x = np.random.default_rng(0).standard_normal((args.batch,) + model.input_shape).astype(args.dtype)
    times = []
    try:
        for _ in range(args.repeats + 1):
            comm.Barrier()
            start = time.perf_counter()
            result = distributed.backward(model, x if comm.rank == 0 else None, be.xp.ones_like, comm,
                                          method=args.method, combine=args.combine, device="gpu",
                                          transport=args.transport)
            comm.Barrier()
            times.append(time.perf_counter() - start)
    except distributed.TransportUnavailableError as error:
        if comm.rank == 0:
            print(json.dumps({"unavailable": str(error)}))
        return
    row: dict[str, Any] = {}
    if comm.rank == 0:
        ranks = result.stats["ranks"]
        row.update(wall_s=statistics.median(times[1:]), layers=[r["layers"] for r in ranks],
                   devices=[r["device"] for r in ranks], transport=ranks[0]["transport"],
                   sent_bytes=[r["sent_bytes"] for r in ranks],
                   transport_sent_bytes=[r["transport_sent_bytes"] for r in ranks],
                   messages=[r["messages"] for r in ranks], timings=[r["timings"] for r in ranks])
        row.update(_one_process_on_the_gpu(model, be.asarray(x), args, result))
    comm.Barrier()  # rank 1 waits while rank 0 times one process
    channel = Channel(comm, 60.0)
    channel.transport = connect(comm, be.xp, args.transport, None,
                                lambda obj: channel.allgather(obj, "the transport's facts"))
    link = _ping_pong(channel, be, args.repeats)
    if comm.rank == 0:
        row["link"] = link
        print(json.dumps(row))


def _one_process_on_the_gpu(model: Any, x: Any, args: argparse.Namespace, result: Any) -> dict[str, Any]:
    """Rank 0: one process's gradients on its GPU (the linear scan: back-propagation), their largest
    relative difference from the distributed pass's, and the median time of the same work."""
    be = backend.get("gpu")

    def step() -> tuple[list[Any], dict[str, Any]]:
        y = model.forward(x)
        grads = model.backward(be.xp.ones_like(y), args.method)
        parameters = model.parameter_gradients(grads)
        be.synchronize()
        return grads, parameters

    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    model.forward(x)
    reference = model.backward(be.xp.ones_like(model.forward(x)), "linear")
    pairs = list(zip(result.grads, reference, strict=True))
    parameters = model.parameter_gradients(reference)
    pairs += [(result.parameters[name], value) for name, value in parameters.items()]
    error = max(float(abs(got - want).max()) / max(float(abs(want).max()), 1e-30) for got, want in pairs)
    return {"single_process_gpu_s": statistics.median(times[1:]), "max_rel_error_vs_one_process": error,
            "compared": len(pairs)}


def _ping_pong(channel: Any, be: Any, repeats: int) -> dict[str, Any]:
    """Ranks 0 and 1: median round trips of one device array through the transport, per size."""
    figures: dict[str, Any] = {}
    for size in PING_BYTES:
        array = be.xp.zeros(size, dtype=np.uint8)
        trips = []
        for _ in range(repeats + 1):
            be.synchronize()
            start = time.perf_counter()
            if channel.rank == 0:
                channel.send(array, 1, 20, "a ping")
                channel.recv(1, 21, "a pong")
            elif channel.rank == 1:
                channel.send(channel.recv(0, 20, "a ping"), 0, 21, "a pong")
            channel.flush()
            be.synchronize()
            trips.append(time.perf_counter() - start)
        figures[str(size)] = statistics.median(trips[1:])
    small, large = (figures[str(size)] for size in PING_BYTES)
    return {"round_trip_s": figures, "latency_s": small / 2,
            "bandwidth_bytes_per_s": PING_BYTES[1] / max(large / 2 - small / 2, 1e-12)}


def measure_gpu(args: argparse.Namespace, log: Rows) -> list[dict[str, Any]]:
    """GPU ranks under ``mpiexec -n P`` for each transport of ``--transports``."""
    mpiexec = launcher()
    rows = []
    for size in [int(p) for p in args.ranks.split(",")]:
        for transport in args.transports.split(","):
            command = [mpiexec, "-n", str(size), *args.rank_command.split(), __file__, "--gpu-worker",
                       "--model", args.model, "--batch", str(args.batch), "--method", args.method,
                       "--combine", args.combine, "--repeats", str(args.repeats), "--dtype", args.dtype,
                       "--transport", transport]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            row = {"model": args.model, "batch": args.batch, "method": args.method, "combine": args.combine,
                   "dtype": args.dtype, "ranks": size, "transport_asked": transport}
            if done.returncode != 0:
                row["failed"] = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            rows.append(row)
            log.add(row)
            print(f"measured GPU ranks {args.model} P={size} {transport}: "
                  + (f"{row['wall_s'] * 1e3:.1f} ms" if "wall_s" in row else str(row)), file=sys.stderr)
    return rows


def links(path: pathlib.Path | None) -> dict[str, dict[str, Any]]:
    """:data:`GPU_LINKS`, with the figures a GPU run measured (``--links``: its rows file) in place of
    the placeholders."""
    figures = {name: dict(link) for name, link in GPU_LINKS.items()}
    if path is None:
        return figures
    report = read_rows(path)
    for row in report["rows"]:
        if "link" in row and row.get("transport") in figures:
            figures[row["transport"]] = {**row["link"], "measured": True,
                                         "source": f"{path}: {report['machine'].get('gpu')}"}
    return figures


# --- modelled ---------------------------------------------------------------------------------------
def chain_figures(model_name: str, batch: int, itemsize: int) -> dict[str, Any]:
    """Per-layer figures of a spec from its linear plan and patterns."""
    model = load_model(ROOT / "data" / model_name, dtype=np.float32)
    shape, n = model.input_shape, len(model)
    plan = model.plan(shape, "linear")
    shapes = model.shapes(shape)
    jt, kinds = [], []
    for i, layer in enumerate(model.layers):
        shared, per_sample = plan.element_bytes[Element(n - i, n - i)]
        jt.append((shared + per_sample * batch) * itemsize + layer.pattern(shapes[i]).nbytes)
        kinds.append(layer.jacobian_kind)
    weights = state_dict(model)
    params = [sum(int(v.nbytes) for k, v in weights.items() if k.startswith(f"{layer.name}."))
              for layer in model.layers]
    sizes = [int(np.prod(s)) for s in shapes]
    return {"name": model_name, "n": n, "costs": layer_costs(model, shape), "jt_bytes": jt, "kinds": kinds,
            "act_bytes": [s * batch * itemsize for s in sizes], "param_bytes": params, "sizes": sizes,
            "bp_flops": plan.work_flops}


def rnn_figures(steps: int, hidden: int, batch: int, itemsize: int) -> dict[str, Any]:
    """A chain of ``steps`` dense ``hidden × hidden`` blocks (one JT per sample and step)."""
    return {"name": f"rnn-T{steps}-H{hidden}", "n": steps, "costs": [2 * hidden * hidden] * steps,
            "jt_bytes": [hidden * hidden * batch * itemsize] * steps, "kinds": ["dense"] * steps,
            "act_bytes": [hidden * batch * itemsize] * (steps + 1), "param_bytes": [0] * steps,
            "sizes": [hidden] * (steps + 1), "bp_flops": 2 * hidden * hidden * steps * batch,
            "shared_param_bytes": (hidden * hidden + hidden) * itemsize, "hidden": hidden}


def _product_bytes(figures: dict[str, Any], a: int, b: int, batch: int, itemsize: int) -> tuple[int, bool]:
    """Bytes of the slice product of layers ``a..b-1``, and whether the figure is exact."""
    kinds = figures["kinds"][a:b]
    general = [i for i, kind in zip(range(a, b), kinds, strict=True) if kind != "diagonal"]
    if all(kind == "dense" for kind in kinds):  # dense blocks stay H×H
        return figures["jt_bytes"][a], True
    if len(general) <= 1:
        return (figures["jt_bytes"][general[0]] if general else figures["act_bytes"][a]), True
    return figures["sizes"][a] * figures["sizes"][b] * batch * itemsize, False


def model_rows(figures: dict[str, Any], batch: int, itemsize: int,
               gpu_links: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Steps, per-rank memory and communication for P = 1 .. 1024 (up to the number of layers); with
    ``gpu_links`` (per transport: latency and bandwidth), the seconds on the wire per batch too."""
    n, rows = figures["n"], []
    shared = figures.get("shared_param_bytes", 0)
    for size in sorted(set(MODEL_PS) | ({n} if n < MODEL_PS[-1] else set())):
        if size > n:
            rows.append({"ranks": size, "feasible": False, "note": f"more ranks than the {n} layers"})
            continue
        counts = balanced_split(figures["costs"], size)
        ends = np.cumsum([0] + counts).tolist()
        bounds = list(zip(ends[:-1], ends[1:], strict=True))
        last = size - 1
        # steps (one sequential worker per rank)
        # chain: a middle rank forms its product only where it pays (as sparse_scan.distributed:
        # a dense product's SpMV no costlier than BP through the slice), else relays its local scan
        pays = [0 < r < last and 2 * figures["sizes"][a] * figures["sizes"][b] <= sum(figures["costs"][a:b])
                for r, (a, b) in enumerate(bounds)]
        base = max([counts[-1]] + [c - 1 for c, paid in zip(counts, pays, strict=True) if paid])
        chain, arrival = (0, base) if size > 1 else (n, 0)
        for r in range(last - 1, -1, -1):  # the vector goes down the ranks
            chain = max(chain, arrival + counts[r])
            arrival += (1 if pays[r] else counts[r]) if r > 0 else 0
        rounds = math.ceil(math.log2(size)) if size > 1 else 0
        exscan = base + rounds + max(counts[:-1], default=0) if size > 1 else n
        micro = 4 * size
        # memory and communication per rank
        memory, products, gpipe_memory, chain_comm, exscan_comm, exact = [], [], [], [], [], True
        for r, (a, b) in enumerate(bounds):
            memory.append(sum(figures["jt_bytes"][a:b]) + sum(figures["act_bytes"][a:b + 1])
                          + sum(figures["param_bytes"][a:b]) + shared)
            product, is_exact = _product_bytes(figures, a, b, batch, itemsize) if 0 < r < last else (0, True)
            exact &= is_exact
            products.append(product if pays[r] else 0)
            gpipe_memory.append(sum(figures["param_bytes"][a:b]) + shared
                                + micro * sum(figures["act_bytes"][a:b + 1]))
            forward = figures["act_bytes"][b] if r < last else 0
            vector = figures["act_bytes"][a] if r > 0 else 0
            chain_comm.append(forward + vector)
            exscan_comm.append(forward + (rounds * (product if 0 < r < last else vector)))
        row: dict[str, Any] = {}
        if "hidden" in figures:  # per sample: mv 2H², mm 2H³ (dense blocks)
            mv, mm = 2 * figures["hidden"] ** 2, 2 * figures["hidden"] ** 3
            local = max(counts[-1] * mv, max(counts[1:-1], default=1) * mm - mm)
            row["critical_flops_per_sample"] = {
                "bp": n * mv, "chain": local + max(size - 2, 0) * mv + max(counts[:-1], default=0) * mv,
                "exscan": local + rounds * (mm if size > 2 else mv) + max(counts[:-1], default=0) * mv
                if size > 1 else n * mv}
        rows.append(row)
        row.update({
            "ranks": size, "feasible": True, "layers_per_rank": [min(counts), max(counts)],
            "steps": {"bp": n, "relay": n, "chain": chain, "exscan": exscan,
                      "paper_n_over_p_plus_log_p": n / size + math.log2(size),
                      "gpipe": (micro + size - 1) * max(counts)},
            "messages_on_critical_path": {"chain_or_relay": last, "exscan": rounds,
                                          "gpipe_m4p": 2 * (micro + size - 2) if size > 1 else 0},
            "max_rank_bytes": {"bppsa_relay": max(memory),
                               "bppsa_chain": max(m + p for m, p in zip(memory, products, strict=True)),
                               "gpipe_m4p": max(gpipe_memory), "slice_products_exact": exact},
            "max_rank_comm_bytes": {"chain_or_relay": max(chain_comm), "exscan": max(exscan_comm),
                                    "gpipe_m4p": micro * max(chain_comm)}})
        if gpu_links is not None:  # seconds on the wire per batch, on the critical path, per transport
            paths = (("chain", last, "chain_or_relay"), ("exscan", rounds, "exscan"))
            row["gpu_comm_s"] = {name: {
                combine: messages * link["latency_s"] + row["max_rank_comm_bytes"][key]
                / link["bandwidth_bytes_per_s"] for combine, messages, key in paths}
                for name, link in gpu_links.items()}
    return rows


def plot(report: dict[str, Any], path: pathlib.Path) -> None:
    """Steps, per-rank memory and per-rank communication against P (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"rnn": "-", "vgg11.yaml": "--", "vgg11-pruned.yaml": ":"}
    for name, rows in report["model"].items():
        rows = [row for row in rows if row["feasible"]]
        ps = [row["ranks"] for row in rows]
        style = styles["rnn" if name.startswith("rnn") else name]
        for key, color in (("bp", "k"), ("chain", "C0"), ("exscan", "C1"),
                           ("paper_n_over_p_plus_log_p", "C2"), ("gpipe", "C3")):
            if name == "vgg11-pruned.yaml":
                continue  # same layer counts as vgg11.yaml
            axes[0].plot(ps, [row["steps"][key] for row in rows], style, color=color,
                         label=f"{name}: {key}")
        for key, color in (("bppsa_chain", "C0"), ("bppsa_relay", "C4"), ("gpipe_m4p", "C3")):
            axes[1].plot(ps, [row["max_rank_bytes"][key] for row in rows], style, color=color,
                         label=f"{name}: {key}")
        for key, color in (("chain_or_relay", "C0"), ("exscan", "C1"), ("gpipe_m4p", "C3")):
            axes[2].plot(ps[1:], [row["max_rank_comm_bytes"][key] for row in rows[1:]], style, color=color,
                         label=f"{name}: {key}")  # one rank sends nothing
    titles = ("steps on the critical path", "largest per-rank memory (bytes)",
              "largest per-rank communication per batch (bytes)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("ranks P")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=6)
    fig.suptitle(f"BPPSA across processes (model; measured on {report['machine']['processor']}, "
                 f"{report['machine']['cpu_count']} cores, in the JSON)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: measure GPU ranks (--ranks, --transports) instead of CPU ranks")
    parser.add_argument("--transports", default="staging,cuda-aware",
                        help="--device gpu: the transports to measure (comma-separated)")
    parser.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float64", help="--device gpu: the model's dtype")
    parser.add_argument("--rank-command", default=sys.executable,
                        help="--device gpu: what starts a rank's Python (e.g. 'python -m cupy_standin')")
    parser.add_argument("--links", type=pathlib.Path,
                        help="a GPU run's rows file: its measured links replace the placeholders")
    parser.add_argument("--rows", type=pathlib.Path, help="append each measured row here as it is measured")
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="lenet5.yaml")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--method", default="blelloch")
    parser.add_argument("--combine", default="chain")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", default="1,2,3", help="measured rank counts")
    parser.add_argument("--model-batch", type=int, default=1, help="batch assumed by the model")
    parser.add_argument("--no-measure", action="store_true", help="the model only")
    parser.add_argument("--out", type=pathlib.Path, help="write the JSON here too")
    parser.add_argument("--plot", type=pathlib.Path, help="write the figure (PNG)")
    parser.add_argument("--force", action="store_true", help="overwrite --out/--plot")
    args = parser.parse_args()
    if args.worker or args.baseline or args.gpu_worker:
        (worker if args.worker else gpu_worker if args.gpu_worker else baseline)(args)
        return
    for path in (args.out, args.plot):
        if path is not None and path.exists() and not args.force:
            parser.error(f"{path} exists (use --force to overwrite)")
    itemsize = 4
    report: dict[str, Any] = {"benchmark": "distributed", "model_batch": args.model_batch,
                              "itemsize": itemsize}
    if args.device == "gpu":  # this process stays off the GPU: the ranks hold it
        log = Rows(args.rows, "distributed", machine(backend.get("cpu"), with_torch=False), device="gpu")
        report["measured_gpu"] = [] if args.no_measure else measure_gpu(args, log)
        log.finish()
    elif not args.no_measure:
        report["measured"] = measure(args.repeats, [int(p) for p in args.ranks.split(",")])
    report["machine"] = machine(backend.get("cpu"))  # after measuring: it imports torch
    figures = [chain_figures(name, args.model_batch, itemsize)
               for name in ("vgg11.yaml", "vgg11-pruned.yaml")]
    figures.append(rnn_figures(30000, 20, args.model_batch, itemsize))
    report["gpu_links"] = links(args.links)
    report["model"] = {f["name"]: model_rows(f, args.model_batch, itemsize, report["gpu_links"])
                       for f in figures}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.plot is not None:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
