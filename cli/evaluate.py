"""``sparse-scan eval MODEL.yaml --data NAME_OR_PATH``: loss and accuracy of a model's weights on data.

Loads the spec, the weights (``--weights``, e.g. ``train --out``; else the spec's own) and the data,
calls :func:`sparse_scan.train.evaluate` on the training and the test split and prints both (or JSON).
Errors: one line, exit code 2.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import click

from ._common import backend_or_fail, check_batch, load_dataset_for, load_weights, model_errors
from ._options import (
    batch_size_option,
    data_option,
    device_option,
    file_option,
    json_option,
    model_argument,
    quiet_option,
    threads_option,
)
from ._progress import Progress


@click.command(name="eval")
@model_argument
@data_option
@file_option("--weights", "weights_path",
             help="the weights to evaluate (.npz by state_dict name, e.g. train --out)")
@batch_size_option(default=128, help="samples per forward pass (sparse_scan.train.evaluate's default)")
@device_option(default="cpu")
@threads_option
@json_option()
@quiet_option(help="no progress on stderr")
def eval_command(model: pathlib.Path, data: str, weights_path: pathlib.Path | None, batch_size: int,
                 device: str, as_json: bool, quiet: bool) -> None:
    """Loss (mean softmax cross-entropy) and accuracy of MODEL on the training and test split."""
    from sparse_scan import load_model  # noqa: PLC0415 - not at import: --help and --threads come first
    from sparse_scan.train import evaluate  # noqa: PLC0415

    backend_or_fail(device)
    with Progress(quiet) as progress, model_errors(model):
        progress.show(f"loading {model}")
        network = load_model(model)
        check_batch(network, batch_size, "float32", f"--batch-size {batch_size}")
        if weights_path is not None:
            load_weights(network, weights_path)
        progress.show(f"loading --data {data}")
        dataset = load_dataset_for(network, model, data, "eval")
        report: dict[str, Any] = {"model": str(model), "data": data,
                                  "weights": None if weights_path is None else str(weights_path)}
        for split in ("train", "test"):
            x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
            progress.show(f"evaluating the {split} split ({len(x)} samples)")
            report[split] = evaluate(network, x, y, batch_size, device)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    source = "its spec's weights" if weights_path is None else str(weights_path)
    click.echo(f"{model} with {source} on {data}:")
    for split in ("train", "test"):
        figures = report[split]
        click.echo(f"  {split:5} loss {figures['loss']:.4f}  accuracy {100 * figures['accuracy']:5.1f} %  "
                   f"({figures['samples']} samples)")
