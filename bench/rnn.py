"""Recurrent backward passes (paper §4.1, Fig. 8): BPPSA against BP, PyTorch autograd and JAX.

The paper's RNN (H=20, input 1, 10 classes, loss on the last hidden state) on the bitstream task, and
its GRU shapes S/M/L (T x input = 259x38, 517x24, 1034x12, H=20) on random data of those shapes. Per
configuration, the median over repeats of one backward pass per iteration:

- ``blelloch``, ``hybrid-auto`` and ``linear`` (BP emulated with the Jacobians): our
  ``recurrent.backward`` (``backward_s``: Jacobian blocks, the scan, input and parameter gradients),
  with the phase it runs for its chain beside it: ``scan_s``, the scan over the filled blocks alone
  (on a GPU BP's is the chain kernel over them). On the CPU back-propagation's schedule (``linear``,
  or ``hybrid-auto`` when it picks depth 0) fills no blocks and has no scan of its own: the cell's
  compiled kernel runs the totals and the gradients in one pass, so its entry has ``kernel_s`` (that
  pass alone, the run's ``backward``) and no ``scan_s`` or scan speedups;
- ``torch``: ``loss.backward()`` through ``nn.RNN``/``nn.GRU`` with the same weights (PyTorch's CPU
  kernels here, cuDNN on a GPU), when torch is installed;
- ``jax``: ``jax.lax.associative_scan`` over the same blocks (jit-compiled, compile time excluded),
  when JAX is installed: the prefix products of the chain, then one batched matrix-vector product.

Our contenders are timed in turn within each round (medians over the rounds); the baselines each run
in a fresh process of their own (PyTorch's OpenMP threads and XLA's thread pool spin between
operations and slow NumPy work in a shared process, and are slowed by it). Also the forward times,
the plan's figures (critical steps, work, peak bytes) and the gradients' largest relative difference
from PyTorch (and JAX's from the linear scan). Prints JSON; ``--rows FILE`` also appends each row to
FILE as one JSON line the moment it is measured (``common.Rows``: a run killed half-way keeps what it
finished); ``--plot FILE.png`` draws the speedups over PyTorch against T and against B (paper Fig. 8).
``--steps 30000 --batches --gru`` measures one point alone (T=30000, B=16).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
from common import Rows, machine, read_rows

from sparse_scan import backend
from sparse_scan.engine.dense_plan import auto_levels, build_dense_plan
from sparse_scan.engine.run import dense_scan
from sparse_scan.engine.schedule import depth
from sparse_scan.recurrent import GRU, RNN, Bitstream

SCHEDULES = (("blelloch", "blelloch", None), ("hybrid-auto", "hybrid", "auto"), ("linear", "linear", None))
GRU_SHAPES = {"S": (259, 38), "M": (517, 24), "L": (1034, 12)}


def repeats_for(steps: int, batch: int) -> int:
    return max(5, min(25, int(4e5 // (steps * batch))))


Timer = Callable[[], float]


def timed(fn: Callable[[], Any], sync: Callable[[], None]) -> Timer:
    """A timer of ``fn``: runs it once and returns the seconds it took (device work included)."""
    def run() -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start
    return run


def interleaved(timers: dict[str, Timer], repeats: int) -> dict[str, float]:
    """Median seconds of every timer, run in turn in each of ``repeats`` rounds after a warm-up round,
    so that a slow spell of the machine slows every contender alike."""
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for round_ in range(repeats + 1):
        for name, timer in timers.items():
            seconds = timer()
            if round_:
                samples[name].append(seconds)
    return {name: float(np.median(values)) for name, values in samples.items()}


def problem(kind: str, steps: int, batch: int, size: int, hidden: int) -> tuple[RNN | GRU, np.ndarray,
                                                                               np.ndarray]:
    """The cell (seeded weights), the inputs and the gradient w.r.t. the last hidden state of one
    configuration: the same in every process."""
    rng = np.random.default_rng(steps * 1000 + batch)
    if kind == "rnn":
        x, _ = Bitstream(steps, samples=batch, seed=0).batch(np.arange(batch))
        cell: RNN | GRU = RNN(size, hidden, rng=0)
    else:
        x = rng.standard_normal((batch, steps, size)).astype(np.float32)
        cell = GRU(size, hidden, rng=0)
    return cell, x, rng.standard_normal((batch, hidden)).astype(np.float32)


def torch_worker(kind: str, steps: int, batch: int, size: int, hidden: int, device: str, repeats: int,
                 out: pathlib.Path) -> dict[str, Any]:
    """PyTorch's forward and autograd's backward (after an untimed forward), in this process alone;
    the parameter gradients of one backward go to ``out`` (``.npz``)."""
    import torch

    cell, x, grad_last = problem(kind, steps, batch, size, hidden)
    dev = "cuda" if device == "gpu" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        return {"unavailable": "PyTorch has no CUDA device here"}
    module = (torch.nn.RNN if kind == "rnn" else torch.nn.GRU)(size, hidden, batch_first=True).to(dev)
    with torch.no_grad():
        for key, value in module.named_parameters():
            value.copy_(torch.from_numpy(getattr(cell, key[:-3])))
    inputs, seed = torch.from_numpy(x).to(dev), torch.from_numpy(grad_last).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def loss() -> Any:
        module.zero_grad()
        return (module(inputs)[0][:, -1] * seed).sum()

    seconds = interleaved({"forward_s": timed(lambda: module(inputs), sync),
                           "backward_s": lambda: timed(loss().backward, sync)()}, repeats)
    loss().backward()
    np.savez(out, **{key[:-3]: value.grad.detach().cpu().numpy() for key, value in module.named_parameters()})
    return seconds


def jax_worker(kind: str, steps: int, batch: int, size: int, hidden: int, repeats: int) -> dict[str, Any]:
    """``jax.lax.associative_scan`` over the chain's blocks, then every gradient from the prefixes
    (jit-compiled before timing), in this process alone."""
    import jax
    import jax.numpy as jnp

    cell, x, grad_last = problem(kind, steps, batch, size, hidden)
    cell.forward(x)
    blocks = cell.transposed_jacobians()

    def combine(a, b):  # prefixes A_T, A_{T-1} A_T, ...: the later element multiplies on the left
        return jnp.matmul(b, a)

    @jax.jit
    def scan(reversed_blocks, seed):
        prefixes = jax.lax.associative_scan(combine, reversed_blocks)  # A_{t+1} ... A_T per step
        return jnp.einsum("tbij,bj->tbi", prefixes, seed)

    reversed_blocks, seed = jnp.asarray(blocks[::-1]), jnp.asarray(grad_last)
    totals = np.asarray(scan(reversed_blocks, seed))[::-1]  # compiles; G_0 .. G_{T-1}
    expected = dense_scan(blocks, grad_last, "linear")[:-1]
    error = float(np.abs(totals - expected).max() / np.abs(expected).max())
    seconds = interleaved({"scan_s": timed(lambda: scan(reversed_blocks, seed).block_until_ready(),
                                           lambda: None)}, repeats)
    return {"scan_s": seconds["scan_s"], "max_rel_error_vs_linear": error}


def in_fresh_process(worker: str, kind: str, steps: int, batch: int, size: int, device: str,
                     repeats: int, out: pathlib.Path | None = None) -> dict[str, Any] | None:
    """Run a baseline worker in its own process (PyTorch's OpenMP threads and XLA's thread pool spin
    between operations and slow NumPy work sharing the process); None when its package is missing, or
    (PyTorch) has no CUDA for a GPU run."""
    command = [sys.executable, __file__, "--worker", worker, "--kind", kind, "--steps", str(steps),
               "--batches", str(batch), "--size", str(size), "--device", device, "--repeats", str(repeats)]
    if out is not None:
        command += ["--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        if "ModuleNotFoundError" in result.stderr:
            return None
        raise RuntimeError(f"{worker} baseline failed:\n{result.stderr}")
    measured = json.loads(result.stdout)
    return None if "unavailable" in measured else measured


def relative_error(got: dict[str, Any], expected: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(backend.of(got[k]).to_host(got[k]) - v).max() / max(np.abs(v).max(), 1e-30))
               for k, v in expected.items())


def factored_schedule(method: str, levels: int | None, device: str) -> bool:
    """Whether ``Recurrent.backward`` runs this schedule on the factored blocks (no block filled: BP on
    the CPU; on a GPU BP is one chain launch over the filled blocks)."""
    return device == "cpu" and (method == "linear" or (method == "hybrid" and levels == 0))


def measure(kind: str, steps: int, batch: int, size: int, hidden: int, be: backend.Backend,
            with_jax: bool) -> dict[str, Any]:
    cell, x, grad_last = problem(kind, steps, batch, size, hidden)
    repeats = repeats_for(steps, batch)
    xd, seed = be.asarray(x), be.asarray(grad_last)
    sync = be.synchronize
    factored = be.name == "cpu"
    row: dict[str, Any] = {"model": kind, "T": steps, "B": batch, "input": size, "H": hidden,
                           "repeats": repeats,
                           "auto_levels": auto_levels(steps, batch, hidden, be.name, factored=factored),
                           "depth": depth(steps)}
    cell.forward(xd)
    blocks, factors = cell.transposed_jacobians(), cell.jacobian_factors()
    run = cell._single_run()
    timers: dict[str, Timer] = {"forward": timed(lambda: cell.forward(xd), sync),
                                "blocks": timed(cell.transposed_jacobians, sync)}
    for label, method, levels in SCHEDULES:
        timers[f"{label}_backward"] = timed(lambda m=method, lv=levels: cell.backward(seed, m, lv), sync)
        resolved = row["auto_levels"] if levels == "auto" else levels
        if factored_schedule(method, resolved, be.name):  # one compiled pass: no block filled, no scan
            timers[f"{label}_kernel"] = timed(lambda m=method, lv=resolved: run.backward(seed, m, lv), sync)
        else:
            timers[f"{label}_scan"] = timed(lambda m=method, lv=resolved: dense_scan(blocks, seed, m, lv),
                                            sync)
    seconds = interleaved(timers, repeats)
    with tempfile.TemporaryDirectory() as folder:
        grads_file = pathlib.Path(folder) / "torch.npz"
        baseline = in_fresh_process("torch", kind, steps, batch, size, be.name, repeats, grads_file)
        torch_grads = dict(np.load(grads_file)) if baseline is not None else None
    jax = in_fresh_process("jax", kind, steps, batch, size, be.name, repeats) \
        if with_jax and be.name == "cpu" else None
    row.update(forward_s=seconds["forward"], blocks_s=seconds["blocks"])
    for label, method, levels in SCHEDULES:
        resolved = row["auto_levels"] if levels == "auto" else levels
        phase = "kernel" if f"{label}_kernel" in seconds else "scan"
        entry = {"backward_s": seconds[f"{label}_backward"], f"{phase}_s": seconds[f"{label}_{phase}"]}
        if factored_schedule(method, resolved, be.name):  # T steps of one GEMM over the stacked factors
            terms = factors[1].shape[2] + (factors[2] is not None)
            flops = 2 * steps * batch * terms * hidden * hidden
            entry.update(critical_steps=steps, work_flops=flops, critical_flops=flops,
                         peak_bytes=(factors[1].nbytes + (steps + 1) * batch * hidden * 4), factored=True)
        else:
            plan = build_dense_plan(steps, method, resolved).sized(hidden, affine=seed.ndim == 3)
            entry.update(critical_steps=plan.critical_steps, work_flops=plan.work_flops * batch,
                         critical_flops=plan.critical_flops * batch, peak_bytes=plan.peak_bytes(batch, 4))
        if baseline is not None:
            result = cell.backward(seed, method, levels)
            entry["max_rel_error_vs_torch"] = relative_error(result, torch_grads)
            entry["speedup_vs_torch"] = baseline["backward_s"] / entry["backward_s"]
            if "scan_s" in entry:
                entry["scan_speedup_vs_torch"] = baseline["backward_s"] / entry["scan_s"]
        if jax is not None and "scan_s" in entry:
            entry["scan_speedup_vs_jax"] = jax["scan_s"] / entry["scan_s"]
        row[label] = entry
    if baseline is not None:
        row["torch"] = baseline
    if jax is not None:
        row["jax_associative_scan_s"] = jax["scan_s"]
        row["jax_max_rel_error_vs_linear"] = jax["max_rel_error_vs_linear"]
    return row


def plot(rows: list[dict[str, Any]], path: pathlib.Path, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rnn = [r for r in rows if r["model"] == "rnn"]
    sweeps = [("T", [r for r in rnn if r["sweep"] == "T"], "sequence length T (B=16)"),
              ("B", [r for r in rnn if r["sweep"] == "B"], "batch size B (T=1000)")]
    for axis, (key, sweep, label) in zip(axes, sweeps, strict=True):
        xs = [r[key] for r in sweep]
        if not xs:  # e.g. the GPU run's rows: T = 1000 and 30000 at B = 16, no B sweep
            axis.set_axis_off()
            axis.set_title(f"no {label.split(' (')[0]} sweep in these rows", fontsize=9)
            continue
        for name, style in (("blelloch", "o-"), ("hybrid-auto", "s--"), ("linear", "^:")):
            ys = [r[name].get("speedup_vs_torch") for r in sweep]
            if all(y is not None for y in ys):
                axis.plot(xs, ys, style, label=f"{name} backward")
        ys = [r["torch"]["backward_s"] / r["jax_associative_scan_s"] for r in sweep
              if "jax_associative_scan_s" in r and "torch" in r]
        if len(ys) == len(xs):
            axis.plot(xs, ys, "x-.", label="JAX associative_scan")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel(label)
        axis.set_ylabel("speedup over PyTorch autograd backward")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"RNN backward (H=20), {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"))
    parser.add_argument("--steps", type=int, nargs="*", default=[10, 30, 100, 300, 1000, 3000, 10000, 30000])
    parser.add_argument("--batches", type=int, nargs="*", default=[2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--gru", nargs="*", default=list(GRU_SHAPES), choices=list(GRU_SHAPES))
    parser.add_argument("--no-jax", action="store_true", help="skip JAX even when it is installed")
    parser.add_argument("--plot", type=pathlib.Path, help="write the Fig. 8-style plot here")
    parser.add_argument("--replot", type=pathlib.Path, metavar="JSON",
                        help="only draw --plot from this script's saved JSON output (or its --rows file)")
    parser.add_argument("--json", action="store_true", help="JSON only (default also JSON)")
    parser.add_argument("--rows", type=pathlib.Path, metavar="FILE",
                        help="append each measured row to FILE as one JSON line as soon as it is measured")
    parser.add_argument("--worker", choices=("torch", "jax"), help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="rnn", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:  # one baseline measurement, in a process of its own
        steps, batch = args.steps[0], args.batches[0]
        result = torch_worker(args.kind, steps, batch, args.size, 20, args.device, args.repeats, args.out) \
            if args.worker == "torch" else jax_worker(args.kind, steps, batch, args.size, 20, args.repeats)
        print(json.dumps(result))
        return 0
    if args.replot is not None:
        if args.plot is None:
            parser.error("--replot needs --plot")
        try:
            saved = json.loads(args.replot.read_text())
        except json.JSONDecodeError:  # JSON lines: a --rows file
            saved = {}
        if "rows" not in saved:
            saved = read_rows(args.replot)
        plot(saved["rows"], args.plot, saved["machine"].get("gpu", saved["machine"]["processor"]))
        return 0
    be = backend.get(args.device)
    rows = []
    log = Rows(args.rows, "rnn", machine(be, with_torch=False))  # torch stays out of this process

    def run(kind: str, sweep: str, steps: int, batch: int, size: int) -> None:
        row = measure(kind, steps, batch, size, 20, be, not args.no_jax)
        row["sweep"] = sweep
        rows.append(row)
        log.add(row)
        print(f"{kind} T={steps} B={batch}: " + ", ".join(
            f"{name} {row[name]['backward_s'] * 1e3:.2f} ms" for name, _, _ in SCHEDULES)
            + (f", torch {row['torch']['backward_s'] * 1e3:.2f} ms" if "torch" in row else ""),
            file=sys.stderr)

    for steps in args.steps:
        run("rnn", "T", steps, 16, 1)
    for batch in args.batches:
        run("rnn", "B", 1000, batch, 1)
    for name in args.gru:
        steps, size = GRU_SHAPES[name]
        run("gru", name, steps, 16, size)
    info = machine(be)
    log.finish()
    print(json.dumps({"machine": info, "rows": rows}, indent=1), flush=True)  # before the plot can fail
    if args.plot is not None:
        plot(rows, args.plot, info.get("gpu", info["processor"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
