"""Recurrent backward passes (paper §4.1, Fig. 8): BPPSA against BP, PyTorch autograd and JAX.

The paper's RNN (H=20, input 1, 10 classes, loss on the last hidden state) on the bitstream task, and
its GRU shapes S/M/L (T x input = 259x38, 517x24, 1034x12, H=20) on random data of those shapes. Per
configuration, the median over repeats of one backward pass per iteration:

- ``blelloch``, ``hybrid-auto`` and ``linear`` (BP emulated with the Jacobians): our
  ``recurrent.backward`` — Jacobian blocks, the scan, input and parameter gradients — with the
  scan alone reported next to it;
- ``torch``: ``loss.backward()`` through ``nn.RNN``/``nn.GRU`` with the same weights (PyTorch's CPU
  kernels here, cuDNN on a GPU), when torch is installed;
- ``jax``: ``jax.lax.associative_scan`` over the same blocks (jit-compiled, compile time excluded),
  when JAX is installed: the prefix products of the chain, then one batched matrix-vector product.

Also the forward times, the plan's figures (critical steps, work, peak bytes) and the gradients'
largest relative difference from PyTorch. Prints JSON; ``--plot FILE.png`` draws the speedups over
PyTorch against T and against B (paper Fig. 8).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np
from common import machine

from sparse_scan import backend
from sparse_scan.dense_scan import auto_levels, dense_plan, dense_scan
from sparse_scan.recurrent import GRU, RNN, Bitstream
from sparse_scan.scan import depth

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


def torch_timers(kind: str, x: np.ndarray, weights: dict[str, np.ndarray], grad_last: np.ndarray,
                 device: str) -> tuple[dict[str, Timer], Callable[[], dict[str, np.ndarray]]] | None:
    """Timers of PyTorch's forward and of autograd's backward (after an untimed forward), and a
    function returning the parameter gradients of one backward; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    dev = "cuda" if device == "gpu" else "cpu"
    size, hidden = x.shape[2], grad_last.shape[1]
    module = (torch.nn.RNN if kind == "rnn" else torch.nn.GRU)(size, hidden, batch_first=True).to(dev)
    with torch.no_grad():
        for key, value in module.named_parameters():
            value.copy_(torch.from_numpy(weights[key[:-3]]))
    inputs = torch.from_numpy(x).to(dev)
    seed = torch.from_numpy(grad_last).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def loss() -> Any:
        module.zero_grad()
        return (module(inputs)[0][:, -1] * seed).sum()

    def backward() -> float:
        graph = loss()
        return timed(graph.backward, sync)()

    def grads() -> dict[str, np.ndarray]:
        loss().backward()
        return {key[:-3]: value.grad.detach().cpu().numpy() for key, value in module.named_parameters()}

    return {"torch_forward": timed(lambda: module(inputs), sync), "torch_backward": backward}, grads


def jax_timer(blocks: np.ndarray, grad_last: np.ndarray) -> Timer | None:
    """``jax.lax.associative_scan`` over the chain's blocks, then every gradient from the prefixes
    (jit-compiled before timing)."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None

    def combine(a, b):  # prefixes A_T, A_{T-1} A_T, ...: the later element multiplies on the left
        return jnp.matmul(b, a)

    @jax.jit
    def scan(reversed_blocks, seed):
        prefixes = jax.lax.associative_scan(combine, reversed_blocks)  # A_{t+1} ... A_T per step
        return jnp.einsum("tbij,bj->tbi", prefixes, seed)

    reversed_blocks = jnp.asarray(blocks[::-1])
    seed = jnp.asarray(grad_last)
    scan(reversed_blocks, seed).block_until_ready()  # compile
    return timed(lambda: scan(reversed_blocks, seed).block_until_ready(), lambda: None)


def relative_error(got: dict[str, Any], expected: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(backend.of(got[k]).to_host(got[k]) - v).max() / max(np.abs(v).max(), 1e-30))
               for k, v in expected.items())


def measure(kind: str, steps: int, batch: int, size: int, hidden: int, be: backend.Backend,
            with_jax: bool) -> dict[str, Any]:
    rng = np.random.default_rng(steps * 1000 + batch)
    if kind == "rnn":
        x, _ = Bitstream(steps, samples=batch, seed=0).batch(np.arange(batch))
        cell: RNN | GRU = RNN(size, hidden, rng=0)
    else:
        x = rng.standard_normal((batch, steps, size)).astype(np.float32)
        cell = GRU(size, hidden, rng=0)
    grad_last = rng.standard_normal((batch, hidden)).astype(np.float32)
    repeats = repeats_for(steps, batch)
    xd, seed = be.asarray(x), be.asarray(grad_last)
    sync = be.synchronize
    row: dict[str, Any] = {"model": kind, "T": steps, "B": batch, "input": size, "H": hidden,
                           "repeats": repeats, "auto_levels": auto_levels(steps, batch, hidden, be.name),
                           "depth": depth(steps)}
    cell.forward(xd)
    blocks = cell.transposed_jacobians()
    timers: dict[str, Timer] = {"forward": timed(lambda: cell.forward(xd), sync),
                                "blocks": timed(cell.transposed_jacobians, sync)}
    for label, method, levels in SCHEDULES:
        timers[f"{label}_backward"] = timed(lambda m=method, lv=levels: cell.backward(seed, m, lv), sync)
        timers[f"{label}_scan"] = timed(lambda m=method, lv=levels: dense_scan(blocks, seed, m, lv), sync)
    baseline = torch_timers(kind, x, cell.state_dict(), grad_last, be.name)
    if baseline is not None:
        timers.update(baseline[0])
    jax = jax_timer(be.to_host(blocks), grad_last) if with_jax and be.name == "cpu" else None
    if jax is not None:
        timers["jax_scan"] = jax
    seconds = interleaved(timers, repeats)
    row.update(forward_s=seconds["forward"], blocks_s=seconds["blocks"])
    for label, method, levels in SCHEDULES:
        plan = dense_plan(steps, method, row["auto_levels"] if levels == "auto" else levels)
        entry = {"backward_s": seconds[f"{label}_backward"], "scan_s": seconds[f"{label}_scan"],
                 "critical_steps": plan.critical_steps, "work_flops": plan.work_flops(hidden) * batch,
                 "critical_flops": plan.critical_flops(hidden) * batch,
                 "peak_bytes": plan.peak_bytes(batch, hidden, 4)}
        if baseline is not None:
            result = cell.backward(seed, method, levels)
            entry["max_rel_error_vs_torch"] = relative_error(result, baseline[1]())
            entry["speedup_vs_torch"] = seconds["torch_backward"] / entry["backward_s"]
            entry["scan_speedup_vs_torch"] = seconds["torch_backward"] / entry["scan_s"]
        if jax is not None:
            entry["scan_speedup_vs_jax"] = seconds["jax_scan"] / entry["scan_s"]
        row[label] = entry
    if baseline is not None:
        row["torch"] = {"forward_s": seconds["torch_forward"], "backward_s": seconds["torch_backward"]}
    if jax is not None:
        row["jax_associative_scan_s"] = seconds["jax_scan"]
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
    parser.add_argument("--json", action="store_true", help="JSON only (default also JSON)")
    args = parser.parse_args(argv)
    be = backend.get(args.device)
    rows = []

    def run(kind: str, sweep: str, steps: int, batch: int, size: int) -> None:
        row = measure(kind, steps, batch, size, 20, be, not args.no_jax)
        row["sweep"] = sweep
        rows.append(row)
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
    if args.plot is not None:
        plot(rows, args.plot, info.get("gpu", info["processor"]))
    print(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
