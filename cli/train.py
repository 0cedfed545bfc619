"""``sparse-scan train MODEL.yaml --data NAME_OR_PATH``: train with BPPSA gradients.

Parses the options, loads the spec (any :class:`sparse_scan.model.Model`), the starting weights
(``--weights``) and the data, runs :func:`sparse_scan.train.train` and reports as it goes: a line per
epoch (loss, accuracy, time) on stdout (stderr with ``--json``), the batches done as progress
(:mod:`._progress`), the CSV log appended and flushed per iteration, the weights (``--out``) written
atomically after every epoch and on Ctrl-C (with the plot of the iterations done), never over an
existing file without ``--force``; at the end a summary with the test accuracy (or JSON) and the loss
plot. Errors: one line, exit code 2, before anything is written (every output is checked first);
training that diverges (:class:`sparse_scan.train.DivergenceError`) is one line too, naming the
iteration and what went non-finite, after ``--out`` and ``--plot`` are written as on Ctrl-C, with the
last finite weights.
"""

from __future__ import annotations

import csv
import json
import pathlib
import sys
from typing import IO, Any

import click

from ._common import (
    INTERRUPTED,
    backend_or_fail,
    check_batch,
    check_outputs,
    fail,
    load_dataset_for,
    load_weights,
    model_errors,
    output_option,
    parse_levels,
    plural,
    pyplot,
    schedule_label,
    schedule_lines,
    write_or_fail,
)
from ._options import (
    FiniteFloat,
    batch_size_option,
    data_option,
    device_option,
    file_option,
    force_option,
    json_option,
    levels_option,
    max_step_flops_option,
    method_option,
    model_argument,
    quiet_option,
    seed_option,
    threads_option,
)
from ._progress import Progress, plan_status

DEFAULT_LR = 0.003
"""``--lr`` default: Adam's (the default optimizer) rate that trains the bundled LeNet-5 on digits to
over 90 % test accuracy in 10 epochs; SGD usually wants 0.01-0.1 (with ``--momentum 0.9``)."""


def _optimizer(name: str, model: Any, lr: float, momentum: float) -> Any:
    from sparse_scan.optim import SGD, Adam  # noqa: PLC0415 - not at import: --help comes first

    return SGD(model, lr=lr, momentum=momentum) if name == "sgd" else Adam(model, lr=lr)


