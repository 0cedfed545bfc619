"""The paper's Fig. 10 by one command: FLOPs per scan step of BP and BPPSA on the 97%-pruned VGG-11.

``data/vgg11-pruned.yaml`` (3x32x32), the hybrid scan with the paper's levels (2 up-sweep levels, §5.3):
per step its FLOPs over the patterns (the static bound, ``sparse_scan.flops.analyse``) and over the live
entries of ``--samples`` random standard normal inputs (``sparse_scan.flops.live``, both conventions:
``ours`` and the paper's artifact's ``paper``), against each step's ``m·n·k``; BP's gradient operators
beside. Writes the JSON (``--out``) and, where matplotlib is installed, the figure (``--plot``): the
static bound, then the live figures (mean over the samples) in the artifact's convention, which is
what the paper's Fig. 10 plots. The JSON's ``comparison`` puts the live totals next to the artifact's
own figures for one random input (issue 21: critical path 51.2 M, work 71.2 M, BP 7.24 M FLOPs).
Counting is deterministic: FLOPs do not depend on the machine (the timings do).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np
from common import machine

from sparse_scan import backend, load_model
from sparse_scan.flops import CONVENTIONS, analyse, live

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

ARTIFACT = {"critical_flops": 51.2e6, "work_flops": 71.2e6, "bp_flops": 7.24e6,
            "source": "issue 21: the FLOP analysis of UofT-EcoSystem/BPPSA-open (pruned_vgg11_analysis.py) "
                      "run unchanged on the JTs of data/vgg11-pruned.yaml for one random input, hybrid 2"}
"""The paper's artifact's figures the ``paper`` convention reproduces."""

TOLERANCE = 0.10
"""The live totals in the artifact's convention must lie within 10 % of :data:`ARTIFACT` (issue 21)."""


def shown(path: pathlib.Path) -> str:
    """``path`` relative to the repository where it lies inside it (results name no machine's folders)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def comparison(report: dict[str, Any]) -> dict[str, Any]:
    """Each live total of the ``paper`` report next to the artifact's, with the relative differences."""
    out = {}
    for key in ("critical_flops", "work_flops", "bp_flops"):
        spread, reference = report["totals"][key]["live"], ARTIFACT[key]
        differences = [value / reference - 1 for value in spread["samples"]]
        out[key] = {"artifact": reference, "mean": spread["mean"], "min": spread["min"], "max": spread["max"],
                    "relative_difference": {"mean": spread["mean"] / reference - 1, "min": min(differences),
                                            "max": max(differences)},
                    "within_10_percent": all(abs(d) <= TOLERANCE for d in differences)}
    return out


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Two panels in the paper's style: static (ours) and live (paper convention, mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    static, paper = result["static"], result["live"]["paper"]
    panels = [
        ("static: every stored entry (ours)",
         [(step, step["flops"], step["critical"]) for step in static["steps"]],
         [(layer["shape"][0] * layer["shape"][1], 2 * layer["nnz"]) for layer in static["layers"]]),
        (f"live: mean of {paper['samples']} random inputs (paper)",
         [(step, step["live"]["mean"], step["critical_live"]) for step in paper["steps"]],
         [(layer["shape"][0] * layer["shape"][1], layer["live"]["mean"]) for layer in paper["bp"]]),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True, sharey=True)
    for axis, (title, steps, bp) in zip(axes, panels, strict=True):
        axis.scatter(*zip(*bp, strict=True), facecolors="none", edgecolors="green", label="baseline (BP)")
        for kind, colour in (("mv", "#f48642"), ("mm", "#5A9BD5")):
            for critical in (False, True):
                points = [(s["mnk"][0] * s["mnk"][1] * s["mnk"][2], max(flops, 1))
                          for s, flops, on_path in steps if s["kind"] == kind and on_path == critical]
                if points:
                    style = {"color": colour} if critical else {"facecolors": "none", "edgecolors": colour}
                    label = f"{kind}, critical" if critical else kind
                    axis.scatter(*zip(*points, strict=True), label=label, **style)
        axis.set(xscale="log", yscale="log", xlabel="m x n x k", ylabel="FLOP", title=title)
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(ncol=2, fontsize=8)
    totals = paper["totals"]
    figure.suptitle(f"97%-pruned VGG-11, hybrid {result['levels']}: live critical path "
                    f"{totals['critical_flops']['live']['mean'] / 1e6:.1f} M, work "
                    f"{totals['work_flops']['live']['mean'] / 1e6:.1f} M, BP "
                    f"{totals['bp_flops']['live']['mean'] / 1e6:.2f} M FLOPs (paper's convention)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=pathlib.Path, default=ROOT / "data" / "vgg11-pruned.yaml")
    parser.add_argument("--levels", type=int, default=2, help="up-sweep levels of the hybrid scan")
    parser.add_argument("--samples", type=int, default=8, help="random standard normal inputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "fig10-vgg11-pruned.json",
                        help="write the JSON here too")
    parser.add_argument("--plot", type=pathlib.Path, default=RESULTS / "fig10-vgg11-pruned.png",
                        help="write the figure here (skipped, with a note, without matplotlib)")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    shape = (args.samples,) + model.input_shape
    x = np.random.default_rng(args.seed).standard_normal(shape).astype(np.float32)
    start = time.perf_counter()
    static = analyse(model, "hybrid", args.levels)
    timings = {"plan_s": time.perf_counter() - start}
    reports = {}
    for convention in CONVENTIONS:
        start = time.perf_counter()
        reports[convention] = live(model, x, "hybrid", args.levels, convention)
        seconds = timings[f"live_{convention}_s"] = time.perf_counter() - start
        critical = reports[convention]["totals"]["critical_flops"]["live"]["mean"]
        print(f"{convention}: critical path {critical:,.0f} FLOPs (mean), {seconds:.1f} s", file=sys.stderr)
    result = {"machine": machine(backend.get("cpu")), "model": shown(args.model),
              "method": "hybrid", "levels": args.levels, "samples": args.samples, "seed": args.seed,
              "inputs": "numpy.random.default_rng(seed).standard_normal((samples, 3, 32, 32)), float32",
              "timings": timings, "artifact": ARTIFACT, "comparison": comparison(reports["paper"]),
              "static": static, "live": reports}
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        result["plot"] = "skipped: matplotlib is not installed (pip install 'sparse-scan[plot]')"
        print(f"note: {result['plot']}", file=sys.stderr)
    else:
        result["plot"] = shown(args.plot)
    text = json.dumps(result, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)  # before the plot can fail
    if result["plot"] == shown(args.plot):
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
