"""``sparse-scan flops MODEL.yaml``: static FLOP analysis of the backward pass (no values).

Parses the options, loads the spec, calls :func:`sparse_scan.flops.analyse` and prints a table or
JSON; ``--plot`` draws the paper's Fig. 10 (FLOPs per step against ``m·n·k``) with matplotlib.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import click

from ._common import (
    check_outputs,
    model_errors,
    parse_levels,
    plan_progress,
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
)


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


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    """The paper's Fig. 10: FLOPs per step against m·n·k, BP's gradient operators beside."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.8))
    bp = [(layer["shape"][0] * layer["shape"][1], 2 * layer["nnz"]) for layer in report["layers"]]
    axes.scatter(*zip(*bp, strict=True), marker="s", facecolors="none", edgecolors="grey",
                 label="BP: gradient operator (JT·g)")
    for kind, marker in (("mm", "o"), ("mv", "^")):
        for critical, colour in ((False, "tab:blue"), (True, "tab:red")):
            points = [(max(1, s["mnk"][0] * s["mnk"][1] * s["mnk"][2]), max(1, s["flops"]))
                      for s in report["steps"] if s["kind"] == kind and s["critical"] == critical]
            if points:
                axes.scatter(*zip(*points, strict=True), marker=marker, color=colour, alpha=0.7,
                             label=f"BPPSA {kind}{' (critical path)' if critical else ''}")
    axes.set(xscale="log", yscale="log", xlabel="m·n·k", ylabel="FLOPs",
             title=f"{report['method']}: FLOPs per step")
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
@file_option("--plot", help="write the paper's Fig. 10 (needs matplotlib)")
@force_option(help="overwrite an existing --plot file")
@quiet_option()
def flops(model: pathlib.Path, method: str, levels: str | None, batch: int, dtype: str,
          max_step_flops: float, as_json: bool, plot: pathlib.Path | None, force: bool,
          quiet: bool) -> None:
    """Static FLOP analysis of MODEL's backward pass: per layer, per scan step, totals."""
    from sparse_scan import load_model  # noqa: PLC0415 - not at import: --help comes first
    from sparse_scan.flops import analyse  # noqa: PLC0415

    check_outputs(force, plot=plot)
    with model_errors(model):
        network = load_model(model, dtype=dtype)
        report = analyse(network, method, parse_levels(levels), batch, dtype, int(max_step_flops),
                         progress=plan_progress(quiet))
    if plot is not None:
        write_or_fail("--plot", plot, lambda: _plot(report, plot))
    click.echo(json.dumps(report, indent=2) if as_json else _table(report))
