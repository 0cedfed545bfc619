"""``sparse-scan train MODEL.yaml --data NAME_OR_PATH``: train with BPPSA gradients.

Parses the options, loads the spec and the data, runs :func:`sparse_scan.train.train` and writes
what was asked: the weights (``--out``, atomically after every epoch and on Ctrl-C, never over an
existing file without ``--force``), a CSV log and a loss plot. Errors: one line, exit code 2.
"""

from __future__ import annotations

import csv
import pathlib
import sys
from typing import Any

import click

from sparse_scan import load_model
from sparse_scan.optim import SGD, Adam
from sparse_scan.scan import SCHEDULES
from sparse_scan.train import load_dataset, train
from sparse_scan.weights import state_dict, write_npz_atomically

from ._schedule import METHOD_HELP, schedule_label, schedule_lines
from .app import (
    FiniteFloat,
    backend_or_fail,
    check_outputs,
    fail,
    main,
    max_step_flops_option,
    model_errors,
    parse_levels,
    pyplot,
    write_or_fail,
)


def _optimizer(name: str, model: Any, lr: float, momentum: float) -> Any:
    return SGD(model, lr=lr, momentum=momentum) if name == "sgd" else Adam(model, lr=lr)


def _write_log(records: list[dict[str, Any]], path: pathlib.Path) -> None:
    with path.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def _plot(records: list[dict[str, Any]], path: pathlib.Path, method: str) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.8))
    iterations = [r["iteration"] for r in records]
    axes.plot(iterations, [r["train_loss"] for r in records], label=f"BPPSA ({method}) train")
    axes.plot(iterations, [r["test_loss"] for r in records], label=f"BPPSA ({method}) test")
    if "bp_train_loss" in records[0]:
        axes.plot(iterations, [r["bp_train_loss"] for r in records], "--", label="BP train")
        axes.plot(iterations, [r["bp_test_loss"] for r in records], "--", label="BP test")
    axes.set(xlabel="iteration", ylabel="cross-entropy loss", title="Training loss per iteration")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


@main.command(name="train")
@click.argument("model", type=click.Path(dir_okay=False, path_type=pathlib.Path))
@click.option("--data", required=True, help="'digits' (scikit-learn's) or a .npz with x_train, y_train, "
              "x_test, y_test")
@click.option("--method", type=click.Choice(SCHEDULES), default="auto", show_default=True, help=METHOD_HELP)
@click.option("--levels", default=None, help="up-sweep levels of hybrid: an int or 'auto' (the default)")
@max_step_flops_option
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--optimizer", "optimizer_name", type=click.Choice(["sgd", "adam"]), default="sgd",
              show_default=True)
@click.option("--lr", type=FiniteFloat(0), default=0.01, show_default=True)
@click.option("--momentum", type=FiniteFloat(0, inclusive=True), default=0.0, show_default=True,
              help="SGD only")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="shuffling of the batches")
@click.option("--device", type=click.Choice(["cpu", "gpu", "auto"]), default="cpu", show_default=True)
@click.option("--compare-bp", is_flag=True, help="train a copy with back-propagation on the same batches")
@click.option("--out", type=click.Path(dir_okay=False, path_type=pathlib.Path),
              help="write the trained weights (.npz, state_dict names)")
@click.option("--log", "log_path", type=click.Path(dir_okay=False, path_type=pathlib.Path),
              help="write the loss per iteration (CSV)")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=pathlib.Path),
              help="plot the losses per iteration (PNG, needs matplotlib)")
@click.option("--force", is_flag=True, help="overwrite existing --out/--log/--plot files")
@click.option("--quiet", is_flag=True, help="no progress bar")
def train_command(model: pathlib.Path, data: str, method: str, levels: str | None, max_step_flops: float,
                  epochs: int, batch_size: int, optimizer_name: str, lr: float, momentum: float, seed: int,
                  device: str, compare_bp: bool, out: pathlib.Path | None, log_path: pathlib.Path | None,
                  plot: pathlib.Path | None, force: bool, quiet: bool) -> None:
    """Train MODEL with BPPSA gradients on a dataset; report the loss per iteration."""
    check_outputs(force, out=out, log=log_path, plot=plot)
    if optimizer_name == "adam" and momentum:
        fail("--momentum applies to --optimizer sgd only")
    levels_value = parse_levels(levels)
    backend_or_fail(device)
    with model_errors(model):
        network = load_model(model)
        baseline = load_model(model) if compare_bp else None
        classes = network.shapes(network.input_shape)[-1]
        if len(classes) != 1:
            fail(f"{model}: training needs a flat (classes,) output, the model gives {list(classes)}")
        dataset = load_dataset(data, network.input_shape, classes[0])
        plan = network.plan(network.input_shape, method, levels_value, max_step_flops=int(max_step_flops))
    if not quiet:
        for line in schedule_lines(plan.explain(batch_size, 4)):
            click.echo(line)
    optimizer = _optimizer(optimizer_name, network, lr, momentum)
    pair = None if baseline is None else (baseline, _optimizer(optimizer_name, baseline, lr, momentum))
    per_epoch = -(-len(dataset.x_train) // batch_size)
    bar = None
    if not quiet and sys.stderr.isatty():
        bar = click.progressbar(length=epochs * per_epoch, label="training", file=sys.stderr)
        bar.__enter__()

    def save_weights() -> None:
        write_or_fail("--out", out, lambda: write_npz_atomically(out, state_dict(network)))

    def on_iteration(record: dict[str, Any]) -> None:
        if bar is not None:
            bar.update(1)
        if out is not None and (record["iteration"] + 1) % per_epoch == 0:
            save_weights()  # a checkpoint per epoch

    records: list[dict[str, Any]] = []
    interrupted = False
    try:
        records = train(network, dataset, optimizer, epochs, batch_size, plan.method, plan.levels, seed,
                        pair, device, on_iteration)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    if out is not None:
        save_weights()
    if interrupted:
        click.echo(f"interrupted; weights so far {'in ' + str(out) if out else 'not saved (no --out)'}",
                   err=True)
        sys.exit(130)
    if log_path is not None:
        write_or_fail("--log", log_path, lambda: _write_log(records, log_path))
    if plot is not None:
        write_or_fail("--plot", plot, lambda: _plot(records, plot, schedule_label(plan.method, plan.levels)))
    last = records[-1]
    click.echo(f"{model}: {len(records)} iterations, {schedule_label(plan.method, plan.levels)}, "
               f"{optimizer_name} lr={lr}; "
               f"last train loss {last['train_loss']:.6g}, test loss {last['test_loss']:.6g}")
    if "bp_train_loss" in last:
        gap = max(max(abs(r["train_loss"] - r["bp_train_loss"]), abs(r["test_loss"] - r["bp_test_loss"]))
                  for r in records)
        click.echo(f"  BP (linear scan) on the same batches: max loss difference {gap:.3g}")
