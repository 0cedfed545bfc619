"""``sparse-scan run MODEL.yaml``: the backward pass of a model on data, by a scan.

Parses the options, loads the spec and the arrays, runs the model's plan, forward and backward
(any :class:`sparse_scan.model.Model`: a sequential or a recurrent spec alike) and writes the
gradients (``.npz``, atomically, never over an existing file without ``--force``) and a timing
breakdown (the phases the model times). Every problem is one line on stderr with exit code 2, and then
nothing is written.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import click

from . import _distributed
from ._common import (
    CHECKS,
    backend_or_fail,
    check_line,
    check_outputs,
    fail,
    load_npy,
    load_weights,
    model_errors,
    model_inputs,
    output_option,
    parse_levels,
    schedule_label,
    schedule_lines,
    write_gradients,
    write_or_fail,
)
from ._options import (
    FiniteFloat,
    device_option,
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
    threads_option,
)
from ._progress import Progress, plan_status

COMBINES = ("chain", "exscan", "relay")
"""``--combine`` choices: :data:`sparse_scan.distributed.COMBINES` (repeated here, where NumPy is not
imported yet; a test keeps them equal)."""
TRANSPORTS = ("auto", "cuda-aware", "nccl", "staging")
"""``--transport`` choices: :data:`sparse_scan.distributed.TRANSPORTS` (repeated likewise)."""


TIMING_LABELS = {"forward_s": "forward", "plan_s": "plan", "values_s": "JT values", "scan_s": "scan",
                 "parameter_grads_s": "parameter grads", "backward_s": "backward (all grads)"}
"""The timing breakdown's lines, in order, for the phases the model times (a recurrent model's backward
is one figure, its parameter gradients come out of its scans)."""


def _upstream(output: Any, grad_path: pathlib.Path | None,
              labels_path: pathlib.Path | None) -> tuple[Any, float | None]:
    """The gradient w.r.t. the output, and the loss when labels give one."""
    import numpy as np  # noqa: PLC0415

    from sparse_scan.loss import softmax_cross_entropy  # noqa: PLC0415

    if grad_path is not None:
        grad = load_npy(grad_path, "--grad")
        if grad.shape != output.shape:
            fail(f"--grad {grad_path}: shape {list(grad.shape)}, the output has {list(output.shape)}")
        with np.errstate(over="ignore"):
            cast = grad.astype(output.dtype) if grad.dtype.kind == "f" else grad
        if grad.dtype.kind != "f" or not np.all(np.isfinite(grad)) or not np.all(np.isfinite(cast)):
            fail(f"--grad {grad_path}: must hold finite floats ({output.dtype.name})")
        return cast, None
    if labels_path is None:
        return np.ones_like(output), None  # L = sum of the outputs
    labels = load_npy(labels_path, "--labels")
    if output.ndim != 2:
        fail(f"--labels {labels_path}: needs a model with flat (N, classes) output, got {list(output.shape)}")
    if labels.shape != (output.shape[0],) or labels.dtype.kind not in "iu":
        fail(f"--labels {labels_path}: expected {output.shape[0]} integer labels, got shape "
             f"{list(labels.shape)} of {labels.dtype}")
    if labels.min() < 0 or labels.max() >= output.shape[1]:
        fail(f"--labels {labels_path}: labels must lie in 0..{output.shape[1] - 1}")
    loss, grad = softmax_cross_entropy(output, labels)  # mean over the batch, like PyTorch
    return grad, loss


@click.command(name="run")
@model_argument
@file_option("--weights", "weights_path",
             help="use these weights (.npz by state_dict name, e.g. train --out) instead of the spec's")
@file_option("--input", "input_path",
             help="inputs (N, *input_shape) as .npy (a recurrent model's: (N, time steps, features))")
@click.option("--random", type=click.IntRange(min=1), help="N seeded random inputs instead of --input")
@seed_option(help="seed of --random")
@file_option("--grad", "grad_path",
             help="gradient w.r.t. the output as .npy (default: ones, i.e. L = sum of outputs)")
@file_option("--labels", "labels_path",
             help="integer class labels as .npy: softmax cross-entropy (mean over the batch)")
@method_option
@levels_option
@max_step_flops_option
@device_option(default="auto")
@dtype_option
@threads_option
@click.option("--check", is_flag=True,
              help="compare with a different computation: the linear scan (back-propagation), or where "
              "the linear scan ran, back-propagation layer by layer through SciPy (a recurrent model: "
              "the blelloch scan)")
@output_option("--out", help="write the gradients (.npz)")
@force_option(help="overwrite an existing --out file")
@json_option()
@quiet_option(help="no progress on stderr")
@click.option("--distributed", is_flag=True,
              help="split the layers over MPI ranks: mpirun -n P sparse-scan run ... --distributed")
@click.option("--split", help="--distributed: layers per rank, e.g. 3,4,5 (default: balanced by FLOPs)")
@click.option("--combine", type=click.Choice(COMBINES), default="chain", show_default=True,
              help="--distributed: how slices combine across ranks")
@click.option("--timeout", type=FiniteFloat(0), default=300.0, show_default=True,
              help="--distributed: seconds to wait for another rank before giving up")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto", show_default=True,
              help="--distributed --device gpu: how device arrays move between ranks (auto: the first "
              "available of cuda-aware MPI, NCCL, host staging)")
@click.option("--gpu-device", type=click.IntRange(0), default=None,
              help="--distributed --device gpu: this rank's GPU (default: local rank % visible GPUs)")
def run(model: pathlib.Path, weights_path: pathlib.Path | None, input_path: pathlib.Path | None,
        random: int | None, seed: int,
        grad_path: pathlib.Path | None, labels_path: pathlib.Path | None, method: str,
        levels: str | None, max_step_flops: float, device: str, dtype: str, check: bool,
        out: pathlib.Path | None, force: bool, as_json: bool, quiet: bool, distributed: bool,
        split: str | None, combine: str, timeout: float, transport: str, gpu_device: int | None) -> None:
    """Gradients of MODEL's loss w.r.t. its input, every layer output and every parameter.

    With --distributed, under `mpirun -n P`, each rank holds a slice of the layers (on a GPU with
    --device gpu); the outputs are those of one process, printed and written by rank 0.
    """
    import numpy as np  # noqa: PLC0415 - not at import: --help and --threads come first

    from sparse_scan import load_model  # noqa: PLC0415

    comm = _distributed.world() if distributed else None
    if comm is None and (split is not None or combine != "chain" or transport != "auto"
                         or gpu_device is not None):
        fail("--split, --combine, --transport and --gpu-device apply to --distributed only")
    if (input_path is None) == (random is None):
        fail("give exactly one of --input X.npy and --random N")
    if grad_path is not None and labels_path is not None:
        fail("give at most one of --grad and --labels")
    check_outputs(force, out=out)
    levels_value = parse_levels(levels)
    split_counts = _distributed.parse_split(split)
    be = backend_or_fail(device)
    if comm is not None and be.name == "cpu" and (transport != "auto" or gpu_device is not None):
        fail("--transport and --gpu-device apply to GPU ranks only (--device gpu)")
    with Progress(quiet or comm is not None) as progress:
        progress.show(f"loading {model}")
        with model_errors(model):
            network = load_model(model, dtype=dtype)
        if weights_path is not None:
            load_weights(network, weights_path)
        try:
            x = model_inputs(network, input_path, random, seed, np.dtype(dtype))
        except MemoryError as error:
            fail(f"--random {random}: out of memory for these inputs: {error}")
        if comm is not None:
            _distributed.run_distributed(comm, model, network, x,
                                         lambda output: _upstream(output, grad_path, labels_path), method,
                                         levels_value, dtype, split_counts, combine, timeout, check, out,
                                         as_json, _distributed.GPURanks(be.name, transport, gpu_device))
            return
        report, grads, parameters = _backward(model, network, be, x, grad_path, labels_path, method,
                                              levels_value, max_step_flops, dtype, check, progress)
        if out is not None:
            progress.show(f"writing {out}")
            write_or_fail("--out", out,
                          lambda: write_gradients(out, network.layers, grads, parameters, be.to_host))
            report["out"] = str(out)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{model}: {schedule_label(report['method'], report['levels'])} on {be.name} "
               f"({report['threads']} CPU threads), batch {report['batch']}, {dtype}")
    for line in schedule_lines(report["schedule"]):
        click.echo(line)
    for name, label in TIMING_LABELS.items():
        if name in report["timings"]:
            if name == "plan_s" and "plan_cache_hit" in report:
                label += f" ({'cache hit' if report['plan_cache_hit'] else 'built'})"
            click.echo(f"  {label:22} {report['timings'][name] * 1e3:10.2f} ms")
    if "loss" in report:
        click.echo(f"  loss {report['loss']:.6g}")
    if "check" in report:
        click.echo(check_line(report["check"]))
    if out is not None:
        click.echo(f"  gradients written to {out}")


def _max_relative_error(be: Any, pairs: Any) -> float:
    """The largest ``max|g - r| / max|r|`` over pairs of gradients (on the host)."""
    worst = 0.0
    for g, r in pairs:
        g, r = be.to_host(g), be.to_host(r)
        worst = max(worst, float(abs(g - r).max()) / max(float(abs(r).max()), 1e-30))
    return worst


def _forward(model: pathlib.Path, network: Any, be: Any, x: Any, dtype: str, grad_path: pathlib.Path | None,
             labels_path: pathlib.Path | None, timings: dict[str, float]) -> tuple[Any, float | None]:
    """The timed forward (``timings["forward_s"]``), a non-finite output refused by layer, and the
    upstream gradient with its loss (:func:`_upstream`)."""
    import numpy as np  # noqa: PLC0415 - not at import: --help and --threads come first

    start = time.perf_counter()
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below, by layer
        output = network.forward(be.asarray(x))
    be.synchronize()
    timings["forward_s"] = time.perf_counter() - start
    overflowing = network.non_finite_output()
    if overflowing is not None:
        fail(f"{model}: layer {overflowing!r}: its output holds NaN or Inf on this input (a {dtype} "
             "overflow? try --dtype float64)")
    return _upstream(be.to_host(output), grad_path, labels_path)


def _backward(model: pathlib.Path, network: Any, be: Any, x: Any, grad_path: pathlib.Path | None,
              labels_path: pathlib.Path | None, method: str, levels: int | str | None,
              max_step_flops: float, dtype: str, check: bool,
              progress: Progress) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """Plan, forward, backward and parameter gradients of the model: the report, the gradients w.r.t.
    every activation and the parameters'. ``check`` compares every gradient with those of the
    computation the model names for it (:meth:`sparse_scan.model.Model.check_reference`: another
    schedule, or back-propagation layer by layer outside the engine)."""
    import numpy as np  # noqa: PLC0415 - not at import: --help and --threads come first

    from sparse_scan import cpu_threads  # noqa: PLC0415

    timings: dict[str, float] = {}
    batch = int(x.shape[0])
    with model_errors(model):
        builds = network.plan_builds  # planned first: a schedule refused costs no forward pass
        progress.show("planning")
        start = time.perf_counter()
        plan = network.plan(network.input_shape, method, levels, batch=batch, device=be.name,
                            max_step_flops=int(max_step_flops), progress=plan_status(progress))
        planned = time.perf_counter() - start
        progress.show("forward")
        grad, loss = _forward(model, network, be, x, dtype, grad_path, labels_path, timings)
        progress.show(f"backward ({schedule_label(plan.method, plan.levels)})")
        grads = network.backward(be.asarray(grad), plan.method, plan.levels, timings=timings)
        timings["plan_s"] = planned  # the build above; backward's own lookup was a cache hit
        progress.show("parameter gradients")
        parameters = network.parameter_gradients(grads, timings=timings)
        if check:
            against = network.check_reference(plan.method)
            progress.show(f"check: {CHECKS[against][1]}")
            reference = network.check_backward(be.asarray(grad), plan.method)
            reference_parameters = network.parameter_gradients(reference)
            pairs = list(zip(grads, reference, strict=True)) + [
                (value, reference_parameters[key]) for key, value in parameters.items()]
    report: dict[str, Any] = {"model": str(model), "method": plan.method, "levels": plan.levels,
                              "device": be.name, "threads": cpu_threads(), "dtype": dtype, "batch": batch,
                              "plan_cache_hit": network.plan_builds == builds, "timings": timings,
                              "schedule": plan.explain(batch, np.dtype(dtype).itemsize, be.name)}
    if loss is not None:
        report["loss"] = loss
    if check:
        report["check"] = {"computed": schedule_label(plan.method, plan.levels), "reference": against,
                           "max_rel_error": _max_relative_error(be, pairs)}
    return report, grads, parameters
