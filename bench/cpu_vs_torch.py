"""The host engine against PyTorch on the CPU (issue 20's figures), every contender in fresh processes.

Four workloads, each timed for sparse-scan and for PyTorch (autograd on the CPU, its default
threads), with the ratio PyTorch / sparse-scan (above 1: we are faster):

* ``vgg``: the backward pass (gradients w.r.t. every activation) through VGG-11's conv stack on
  3x32x32, 97%-pruned (``data/vgg11-pruned.yaml``) and unpruned (``data/vgg11.yaml``), at batch 1, 4
  and 16, for each schedule (linear, hybrid 1, hybrid ``auto``, blelloch; a schedule needing a
  product over ``--max-step-flops`` or more than ``--max-work-flops`` of work is reported as not
  planned or not run), against ``torch.autograd.grad`` w.r.t. the input through the same layers;
* ``vgg-full`` (issue 45): the full backward of the 97%-pruned stack, the scan's gradients and every
  parameter's (``backward`` by ``auto`` then ``parameter_gradients``: the pruned convolutions' weight
  gradients sampled at the kept weights, beside the scan, ``parameters_beside``, as a training step
  asks), at batch 1, 4 and 16, against ``torch.autograd.grad``
  w.r.t. the input and every parameter (autograd's dense weight gradients: PyTorch knows no pruning);
* ``lenet``: one training iteration of LeNet-5 on scikit-learn's digits (``data/lenet5-digits.yaml``,
  batch 64, Adam lr 0.003: forward, loss, backward by ``--lenet-method`` without the input's gradient (as
  autograd's, the input requiring none), parameter gradients, step)
  against the same network, weights and batches in PyTorch;
* ``rnn``: the paper's RNN backward at T=1000, B=16, H=20 (back-propagation's schedule, as
  ``bench/rnn.py`` times it) against autograd through ``nn.RNN``.

Each contender runs in its own fresh process per round (PyTorch's OpenMP threads and OpenBLAS's
spin between operations and slow whatever shares their process), reports the median of its repeats,
and the rounds alternate the contenders' order; the figures are medians over ``--rounds`` rounds, so
that the ratios come from one run. ``--old TREE`` times a second checkout of sparse-scan in the same
rounds (its ``sparse_scan`` imported through ``PYTHONPATH``): before/after figures of one run.
``/proc/pressure/cpu`` is recorded before and after. Prints JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

BENCH = pathlib.Path(__file__).resolve().parent
DATA = BENCH.parent / "data"
BATCHES = (1, 4, 16)
SCHEDULES = (("linear", None), ("hybrid", 1), ("hybrid", "auto"), ("blelloch", None))
VGG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def median_time(fn: Callable[..., Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn()`` (or ``fn(setup())``, ``setup`` untimed) over ``repeats`` calls after a
    warm-up call (3 calls when one takes over a second)."""
    times: list[float] = []
    while len(times) < repeats + 1:
        given = () if setup is None else (setup(),)
        start = time.perf_counter()
        fn(*given)
        times.append(time.perf_counter() - start)
        if times[0] > 1.0:
            repeats = min(repeats, 3)
    return statistics.median(times[1:])


