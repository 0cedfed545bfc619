"""LSTM backward through BPPSA against PyTorch autograd at the paper's RNN sizes, and its bitstream
training curve against PyTorch's.

The paper's RNN setting (H=20, input 1, 10 classes, loss on the last hidden state, bitstream data) with
an LSTM cell: a T sweep at B=16 and a B sweep at T=1000. Per configuration, the median over repeats of
one backward pass per iteration:

- ``blelloch``, ``hybrid-auto`` and ``linear``: our ``LSTM.backward`` (``backward_s``: the ``(h, c)``
  state's ``2H×2H`` blocks, the scan, input and parameter gradients), with the phase the backward runs
  for its chain beside it: ``scan_s``, the scan over the filled blocks (``blocks_s`` fills them). On
  the CPU back-propagation's schedule (``linear``, or ``hybrid-auto`` at depth 0) fills no block and
  has no scan of its own: the cell's compiled kernel (``lstm_backward``) runs the totals, the input
  and the parameter gradients in one pass per run of samples, so its entry has ``kernel_s`` (that
  pass alone, the run's ``backward``) and no ``scan_s``;
- ``torch``: ``loss.backward()`` through ``nn.LSTM`` with the same weights, in a fresh process of
  its own (PyTorch's OpenMP threads slow NumPy work in a shared process, and are slowed by it), with
  the largest relative difference of our gradients from its.

``--device gpu`` runs ours on the GPU (CuPy: the blocks filled, the scan's RawKernels, back-propagation
as one chain launch) and PyTorch on CUDA (cuDNN's LSTM, TF32 off), each timed with a synchronisation
after the pass; ``gpu`` in the machine record names the device.

Our contenders are timed in turn within each round (medians over the rounds), after a warm-up round.
``--curve`` trains the paper's classifier with an LSTM for ``--iterations`` (100) Adam steps with
BPPSA (``blelloch``) and with PyTorch on the same batches and reports both loss curves and their
largest relative difference. Prints JSON; ``--rows FILE`` also appends each measured row to FILE as
one JSON line the moment it is measured (``common.Rows``: a run killed half-way keeps what it finished).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
from common import Rows, machine
from rnn import factored_schedule, interleaved, repeats_for, timed

from sparse_scan import backend
from sparse_scan.engine.dense_plan import auto_levels
from sparse_scan.engine.run import dense_scan
from sparse_scan.engine.schedule import depth
from sparse_scan.optim import Adam
from sparse_scan.recurrent import LSTM, Bitstream, RecurrentClassifier
from sparse_scan.train import train_iterations

SCHEDULES = (("blelloch", "blelloch", None), ("hybrid-auto", "hybrid", "auto"), ("linear", "linear", None))
HIDDEN = 20
NOTE = ("per schedule: backward_s, LSTM.backward; scan_s, the scan over the filled blocks alone (blocks_s "
        "fills them); kernel_s in place of scan_s where the backward has no scan of its own (the CPU's "
        "linear, and hybrid-auto at depth 0): the cell's compiled kernel, totals and gradients in one pass")


def problem(steps: int, batch: int) -> tuple[LSTM, np.ndarray, np.ndarray]:
    """The LSTM (seeded weights), bitstream inputs and the gradient w.r.t. the last hidden state: the
    same in every process."""
    x, _ = Bitstream(steps, samples=batch, seed=0).batch(np.arange(batch))
    seed = np.random.default_rng(steps * 1000 + batch).standard_normal((batch, HIDDEN)).astype(np.float32)
    return LSTM(1, HIDDEN, batch_first=True, rng=0), x, seed


def torch_device(torch: Any, device: str) -> str:
    """PyTorch's device for ``--device`` (``cuda`` for the GPU, with TF32 off: cuDNN's float32
    products then round as ours do)."""
    if device != "gpu":
        return "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return "cuda"


def torch_worker(steps: int, batch: int, repeats: int, device: str, out: pathlib.Path) -> dict[str, Any]:
    """PyTorch's forward and autograd's backward in this process alone; the gradients go to ``out``."""
    import torch

    dev = torch_device(torch, device)
    if dev == "cuda" and not torch.cuda.is_available():
        return {"unavailable": "PyTorch has no CUDA device here"}
    lstm, x, seed = problem(steps, batch)
    module = torch.nn.LSTM(1, HIDDEN, batch_first=True).to(dev)
    with torch.no_grad():
        for key, value in module.named_parameters():
            value.copy_(torch.from_numpy(getattr(lstm, key)))
    inputs, grad_last = torch.from_numpy(x).to(dev), torch.from_numpy(seed).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def loss() -> Any:
        module.zero_grad()
        return (module(inputs)[0][:, -1] * grad_last).sum()

    seconds = interleaved({"forward_s": timed(lambda: module(inputs), sync),
                           "backward_s": lambda: timed(loss().backward, sync)()}, repeats)
    loss().backward()
    np.savez(out, **{key: value.grad.cpu().numpy() for key, value in module.named_parameters()})
    return seconds


def torch_baseline(steps: int, batch: int, repeats: int, device: str,
                   grads: pathlib.Path) -> dict[str, Any] | None:
    """The PyTorch worker in a fresh process; None without torch, or (GPU) without CUDA in torch."""
    command = [sys.executable, __file__, "--worker", "--steps", str(steps), "--batches", str(batch),
               "--repeats", str(repeats), "--device", device, "--out", str(grads)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        if "ModuleNotFoundError" in result.stderr:
            return None
        raise RuntimeError(f"torch baseline failed:\n{result.stderr}")
    measured = json.loads(result.stdout)
    return None if "unavailable" in measured else measured


def measure(steps: int, batch: int, be: backend.Backend) -> dict[str, Any]:
    lstm, x, seed = problem(steps, batch)
    repeats = repeats_for(steps, batch)
    xd, seed_d = be.asarray(x), be.asarray(seed)
    sync = be.synchronize
    lstm.forward(xd)
    run = lstm._single_run()
    blocks = lstm.transposed_jacobians()
    resolved = {label: (None if levels is None else
                        lstm_levels(steps, batch, be.name)) for label, _, levels in SCHEDULES}
    timers = {"forward": timed(lambda: lstm.forward(xd), sync),
              "blocks": timed(lstm.transposed_jacobians, sync)}
    state_seed = be.xp.concatenate([seed_d, be.xp.zeros_like(seed_d)], axis=1)
    for label, method, levels in SCHEDULES:
        timers[f"{label}_backward"] = timed(lambda m=method, lv=levels: lstm.backward(seed_d, m, lv), sync)
        level = resolved[label]
        if factored_schedule(method, level, be.name):  # one compiled pass: no block filled, no scan
            timers[f"{label}_kernel"] = timed(lambda m=method, lv=level: run.backward(state_seed, m, lv),
                                              sync)
        else:
            timers[f"{label}_scan"] = timed(lambda m=method, lv=level: dense_scan(blocks, state_seed, m, lv),
                                            sync)
    seconds = interleaved(timers, repeats)
    with tempfile.TemporaryDirectory() as folder:
        grads_file = pathlib.Path(folder) / "torch.npz"
        baseline = torch_baseline(steps, batch, repeats, be.name, grads_file)
        torch_grads = dict(np.load(grads_file)) if baseline is not None else None
    row: dict[str, Any] = {"model": "lstm", "T": steps, "B": batch, "input": 1, "H": HIDDEN,
                           "state": 2 * HIDDEN, "repeats": repeats, "auto_levels": resolved["hybrid-auto"],
                           "depth": depth(steps),
                           "forward_s": seconds["forward"], "blocks_s": seconds["blocks"]}
    for label, method, levels in SCHEDULES:
        phase = "kernel" if f"{label}_kernel" in seconds else "scan"
        entry = {"backward_s": seconds[f"{label}_backward"], f"{phase}_s": seconds[f"{label}_{phase}"]}
        if baseline is not None:
            result = lstm.backward(seed_d, method, levels)
            entry["max_rel_error_vs_torch"] = max(
                float(np.abs(be.to_host(result[key.removesuffix("_l0")]) - value).max()
                      / max(np.abs(value).max(), 1e-30))
                for key, value in torch_grads.items())
            entry["speedup_vs_torch"] = baseline["backward_s"] / entry["backward_s"]
        row[label] = entry
    if baseline is not None:
        row["torch"] = baseline
    return row


def lstm_levels(steps: int, batch: int, device: str) -> int:
    """The depth ``levels="auto"`` picks (``hybrid-auto``): the CPU's BP runs factored."""
    return auto_levels(steps, batch, 2 * HIDDEN, device, factored=device == "cpu")


