"""Issue 21: the numeric phase's dead-work skipping, before/after in one run.

On the 97%-pruned VGG-11 conv stack (``data/vgg11-pruned.yaml``, 3x32x32, float32) with a random
normal input (live zeros from its real ReLUs and max-pools): every product of up-sweep levels 0-2 of
the Blelloch scan (``run.multiply`` with its plan; products over ``--max-multiply-adds`` per sample
skipped and reported) at batch 1 and ``--batch``, and the whole backward's numeric scan
(``Sequential.backward``'s ``scan_s``) for hybrid 1, hybrid 2 and blelloch (a schedule with a product
over ``--max-step-flops`` is reported as not planned). ``--old TREE`` is the code before (e.g. ``git
archive 4906d38``); each tree runs in a fresh process per round (its ``sparse_scan`` imported through
``PYTHONPATH``), the rounds alternating which goes first, and the figures are medians over rounds of
each process's median of ``--repeats`` calls after a warm-up. Ratios old/new (above 1: faster now) come
from the same run; ``/proc/pressure/cpu`` is recorded before and after (the machine is shared). Prints
JSON.
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
SCHEDULES = [("hybrid", 1), ("hybrid", 2), ("blelloch", None)]


def median_time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def products(batch: int, repeats: int, max_multiply_adds: float) -> list[dict[str, Any]]:
    """Levels 0-2 of the Blelloch up-sweep, each product timed with its plan."""
    from vgg import vgg11_features

    from sparse_scan.engine.products import count_multiply_adds, plan_product
    from sparse_scan.engine.run import multiply
    from sparse_scan.engine.schedule import Element, schedule

    rows = []
    model = vgg11_features(pruned=True)
    x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    model.forward(x)
    n, shapes, jts = len(model), model.shapes(x.shape[1:]), model.transposed_jacobians()
    values = {Element(j, j): (jts[n - j].pattern, model.layers[n - j].jacobian_kind, jts[n - j].data)
              for j in range(1, n + 1)}
    for level, phase, left, right, _ in schedule(n, "blelloch", None):
        if phase != "up" or level > 2 or left.lo == 0:
            continue
        out = Element(left.lo, right.hi)
        row: dict[str, Any] = {"batch": batch, "level": level,
                               "layers": [model.layers[n - right.hi].name, model.layers[n - left.lo].name]}
        rows.append(row)
        if values.get(left) is None or values.get(right) is None:
            row["skipped"] = "an operand was not computed"
            values[out] = None
            continue
        (a_pat, a_kind, a_data), (b_pat, b_kind, b_data) = values[right], values[left]
        row["multiply_adds"] = count_multiply_adds(a_pat, b_pat)
        if row["multiply_adds"] > max_multiply_adds:
            row["skipped"] = "over --max-multiply-adds"
            values[out] = None
            continue
        channels = (shapes[n - right.hi][0], shapes[n - left.hi][0], shapes[n - left.lo + 1][0])
        plan = plan_product(a_pat, b_pat, a_kind, b_kind, channels=channels)
        result = multiply(plan, a_data, b_data)
        values[out] = (plan.out, "general", result)
        row.update(method=plan.method, a_zeros=float(np.mean(a_data == 0)),
                   b_zeros=float(np.mean(b_data == 0)),
                   s=median_time(lambda: multiply(plan, a_data, b_data), repeats),  # noqa: B023
                   checksum=float(np.abs(result).astype(np.float64).sum()))
    return rows


def backwards(batch: int, repeats: int, max_step_flops: float) -> list[dict[str, Any]]:
    """The whole backward's numeric scan per schedule (plan built before the timing)."""
    from vgg import vgg11_features

    from sparse_scan.engine.plan import ScanCostError

    rows = []
    model = vgg11_features(pruned=True)
    x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    y = model.forward(x)
    grad = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    for method, levels in SCHEDULES:
        row: dict[str, Any] = {"batch": batch, "method": method, "levels": levels}
        rows.append(row)
        try:
            model.plan(x.shape[1:], method, levels, max_step_flops=int(max_step_flops))
        except ScanCostError as error:
            row["skipped"] = f"not planned: {error}"
            continue
        scan = []

        def run() -> None:
            timings: dict[str, float] = {}
            model.backward(grad, method, levels, timings=timings)  # noqa: B023
            scan.append(timings["scan_s"])  # noqa: B023

        row["backward_s"] = median_time(run, repeats)
        row["scan_s"] = statistics.median(scan[1:])
    return rows


def worker(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"products": [], "backwards": []}
    for batch in (1, args.batch):
        out["products"] += products(batch, args.repeats, args.max_multiply_adds)
        out["backwards"] += backwards(batch, args.repeats, args.max_step_flops)
    return out


def key(row: dict[str, Any]) -> str:
    if "layers" in row:
        return f"level {row['level']} {'·'.join(row['layers'])} B={row['batch']}"
    return f"{row['method']} {row['levels']} B={row['batch']}"


def summarise(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Per product / schedule: medians over rounds of each tree's time, and old/new."""
    summary: dict[str, list[dict[str, Any]]] = {}
    for part, field in (("products", "s"), ("backwards", "scan_s")):
        rows = []
        for index, first in enumerate(rounds["new"][0][part]):
            row = {k: v for k, v in first.items() if k not in (field, "backward_s", "checksum")}
            row["name"] = key(first)
            for tree in rounds:
                samples = [r[part][index] for r in rounds[tree]]
                if all(field in s for s in samples):
                    row[f"{tree}_{field}"] = statistics.median(s[field] for s in samples)
                    row[f"{tree}_{field}_rounds"] = [s[field] for s in samples]
                    if part == "backwards":
                        row[f"{tree}_backward_s"] = statistics.median(s["backward_s"] for s in samples)
            if "old" in rounds and f"old_{field}" in row and f"new_{field}" in row:
                row["old_over_new"] = row[f"old_{field}"] / row[f"new_{field}"]
                if part == "products":
                    row["same_checksum"] = first["checksum"] == rounds["old"][0][part][index]["checksum"]
            rows.append(row)
        summary[part] = rows
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=pathlib.Path, help="a checkout of the code before, timed in turn")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-multiply-adds", type=float, default=5e7)
    parser.add_argument("--max-step-flops", type=float, default=1e8)
    parser.add_argument("--output", type=pathlib.Path, help="also write the JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    sys.path.insert(0, str(BENCH))
    from common import cpu_pressure, machine

    from sparse_scan import backend

    report: dict[str, Any] = {"benchmark": "dead_work", "machine": machine(backend.get("cpu")),
                              "cpu_pressure_before": cpu_pressure(), "rounds": args.rounds,
                              "repeats": args.repeats, "old": str(args.old) if args.old else None}
    trees = {"new": BENCH.parent}
    if args.old:
        trees["old"] = args.old.resolve()
    rounds: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--batch",
               str(args.batch), "--repeats", str(args.repeats), "--max-multiply-adds",
               str(args.max_multiply_adds), "--max-step-flops", str(args.max_step_flops)]
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
        for tree in order:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(trees[tree]), str(BENCH)))}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                                  cwd=str(trees[tree]))
            rounds[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}/{args.rounds}: {tree} done", file=sys.stderr, flush=True)
    report.update(summarise(rounds))
    report["cpu_pressure_after"] = cpu_pressure()
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
