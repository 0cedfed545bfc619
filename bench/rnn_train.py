"""The paper's RNN training (§4.1, Fig. 7) on the bitstream task: BPPSA and BP give the same loss curve.

Trains two identical copies of the paper's classifier (Elman RNN, H=20, input 1, 10 classes, Adam) on
the same batches, one with the Blelloch scan and one with BP (the linear scan), and reports per
iteration both losses and the wall time of each iteration, the largest difference between the
curves, and (``--plot``) both curves against the iteration. Prints JSON; ``--csv`` writes the curves.

Two float runs of the same training drift apart once rounding differences (the scan sums in another
order than BP) are amplified by unstable stretches of training (the loss spikes of an RNN over long
sequences), so a third run checks exactness in lockstep: it trains with BP and, at every iteration,
also computes the BPPSA gradients from the same weights and batch, and records their largest relative
difference from BP's.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import time

import numpy as np
from common import machine

from sparse_scan import backend
from sparse_scan.optim import Adam
from sparse_scan.recurrent import RNN, Bitstream, RecurrentClassifier
from sparse_scan.train import train_iterations


class _Lockstep:
    """The model, trained with BP's parameter gradients; at every backward BPPSA's from the same state
    are computed too and compared (a :class:`sparse_scan.model.Model` for the training loop)."""

    def __init__(self, model: RecurrentClassifier) -> None:
        self.model, self.layers, self.differences = model, model.layers, []
        self._parameters: dict = {}

    def forward(self, x):
        return self.model.forward(x)

    def backward(self, grad_out, method="auto", levels=None):
        grads = self.model.backward(grad_out, "linear")
        self._parameters = self.model.parameter_gradients(grads)
        scan = self.model.parameter_gradients(self.model.backward(grad_out, "blelloch"))
        self.differences.append(max(float(np.abs(backend.of(v).to_host(scan[k] - v)).max()
                                          / max(float(np.abs(backend.of(v).to_host(v)).max()), 1e-30))
                                    for k, v in self._parameters.items()))
        return grads

    def parameter_gradients(self, grads):
        return self._parameters


def _first(mask: np.ndarray) -> int | None:
    """The first iteration where ``mask`` holds, or None."""
    return int(np.argmax(mask)) if mask.any() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="sequence length T")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (the paper: 1e-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"))
    parser.add_argument("--csv", type=pathlib.Path)
    parser.add_argument("--plot", type=pathlib.Path)
    args = parser.parse_args(argv)
    data = Bitstream(args.steps, seed=args.seed, dtype=args.dtype)
    curves, seconds = {}, {}
    for method in ("blelloch", "linear"):
        recurrent = RNN(1, 20, dtype=args.dtype, rng=args.seed)
        model = RecurrentClassifier(recurrent, classes=10, rng=args.seed + 1)
        start = time.perf_counter()
        records = train_iterations(model, data, Adam(model, lr=args.lr), args.iterations, args.batch_size,
                                   method=method, seed=args.seed, device=args.device,
                                   progress=lambda i, n, loss, m=method: print(
                                       f"\r{m} {i}/{n} loss {loss:.4f}", end="", file=sys.stderr))
        print(file=sys.stderr)
        seconds[method] = (time.perf_counter() - start) / args.iterations
        curves[method] = np.array([r["loss"] for r in records])
    model = RecurrentClassifier(RNN(1, 20, dtype=args.dtype, rng=args.seed), classes=10,
                                rng=args.seed + 1)
    checked = _Lockstep(model)
    train_iterations(checked, data, Adam(checked, lr=args.lr), args.iterations, args.batch_size,
                     seed=args.seed, device=args.device)
    lockstep = np.array(checked.differences)
    difference = np.abs(curves["blelloch"] - curves["linear"])
    if args.csv is not None:
        with open(args.csv, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["iteration", "loss_bppsa", "loss_bp", "lockstep_grad_rel_difference"])
            writer.writerows(zip(range(args.iterations), curves["blelloch"], curves["linear"], lockstep,
                                 strict=True))
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (axis, below) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                          gridspec_kw={"height_ratios": [2, 1]})
        below.semilogy(np.maximum(lockstep, 1e-18), ".", markersize=2)
        below.set_ylabel("BPPSA vs BP gradients\nsame weights (max rel.)")
        below.set_xlabel("iteration")
        axis.plot(curves["blelloch"], label="BPPSA (Blelloch scan)")
        axis.plot(curves["linear"], "--", label="BP (linear scan)")
        axis.set_ylabel("training loss (batch)")
        axis.set_title(f"RNN on bitstream, T={args.steps}, B={args.batch_size}, Adam lr={args.lr:g}, "
                       f"{args.dtype}")
        axis.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    print(json.dumps({
        "machine": machine(backend.get(args.device)), "T": args.steps, "iterations": args.iterations,
        "batch_size": args.batch_size, "lr": args.lr, "dtype": args.dtype,
        "first_divergence": {f"{threshold:g}": _first(difference > threshold * np.abs(curves["linear"]))
                             for threshold in (1e-6, 1e-4, 1e-2)},
        "first_loss": float(curves["linear"][0]), "last_loss": float(curves["linear"][-1]),
        "mean_loss_last_50": {m: float(c[-50:].mean()) for m, c in curves.items()},
        "max_abs_difference": float(difference.max()),
        "max_rel_difference": float((difference / np.abs(curves["linear"])).max()),
        "lockstep_max_grad_rel_difference": float(lockstep.max()),
        "lockstep_median_grad_rel_difference": float(np.median(lockstep)),
        "seconds_per_iteration": seconds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