def curve(steps: int, iterations: int, batch: int, lr: float, device: str) -> dict[str, Any]:
    """BPPSA's and PyTorch's bitstream training curves on the same batches, both on ``device``."""
    import torch

    dev = torch_device(torch, device)
    if dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--curve --device gpu needs PyTorch with CUDA (the curves run on one device)")
    data = Bitstream(steps=steps, samples=max(32000 // max(steps // 100, 1), 4 * batch), seed=0)
    model = RecurrentClassifier(LSTM(1, HIDDEN, rng=0), classes=10, rng=1)
    module, head = torch.nn.LSTM(1, HIDDEN, batch_first=True), torch.nn.Linear(HIDDEN, 10)
    with torch.no_grad():
        for key, value in module.named_parameters():
            value.copy_(torch.from_numpy(getattr(model.recurrent, key)))
        head.weight.copy_(torch.from_numpy(model.fc.weight))
        head.bias.copy_(torch.from_numpy(model.fc.bias))
    module, head = module.to(dev), head.to(dev)
    ours = [r["loss"] for r in train_iterations(model, data, Adam(model, lr=lr), iterations, batch,
                                                method="blelloch", seed=1, device=device)]
    optimizer = torch.optim.Adam(list(module.parameters()) + list(head.parameters()), lr=lr)
    order, position, theirs = np.random.default_rng(1), 0, []
    permutation = order.permutation(len(data))
    for _ in range(iterations):
        if position + batch > len(permutation):
            permutation, position = order.permutation(len(data)), 0
        x, labels = data.batch(permutation[position:position + batch])
        position += batch
        out, _ = module(torch.from_numpy(x).to(dev))
        loss = torch.nn.functional.cross_entropy(head(out[:, -1]), torch.from_numpy(labels).to(dev))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    difference = np.abs(np.array(ours) - theirs) / np.abs(theirs)
    return {"T": steps, "B": batch, "lr": lr, "device": device, "iterations": iterations,
            "bppsa_losses": ours, "torch_losses": theirs, "max_rel_difference": float(difference.max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"),
                        help="where ours and PyTorch run (gpu: CuPy and CUDA/cuDNN)")
    parser.add_argument("--steps", type=int, nargs="*", default=[10, 100, 1000, 10000])
    parser.add_argument("--batches", type=int, nargs="*", default=[2, 16, 64])
    parser.add_argument("--curve", action="store_true", help="the bitstream training curves only")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="Adam's (the paper's 1e-5 barely moves the loss in 100 steps)")
    parser.add_argument("--rows", type=pathlib.Path, metavar="FILE",
                        help="append each measured row to FILE as one JSON line as soon as it is measured")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one baseline measurement, in a process of its own
        print(json.dumps(torch_worker(args.steps[0], args.batches[0], args.repeats, args.device, args.out)))
        return 0
    be = backend.get(args.device)
    info = machine(be)
    if args.curve:
        print(json.dumps({"machine": info, "curve": curve(args.steps[0], args.iterations, 16, args.lr,
                                                          be.name)}, indent=1))
        return 0
    rows = []
    log = Rows(args.rows, "lstm", info, note=NOTE)
    sweep = [("T", steps, 16) for steps in args.steps] + [("B", 1000, batch) for batch in args.batches
                                                           if batch != 16 or 1000 not in args.steps]
    for name, steps, batch in sweep:
        row = measure(steps, batch, be)
        row["sweep"] = name
        rows.append(row)
        log.add(row)
        print(f"lstm T={steps} B={batch}: " + ", ".join(
            f"{label} {row[label]['backward_s'] * 1e3:.2f} ms" for label, _, _ in SCHEDULES)
            + (f", torch {row['torch']['backward_s'] * 1e3:.2f} ms" if "torch" in row else ""),
            file=sys.stderr)
    log.finish()
    print(json.dumps({"machine": info, "note": NOTE, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
