"""``method="auto"`` against every schedule, on the CPU (issue 38): regret and the cost model's error.

For every case (a model and a batch size: every bundled spec at batch 1, 4 and 16; deep narrow MLPs of
64-512 layers and widths 4-64 (issue 45: 512 layers of width 8); small CNN chains; RNN and LSTM
classifiers over 100-10,000 time steps)
every schedule that plans within ``--max-plan-seconds`` (hybrid depths 0 .. the full depth, named as
``auto`` names them) and ``auto`` itself are timed in turn, one backward each per round
(``model.backward`` after one forward, the forward not timed), in a new random order every round,
over ``--rounds`` rounds; the figures are medians over the rounds. Per case:

- ``regret``: the median backward time of the schedule auto chose over the fastest schedule's, both
  from the same timings (1.0: auto chose the fastest); ``regret_direct``: ``backward(method="auto")``
  timed as an entry of its own over the fastest's (the same arithmetic as its choice, so it differs from
  ``regret`` by the machine's noise and auto's cached-plan lookup);
- ``ratio`` per schedule: the cost model's predicted time (:meth:`ScanPlan.predicted_seconds`, the
  model :func:`sparse_scan.engine.cost.current` gives: this machine's calibration where one is cached)
  over the measured median, predicted after the timings (a recurrent back-propagation from the last
  state as far as it was seen to go, :class:`sparse_scan.recurrent.Horizon`; a chain with the
  subnormal values its gradients held, :mod:`sparse_scan.engine.subnormals`; ``auto``'s choice is the
  one the timed runs used, made after the warm-up);
- schedules an explicit request refuses before building (the planning limit) are listed as refused.

Recurrent cases of 10,000 steps time depths 0, 1, 2, 4 and the full depth only (a deep scan over
10,000 blocks takes seconds per backward on 2 cores). The JSON ends with the summary: regret's median
and worst, and the distribution of predicted/measured over every schedule built.

``--calibrate`` first calibrates the cost model on this machine (what ``sparse-scan calibrate`` does)
and predicts with that, so that the constants and the timings come from the same conditions.

``--combine RUN.json ...`` prints saved runs of the same cases as one: every time the median of the
runs' medians, predicted by the cost model in use (``SPARSE_SCAN_COST_MODEL=defaults`` for the
documented defaults).

Usage: ``python bench/auto_regret.py --calibrate [--quick] [--rounds 5] > RUN.json``;
``SPARSE_SCAN_COST_MODEL=defaults python bench/auto_regret.py --combine RUN1.json RUN2.json ... >
bench/results/auto_regret-2core-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

import numpy as np
from common import cpu_pressure, machine

from sparse_scan import Sequential, backend, load_model
from sparse_scan.calibration import calibrate
from sparse_scan.engine.cost import current, save
from sparse_scan.engine.plan import ScanCostError, ScanMemoryError
from sparse_scan.engine.schedule import depth, schedule_at_depth
from sparse_scan.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Tanh
from sparse_scan.model import Model
from sparse_scan.recurrent import LSTM, RNN, RecurrentClassifier

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def deep_mlp(layers: int, width: int) -> Sequential:
    """``layers / 2`` pairs of Linear(width, width) and Tanh."""
    blocks = [[Linear(width, width, rng=index), Tanh()] for index in range(layers // 2)]
    return Sequential(*[layer for block in blocks for layer in block], input_shape=(width,))


def cnn(channels: int, size: int, stages: int) -> Sequential:
    """``stages`` of Conv2d 3x3 (padding 1), ReLU and MaxPool2d 2, then a linear head."""
    layers, c = [], 3
    for stage in range(stages):
        layers += [Conv2d(c, channels * 2**stage, 3, padding=1, rng=stage), ReLU(), MaxPool2d(2)]
        c = channels * 2**stage
    side = size // 2**stages
    layers += [Flatten(), Linear(c * side * side, 10, rng=99)]
    return Sequential(*layers, input_shape=(3, size, size))


def recurrent(kind: str, steps: int, hidden: int) -> RecurrentClassifier:
    module = (RNN if kind == "rnn" else LSTM)(1, hidden, rng=0)
    return RecurrentClassifier(module, 10, rng=1, input_shape=(steps, 1))


def cases(quick: bool) -> Iterator[tuple[str, Model, tuple[int, ...]]]:
    """``(name, model, batches)`` of every case."""
    batches = (1, 4, 16)
    for spec in sorted(DATA.glob("*.yaml")):
        yield f"spec {spec.name}", load_model(spec), batches
    widths = (4, 64) if quick else (4, 8, 16, 64)
    for layers in ((64, 512) if quick else (64, 256, 512)):
        for width in widths:
            yield f"mlp {layers} layers width {width}", deep_mlp(layers, width), batches
    for channels, size, stages in ((4, 16, 2), (8, 32, 3), (16, 32, 2)):
        name = f"cnn {stages}x(conv {channels}.., relu, pool) on 3x{size}x{size}"
        yield name, cnn(channels, size, stages), batches
    for kind in ("rnn", "lstm"):
        for steps in ((100, 10000) if quick else (100, 1000, 10000)):
            yield f"{kind} T={steps} H=20", recurrent(kind, steps, 20), batches


def schedules(model: Model) -> list[tuple[str, int | None]]:
    """The schedules ``auto`` chooses among (hybrid depths 0 .. full, named as auto names them)."""
    n = model.plan(model.input_shape, "linear").n
    full = depth(n)
    depths = range(max(full, 1))
    if n >= 10000:
        depths = sorted({0, 1, 2, 4, full - 1} & set(depths))
    return [schedule_at_depth("auto", k, full) for k in depths]


def run_case(model: Model, batch: int, rounds: int, cost: Any) -> dict[str, Any]:
    rng = np.random.default_rng(batch)
    shape = tuple(model.input_shape)
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = model.forward(x)
    grad = rng.standard_normal(y.shape).astype(y.dtype)
    start = time.perf_counter()
    model.plan(shape, "auto", batch=batch)
    plan_auto_s = time.perf_counter() - start
    plans, refused = {}, {}
    for method, levels in schedules(model):
        try:
            plans[(method, levels)] = model.plan(shape, method, levels, batch=batch)
        except (ScanCostError, ScanMemoryError) as error:
            refused[f"{method}{'' if levels is None else f' {levels}'}"] = str(error)[:200]
    entries = list(plans) + ["auto"]
    times: dict[Any, list[float]] = {entry: [] for entry in entries}
    for entry in entries:  # warm-up: kernels compiled, buffers allocated, a horizon and subnormals seen
        model.backward(grad, *(("auto", None) if entry == "auto" else entry))
    auto = model.plan(shape, "auto", batch=batch)  # the choice the timed runs use
    chosen = (auto.method, auto.levels)
    order = np.random.default_rng(0)
    for _ in range(rounds):  # a new order every round: no entry always follows the same one
        for index in order.permutation(len(entries)):
            entry = entries[index]
            method, levels = ("auto", None) if entry == "auto" else entry
            begin = time.perf_counter()
            model.backward(grad, method, levels)
            times[entry].append(time.perf_counter() - begin)
    medians = {entry: statistics.median(values) for entry, values in times.items()}
    fastest = min(plans, key=lambda entry: medians[entry])
    chosen_s = medians[chosen] if chosen in medians else medians["auto"]
    rows = []
    for (method, levels), plan in plans.items():
        predicted = plan.predicted_seconds(batch, cost)
        rows.append({"method": method, "levels": levels, "measured_s": medians[(method, levels)],
                     "predicted_s": predicted, "ratio": predicted / medians[(method, levels)],
                     "critical_flops": plan.critical_flops, "work_flops": plan.work_flops,
                     "features": plan.features(batch, cost.threads)})
    return {"batch": batch, "auto": {"method": chosen[0], "levels": chosen[1], "measured_s": medians["auto"],
                                     "plan_s": plan_auto_s},
            "fastest": {"method": fastest[0], "levels": fastest[1], "measured_s": medians[fastest]},
            "regret": chosen_s / medians[fastest], "regret_direct": medians["auto"] / medians[fastest],
            "schedules": rows, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer generated chains")
    parser.add_argument("--max-plan-seconds", type=float, default=20.0,
                        help="the planning limit of every explicit schedule (SPARSE_SCAN_MAX_PLAN_SECONDS)")
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate the cost model first (`sparse-scan calibrate`) and predict with it")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--combine", type=pathlib.Path, nargs="+", default=None, metavar="RUN",
                        help="saved runs of the same cases: print them as one, every time the median of the "
                             "runs' medians, predicted by the cost model in use (SPARSE_SCAN_COST_MODEL)")
    args = parser.parse_args()
    if args.combine is not None:
        print(json.dumps(combine([json.loads(path.read_text(encoding="utf-8")) for path in args.combine],
                                 [str(path) for path in args.combine]), indent=1))
        return
    os.environ["SPARSE_SCAN_MAX_PLAN_SECONDS"] = str(args.max_plan_seconds)
    if args.calibrate:  # this machine's constants now, as `sparse-scan calibrate` caches them
        cost, _ = calibrate("cpu")
        os.environ["SPARSE_SCAN_COST_MODEL"] = str(save(cost, pathlib.Path(tempfile.mkdtemp()) / "cost.json"))
    cost = current("cpu")
    info = machine(backend.get("cpu"), with_torch=False)
    report: dict[str, Any] = {"benchmark": "auto_regret", "machine": info,
                              "environment": {name: os.environ.get(name) for name in
                                              ("OPENBLAS_NUM_THREADS", "SPARSE_SCAN_THREADS",
                                               "SPARSE_SCAN_COST_MODEL", "SPARSE_SCAN_MAX_PLAN_SECONDS")},
                              "cost_model": cost.as_dict(), "rounds": args.rounds,
                              "cpu_pressure_start": cpu_pressure(), "load_start": os.getloadavg(),
                              "cases": []}
    for name, model, batches in cases(args.quick):
        if args.only and args.only not in name:
            continue
        for batch in batches:
            row = {"case": name, **run_case(model, batch, args.rounds, cost)}
            report["cases"].append(row)
            print(f"{name} batch {batch}: auto {row['auto']['method']} {row['auto']['levels']}, fastest "
                  f"{row['fastest']['method']} {row['fastest']['levels']}, regret {row['regret']:.2f}",
                  file=sys.stderr, flush=True)
    report["cpu_pressure_end"], report["load_end"] = cpu_pressure(), os.getloadavg()
    report["summary"] = summary(report["cases"])
    print(json.dumps(report, indent=1))


def combine(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Runs of the same cases as one report: per schedule (and ``auto``) the median of the runs'
    median times, its prediction by the cost model in use (:func:`current`, from the features the
    first run recorded: give the newest first), regret from the combined times, and the summary. A
    machine's load moves a run's times by up to 2-4x on these shared machines; the median of runs is
    steadier."""
    cost = current("cpu")
    runs_seen = [{"file": name, "date": run["machine"]["date"], "cost_model": run["cost_model"]["source"],
                  "cpu_pressure_start": run["cpu_pressure_start"],
                  "cpu_pressure_end": run["cpu_pressure_end"],
                  "summary": {k: v for k, v in run["summary"].items() if k != "outside_2x"}}
                 for name, run in zip(names, runs, strict=True)]
    report = {"benchmark": "auto_regret", "combined": runs_seen, "machine": runs[0]["machine"],
              "cost_model": cost.as_dict(), "rounds": sum(run["rounds"] for run in runs), "cases": []}

    def key(row: dict[str, Any]) -> tuple[str, int]:
        return row["case"], row["batch"]

    others = [{key(row): row for row in run["cases"]} for run in runs[1:]]
    for first in runs[0]["cases"]:
        rows = [first] + [other[key(first)] for other in others]
        row = {"case": first["case"], "batch": first["batch"], "refused": first["refused"], "schedules": []}
        times = {}
        for index, entry in enumerate(first["schedules"]):
            measured = statistics.median(r["schedules"][index]["measured_s"] for r in rows)
            predicted = cost.predict(entry["features"])
            times[(entry["method"], entry["levels"])] = measured
            row["schedules"].append(entry | {"measured_s": measured, "predicted_s": predicted,
                                             "ratio": predicted / measured})
        fastest = min(times, key=times.__getitem__)
        chosen = (first["auto"]["method"], first["auto"]["levels"])
        auto_s = statistics.median(r["auto"]["measured_s"] for r in rows)
        row["auto"] = first["auto"] | {"measured_s": auto_s}
        row["fastest"] = {"method": fastest[0], "levels": fastest[1], "measured_s": times[fastest]}
        row["regret"] = times.get(chosen, auto_s) / times[fastest]
        row["regret_direct"] = auto_s / times[fastest]
        report["cases"].append(row)
    report["summary"] = summary(report["cases"])
    return report


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Regret's median and worst (both kinds), auto's choices against the fastest, and the
    distribution of predicted over measured time of every schedule timed."""
    regrets = [row["regret"] for row in rows]
    direct = [row["regret_direct"] for row in rows]
    ratios = sorted(entry["ratio"] for row in rows for entry in row["schedules"])
    misses = [{"case": row["case"], "batch": row["batch"], "method": entry["method"],
               "levels": entry["levels"], "ratio": round(entry["ratio"], 3),
               "measured_s": entry["measured_s"]}
              for row in rows for entry in row["schedules"] if not 0.5 <= entry["ratio"] <= 2]
    missed = [f"{row['case']} batch {row['batch']}" for row in rows
              if (row["auto"]["method"], row["auto"]["levels"]) != (row["fastest"]["method"],
                                                                    row["fastest"]["levels"])]
    return {"cases": len(regrets), "regret_median": statistics.median(regrets), "regret_worst": max(regrets),
            "regret_over_1_3": sum(r > 1.3 for r in regrets),
            "regret_direct_median": statistics.median(direct), "regret_direct_worst": max(direct),
            "auto_not_the_fastest": missed,
            "schedules_timed": len(ratios),
            "predicted_over_measured": {"min": ratios[0], "p10": ratios[len(ratios) // 10],
                                        "median": statistics.median(ratios),
                                        "p90": ratios[9 * len(ratios) // 10], "max": ratios[-1]},
            "within_2x": sum(0.5 <= r <= 2 for r in ratios), "outside_2x": misses}


if __name__ == "__main__":
    main()