def _plot(records: list[dict[str, Any]], path: pathlib.Path, schedule: str) -> None:
    """Loss per iteration: the scan's curves thick and solid, BP's thin, dashed and marked on top, so
    that both stay visible where they coincide (they should)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.8))
    iterations = [r["iteration"] for r in records]
    for split, colour in (("train", "tab:blue"), ("test", "tab:orange")):
        axes.plot(iterations, [r[f"{split}_loss"] for r in records], "-", color=colour, linewidth=3,
                  alpha=0.55, label=f"BPPSA ({schedule}) {split}")
    if "bp_train_loss" in records[0]:
        every = max(1, len(records) // 25)
        for split, colour in (("train", "navy"), ("test", "darkred")):
            axes.plot(iterations, [r[f"bp_{split}_loss"] for r in records], "--", color=colour,
                      linewidth=1, marker="x", markevery=every, markersize=5, label=f"BP {split}")
    axes.set(xlabel="iteration", ylabel="cross-entropy loss", title="Training loss per iteration")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _epoch_line(summary: dict[str, Any], epochs: int) -> str:
    line = (f"epoch {summary['epoch'] + 1:>{len(str(epochs))}}/{epochs}  "
            f"train loss {summary['train_loss']:.4f} acc {100 * summary['train_accuracy']:5.1f} %  "
            f"test loss {summary['test_loss']:.4f} acc {100 * summary['test_accuracy']:5.1f} %  "
            f"{summary['elapsed_s']:7.1f} s")
    if "bp_test_loss" in summary:
        line += (f"  | BP test loss {summary['bp_test_loss']:.4f} "
                 f"acc {100 * summary['bp_test_accuracy']:5.1f} %")
    return line


class _Log:
    """The CSV log, opened once the run is sure to start, a row appended and flushed per iteration."""

    def __init__(self, path: pathlib.Path | None, fields: list[str]) -> None:
        self.path, self.stream, self.writer = path, None, None
        if path is not None:
            try:
                self.stream = path.open("w", newline="")
                self.writer = csv.DictWriter(self.stream, fieldnames=fields)
                self.writer.writeheader()
            except OSError as error:
                fail(f"--log {path}: cannot write: {error.strerror or error}")

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.writerow(record)
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


@click.command(name="train")
@model_argument
@data_option
@file_option("--weights", "weights_path",
             help="start from these weights (.npz by state_dict name, e.g. an earlier --out)")
@method_option
@levels_option
@max_step_flops_option
@click.option("--epochs", type=click.IntRange(min=1), default=10, show_default=True)
@batch_size_option(default=64)
@click.option("--optimizer", "optimizer_name", type=click.Choice(["adam", "sgd"]), default="adam",
              show_default=True)
@click.option("--lr", type=FiniteFloat(0), default=DEFAULT_LR, show_default=True,
              help="learning rate (SGD usually wants 0.01-0.1)")
@click.option("--momentum", type=FiniteFloat(0, inclusive=True), default=0.0, show_default=True,
              help="SGD only")
@seed_option(help="shuffling of the batches")
@device_option(default="cpu")
@threads_option
@click.option("--compare-bp", is_flag=True, help="train a copy with back-propagation on the same batches")
@output_option("--out", help="write the trained weights (.npz, state_dict names) after every epoch")
@output_option("--log", "log_path",
               help="write the losses and accuracies per iteration (CSV, appended as it goes)")
@output_option("--plot", help="plot the losses per iteration (PNG, needs matplotlib)")
@force_option(help="overwrite existing --out/--log/--plot files")
@json_option(help="print a JSON summary only (epoch lines on stderr)")
@quiet_option(help="no schedule, epoch or progress lines, only the summary")
def train_command(model: pathlib.Path, data: str, weights_path: pathlib.Path | None, method: str,
                  levels: str | None, max_step_flops: float, epochs: int, batch_size: int,
                  optimizer_name: str, lr: float, momentum: float, seed: int, device: str,
                  compare_bp: bool, out: pathlib.Path | None,
                  log_path: pathlib.Path | None, plot: pathlib.Path | None, force: bool, as_json: bool,
                  quiet: bool) -> None:
    """Train MODEL with BPPSA gradients on a dataset: a line per epoch (loss, accuracy, time), the
    test accuracy at the end."""
    import sparse_scan.train as training  # noqa: PLC0415 - not at import: --help and --threads first
    from sparse_scan import load_model  # noqa: PLC0415
    from sparse_scan.weights import write_npz_atomically  # noqa: PLC0415

    check_outputs(force, out=out, log=log_path, plot=plot)
    if optimizer_name == "adam" and momentum:
        fail("--momentum applies to --optimizer sgd only")
    levels_value = parse_levels(levels)
    be = backend_or_fail(device)
    with Progress(quiet) as progress:
        progress.show(f"loading {model}")
        with model_errors(model):
            network = load_model(model)
            check_batch(network, batch_size, "float32", f"--batch-size {batch_size}")
            baseline = load_model(model) if compare_bp else None
            for net in (network, baseline):
                if net is not None and weights_path is not None:
                    load_weights(net, weights_path)
            progress.show(f"loading --data {data}")
            dataset = load_dataset_for(network, model, data, "training")
            progress.show("planning")
            plan = network.plan(network.input_shape, method, levels_value, batch=batch_size, device=be.name,
                                max_step_flops=int(max_step_flops), progress=plan_status(progress))
            explained = plan.explain(batch_size, 4, be.name)
        schedule = schedule_label(plan.method, plan.levels)
        lines: IO[str] | None = None if quiet else (sys.stderr if as_json else sys.stdout)
        per_epoch = -(-len(dataset.x_train) // batch_size)

        def say(text: str) -> None:
            if lines is not None:
                progress.echo(text, lines)

        say(f"{model}: {len(dataset.x_train)} training and {len(dataset.x_test)} test samples ({data}), "
            f"{plural(epochs, 'epoch')} of {plural(per_epoch, 'batch', 'batches')} of {batch_size}, "
            f"{optimizer_name} lr={lr:g}")
        for line in schedule_lines(explained):
            say(line)
        optimizer = _optimizer(optimizer_name, network, lr, momentum)
        pair = None if baseline is None else (baseline, _optimizer(optimizer_name, baseline, lr, momentum))
        figures = ("train_loss", "train_accuracy", "test_loss", "test_accuracy")
        fields = list(training.RECORD_KEYS) + ([f"bp_{k}" for k in figures] if compare_bp else [])
        log = _Log(log_path, fields)
        records: list[dict[str, Any]] = []
        summaries: list[dict[str, Any]] = []

        def save_weights() -> None:
            write_or_fail("--out", out, lambda: write_npz_atomically(out, network.state_dict()))

        def on_iteration(record: dict[str, Any]) -> None:
            log.write(record)
            records.append(record)
            batch = record["iteration"] % per_epoch + 1
            if batch == per_epoch:  # the epoch's last batch
                summaries.append(training.epoch_summary(records[-per_epoch:]))
                say(_epoch_line(summaries[-1], epochs))
                if out is not None:
                    save_weights()  # a checkpoint per epoch
            show_batches(record["iteration"] + 1)

        def show_batches(iterations: int) -> None:
            if iterations < epochs * per_epoch:
                progress.show(f"epoch {iterations // per_epoch + 1}/{epochs}: "
                              f"{iterations % per_epoch}/{per_epoch} batches done")

        def keep(weights: str) -> str:
            """Training stopped early: ``--out`` (the ``weights`` the model holds) and ``--plot`` (the
            iterations done) written; says what was kept where."""
            progress.wipe()
            if out is not None:
                save_weights()
            if plot is not None and records:
                write_or_fail("--plot", plot, lambda: _plot(records, plot, schedule))
            saved = [f"{weights} in {out}" if out else "weights not saved (no --out)"]
            saved += [f"log in {log_path}"] if log_path is not None else []
            saved += [f"plot of {plural(len(records), 'iteration')} in {plot}"] if plot and records else []
            return ", ".join(saved)

        show_batches(0)
        try:
            training.train(network, dataset, optimizer, epochs, batch_size, plan.method, plan.levels, seed,
                           pair, device, on_iteration)
        except KeyboardInterrupt:
            click.echo(f"sparse-scan: interrupted; {keep('weights so far')}", err=True)
            sys.exit(INTERRUPTED)
        except training.DivergenceError as diverged:  # the model holds its last finite weights
            epoch, batch = divmod(diverged.iteration, per_epoch)
            whose = "the --compare-bp copy's " if diverged.copy else ""
            fail(f"{model}: training diverged at iteration {diverged.iteration} (epoch {epoch + 1}, batch "
                 f"{batch + 1}/{per_epoch}): {whose}{diverged.what}; {keep('the last finite weights')} "
                 "(lower --lr?)")
        finally:
            log.close()
        if plot is not None:
            progress.show(f"drawing {plot}")
            write_or_fail("--plot", plot, lambda: _plot(records, plot, schedule))
    final = summaries[-1]
    report: dict[str, Any] = {
        "model": str(model), "data": data, "schedule": explained,
        "optimizer": optimizer_name, "lr": lr, "epochs": epochs, "batch_size": batch_size,
        "iterations": len(records), "seconds": final["elapsed_s"], "final": final, "per_epoch": summaries}
    if compare_bp:
        report["max_loss_difference_vs_bp"] = max(
            max(abs(r["train_loss"] - r["bp_train_loss"]), abs(r["test_loss"] - r["bp_test_loss"]))
            for r in records)
    for option, path in (("out", out), ("log", log_path), ("plot", plot)):
        if path is not None:
            report[option] = str(path)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{model}: test accuracy {100 * final['test_accuracy']:.1f} % (loss {final['test_loss']:.4f}) "
               f"after {plural(epochs, 'epoch')}, {plural(len(records), 'iteration')} in "
               f"{final['elapsed_s']:.1f} s; {schedule}, {optimizer_name} lr={lr:g}")
    if compare_bp:
        click.echo(f"  BP (linear scan) on the same batches: test accuracy "
                   f"{100 * final['bp_test_accuracy']:.1f} %, max loss difference "
                   f"{report['max_loss_difference_vs_bp']:.3g}")
