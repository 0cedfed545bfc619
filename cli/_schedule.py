"""How the CLI states a scan's schedule: which one ran, why, and what else was considered."""

from __future__ import annotations

from typing import Any

__all__ = ["METHOD_HELP", "schedule_label", "schedule_lines", "size_text"]

METHOD_HELP = ("scan schedule; auto chooses linear, hybrid or blelloch from cost estimates (hybrid "
               "without --levels chooses its depth)")
"""``--method`` help of every command that plans a scan."""


def schedule_label(method: str, levels: int | None) -> str:
    """``linear``, ``blelloch`` or ``hybrid N``."""
    return method if levels is None else f"{method} {levels}"


def size_text(nbytes: float) -> str:
    """Bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:,.1f} GiB"


def schedule_lines(schedule: dict[str, Any]) -> list[str]:
    """Text lines of :meth:`sparse_scan.scan.ScanPlan.explain`: the schedule and its figures, then
    every other schedule an automatic choice considered, with why it was set aside."""
    label = schedule_label(schedule["method"], schedule["levels"])
    requested = schedule["requested"]
    why = ("as requested" if "candidates" not in schedule
           else f"chosen by --method {requested}: {schedule['reason']}" if requested == "auto"
           else f"depth chosen by --method hybrid: {schedule['reason']}")
    lines = [f"  schedule: {label} ({why})",
             f"    critical path {schedule['critical_flops']:,} FLOPs in {schedule['critical_steps']} "
             f"steps, work {schedule['work_flops']:,} FLOPs, peak memory {size_text(schedule['peak_bytes'])} "
             f"+ plan {size_text(schedule['plan_bytes'])}"]
    for candidate in schedule.get("candidates", []):
        if candidate["verdict"] == "chosen":
            continue
        estimated = "~" if candidate["estimated"] else ""
        lines.append(f"    {schedule_label(candidate['method'], candidate['levels']):10} critical path "
                     f"{estimated}{candidate['critical_flops']:.3g} FLOPs: {candidate['verdict']}")
    return lines
