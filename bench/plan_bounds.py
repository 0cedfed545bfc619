"""What planning costs (issue 38): ``load_model`` + ``plan(auto)`` of every bundled spec, and how fast an
explicit schedule over the planning limit is refused.

Each measurement runs in a fresh process (``python bench/plan_bounds.py --one SPEC METHOD [LEVELS]``),
which reports its wall time from before ``import sparse_scan`` to the plan (or the refusal) and its
peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``); a child past ``--timeout``
seconds is killed and reported so. Cases: ``auto`` on every ``data/*.yaml``; ``hybrid 1``, ``hybrid 2``,
``hybrid 3`` and ``blelloch`` on the pruned ResNet-20 and on VGG-11, the deep schedules that planned
for minutes and up to 18 GB before. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
DEEP = ("resnet20-pruned.yaml", "vgg11.yaml")
SCHEDULES = (("hybrid", 1), ("hybrid", 2), ("hybrid", 3), ("blelloch", None))


def one(spec: str, method: str, levels: int | None) -> dict[str, Any]:
    """Load ``spec`` and plan it (in this process); wall time and peak memory."""
    import resource

    start = time.perf_counter()
    from sparse_scan import load_model
    from sparse_scan.engine.plan import ScanCostError, ScanMemoryError

    model = load_model(DATA / spec)
    outcome: dict[str, Any] = {}
    try:
        plan = model.plan(model.input_shape, method, levels)
        outcome = {"planned": f"{plan.method}{'' if plan.levels is None else f' {plan.levels}'}",
                   "plan_builds": model.plan_builds}
    except (ScanCostError, ScanMemoryError) as error:
        outcome = {"refused": f"{type(error).__name__}: {error}"}
    outcome["seconds"] = time.perf_counter() - start
    outcome["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return outcome


def measure(spec: str, method: str, levels: int | None, timeout: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", spec, method] + ([] if levels is None else [str(levels)])
    row: dict[str, Any] = {"spec": spec, "method": method, "levels": levels}
    start = time.perf_counter()
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return row | {"killed_after_s": timeout}
    if child.returncode != 0:
        return row | {"error": child.stderr.strip().splitlines()[-1:],
                      "process_s": time.perf_counter() - start}
    return row | json.loads(child.stdout) | {"process_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    if args.one:
        spec, method, *levels = args.one
        print(json.dumps(one(spec, method, int(levels[0]) if levels else None)))
        return
    rows = [measure(path.name, "auto", None, args.timeout) for path in sorted(DATA.glob("*.yaml"))]
    rows += [measure(spec, method, levels, args.timeout) for spec in DEEP for method, levels in SCHEDULES]
    for row in rows:
        print(json.dumps(row), file=sys.stderr, flush=True)
    auto = [row for row in rows if row["method"] == "auto"]
    deep = [row for row in rows if row["method"] != "auto"]
    summary = {"auto_worst_s": max(row.get("seconds", float("inf")) for row in auto),
               "auto_over_1s": [row["spec"] for row in auto if row.get("seconds", 1e9) > 1],
               "deep_all_refused": all("refused" in row for row in deep),
               "deep_worst_s": max(row.get("seconds", float("inf")) for row in deep),
               "deep_worst_rss_mib": max(row.get("peak_rss_mib", float("inf")) for row in deep)}
    environment = {name: os.environ.get(name) for name in
                   ("OPENBLAS_NUM_THREADS", "SPARSE_SCAN_COST_MODEL", "SPARSE_SCAN_MAX_PLAN_SECONDS")}
    print(json.dumps({"benchmark": "plan_bounds", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "cpu_count": os.cpu_count(), "load": os.getloadavg(), "environment": environment,
                      "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
