"""The PyTorch bridge's cost (issues 36 and 45): ``sparse_scan.torch.bppsa`` against the engine's own
backward on the same model and batch, and a whole training iteration through the bridge against plain
PyTorch.

Two workloads, float32, on the CPU (``--device gpu``: on CUDA tensors, the bridge's engine on CuPy views
of them against PyTorch's CUDA autograd (cuDNN), TF32 off, each timed with a CUDA synchronisation after
it):

- ``vgg11-pruned``: VGG-11's convolutional stack on 3x32x32 (the paper's micro-benchmark, as
  ``data/vgg11-pruned.yaml``), every convolution pruned with ``torch.nn.utils.prune.l1_unstructured``
  to ``1 - amount`` of its weights (``--amounts``, 0.97 by default: 3 % kept; the bridge then leaves the
  pruned weights out of the Jacobians' patterns, runs the sparse forward and the sampled weight
  gradient), the loss the sum of the outputs weighted by a fixed gradient;
- ``lstm``: the paper's RNN classifier with an LSTM cell (T = 1000, H = 20, input 1, 10 classes,
  ``fc(out[:, -1])``), cross-entropy loss.

Per workload, batch size (``--batches``) and pruning amount, medians over ``--repeats`` rounds, the
contenders timed in turn within each round after a warm-up round, each ``--burst`` (3) times in a row
with the first of each burst not counted (``--burst 1``: every call right after the other contenders',
its caches as they left them, not as a training loop's previous iteration leaves them):

- ``bridge_backward_s``: ``loss.backward()`` through ``bppsa(net)`` after ``zero_grad()`` and its
  forward (autograd's call of the scan, the conversions, the gradients handed to ``.grad``; a pruned
  layer's ``weight_orig`` gradient masked, as autograd's own backward of ``weight_orig * weight_mask``
  masks it);
- ``engine_backward_s``: the loss's gradient by autograd (the loss is PyTorch's on both sides), then the
  same engine model's ``backward`` (without the input's gradient: the batch requires none) plus
  ``parameter_gradients`` called directly on the same batch: what the bridge runs, without the bridge,
  so that the ratio is what the bridge adds (autograd's call of the scan, the conversions, the
  gradients handed to ``.grad``);
- ``bridge_iteration_s`` and ``torch_iteration_s``: ``zero_grad``, forward, loss, backward and
  ``torch.optim.Adam``'s step (``--optimizer``: ``adam``, PyTorch's default implementation, or
  ``adam-fused``, ``fused=True``), through the bridge and through plain PyTorch autograd;
- ``step_s``: that optimizer's step alone (the same for both: every weight of ``weight_orig``, pruned
  or not, is a parameter PyTorch's Adam updates), a floor under both iterations;
- with ``--pruned-adam``, the bridge's iteration steps with ``sparse_scan.torch.PrunedAdam`` instead (the
  same options and trajectory, the pruned weights left out of the step: PyTorch's update on the
  weights that can move), and ``pruned_adam_step_s`` is its step alone; ``--trusted-gradients`` gives it
  ``trusted_gradients=True`` (the bridge's gradients stepped without reading ``.grad``).

The ratios ``bridge_backward_s / engine_backward_s`` (the bridge's overhead: at most 1.05) and
``torch_iteration_s / bridge_iteration_s`` (above 1: the bridge's iteration is faster) are printed with
them. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import Rows, cpu_pressure, machine
from torch import nn
from torch.nn.utils import prune

from sparse_scan import backend
from sparse_scan.torch import PrunedAdam, bppsa

VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def vgg11_pruned(amount: float = 0.97) -> nn.Module:
    """VGG-11's conv stack (configuration A), each conv magnitude-pruned by ``torch.nn.utils.prune``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 3
    for item in VGG11:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            conv = nn.Conv2d(channels, item, 3, padding=1)
            prune.l1_unstructured(conv, "weight", amount=amount)
            layers += [conv, nn.ReLU()]
            channels = item
    return nn.Sequential(*layers)


