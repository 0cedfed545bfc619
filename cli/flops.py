"""``sparse-scan flops MODEL.yaml``: FLOP analysis of the backward pass, static and (for a batch) live.

Parses the options, loads the spec, calls :func:`sparse_scan.flops.analyse` and prints a table or
JSON; ``--plot`` draws the paper's Fig. 10 (FLOPs per step against ``m·n·k``) with matplotlib. With
``--input X.npy`` or ``--random N``, :func:`sparse_scan.flops.live` adds the FLOPs on that batch's
live entries (``--convention ours|paper``): a ``live`` section after the static one, a ``live`` key in
the JSON, and ``--plot`` draws the live figures. Without them the output is the static analysis alone.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import click

from ._common import (
    check_outputs,
    fail,
    model_errors,
    model_inputs,
    output_option,
    parse_levels,
    pyplot,
    schedule_label,
    schedule_lines,
    write_or_fail,
)
from ._options import (
    dtype_option,
    file_option,
    force_option,
    json_option,
    levels_option,
    max_step_flops_option,
    method_option,
    model_argument,
    quiet_option,
    seed_option,
)
from ._progress import Progress, plan_status

CONVENTIONS = ("ours", "paper")
"""``--convention`` choices: :data:`sparse_scan.flops.CONVENTIONS` (repeated here, where NumPy is not
imported yet; a test keeps them equal)."""


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'layer':10} {'type':10} {'JT shape':>20} {'nnz':>12} {'sparsity':>9} "
             f"{'CSR MiB':>9} {'dense MiB':>11}"]
    for layer in report["layers"]:
        shape = "x".join(str(s) for s in layer["shape"])
        lines.append(f"{layer['name']:10} {layer['type']:10} {shape:>20} {layer['nnz']:>12,} "
                     f"{layer['sparsity']:>9.5f} {layer['csr_bytes'] / 2**20:>9.2f} "
                     f"{layer['dense_bytes'] / 2**20:>11.1f}")
    lines.append("")
    lines.append(f"{'level':>5} {'phase':6} {'kind':4} {'method':13} {'m·n·k':>24} {'FLOPs':>14} "
                 f"{'live FLOPs':>14} critical")
    for step in report["steps"]:
        mnk = "x".join(str(s) for s in step["mnk"])
        lines.append(f"{step['level']:>5} {step['phase']:6} {step['kind']:4} {step['method']:13} "
                     f"{mnk:>24} {step['flops']:>14,} {step['flops_live']:>14,} "
                     f"{'*' if step['critical'] else ''}")
    totals = report["totals"]
    lines += ["", f"{schedule_label(report['method'], report['levels'])}: {totals['critical_steps']} "
              "sequential steps", *schedule_lines(report["schedule"]),
              f"BP FLOPs               {totals['bp_flops']:>16,}",
              f"BPPSA critical FLOPs   {totals['critical_flops']:>16,}",
              f"BPPSA work FLOPs       {totals['work_flops']:>16,}",
              f"peak memory            {totals['peak_bytes'] / 2**20:>13.1f} MiB"]
    return "\n".join(lines)


def _live_table(live: dict[str, Any]) -> str:
    """The live section: per step its static and live FLOPs (mean, min, max over the samples), then
    the totals."""
    lines = ["", f"live FLOPs on {live['samples']} sample{'s' if live['samples'] > 1 else ''}, "
             f"convention {live['convention']} (critical: the level's costliest step by mean live FLOPs)",
             f"{'level':>5} {'phase':6} {'kind':4} {'m·n·k':>24} {'static FLOPs':>14} {'live mean':>14} "
             f"{'live min':>14} {'live max':>14} critical"]
    for step in live["steps"]:
        mnk = "x".join(str(s) for s in step["mnk"])
        spread = step["live"]
        note = "" if step["in_plan"] else " (not in the plan: the paper's unused product)"
        lines.append(f"{step['level']:>5} {step['phase']:6} {step['kind']:4} {mnk:>24} {step['static']:>14,} "
                     f"{spread['mean']:>14,.0f} {spread['min']:>14,} {spread['max']:>14,} "
                     f"{'*' if step['critical_live'] else ''}{note}")
    lines.append("")
    totals = live["totals"]
    for label, key in (("BP FLOPs", "bp_flops"), ("BPPSA critical FLOPs", "critical_flops"),
                       ("BPPSA work FLOPs", "work_flops")):
        spread = totals[key]["live"]
        lines.append(f"{label:22} static {totals[key]['static']:>16,}   live {spread['mean']:>16,.0f} "
                     f"(min {spread['min']:,}, max {spread['max']:,})")
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    """The paper's Fig. 10: FLOPs per step against m·n·k, BP's gradient operators beside (the live
    figures' means where the report has them)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.8))
    live = report.get("live")
    if live is None:
        bp = [(layer["shape"][0] * layer["shape"][1], 2 * layer["nnz"]) for layer in report["layers"]]
        steps = [(step, step["flops"], step["critical"]) for step in report["steps"]]
        title = f"{report['method']}: FLOPs per step"
    else:
        bp = [(layer["shape"][0] * layer["shape"][1], layer["live"]["mean"]) for layer in live["bp"]]
        steps = [(step, step["live"]["mean"], step["critical_live"]) for step in live["steps"]]
        title = (f"{report['method']}: live FLOPs per step ({live['convention']}, mean of "
                 f"{live['samples']})")
    axes.scatter(*zip(*bp, strict=True), marker="s", facecolors="none", edgecolors="grey",
                 label="BP: gradient operator (JT·g)")
    for kind, marker in (("mm", "o"), ("mv", "^")):
        for critical, colour in ((False, "tab:blue"), (True, "tab:red")):
            points = [(max(1, s["mnk"][0] * s["mnk"][1] * s["mnk"][2]), max(1, flops))
                      for s, flops, on_path in steps if s["kind"] == kind and on_path == critical]
            if points:
                axes.scatter(*zip(*points, strict=True), marker=marker, color=colour, alpha=0.7,
                             label=f"BPPSA {kind}{' (critical path)' if critical else ''}")
    axes.set(xscale="log", yscale="log", xlabel="m·n·k", ylabel="FLOPs", title=title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


@click.command(name="flops")
@model_argument
@method_option
@levels_option
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="samples assumed for peak memory")
@dtype_option
@max_step_flops_option
@json_option()
@output_option("--plot", help="write the paper's Fig. 10 (needs matplotlib; the live figures with --input or "
             "--random)")
@force_option(help="overwrite an existing --plot file")
@quiet_option(help="no progress on stderr")
@file_option("--input", "input_path",
             help="also count the live FLOPs of these inputs (N, *input_shape) as .npy")
@click.option("--random", type=click.IntRange(min=1),
              help="also count the live FLOPs of N seeded standard normal inputs")
@seed_option(help="seed of --random")
@click.option("--convention", type=click.Choice(CONVENTIONS), default=None,
              help="FLOPs of the live figures: ours (docs/design.md, the static figures' own; default) or "
              "paper (the paper's artifact: scalings 2 per entry, no dL/dx0 step, unused up-sweep products "
              "counted, its BP formula)")
def flops(model: pathlib.Path, method: str, levels: str | None, batch: int, dtype: str,
          max_step_flops: float, as_json: bool, plot: pathlib.Path | None, force: bool,
          quiet: bool, input_path: pathlib.Path | None, random: int | None, seed: int,
          convention: str | None) -> None:
    """FLOP analysis of MODEL's backward pass: per layer, per scan step, totals; with --input or
    --random, also on the live entries of that batch."""
    from sparse_scan import load_model  # noqa: PLC0415 - not at import: --help comes first
    from sparse_scan.flops import analyse, live  # noqa: PLC0415

    if input_path is not None and random is not None:
        fail("give at most one of --input X.npy and --random N")
    if convention is not None and input_path is None and random is None:
        fail("--convention applies to the live figures: give --input X.npy or --random N")
    check_outputs(force, plot=plot)
    with Progress(quiet) as progress, model_errors(model):
        progress.show(f"loading {model}")
        network = load_model(model, dtype=dtype)
        report = analyse(network, method, parse_levels(levels), batch, dtype, int(max_step_flops),
                         progress=plan_status(progress))
        if input_path is not None or random is not None:
            x = model_inputs(network, input_path, random, seed, dtype)
            report["live"] = live(network, x, method, parse_levels(levels), convention or "ours",
                                  int(max_step_flops), progress=plan_status(progress, "live FLOPs"))
        if plot is not None:
            progress.show(f"drawing {plot}")
            write_or_fail("--plot", plot, lambda: _plot(report, plot))
    text = _table(report) + ("" if "live" not in report else "\n" + _live_table(report["live"]))
    click.echo(json.dumps(report, indent=2) if as_json else text)
