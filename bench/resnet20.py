"""ResNet-20 through ``export_torch``: every schedule's gradients against PyTorch autograd (issue 22).

The network is CIFAR-style ResNet-20 (He et al. 2016, section 4.2) written as PyTorch users write it: an
``nn.Sequential`` of a stem, three stages of three torchvision-style ``BasicBlock`` modules (a stride-2
1x1 conv + batch-norm ``downsample`` where the shape changes), global average pooling and a linear
layer, float64, batch norms in eval mode with random statistics. ``export_torch`` writes its spec (the
blocks recognised by ``torch.fx`` tracing) and weights; the loaded model runs the backward with every
schedule (linear, hybrid at every level, blelloch), each in a fresh process under a memory limit
(``--memory-gb``, an address-space limit) and a time limit (``--timeout``).

For each schedule the JSON holds the worst relative error over every activation gradient (the input's
and every layer output's, the blocks' pre-ReLU sums included) and over every parameter gradient, ``max
|ours - autograd| / max |autograd|`` per tensor; the plan's seconds, bytes, critical-path and work FLOPs
per sample (the residual blocks' JT fills included); the backward's seconds (``Sequential.backward``,
the JT fills included), of the process's first call (numba compiles what its cache lacks) and of the
second. A schedule stopped by a limit reports which, with the planner's estimate
(:meth:`Sequential.estimate`, an upper bound: it counts a product's multiply-adds as if its entries were
spread evenly, and stores them at 12 bytes each, where the built plan multiplies the unpruned
convolutions' dense channel blocks). PyTorch's own backward time (the second ``torch.autograd.grad`` of
the same graph, default threads) is given for scale. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

BENCH = pathlib.Path(__file__).resolve().parent
TESTS = BENCH.parent / "tests"
"""Holds ``resnet_blocks.py``, torchvision's BasicBlock that the tests export too (no package: put on
the path where the block is needed)."""
STAGES = ((16, 1), (32, 2), (64, 2))


def torch_resnet20(seed: int, random_statistics: bool = True) -> Any:
    """The reference network: float64, eval mode (frozen batch norms); with ``random_statistics``
    their statistics and affine parameters random (PyTorch's initial ones make every batch norm nearly
    the identity, which would hide a wrong batch-norm JT)."""
    import torch
    from torch import nn

    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    from resnet_blocks import BasicBlock  # the tests' reference, torchvision's forward

    torch.manual_seed(seed)
    net = nn.Sequential()
    for name, module in (("conv1", nn.Conv2d(3, 16, 3, 1, 1, bias=False)), ("bn1", nn.BatchNorm2d(16)),
                         ("relu", nn.ReLU())):
        net.add_module(name, module)
    planes = 16
    for stage, (width, stride) in enumerate(STAGES, start=1):
        blocks = [BasicBlock(planes if b == 0 else width, width, stride if b == 0 else 1) for b in range(3)]
        net.add_module(f"layer{stage}", nn.Sequential(*blocks))
        planes = width
    for name, module in (("avgpool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()),
                         ("fc", nn.Linear(64, 10))):
        net.add_module(name, module)
    with torch.no_grad():
        for module in net.modules() if random_statistics else ():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.5)
    return net.double().eval()


def autograd(net: Any, x: np.ndarray, g: np.ndarray) -> tuple[list[np.ndarray], dict[str, np.ndarray], float]:
    """PyTorch's gradient w.r.t. the input and every point where the exported spec has a layer output
    (the stem's modules, each block's sum before its final ReLU and its output, the head's modules),
    every parameter's gradient, and the seconds of that backward."""
    import torch

    points: list[Any] = []
    blocks = [block for stage in ("layer1", "layer2", "layer3") for block in getattr(net, stage)]
    handles = [getattr(net, name).register_forward_hook(lambda m, i, o: points.append(o))
               for name in ("conv1", "bn1", "relu", "avgpool", "flatten", "fc")]
    for block in blocks:
        calls = []

        def before_relu(module, inputs, output, calls=calls):  # the second call's input is the sum
            calls.append(None)
            if len(calls) % 2 == 0:
                points.append(inputs[0])

        handles.append(block.relu.register_forward_hook(before_relu))
        handles.append(block.register_forward_hook(lambda m, i, o: points.append(o)))
    inputs = torch.from_numpy(x).requires_grad_(True)
    out = net(inputs)
    for handle in handles:
        handle.remove()
    targets = [inputs] + points
    torch.autograd.grad(out, targets + list(net.parameters()), torch.from_numpy(g), retain_graph=True)
    start = time.perf_counter()  # the second call: warm
    grads = torch.autograd.grad(out, targets + list(net.parameters()), torch.from_numpy(g))
    seconds = time.perf_counter() - start
    names = [name for name, _ in net.named_parameters()]
    activation = [grad.numpy() for grad in grads[:len(targets)]]
    return activation, dict(zip(names, (grad.numpy() for grad in grads[len(targets):]), strict=True)), seconds


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """``max |ours - theirs| / max |theirs|`` (0 where both are 0)."""
    scale = float(np.max(np.abs(theirs)))
    error = float(np.max(np.abs(np.asarray(ours) - theirs)))
    return error / scale if scale else error


def run_schedule(args: argparse.Namespace) -> dict[str, Any]:
    """One schedule in this process: export, load, plan, backward, compare (the child's work)."""
    from sparse_scan import export_torch, load_model

    net = torch_resnet20(args.seed)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch, 3, 32, 32))
    g = rng.standard_normal((args.batch, 10))
    want_activations, want_parameters, torch_seconds = autograd(net, x, g)
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(export_torch(net, (3, 32, 32), pathlib.Path(folder) / "resnet20.yaml"),
                           dtype=np.float64)
    levels = None if args.levels is None else int(args.levels)
    model.forward(x)
    start = time.perf_counter()
    plan = model.plan((3, 32, 32), args.method, levels=levels)
    plan_seconds = time.perf_counter() - start
    seconds = []
    for _ in range(2):  # the first call compiles what numba has not cached yet
        start = time.perf_counter()
        grads = model.backward(g, method=args.method, levels=levels)
        seconds.append(time.perf_counter() - start)
    parameters = model.parameter_gradients(grads)
    if len(grads) != len(want_activations) or sorted(parameters) != sorted(want_parameters):
        raise AssertionError("the spec's layers or parameters do not match the module's")
    return {"plan_s": plan_seconds, "first_backward_s": seconds[0], "backward_s": seconds[1],
            "torch_backward_s": torch_seconds, "plan_bytes": plan.plan_bytes,
            "critical_flops": plan.critical_flops, "work_flops": plan.work_flops,
            "fill_flops": list(plan.fill_flops),
            "activation_rel_error": max(map(relative_error, grads, want_activations)),
            "parameter_rel_error": max(relative_error(parameters[k], v)
                                       for k, v in want_parameters.items()),
            "activation_gradients": len(grads), "parameter_gradients": len(parameters)}


