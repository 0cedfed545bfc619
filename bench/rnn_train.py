"""The paper's RNN training (§4.1, Fig. 7) on the bitstream task: BPPSA and BP give the same loss curve.

Trains two identical copies of the paper's classifier (Elman RNN, H=20, input 1, 10 classes, Adam) on
the same batches, one with the Blelloch scan and one with BP (the linear scan), and reports per
iteration both losses and the wall time of each iteration, the largest difference between the
curves, and (``--plot``) both curves against the iteration. Prints JSON; ``--csv`` writes the curves.
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
from sparse_scan.recurrent import RNN, Bitstream, RecurrentClassifier, train_recurrent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="sequence length T")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (the paper: 1e-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"))
    parser.add_argument("--csv", type=pathlib.Path)
    parser.add_argument("--plot", type=pathlib.Path)
    args = parser.parse_args(argv)
    data = Bitstream(args.steps, seed=args.seed)
    curves, seconds = {}, {}
    for method in ("blelloch", "linear"):
        model = RecurrentClassifier(RNN(1, 20, rng=args.seed), classes=10, rng=args.seed + 1)
        start = time.perf_counter()
        records = train_recurrent(model, data, Adam(model, lr=args.lr), args.iterations, args.batch_size,
                                  method=method, seed=args.seed, device=args.device,
                                  progress=lambda i, n, loss, m=method: print(
                                      f"\r{m} {i}/{n} loss {loss:.4f}", end="", file=sys.stderr))
        print(file=sys.stderr)
        seconds[method] = (time.perf_counter() - start) / args.iterations
        curves[method] = np.array([r["loss"] for r in records])
    difference = np.abs(curves["blelloch"] - curves["linear"])
    if args.csv is not None:
        with open(args.csv, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["iteration", "loss_bppsa", "loss_bp"])
            writer.writerows(zip(range(args.iterations), curves["blelloch"], curves["linear"], strict=True))
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axis = plt.subplots(figsize=(6, 4))
        axis.plot(curves["blelloch"], label="BPPSA (Blelloch scan)")
        axis.plot(curves["linear"], "--", label="BP (linear scan)")
        axis.set_xlabel("iteration")
        axis.set_ylabel("training loss (batch)")
        axis.set_title(f"RNN on bitstream, T={args.steps}, B={args.batch_size}, Adam lr={args.lr:g}")
        axis.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    print(json.dumps({
        "machine": machine(backend.get(args.device)), "T": args.steps, "iterations": args.iterations,
        "batch_size": args.batch_size, "lr": args.lr,
        "first_loss": float(curves["linear"][0]), "last_loss": float(curves["linear"][-1]),
        "mean_loss_last_50": {m: float(c[-50:].mean()) for m, c in curves.items()},
        "max_abs_difference": float(difference.max()),
        "max_rel_difference": float((difference / np.abs(curves["linear"])).max()),
        "seconds_per_iteration": seconds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
