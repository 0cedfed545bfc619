"""Same-run timing of two checkouts of sparse-scan: the ratio new/old per workload.

    python bench/compare_trees.py OLD_TREE NEW_TREE [--rounds 5] [--json]

Each round runs every workload once in each tree, in a fresh interpreter (``PYTHONPATH`` set to the
tree, so the tree's own ``sparse_scan`` is imported), alternating which tree goes first; a workload
reports the median of its repeats inside the process, and the script prints per workload the median
over rounds for each tree and their ratio. Alternating trees in one run is what makes the ratio mean
something on a shared machine: both trees see the same load. Workloads use only the public API both
trees share (``load_model``, ``Sequential.backward``, ``recurrent.RNN``/``LSTM``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKLOAD = r'''
import json, statistics, sys, time
import numpy as np
import sparse_scan
from sparse_scan import load_model
from sparse_scan.recurrent import LSTM, RNN

def median(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return statistics.median(times)

name = sys.argv[1]
rng = np.random.default_rng(0)
if name.startswith("lenet5") or name.startswith("vgg11"):
    spec, method, levels, batch = {
        "lenet5-linear": ("data/lenet5.yaml", "linear", None, 16),
        "lenet5-blelloch": ("data/lenet5.yaml", "blelloch", None, 16),
        "vgg11-pruned-linear": ("data/vgg11-pruned.yaml", "linear", None, 4),
        "vgg11-pruned-hybrid1": ("data/vgg11-pruned.yaml", "hybrid", 1, 4),
        "vgg11-linear": ("data/vgg11.yaml", "linear", None, 4),
    }[name]
    start = time.perf_counter()
    model = load_model(spec, dtype=np.float32)
    x = rng.standard_normal((batch,) + tuple(model.input_shape)).astype(np.float32)
    y = model.forward(x)
    model.backward(np.ones_like(y), method=method, levels=levels)
    cold = time.perf_counter() - start
    def step():
        model.forward(x)
        model.backward(np.ones_like(y), method=method, levels=levels)
    warm = median(step, 5)
    print(json.dumps({"cold_s": cold, "warm_s": warm}))
else:
    cls, method = {"rnn-blelloch": (RNN, "blelloch"), "rnn-linear": (RNN, "linear"),
                   "lstm-blelloch": (LSTM, "blelloch"), "lstm-linear": (LSTM, "linear")}[name]
    module = cls(1, 20, dtype=np.float32, rng=0) if cls is RNN else cls(1, 20, dtype=np.float32, rng=0)
    x = rng.standard_normal((16, 1000, 1)).astype(np.float32)
    def step():
        module(x)
        module.backward(None, method=method)
    print(json.dumps({"warm_s": median(step, 5)}))
'''

WORKLOADS = ("lenet5-linear", "lenet5-blelloch", "vgg11-pruned-linear", "vgg11-pruned-hybrid1",
             "vgg11-linear", "rnn-blelloch", "rnn-linear", "lstm-blelloch", "lstm-linear")


def run(tree: str, workload: str) -> dict[str, float]:
    """One workload in a fresh interpreter importing ``tree``'s sparse_scan."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", WORKLOAD, workload], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import cpu_pressure
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    for round_ in range(args.rounds):
        for workload in args.workloads:
            trees = (("old", args.old), ("new", args.new))
            for label, tree in trees if round_ % 2 == 0 else trees[::-1]:
                for key, value in run(tree, workload).items():
                    results.setdefault(workload, {}).setdefault(key, {}).setdefault(label, []).append(value)
            print(f"round {round_ + 1}/{args.rounds}: {workload} done", file=sys.stderr, flush=True)
    report = {}
    for workload, figures in results.items():
        for key, by_tree in figures.items():
            old, new = statistics.median(by_tree["old"]), statistics.median(by_tree["new"])
            report[f"{workload}/{key}"] = {"old": old, "new": new, "new_over_old": new / old}
    print(json.dumps({"rounds": args.rounds, "cpu_pressure_after": cpu_pressure(), "results": report},
                     indent=1))


if __name__ == "__main__":
    main()