def estimate(method: str, levels: int | None, batch: int) -> dict[str, Any]:
    """The planner's estimate (nothing built) for a schedule stopped by a limit."""
    from sparse_scan import load_model

    plan = load_model(pathlib.Path(BENCH.parent, "data", "resnet20.yaml"), dtype=np.float64).estimate(
        (3, 32, 32), method, levels)
    return {"estimated_critical_flops": plan.critical_flops, "estimated_work_flops": plan.work_flops,
            "estimated_plan_bytes": plan.plan_bytes,
            "estimated_peak_bytes": plan.peak_bytes(batch, 8)}


def limit_memory(gigabytes: float) -> None:
    """The child's address-space limit (a plan too big fails with MemoryError, not the machine)."""
    limit = int(gigabytes * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-gb", type=float, default=16.0,
                        help="address-space limit of each schedule's process")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per schedule")
    parser.add_argument("--schedules", default="",
                        help="comma-separated METHOD[:LEVELS] (default: linear, hybrid 0..5, blelloch)")
    parser.add_argument("--method", help=argparse.SUPPRESS)  # a child process's one schedule
    parser.add_argument("--levels", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        print(json.dumps(run_schedule(args)))
        return
    sys.path.insert(0, str(BENCH))
    from common import cpu_pressure

    from sparse_scan import load_model
    from sparse_scan.engine.schedule import depth

    n = len(load_model(BENCH.parent / "data" / "resnet20.yaml"))
    asked = [item.split(":") + [None] for item in args.schedules.split(",")] if args.schedules else []
    every = [("linear", None)] + [("hybrid", str(k)) for k in range(depth(n) + 1)] + [("blelloch", None)]
    schedules = [(item[0], item[1]) for item in asked] if asked else every
    rows = []
    for method, levels in schedules:
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--method", method,
                   "--batch", str(args.batch), "--seed", str(args.seed)]
        command += ["--levels", levels] if levels else []
        row: dict[str, Any] = {"method": method, "levels": None if levels is None else int(levels)}
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                                  preexec_fn=lambda: limit_memory(args.memory_gb))
        except subprocess.TimeoutExpired:
            row |= {"stopped": f"over the time limit of {args.timeout:g} s"}
        else:
            if done.returncode == 0:
                row |= json.loads(done.stdout.strip().splitlines()[-1])
            else:
                last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
                memory = "MemoryError" in done.stderr or "Unable to allocate" in done.stderr
                why = f"over the memory limit of {args.memory_gb:g} GiB: " if memory else "failed: "
                row |= {"stopped": why + last[:300]}
        row["wall_s"] = time.perf_counter() - start
        if "stopped" in row:
            row |= estimate(method, row["levels"], args.batch)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "resnet20 export_torch gradients vs autograd", "batch": args.batch,
                      "dtype": "float64", "memory_limit_gb": args.memory_gb, "timeout_s": args.timeout,
                      "chain_elements": n, "cpu_pressure": cpu_pressure(),
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
