"""Retraining the 97%-pruned VGG-11 stack with BPPSA gradients: time per iteration per schedule.

The bundled ``data/vgg11-pruned.yaml`` plus a classifier (flatten, linear 512 -> 10) is trained for a
few SGD iterations on random CIFAR-shaped data (3x32x32, 10 classes) with each schedule; the pruned
weights must stay exactly zero. Prints JSON: per schedule the median seconds per iteration (forward,
loss, scan, parameter gradients, update, and the test batch's loss) and the losses, which must agree
across schedules. When torch is installed, the same network trained by PyTorch on the same batches
(``torch.optim.SGD``, the pruned weights' gradients masked) is a last row: its seconds per iteration
and the largest difference of its losses from ours.
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


def torch_row(model: Any, data: Dataset, batch: int, iterations: int) -> dict[str, Any] | None:
    """PyTorch training the mirror of ``model`` (weights copied) on the batches ``train`` draws."""
    try:
        import torch
    except ImportError:
        return None
    modules, masks = [], []
    for layer in model.layers:
        kind = type(layer).__name__
        if kind == "Conv2d":
            module = torch.nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                                     layer.padding)
        elif kind == "Linear":
            module = torch.nn.Linear(layer.in_features, layer.out_features)
        else:
            modules.append(torch.nn.MaxPool2d(layer.kernel_size, layer.stride) if kind == "MaxPool2d"
                           else {"ReLU": torch.nn.ReLU, "Flatten": torch.nn.Flatten}[kind]())
            continue
        module.weight.data = torch.from_numpy(layer.weight.copy())
        module.bias.data = torch.from_numpy(layer.bias.copy())
        if getattr(layer, "prune_pattern", False):
            masks.append((module.weight, torch.from_numpy(layer.weight != 0)))
        modules.append(module)
    net = torch.nn.Sequential(*modules)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    order = np.random.default_rng(0).permutation(len(data.x_train))  # train()'s shuffle (seed 0)
    test_x = torch.from_numpy(data.x_test)
    losses, stamps = [], [time.perf_counter()]
    for start in range(0, batch * iterations, batch):
        chosen = order[start:start + batch]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(data.x_train[chosen])),
                                                 torch.from_numpy(data.y_train[chosen]))
        loss.backward()
        for weight, mask in masks:
            weight.grad.mul_(mask)
        optimizer.step()
        with torch.no_grad():  # train() also takes the test set's loss after every step
            torch.nn.functional.cross_entropy(net(test_x), torch.from_numpy(data.y_test))
        losses.append(loss.item())
        stamps.append(time.perf_counter())
    return {"method": "torch", "levels": None, "median_iteration_s": float(np.median(np.diff(stamps))),
            "train_losses": losses, "torch_threads": torch.get_num_threads()}


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
        baseline = torch_row(load_model(spec), data, args.batch, args.iterations)
        if baseline is not None:
            baseline["max_loss_difference_vs_ours"] = max(
                abs(a - b) for a, b in zip(baseline["train_losses"], rows[0]["train_losses"], strict=True))
            print(json.dumps(baseline), file=sys.stderr, flush=True)
            rows.append(baseline)
    print(json.dumps({"benchmark": "retrain", "machine": machine(backend.get("cpu")), "batch": args.batch,
                      "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
