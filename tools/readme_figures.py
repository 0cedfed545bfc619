#!/usr/bin/env python3
"""Reproduce the training accuracies README.md quotes, each from its own command, at several thread counts.

Every entry of :data:`FIGURES` is a ``sparse-scan train`` command exactly as README.md gives it and the
test accuracies README.md quotes for some of its epochs. The script runs each command (as ``python -m
sparse_scan.cli``, from the repository root, its ``--out``/``--log``/``--plot`` files sent to a
temporary folder) with ``--json --quiet --threads N`` for every N of ``--threads`` (default 1 and 2),
and compares every quoted epoch's test accuracy, rounded to 0.1 % as README prints it. The seeds are
fixed (weights, data, batch order), so the figures do not depend on the run or on the thread count;
they are float32 trainings, though, so a change anywhere in the backward that reorders a sum can move
them (the LSTM's 35.9 % of 2026-11-24 is 40.4 % since the recurrent cells' compiled kernels, c7564c0):
the script then says which figure moved, and README.md is updated from its output. It prints the
machine and each run's seconds too (README quotes times with the machine they were measured on).

``tests/test_readme.py`` keeps :data:`FIGURES` and README.md in step (each command and figure here is in
README.md) and runs the LeNet-5 example; the others take minutes (2-core machine: LeNet-5 10 s,
ResNet-20 about 2 minutes, the LSTM about 3 per thread count).

Usage: ``python tools/readme_figures.py [--only lenet5-digits|lstm-bitstream|resnet20 ...] [--threads N
...]``; exits 1 when a figure differs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIGURES = {
    "lenet5-digits": ("sparse-scan train data/lenet5-digits.yaml --data digits --method blelloch "
                      "--compare-bp --out runs/weights.npz --log runs/loss.csv --plot runs/loss.png",
                      {1: 35.3, 10: 93.6}),
    "lstm-bitstream": ("sparse-scan train data/lstm-bitstream.yaml --data bitstream --batch-size 16 "
                       "--lr 0.01 --epochs 2", {1: 35.4, 2: 40.4}),
    "resnet20": ("sparse-scan train data/resnet20.yaml --data digits --epochs 1 --batch-size 32 --lr 0.001",
                 {1: 23.1}),
}
"""Name -> (README's command, {epoch (from 1): README's test accuracy in %})."""

OUTPUTS = ("--out", "--log", "--plot")


def arguments(command: str, folder: pathlib.Path) -> list[str]:
    """The command's arguments after ``sparse-scan``, its output files moved into ``folder``."""
    args = shlex.split(command)[1:]
    for index, arg in enumerate(args[:-1]):
        if arg in OUTPUTS:
            args[index + 1] = str(folder / pathlib.Path(args[index + 1]).name)
    return args


def accuracies(command: str, threads: int) -> tuple[dict[int, float], float]:
    """Every epoch's test accuracy (%, unrounded) of ``command`` run with ``threads``, and its seconds."""
    with tempfile.TemporaryDirectory() as folder:
        args = arguments(command, pathlib.Path(folder))
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "sparse_scan.cli", *args, "--json", "--quiet",
                               "--threads", str(threads)], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{command} --threads {threads} failed: {done.stderr.strip()}")
    report = json.loads(done.stdout)
    return {epoch["epoch"] + 1: 100 * epoch["test_accuracy"] for epoch in report["per_epoch"]}, seconds


def machine() -> str:
    """The CPU model and the cores this process may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), default=sorted(FIGURES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    print(f"machine: {machine()}")
    failed = 0
    for name in args.only:
        command, quoted = FIGURES[name]
        for threads in args.threads:
            got, seconds = accuracies(command, threads)
            for epoch, figure in sorted(quoted.items()):
                ok = round(got[epoch], 1) == figure
                failed += not ok
                print(f"{name}, {threads} thread{'s' if threads > 1 else ''}, epoch {epoch}: "
                      f"{got[epoch]:.2f} % (README: {figure:.1f} %) {'ok' if ok else 'DIFFERS'}; "
                      f"run {seconds:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
