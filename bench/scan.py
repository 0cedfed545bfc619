"""Whole backward pass on VGG-11's conv stack (3x32x32), dense and 97%-magnitude-pruned.

For every schedule (linear, hybrid with each number of up-sweep levels and ``auto``, blelloch) one run
reports the plan's own figures (critical-path FLOPs, work, critical steps, peak memory), the plan
build time (symbolic, once per architecture) and the median wall time of ``Sequential.backward``
(JTs' values and the numeric scan), next to PyTorch autograd's backward through the same layers
when torch is installed. Gradients are checked against the linear scan. Schedules whose plan does not
fit the memory budget or need a product of more than ``--max-step-flops`` (checked before it is
built), or whose work exceeds ``--max-work-flops``, are listed (with their figures when planned) and
not run. With ``--device gpu`` the forward and backward run on CuPy arrays (timed to the end of the
device work) against PyTorch autograd on CUDA, and the gradients are checked against the CPU's linear
scan. Prints JSON (``--json``) or a table; ``--rows FILE`` also appends each row to FILE as one JSON line
the moment it is done (``common.Rows``: a run killed half-way keeps what it finished).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np
from common import Rows, machine, median_time, no_sync
from vgg import vgg11_features

from sparse_scan import backend
from sparse_scan.engine.plan import ScanCostError, ScanMemoryError
from sparse_scan.engine.schedule import depth


def torch_backward_time(model, x: np.ndarray, grad: np.ndarray, repeats: int,
                        device: str = "cpu") -> float | None:
    """Median time of autograd's backward through a PyTorch mirror of ``model`` (None without torch,
    or without CUDA in torch when ``device`` is gpu)."""
    try:
        import torch
    except ImportError:
        return None
    if device == "gpu" and not torch.cuda.is_available():
        return None
    modules = []
    for layer in model.layers:
        name = type(layer).__name__
        if name == "Conv2d":
            m = torch.nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                                layer.padding)
            m.weight.data = torch.from_numpy(np.ascontiguousarray(layer.weight))
            m.bias.data = torch.from_numpy(np.ascontiguousarray(layer.bias))
        elif name == "MaxPool2d":
            m = torch.nn.MaxPool2d(layer.kernel_size, layer.stride)
        else:
            m = torch.nn.ReLU()
        modules.append(m)
    where = "cuda" if device == "gpu" else "cpu"
    net = torch.nn.Sequential(*modules).to(where)
    inputs = torch.from_numpy(x).to(where).requires_grad_(True)
    output = net(inputs)
    upstream = torch.from_numpy(grad).to(where)

    def backward() -> None:
        torch.autograd.grad(output, [inputs], upstream, retain_graph=True)

    sync = torch.cuda.synchronize if device == "gpu" else no_sync
    return median_time(backward, repeats, sync)


def schedules(n: int) -> list[tuple[str, Any]]:
    return ([("linear", None)] + [("hybrid", k) for k in range(1, depth(n))] + [("hybrid", "auto"),
                                                                                ("blelloch", None)])


def measure(args: argparse.Namespace, prune: float, log: Rows) -> list[dict[str, Any]]:
    be = backend.get(args.device)
    rng = np.random.default_rng(0)
    model = vgg11_features(pruned=prune > 0)
    name = f"vgg11-pruned{int(prune * 100)}" if prune else "vgg11"
    x = rng.standard_normal((args.batch, 3, 32, 32)).astype(np.float32)
    grad = rng.standard_normal(model.forward(x).shape).astype(np.float32)
    oracle = vgg11_features(pruned=prune > 0)  # its own plan cache: the timed model plans cold
    oracle.forward(x)
    reference = oracle.backward(grad, "linear")  # on the CPU
    rows = []
    torch_s = torch_backward_time(model, x, grad, args.repeats, be.name)
    model.forward(be.asarray(x))
    grad = be.asarray(grad)
    for method, levels in schedules(len(model)):
        row: dict[str, Any] = {"model": name, "batch": args.batch, "method": method, "levels": levels}
        rows.append(row)
        try:
            start = time.perf_counter()
            try:
                plan = model.plan(x.shape[1:], method, levels, max_step_flops=int(args.max_step_flops))
            except ScanMemoryError as error:
                row["skipped"] = f"does not fit the memory budget: {error}"
                continue
            except ScanCostError as error:
                row["skipped"] = f"not planned: {error}"
                print(json.dumps(row), file=sys.stderr, flush=True)
                continue
            row["plan_s"] = time.perf_counter() - start
            row["levels_chosen"] = plan.levels
            totals = plan.report(args.batch, 4)["totals"]
            row.update(totals)
            if plan.work_flops * args.batch > args.max_work_flops:
                row["skipped"] = f"{plan.work_flops * args.batch:.3g} FLOPs of work over --max-work-flops"
                continue
            grads = [be.to_host(g) for g in model.backward(grad, method, levels)]
            row["max_rel_error_vs_linear"] = max(float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
                                                 for g, r in zip(grads, reference, strict=True))
            row["backward_s"] = median_time(lambda m=method, k=levels: model.backward(grad, m, k),
                                            args.repeats, be.synchronize)
            if torch_s is not None:
                row["torch_autograd_s"] = torch_s
                row["speedup_vs_torch"] = torch_s / row["backward_s"]
            linear_s = rows[0].get("backward_s")
            if linear_s:
                row["speedup_vs_linear"] = linear_s / row["backward_s"]
            print(json.dumps(row), file=sys.stderr, flush=True)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
            raise
        finally:  # each row as soon as it is done, skipped or failed ones too
            log.add(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-step-flops", type=float, default=1e9,
                        help="schedules needing a costlier product are not planned (it would take minutes)")
    parser.add_argument("--max-work-flops", type=float, default=2e11,
                        help="schedules with more work (whole batch) are planned but not run")
    parser.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                        help="also the unpruned network")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", type=pathlib.Path, metavar="FILE",
                        help="append each row to FILE as one JSON line as soon as it is done")
    args = parser.parse_args(argv)
    log = Rows(args.rows, "scan", machine(backend.get(args.device), with_torch=False))
    rows = measure(args, 0.97, log) + (measure(args, 0.0, log) if args.dense else [])
    log.finish()
    if args.json:
        print(json.dumps({"benchmark": "scan", "machine": machine(backend.get(args.device)), "rows": rows},
                         indent=2))
        return 0
    for r in rows:
        head = f"{r['model']:15} {r['method']:8} {str(r['levels']):5}"
        if "backward_s" not in r:
            print(head, r.get("skipped", ""))
            continue
        print(f"{head} {r['backward_s'] * 1e3:10.1f} ms  critical={r['critical_flops']:.3g} "
              f"work={r['work_flops']:.3g} steps={r['critical_steps']} peak={r['peak_bytes'] / 2**20:.0f} MiB"
              + (f"  x{r['speedup_vs_torch']:.2f} vs torch" if "speedup_vs_torch" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
