"""``sparse-scan calibrate``: measure this machine's cost-model constants and cache them.

Calls :func:`sparse_scan.calibration.calibrate` (about ten seconds of small backwards), writes the fitted
constants where :func:`sparse_scan.engine.cost.current` finds them (per machine and library version,
under ``$XDG_CACHE_HOME/sparse-scan``; ``--output`` elsewhere) and prints them with each timed
schedule's predicted against measured time (or JSON). ``--show`` prints the constants runs use now,
measuring nothing. Where the constants go is checked before measuring (:func:`._common.check_output`:
missing folders are made); an ``--output`` file that exists is rewritten if it is a calibration, and
needs ``--force`` if it is not. Errors: one line, exit code 2.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import click

from ._common import check_output, fail, output_option
from ._options import force_option, json_option, quiet_option, threads_option
from ._progress import Progress


@click.command(name="calibrate")
@click.option("--device", type=click.Choice(["cpu"]), default="cpu", show_default=True,
              help="the backend to measure (the GPU's constants are placeholders: docs/gpu.md)")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="timed runs per schedule (the median is fitted)")
@output_option("--output", help="write the constants here instead of the cache")
@force_option(help="overwrite an existing --output file that is not a calibration")
@click.option("--show", is_flag=True, help="print the constants runs use now; measure nothing")
@threads_option
@json_option()
@quiet_option(help="no progress on stderr")
def calibrate_command(device: str, repeats: int, output: pathlib.Path | None, force: bool, show: bool,
                      as_json: bool, quiet: bool) -> None:
    """Measure the cost model's constants on this machine (what `--method auto` predicts times with)."""
    from sparse_scan.calibration import calibrate  # noqa: PLC0415 - not at import: --help comes first
    from sparse_scan.engine.cost import cache_path, current, load, save  # noqa: PLC0415

    if show:
        try:
            model = current(device)
        except ValueError as error:
            fail(str(error))
        report: dict[str, Any] = model.as_dict() | {"cache": str(cache_path(device))}
    else:
        check_output("--output" if output else "cache", output or cache_path(device), True, make_folders=True,
                     what="the calibration")
        if output is not None and output.exists() and not force:
            try:  # a calibration is rewritten (as the cache is), any other file kept
                load(output)
            except ValueError:
                fail(f"--output {output}: exists and is not a calibration (use --force to overwrite)")
        with Progress(quiet) as progress:
            model, measurements = calibrate(device, repeats,
                                            progress=lambda phase, done, total: progress.show(
                                                f"timing schedule {done}/{total}"))
        try:
            path = save(model, output)
        except OSError as error:
            fail(f"{output or cache_path(device)}: cannot write the calibration ({error.strerror})")
        report = model.as_dict() | {"cache": str(path), "measurements": [
            {"workload": m.workload, "method": m.method, "levels": m.levels, "batch": m.batch,
             "measured_s": m.seconds, "predicted_s": model.predict(m.features)} for m in measurements]}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"cost model of the {report['device']} ({report['source']}; {report['threads']} threads), "
               f"cached at {report['cache']}:")
    for name, seconds in report["seconds"].items():
        click.echo(f"  {name:18} {seconds:.3g} s")
    for row in report.get("measurements", []):
        schedule = row["method"] + ("" if row["levels"] is None else f" {row['levels']}")
        click.echo(f"  {row['workload']:28} {schedule:10} batch {row['batch']:2}: measured "
                   f"{1e3 * row['measured_s']:8.3f} ms, predicted {1e3 * row['predicted_s']:8.3f} ms")