class LSTMClassifier(nn.Module):
    """The paper's RNN classifier with an LSTM cell: the last output, a linear head."""

    def __init__(self, hidden: int = 20, classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


def workload(name: str, batch: int, device: torch.device,
             amount: float = 0.97) -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The model, a batch and the loss of its output, on ``device``."""
    generator = torch.Generator().manual_seed(1)
    if name == "vgg11-pruned":
        x = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
        weights = torch.randn(batch, 512, 1, 1, generator=generator).to(device)
        return vgg11_pruned(amount).to(device), x, lambda out: (out * weights).sum()
    torch.manual_seed(0)
    x = torch.randint(0, 2, (batch, 1000, 1), generator=generator).float().to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    return LSTMClassifier().to(device), x, lambda out: F.cross_entropy(out, labels)


def interleaved(contenders: dict[str, Callable[[], float]], repeats: int, burst: int = 1) -> dict[str, float]:
    """Median seconds of each contender (each returns the seconds of the part it times), taken in turn
    within each round, after a warm-up round; the order rotates by one each round, so that every
    contender follows each other one as often (the one right after PyTorch's contenders ran up to 13 %
    slower, its burst's later calls included: 9.8 against 8.7 ms for the same backward, at batch 1 on
    the 90 %-pruned VGG-11). With ``burst`` > 1 each contender runs ``burst`` times in a row per round
    and the first of each burst is not counted: the later calls find their caches as a training loop's
    next iteration does, not as the other contenders left them."""
    for timed in contenders.values():
        timed()
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_number in range(repeats):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            burst_times = [contenders[name]() for _ in range(burst)]
            times[name] += burst_times[1:] if burst > 1 else burst_times
    return {name: statistics.median(values) for name, values in times.items()}


def measure(name: str, batch: int, method: str, repeats: int, device: torch.device, amount: float,
            optimizer: str, burst: int = 1, pruned_adam: bool = False,
            trusted_gradients: bool = False) -> dict[str, Any]:
    net, x, loss_of = workload(name, batch, device, amount)
    bnet = bppsa(net, method)
    reference = (type(net)() if name == "lstm" else vgg11_pruned(amount)).to(device)
    reference.load_state_dict(net.state_dict())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    options = {"fused": True} if optimizer == "adam-fused" else {}
    ours = torch.optim.Adam(net.parameters(), lr=1e-3, **options) if not pruned_adam else PrunedAdam(
        net.parameters(), lr=1e-3, trusted_gradients=trusted_gradients, **options)
    optimizers = {"bridge": ours,
                  "torch": torch.optim.Adam(reference.parameters(), lr=1e-3, **options)}

    def bridge_backward() -> float:
        net.zero_grad()  # as a training loop does (set_to_none): autograd hands over the scan's arrays
        loss = loss_of(bnet(x))
        sync()
        start = time.perf_counter()
        loss.backward()
        sync()
        return time.perf_counter() - start

    def engine_backward() -> float:
        out = bnet(x)  # binds the weights and runs the engine's forward
        (engine,) = [e for engines in bnet._engines.values() for e in engines]
        with engine.on_stream(x):
            sync()
            start = time.perf_counter()
            g = engine.array(_loss_gradient(loss_of, out))  # the loss's gradient, by autograd as well
            grads = engine.model.backward(g, method=method, input_gradient=False,  # x requires none
                                          parameters_beside=True)
            engine.model.parameter_gradients(grads)
            sync()
        return time.perf_counter() - start

    def iteration(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], float]:
        def run() -> float:
            sync()
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_of(model(x)).backward()
            optimizer.step()
            sync()
            return time.perf_counter() - start
        return run

    def step(side: str) -> Callable[[], float]:
        def run() -> float:
            sync()
            start = time.perf_counter()
            optimizers[side].step()
            sync()
            return time.perf_counter() - start
        return run

    contenders = {"bridge_backward_s": bridge_backward, "engine_backward_s": engine_backward,
                  "bridge_iteration_s": iteration(bnet, optimizers["bridge"]),
                  "torch_iteration_s": iteration(reference, optimizers["torch"]), "step_s": step("torch")}
    if pruned_adam:
        contenders["pruned_adam_step_s"] = step("bridge")
    timings = interleaved(contenders, repeats, burst)
    return {"workload": name, "batch": batch, "method": method, "optimizer": optimizer, "burst": burst,
            "pruned_adam": pruned_adam, "trusted_gradients": pruned_adam and trusted_gradients,
            "pruned": amount if name == "vgg11-pruned" else None, **timings,
            "bridge_over_engine_backward": timings["bridge_backward_s"] / timings["engine_backward_s"],
            "torch_over_bridge_iteration": timings["torch_iteration_s"] / timings["bridge_iteration_s"]}


def _loss_gradient(loss_of: Callable[[torch.Tensor], torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """d loss / d out, as the bridge's backward receives it."""
    leaf = out.detach().requires_grad_(True)
    loss_of(leaf).backward()
    return leaf.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="vgg11-pruned,lstm")
    parser.add_argument("--batches", default="16", help="batch sizes, comma-separated")
    parser.add_argument("--amounts", default="0.97", help="the VGG-11's pruned shares, comma-separated")
    parser.add_argument("--optimizer", choices=("adam", "adam-fused"), default="adam")
    parser.add_argument("--pruned-adam", action="store_true",
                        help="the bridge's iteration steps with sparse_scan.torch.PrunedAdam (the pruned "
                             "weights left out of the step)")
    parser.add_argument("--trusted-gradients", action="store_true",
                        help="with --pruned-adam: trusted_gradients=True (the bridge's gradients stepped "
                             "without reading .grad)")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--burst", type=int, default=3,
                        help="calls of each contender in a row per round, the first not counted (1: each "
                             "call right after the other contenders')")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--rows", type=pathlib.Path, help="also append each row to this JSON-lines file")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "gpu" else "cpu")
    workloads = args.workloads.split(",")
    if args.device == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    name = "bridge: bppsa backward vs the engine's, iteration vs PyTorch"
    info = machine(backend.get(args.device))
    rows_file = Rows(args.rows, name, info, torch_threads=torch.get_num_threads())
    rows = []
    for workload_name in workloads:
        amounts = [float(a) for a in args.amounts.split(",")] if workload_name == "vgg11-pruned" else [0.0]
        for amount in amounts:
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(measure(workload_name, batch, args.method, args.repeats, device, amount,
                                    args.optimizer, args.burst, args.pruned_adam, args.trusted_gradients))
                rows_file.add(rows[-1])
    rows_file.finish()
    print(json.dumps({"benchmark": name, "machine": info, "cpu_pressure": cpu_pressure(),
                      "torch_threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
