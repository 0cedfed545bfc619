"""Block products on the host, before and after: a ResNet-20 residual block's JT fill.

The first residual block of ``data/resnet20.yaml`` (conv1·bn1·relu·conv2·bn2: its third step is a
block product of 16×16-channel blocks, 316 M multiply-adds per sample) is filled at batch 3 in
float64 and float32 by this tree's sparse_scan and by ``--old TREE``'s, each in its own fresh
process per round, the order alternating between rounds; a worker reports the median of its repeats
and the figures are medians over rounds (same-run ratios). ``/proc/pressure/cpu`` is recorded before
and after. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

BENCH = pathlib.Path(__file__).resolve().parent
DTYPES = ("float64", "float32")


def worker(repeats: int, batch: int) -> dict[str, float]:
    """Median seconds of the block's JT fill per dtype, in this process's sparse_scan."""
    from sparse_scan import load_model

    out = {}
    for name in DTYPES:
        dtype = np.dtype(name)
        model = load_model(BENCH.parent / "data" / "resnet20.yaml", dtype=dtype)
        x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(dtype)
        model.forward(x)
        block, inputs = model.layers[3], model._require_forward()[3]
        block.transposed_jacobian(inputs)  # plans, compiles or loads the kernels
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            block.transposed_jacobian(inputs)
            times.append(time.perf_counter() - start)
        out[f"resnet20-block1-jt/B{batch}/{name}"] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=pathlib.Path, required=True, help="the checkout timed as before")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.repeats, args.batch)))
        return 0
    sys.path.insert(0, str(BENCH))
    from common import cpu_pressure, machine

    from sparse_scan import backend

    trees = [("new", BENCH.parent), ("old", args.old.resolve())]
    report: dict[str, Any] = {"benchmark": "blocks", "machine": machine(backend.get("cpu")),
                              "cpu_pressure_before": cpu_pressure(), "old_tree": str(args.old),
                              "rounds": args.rounds, "repeats": args.repeats}
    rounds = []
    for round_ in range(args.rounds):
        figures = {}
        for label, tree in trees if round_ % 2 == 0 else trees[::-1]:
            command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--old", str(tree),
                       "--repeats", str(args.repeats), "--batch", str(args.batch)]
            env = dict(os.environ, PYTHONPATH=str(tree), PYTHONWARNINGS="ignore")
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            figures[label] = json.loads(done.stdout.strip().splitlines()[-1])
        rounds.append(figures)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for key in rounds[0]["new"]:
        new = [r["new"][key] for r in rounds]
        old = [r["old"][key] for r in rounds]
        rows.append({"config": key, "new_s": statistics.median(new), "old_s": statistics.median(old),
                     "old_over_new": statistics.median(old) / statistics.median(new),
                     "median_round_ratio": statistics.median(o / n for o, n in zip(old, new, strict=True)),
                     "rounds_s": {"new": new, "old": old}})
    report["rows"] = rows
    report["cpu_pressure_after"] = cpu_pressure()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