def vgg_inputs(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    return x, rng.standard_normal((batch, 512, 1, 1)).astype(np.float32)


def digits_batches(batch: int, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``count`` training batches of the digits, the same in every process."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0)[:, None].astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    chosen = [order[(k * batch) % (len(x) - batch):][:batch] for k in range(count)]
    return [x[c] for c in chosen], [digits.target[c].astype(np.int64) for c in chosen]


# --- sparse-scan ----------------------------------------------------------------------------------
def ours(args: argparse.Namespace) -> dict[str, Any]:
    from sparse_scan import load_model
    from sparse_scan.engine.plan import ScanCostError
    from sparse_scan.loss import softmax_cross_entropy
    from sparse_scan.optim import Adam
    from sparse_scan.recurrent import RNN, Bitstream

    out: dict[str, Any] = {}
    if "vgg" in args.workloads:
        for pruned in (True, False):
            name = "vgg11-pruned" if pruned else "vgg11"
            for batch in BATCHES:
                model = load_model(DATA / f"{name}.yaml", dtype=np.float32)
                x, grad = vgg_inputs(batch)
                model.forward(x)
                for method, levels in SCHEDULES:
                    key = f"{name}/B{batch}/{method}{'' if levels is None else f'-{levels}'}"
                    try:
                        plan = model.plan(x.shape[1:], method, levels,
                                          max_step_flops=int(args.max_step_flops))
                    except ScanCostError:
                        out[key] = "not planned: a product over --max-step-flops"
                        continue
                    if plan.work_flops * batch > args.max_work_flops:
                        out[key] = "not run: work over --max-work-flops"
                        continue
                    backward = functools.partial(model.backward, grad, method, levels)
                    out[key] = median_time(backward, args.repeats)
    if "vgg-full" in args.workloads:  # the scan's gradients and every parameter's (the pruned: sampled)
        for batch in BATCHES:
            model = load_model(DATA / "vgg11-pruned.yaml", dtype=np.float32)
            x, grad = vgg_inputs(batch)
            model.forward(x)
            full = functools.partial(  # the parameter gradients beside the scan, as a training step asks
                lambda m, g: m.parameter_gradients(m.backward(g, "auto", parameters_beside=True)),
                model, grad)
            out[f"vgg11-pruned-full/B{batch}/auto"] = median_time(full, args.repeats)
    if "lenet" in args.workloads:
        model = load_model(DATA / "lenet5-digits.yaml", dtype=np.float32)
        optimizer = Adam(model, lr=0.003)
        xs, ys = digits_batches(64, args.repeats + 1)
        batches = iter(range(10**9))

        def iteration() -> None:
            k = next(batches) % len(xs)
            loss, grad = softmax_cross_entropy(model.forward(xs[k]), ys[k])
            # a training step: no input gradient, as autograd computes none for an input that requires none
            grads = model.backward(grad, method=args.lenet_method, input_gradient=False,
                                   parameters_beside=True)
            optimizer.step(model.parameter_gradients(grads))

        out[f"lenet5-digits/B64/adam/{args.lenet_method}"] = median_time(iteration, args.repeats)
    if "rnn" in args.workloads:
        cell = RNN(1, 20, rng=0)
        x, _ = Bitstream(1000, samples=16, seed=0).batch(np.arange(16))
        seed = np.random.default_rng(0).standard_normal((16, 20)).astype(np.float32)
        cell.forward(x)
        out["rnn/T1000/B16/H20/linear"] = median_time(lambda: cell.backward(seed, "linear"), args.repeats)
    return out


# --- PyTorch ----------------------------------------------------------------------------------------
def torch_vgg(name: str) -> Any:
    """The bundled VGG-11 spec ``name`` as a PyTorch module with the same weights."""
    import torch

    from sparse_scan import load_model

    model = load_model(DATA / f"{name}.yaml", dtype=np.float32)
    convs = iter(layer for layer in model.layers if type(layer).__name__ == "Conv2d")
    layers, channels = [], 3
    for item in VGG:
        if item == "M":
            layers.append(torch.nn.MaxPool2d(2, 2))
            continue
        conv, source = torch.nn.Conv2d(channels, item, 3, padding=1), next(convs)
        conv.weight.data = torch.from_numpy(np.array(source.weight))
        conv.bias.data = torch.from_numpy(np.array(source.bias))
        layers += [conv, torch.nn.ReLU()]
        channels = item
    return torch.nn.Sequential(*layers)


def theirs(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sparse_scan import load_model
    from sparse_scan.recurrent import RNN, Bitstream

    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    if "vgg" in args.workloads:
        for name in ("vgg11-pruned", "vgg11"):
            net = torch_vgg(name)
            for batch in BATCHES:
                x, grad = vgg_inputs(batch)
                inputs = torch.from_numpy(x).requires_grad_(True)
                output, upstream = net(inputs), torch.from_numpy(grad)
                out[f"{name}/B{batch}"] = median_time(
                    lambda o=output, i=inputs, u=upstream: torch.autograd.grad(o, [i], u, retain_graph=True),
                    args.repeats)
    if "vgg-full" in args.workloads:  # the input's gradient and every parameter's (dense: autograd's)
        net = torch_vgg("vgg11-pruned")
        for batch in BATCHES:
            x, grad = vgg_inputs(batch)
            inputs = torch.from_numpy(x).requires_grad_(True)
            output, upstream, wrt = net(inputs), torch.from_numpy(grad), [inputs, *net.parameters()]
            out[f"vgg11-pruned-full/B{batch}"] = median_time(
                lambda o=output, w=wrt, u=upstream: torch.autograd.grad(o, w, u, retain_graph=True),
                args.repeats)
    if "lenet" in args.workloads:
        model = load_model(DATA / "lenet5-digits.yaml", dtype=np.float32)
        modules = []
        for layer in model.layers:
            kind = type(layer).__name__
            if kind == "Conv2d":
                module = torch.nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                                         layer.stride, layer.padding)
            elif kind == "Linear":
                module = torch.nn.Linear(layer.in_features, layer.out_features)
            else:
                modules.append(torch.nn.MaxPool2d(layer.kernel_size) if kind == "MaxPool2d"
                               else {"ReLU": torch.nn.ReLU, "Flatten": torch.nn.Flatten}[kind]())
                continue
            module.weight.data = torch.from_numpy(np.array(layer.weight))
            module.bias.data = torch.from_numpy(np.array(layer.bias))
            modules.append(module)
        net = torch.nn.Sequential(*modules)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.003)
        xs, ys = digits_batches(64, args.repeats + 1)
        batches = iter(range(10**9))

        def iteration() -> None:
            k = next(batches) % len(xs)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(xs[k])), torch.from_numpy(ys[k]))
            loss.backward()
            optimizer.step()

        out["lenet5-digits/B64/adam"] = median_time(iteration, args.repeats)
    if "rnn" in args.workloads:
        cell = RNN(1, 20, rng=0)
        x, _ = Bitstream(1000, samples=16, seed=0).batch(np.arange(16))
        seed = torch.from_numpy(np.random.default_rng(0).standard_normal((16, 20)).astype(np.float32))
        module = torch.nn.RNN(1, 20, batch_first=True)
        with torch.no_grad():
            for key, value in module.named_parameters():
                value.copy_(torch.from_numpy(getattr(cell, key[:-3])))
        inputs = torch.from_numpy(x)

        def loss() -> Any:  # untimed, as bench/rnn.py times it: the backward alone
            module.zero_grad()
            return (module(inputs)[0][:, -1] * seed).sum()

        out["rnn/T1000/B16/H20"] = median_time(lambda value: value.backward(), args.repeats, setup=loss)
    return out


