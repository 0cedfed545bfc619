"""torchvision's classification models through the PyTorch front door (issue 46): per model, whether it
is captured exactly or refused (and for what), the capture's cost, and the engine's backward against
PyTorch autograd's in the same run.

Every family of ``tests/torchvision_models.py`` (``--families``, comma-separated; all by default): its
smallest variant, ``weights=None`` (seeded), eval mode with random batch-norm statistics, float32, a batch
of ``--batch`` (4) inputs of the family's shape (3x32x32 where the model takes it). Each model runs in a
fresh process (its memory returned, no model's warm caches lent to the next), stopped after
``--max-seconds`` (60) plus :data:`STARTUP_S` for the imports; a model stopped so is reported as
skipped. Per model:

- ``export_s``: ``export_torch`` into a temporary folder (the capture by torch.fx, its float64 check,
  the spec and the weights written), or the time until it refuses; ``status`` ``exact`` or ``refused``
  with ``reason`` (the refusal's reason) and ``node`` (the graph node it names);
- ``bppsa_first_forward_s``: the first forward through ``sparse_scan.torch.bppsa(net)`` (the default
  method, ``auto``): the capture again, the engine's model built, one forward; ``bppsa_forward_s``: a
  later forward (median), so the capture costs about their difference;
- ``bppsa_first_backward_s``: its first ``backward`` (the scan's plan for this batch size, built once,
  then the scan);
- ``bppsa_backward_ms`` and ``torch_backward_ms``: medians over ``--repeats`` rounds of ``loss.backward()``
  alone (``out.backward(g)`` for a fixed ``g``), after a forward through ``bppsa(net)`` and through
  ``net``, the two taken in turn in each round; ``speedup`` is PyTorch's over ours (above 1: ours is
  faster);
- ``max_rel_error``: the largest difference of the input gradient and every parameter gradient from
  autograd's, relative to each array's largest magnitude (float32 rounding: the exactness itself is
  ``tests/test_zoo.py``'s, in float64).

Prints one JSON document on stdout (the machine, the settings, ``/proc/pressure/cpu`` before and after,
the rows); a line per model on stderr as it finishes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BENCH = pathlib.Path(__file__).resolve().parent
TESTS = BENCH.parent / "tests"
"""Holds ``torchvision_models.py`` (the families, and torchvision imported without its compiled
operators) and ``oracles.py`` (random batch-norm statistics): no package, put on ``sys.path``."""

STARTUP_S = 20.0
"""A child process's allowance for importing torch, torchvision and sparse-scan (about 5 s on a 2-core
machine), on top of ``--max-seconds``."""

REFUSAL = re.compile(r"node '(?P<node>[^']+)' \([^`]*?(`.*?`)?\): (?P<reason>.*)")
"""A capture's refusal: ``node 'name' (what at file.py:12: `code`): reason``."""


def relative_error(got: Any, want: Any) -> float:
    """``max |got - want|`` over ``want``'s largest magnitude."""
    import numpy as np  # noqa: PLC0415

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.abs(got - want).max(initial=0.0) / max(float(np.abs(want).max(initial=0.0)), 1e-300))


def refusal(error: BaseException) -> dict[str, Any]:
    """A refusal's node and reason, read off its message (the whole message where it names no node)."""
    message = str(error)
    found = REFUSAL.match(message)
    if found is None:
        return {"reason": f"{type(error).__name__}: {message}", "node": None}
    return {"reason": found["reason"], "node": found["node"]}


