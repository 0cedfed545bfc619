"""Retraining the 97%-pruned VGG-11 stack with BPPSA gradients: time per iteration per schedule.

The bundled ``data/vgg11-pruned.yaml`` plus a classifier (flatten, linear 512 -> 10) is trained for a
few SGD iterations on random CIFAR-shaped data (3x32x32, 10 classes) with each schedule; the pruned
weights must stay exactly zero. Prints JSON: per schedule the median seconds per iteration (forward,
loss, scan, parameter gradients, update, and the test batch's loss) and the losses, which must agree
across schedules.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

import numpy as np
import yaml
from common import machine

from sparse_scan import backend, load_model
from sparse_scan.optim import SGD
from sparse_scan.train import Dataset, train

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def classifier_spec(folder: pathlib.Path) -> pathlib.Path:
    spec = yaml.safe_load((DATA / "vgg11-pruned.yaml").read_text())
    spec["layers"] += [{"name": "flat", "type": "flatten"},
                       {"name": "fc", "type": "linear", "out_features": 10}]
    path = folder / "vgg11-pruned-classifier.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=4)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    n = args.batch * args.iterations
    data = Dataset(rng.standard_normal((n, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, n),
                   rng.standard_normal((args.batch, 3, 32, 32)).astype(np.float32),
                   rng.integers(0, 10, args.batch))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        spec = classifier_spec(pathlib.Path(folder))
        for method, levels in (("linear", None), ("hybrid", 1), ("hybrid", "auto")):
            model = load_model(spec)
            pruned = {layer.name: layer.weight == 0 for layer in model.layers
                      if getattr(layer, "prune_pattern", False)}
            start = time.perf_counter()
            model.plan(model.input_shape, method, levels)
            plan_s = time.perf_counter() - start
            stamps = [time.perf_counter()]
            records = train(model, data, SGD(model, lr=0.01, momentum=0.9), epochs=1,
                            batch_size=args.batch, method=method, levels=levels,
                            on_iteration=lambda record, stamps=stamps: stamps.append(time.perf_counter()))
            per_iteration = np.diff(stamps)
            still_zero = all(np.all(layer.weight[pruned[layer.name]] == 0) for layer in model.layers
                             if layer.name in pruned)
            row = {"method": method, "levels": levels, "plan_s": plan_s,
                   "median_iteration_s": float(np.median(per_iteration)),
                   "train_losses": [r["train_loss"] for r in records], "pruned_weights_stay_zero": still_zero}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    print(json.dumps({"benchmark": "retrain", "machine": machine(backend.get("cpu")), "batch": args.batch,
                      "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