# --- the driver -----------------------------------------------------------------------------------
def run_worker(contender: str, tree: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    """One contender's figures, measured in a fresh interpreter importing ``tree``'s sparse_scan."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", contender,
               "--workloads", *args.workloads, "--repeats", str(args.repeats),
               "--max-step-flops", str(args.max_step_flops), "--max-work-flops", str(args.max_work_flops),
               "--lenet-method", args.lenet_method]
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONWARNINGS="ignore")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per configuration: each contender's median over rounds, the ratios of those medians and the
    medians of the per-round ratios."""
    rows = []
    for key in rounds[0]["new"]:
        row: dict[str, Any] = {"config": key}
        figures = {who: [r[who].get(key) for r in rounds if who in r] for who in ("new", "old")}
        if not all(isinstance(v, float) for v in figures["new"]):
            row["new"] = figures["new"][0]
            rows.append(row)
            continue
        row["new_s"] = statistics.median(figures["new"])
        torch_times = [r["torch"][key.rsplit("/", 1)[0]] for r in rounds]  # the key without our schedule
        row["torch_s"] = statistics.median(torch_times)
        row["torch_over_new"] = row["torch_s"] / row["new_s"]
        row["torch_over_new_per_round"] = statistics.median(
            t / n for t, n in zip(torch_times, figures["new"], strict=True))
        row["rounds_s"] = {"new": figures["new"], "torch": torch_times}
        old = figures["old"]
        if old and all(isinstance(v, float) for v in old):
            row["old_s"] = statistics.median(old)
            row["torch_over_old"] = row["torch_s"] / row["old_s"]
            row["old_over_new"] = row["old_s"] / row["new_s"]
            row["rounds_s"]["old"] = old
        elif old:
            row["old"] = old[0]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=("vgg", "vgg-full", "lenet", "rnn"),
                        default=["vgg", "vgg-full", "lenet", "rnn"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per process (medians)")
    parser.add_argument("--old", type=pathlib.Path, help="a second checkout timed in the same rounds")
    parser.add_argument("--max-step-flops", type=float, default=1e9)
    parser.add_argument("--max-work-flops", type=float, default=5e10)
    parser.add_argument("--lenet-method", default="auto")
    parser.add_argument("--worker", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(ours(args) if args.worker == "ours" else theirs(args)))
        return 0
    sys.path.insert(0, str(BENCH))
    from common import cpu_pressure, machine

    from sparse_scan import backend

    new_tree = BENCH.parent
    contenders = [("new", "ours", new_tree), ("torch", "theirs", new_tree)]
    if args.old is not None:
        contenders.insert(1, ("old", "ours", args.old.resolve()))
    report: dict[str, Any] = {"benchmark": "cpu_vs_torch", "machine": machine(backend.get("cpu")),
                              "cpu_pressure_before": cpu_pressure(), "rounds": args.rounds,
                              "old_tree": None if args.old is None else str(args.old)}
    rounds = []
    for round_ in range(args.rounds):
        figures = {}
        for label, contender, tree in contenders if round_ % 2 == 0 else contenders[::-1]:
            figures[label] = run_worker(contender, tree, args)
        rounds.append(figures)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    report["torch_threads"] = rounds[0]["torch"].pop("torch_threads")
    for figures in rounds[1:]:
        figures["torch"].pop("torch_threads")
    report["rows"] = summarise(rounds)
    report["cpu_pressure_after"] = cpu_pressure()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