def measure(family_name: str, batch: int, repeats: int) -> dict[str, Any]:
    """One model's row (the module docstring), measured in this process."""
    for path in (TESTS, BENCH):
        if str(path) not in sys.path:
            sys.path.append(str(path))
    import torch  # noqa: PLC0415
    import torchvision_models  # noqa: PLC0415
    from oracles import randomize_batch_norms  # noqa: PLC0415

    from sparse_scan import export_torch  # noqa: PLC0415
    from sparse_scan.torch import CaptureError, bppsa  # noqa: PLC0415

    (family,) = [family for family in torchvision_models.FAMILIES if family.name == family_name]
    start = time.perf_counter()
    net = torchvision_models.build(family, torch.float32)
    randomize_batch_norms(net)
    row: dict[str, Any] = {"family": family.name, "model": family.builder,
                           "input": [3, family.side, family.side], "batch": batch,
                           "parameters": sum(p.numel() for p in net.parameters()),
                           "build_s": time.perf_counter() - start}
    generator = torch.Generator().manual_seed(1)
    x = torch.randn((batch, 3, family.side, family.side), generator=generator)

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        try:
            export_torch(net, tuple(x.shape[1:]), pathlib.Path(folder) / "model.yaml")
        except CaptureError as error:
            return row | {"status": "refused", **refusal(error), "export_s": time.perf_counter() - start}
        row |= {"status": "exact", "export_s": time.perf_counter() - start}

    leaf = x.clone().requires_grad_(True)
    out = net(leaf)
    g = torch.randn(out.shape, generator=generator)
    out.backward(g)
    want = [leaf.grad.clone()] + [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad(set_to_none=True)

    bnet = bppsa(net)
    leaf = x.clone().requires_grad_(True)
    start = time.perf_counter()
    out = bnet(leaf)
    row["bppsa_first_forward_s"] = time.perf_counter() - start
    start = time.perf_counter()
    out.backward(g)
    row["bppsa_first_backward_s"] = time.perf_counter() - start
    got = [leaf.grad] + [p.grad for p in net.parameters() if p.grad is not None]  # autograd's, used ones
    row["max_rel_error"] = max(relative_error(a.numpy(), b.numpy()) for a, b in zip(got, want, strict=True))

    times: dict[str, list[float]] = {"bppsa_forward": [], "bppsa_backward": [], "torch_backward": []}
    for _ in range(repeats):
        for name, module in (("bppsa", bnet), ("torch", net)):
            net.zero_grad(set_to_none=True)
            start = time.perf_counter()
            out = module(x.clone().requires_grad_(True))
            forward = time.perf_counter() - start
            start = time.perf_counter()
            out.backward(g)
            times[f"{name}_backward"].append(time.perf_counter() - start)
            if name == "bppsa":
                times["bppsa_forward"].append(forward)
    row["bppsa_forward_s"] = statistics.median(times["bppsa_forward"])
    row["bppsa_backward_ms"] = 1e3 * statistics.median(times["bppsa_backward"])
    row["torch_backward_ms"] = 1e3 * statistics.median(times["torch_backward"])
    row["speedup"] = row["torch_backward_ms"] / row["bppsa_backward_ms"]
    return row


def progress(row: dict[str, Any]) -> str:
    """One model's line on stderr."""
    line = f"{row['family']} ({row.get('model', '?')}): {row['status']}"
    if row["status"] == "exact":
        line += (f", export {row['export_s']:.1f} s, backward {row['bppsa_backward_ms']:.1f} ms ours, "
                 f"{row['torch_backward_ms']:.1f} ms PyTorch")
    else:
        line += f": {row['reason'][:100]}"
    return line + f" ({row['wall_s']:.0f} s)"


def main() -> None:
    sys.path.insert(0, str(TESTS))
    import torchvision_models  # noqa: PLC0415 - the families, no torch

    names = [family.name for family in torchvision_models.FAMILIES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(names),
                        help=f"comma-separated, of: {', '.join(names)} (default: all)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="a model taking longer (its imports aside) is stopped and reported as skipped")
    parser.add_argument("--note", default="", help="said in the JSON (e.g. whether the machine was shared)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a child process's one family
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.batch, args.repeats)))
        return
    chosen = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"--families: no family {', '.join(unknown)} (families: {', '.join(names)})")

    sys.path.insert(0, str(BENCH))
    from common import cpu_pressure, machine  # noqa: PLC0415

    from sparse_scan import backend  # noqa: PLC0415

    pressure_before = cpu_pressure()
    rows = []
    for name in chosen:
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", name,
                   "--batch", str(args.batch), "--repeats", str(args.repeats)]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=args.max_seconds + STARTUP_S)
        except subprocess.TimeoutExpired:
            row = {"family": name, "status": "skipped",
                   "reason": f"over {args.max_seconds:g} s (+{STARTUP_S:g} s for the imports)"}
        else:
            if done.returncode == 0:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
                row = {"family": name, "status": "error", "reason": last[:500]}
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        print(progress(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "zoo: torchvision classification models, export_torch and bppsa",
                      "machine": machine(backend.get("cpu")), "note": args.note, "dtype": "float32",
                      "batch": args.batch, "repeats": args.repeats, "method": "auto",
                      "max_seconds": args.max_seconds, "cpu_pressure_before": pressure_before,
                      "cpu_pressure_after": cpu_pressure(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
