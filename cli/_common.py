"""Helpers shared by the ``sparse-scan`` subcommands: one-line errors, input and output checks, loading
and writing files, and the text that states a scan's schedule (the options are in :mod:`._options`).

Importing this module costs only click: the library (NumPy, SciPy) is imported inside the helpers that
need it, so that ``sparse-scan --help`` starts at once and ``--threads`` takes effect before NumPy
loads its BLAS.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from typing import IO, Any, Callable, Iterator, NoReturn, Sequence

import click

from sparse_scan.engine.figures import size_text

from ._progress import end_line

__all__ = ["CHECKS", "INTERRUPTED", "OUTPUT", "OutputPath", "backend_or_fail", "check_batch", "check_line",
           "check_output", "check_outputs", "echo_error", "fail", "load_dataset_for", "load_npy",
           "load_weights", "model_errors", "model_inputs", "output_option", "parse_levels", "plural",
           "pyplot", "schedule_label", "schedule_lines", "seconds_text", "size_text", "write_gradients",
           "write_or_fail"]

INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, as shells report it)."""

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""File types ``--plot`` writes (matplotlib would append ``.png`` to a name without a suffix, past the
check for an existing file, and fail after the work on one it does not know)."""

OUTPUT_SUFFIXES = {"plot": PLOT_SUFFIXES, "out": (".npz",)}
"""Suffixes an output option's file name must end in (``--out`` writes an ``.npz`` archive: under
another name a user would not know what it holds)."""


def echo_error(message: str, file: IO[str] | None = None) -> None:
    """Print ``sparse-scan: error: message`` on ``file`` (default: stderr), on a line of its own (a
    progress line on the terminal is wiped first: :func:`._progress.end_line`)."""
    end_line()
    click.echo(f"sparse-scan: error: {message}", file=file, err=file is None)


def fail(message: str) -> NoReturn:
    """Print ``sparse-scan: error: message`` on stderr and exit with status 2."""
    echo_error(message)
    sys.exit(2)


def parse_levels(levels: str | None) -> int | str | None:
    """``--levels``: None, ``"auto"`` or a non-negative int (else a one-line error)."""
    if levels is None or levels == "auto":
        return levels
    try:
        value = int(levels)
    except ValueError:
        value = -1
    if value < 0:
        fail(f"--levels must be a non-negative int or 'auto', got {levels!r}")
    return value


class OutputPath(click.Path):
    """The type of an option naming a file a command writes: a :class:`pathlib.Path`, not a directory,
    and not a name ending in a separator (``d.npz/`` names a folder; :class:`pathlib.Path` would drop the
    slash and a file ``d.npz`` be written)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.endswith(("/", os.sep)):
            self.fail(f"{value!r} ends in {value[-1]!r}, a folder's name: give a file name", param, ctx)
        return super().convert(value, param, ctx)


OUTPUT = OutputPath(dir_okay=False, path_type=pathlib.Path)
"""The type of every output option (``--out``, ``--log``, ``--plot``, ``calibrate --output``)."""


def output_option(*names: str, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option naming a file the command writes (:data:`OUTPUT`): ``names`` as for ``click.option``
    (the flag, then the parameter's name where it differs)."""
    return click.option(*names, type=OUTPUT, help=help)


def _blocking_ancestor(path: pathlib.Path) -> pathlib.Path | None:
    """The nearest ancestor of ``path`` that exists, where it is no folder (a regular file): what
    keeps ``path`` from being written; None where that ancestor is a folder."""
    ancestor = next(parent for parent in path.parents if os.path.lexists(parent))
    return None if ancestor.is_dir() else ancestor


def check_output(option: str, path: pathlib.Path, force: bool, make_folders: bool = False,
                 what: str = "there") -> None:
    """Refuse, before any work, an output ``path`` that cannot be written where
    :func:`sparse_scan.weights.write_npz_atomically` writes (through a symlink: to the file it leads to),
    one line naming the option and the cause (``cannot write <what>: ...``): a symlink loop, a name too
    long, a missing folder (unless ``make_folders``: the command makes it), a regular file where a folder
    should be, a read-only or full file system, no permission (a file is created and removed beside it,
    after removing the temporaries killed writers left); and, without ``force``, an existing file (a
    symlink too, even one leading nowhere)."""
    from sparse_scan.weights import check_writable, write_target  # noqa: PLC0415 - imports NumPy

    try:
        target = write_target(path)
        exists = os.path.lexists(path)
    except (OSError, ValueError) as error:  # a symlink loop, a name too long
        fail(f"{option} {path}: cannot write {what}: {getattr(error, 'strerror', None) or error}")
    if exists and not force:
        through = "" if target == path else " through the symlink"
        fail(f"{option} {path}: exists (use --force to overwrite{through})")
    if not target.parent.is_dir():
        blocker = _blocking_ancestor(target)
        if blocker is not None:
            kind = "a regular file" if blocker.is_file() else "no folder"
            fail(f"{option} {path}: cannot write {what}: {blocker} is {kind}, not a folder")
        if not make_folders:
            fail(f"{option} {path}: no such directory {target.parent}")
        return  # the command makes the folders: nothing to try before
    try:
        check_writable(target)
    except OSError as error:
        fail(f"{option} {path}: cannot write {what}: {error.strerror or error}")


def check_outputs(force: bool, **paths: pathlib.Path | None) -> None:
    """Refuse, before any work, output paths that :func:`check_output` refuses, name one file twice or
    do not end in their option's suffix (:data:`OUTPUT_SUFFIXES`); ``plot`` also needs matplotlib
    (:func:`pyplot`). Keys are option names (``out``, ``log``, ``plot``)."""
    from sparse_scan.weights import write_target  # noqa: PLC0415 - imports NumPy

    seen: dict[pathlib.Path, str] = {}
    for key, path in paths.items():
        if path is None:
            continue
        option = f"--{key}"
        suffixes = OUTPUT_SUFFIXES.get(key)
        if suffixes is not None and path.suffix.lower() not in suffixes:
            fail(f"{option} {path}: give a file name ending in {', '.join(suffixes)}")
        check_output(option, path, force)
        resolved = write_target(path).resolve()
        if resolved in seen:
            fail(f"{option} {path}: the same file as {seen[resolved]}")
        seen[resolved] = option
        if key == "plot":
            pyplot()


NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


def load_npy(path: pathlib.Path, option: str) -> Any:
    """One array from a ``.npy`` file, mapped, not read (its shape and dtype are checked before its
    values are), or a one-line error naming the option and the file: missing, a symlink loop, no regular
    file (a named pipe, which would block), unreadable, an ``.npz`` archive, not NumPy's format (a text
    file), or Python objects."""
    import numpy as np  # noqa: PLC0415 - imports NumPy

    from sparse_scan.weights import open_regular_file  # noqa: PLC0415

    try:
        with open_regular_file(path) as stream:
            magic = stream.read(len(NPY_MAGIC))
    except FileNotFoundError:
        fail(f"{option} {path}: no such file")
    except ValueError as error:  # a symlink loop, a named pipe
        fail(f"{option} {path}: {error}")
    except OSError as error:
        fail(f"{option} {path}: cannot read: {error.strerror or error}")
    if magic.startswith(ZIP_MAGICS):
        fail(f"{option} {path}: an .npz archive; give one array as .npy (numpy.save)")
    if magic != NPY_MAGIC:
        what = "empty" if not magic else "no NumPy header: a text file?"
        fail(f"{option} {path}: not a .npy file ({what}); write arrays with numpy.save")
    try:
        return np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
    except ValueError as error:
        if "Python objects" in str(error):  # "Array can't be memory-mapped: Python objects in dtype."
            fail(f"{option} {path}: holds Python objects, not numbers")
        fail(f"{option} {path}: not a readable .npy file: {error}")
    except (OSError, EOFError) as error:
        fail(f"{option} {path}: not a readable .npy file: {error}")


def check_batch(network: Any, samples: int, dtype: Any, what: str) -> None:
    """Refuse, before it is allocated, a batch of ``samples`` through ``network`` (its parameters and
    :func:`sparse_scan.spec.sample_bytes` per sample, of ``dtype``) over the memory budget: one line
    naming ``what`` (``--random N``, ``--input X.npy``, ``--batch-size N``), the size and
    ``SPARSE_SCAN_MEMORY_BUDGET``."""
    import numpy as np  # noqa: PLC0415 - imports NumPy

    from sparse_scan import default_memory_budget  # noqa: PLC0415
    from sparse_scan.spec import sample_bytes  # noqa: PLC0415
    from sparse_scan.weights import budget_problem  # noqa: PLC0415

    per_sample = sample_bytes(network.shapes(network.input_shape), np.dtype(dtype).itemsize)
    parameters = sum(np.asarray(value).nbytes for value in network.state_dict().values())
    problem = budget_problem(parameters + samples * per_sample,
                             f"a batch of {plural(samples, 'sample')} ({size_text(per_sample)} each, the "
                             "inputs, activations and gradients) with the model's parameters",
                             default_memory_budget())
    if problem is not None:
        fail(f"{what}: {problem}")


def model_inputs(network: Any, input_path: pathlib.Path | None, random: int | None, seed: int,
                 dtype: Any) -> Any:
    """The batch of ``--input X.npy`` (checked: its shape, numbers, at least one sample, floats of
    ``dtype`` exactly: :func:`sparse_scan.weights.as_float_array`) or ``--random N`` (``N`` seeded
    standard normal samples), refused before it is allocated where it would not fit the memory budget
    (:func:`check_batch`); every problem is one line."""
    import numpy as np  # noqa: PLC0415 - imports NumPy

    from sparse_scan.weights import as_float_array  # noqa: PLC0415

    shape = tuple(network.input_shape)
    if input_path is None:
        check_batch(network, random, dtype, f"--random {random}")
        return np.random.default_rng(seed).standard_normal((random,) + shape).astype(dtype)
    x = load_npy(input_path, "--input")
    if tuple(x.shape[1:]) != shape:
        fail(f"--input {input_path}: shape {list(x.shape)}, the model takes "
             f"(N, {', '.join(map(str, shape))})")
    if not len(x):
        fail(f"--input {input_path}: holds no samples")
    check_batch(network, len(x), dtype, f"--input {input_path}")
    try:
        return as_float_array(x, dtype, f"--input {input_path}")
    except ValueError as error:
        fail(str(error))


def load_weights(network: Any, path: pathlib.Path) -> None:
    """``--weights``: copy a ``.npz`` of parameters (state_dict names, e.g. ``train --out``) into
    ``network``; every problem is one line naming the option and the file."""
    from sparse_scan import default_memory_budget  # noqa: PLC0415 - imports NumPy
    from sparse_scan.weights import read_npz  # noqa: PLC0415

    try:
        state = read_npz(path, default_memory_budget())
    except FileNotFoundError:
        fail(f"--weights {path}: no such file")
    except (OSError, ValueError) as error:
        fail(f"--weights {path}: not a readable .npz: {error}")
    try:
        network.load_state_dict(state)
    except ValueError as error:
        fail(f"--weights {path}: {error}")


BITSTREAM = "bitstream"
BITSTREAM_SAMPLES = (2048, 512)
"""``--data bitstream[:TRAIN[:TEST]]``: the paper's synthetic task, TRAIN and TEST sequences by default."""


def _bitstream(data: str, input_shape: tuple[int, ...], classes: int) -> Any:
    """The dataset of ``--data bitstream[:TRAIN[:TEST]]`` for a model of ``input_shape`` ``(T, 1)``
    and ``classes`` outputs (at most 10), sequences of ``T`` steps; a one-line error otherwise."""
    from sparse_scan.recurrent import Bitstream  # noqa: PLC0415 - imports NumPy

    parts = data.split(":")[1:]
    if len(parts) > 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        fail(f"--data {data}: expected bitstream, bitstream:TRAIN or bitstream:TRAIN:TEST with positive "
             "sample counts")
    train, test = [int(part) for part in parts] + list(BITSTREAM_SAMPLES[len(parts):])
    if len(input_shape) != 2 or input_shape[1] != 1:
        fail(f"--data {data}: bitstream sequences are (time steps, 1), the model takes "
             f"{list(input_shape)}")
    if classes > 10:
        fail(f"--data {data}: the bitstream task has 10 classes, the model {classes} outputs")
    return Bitstream(input_shape[0], samples=train + test, classes=classes).split(test)


def load_dataset_for(network: Any, model: pathlib.Path, data: str, needs: str) -> Any:
    """``--data`` for the classifier ``network`` (from ``model``): the dataset
    (:func:`sparse_scan.train.load_dataset`, or the bitstream task) of its input shape and classes,
    or a one-line error when its output is not flat (``needs`` names what needs it: ``training``,
    ``eval``)."""
    from sparse_scan.train import load_dataset  # noqa: PLC0415 - imports NumPy

    classes = network.shapes(network.input_shape)[-1]
    if len(classes) != 1:
        fail(f"{model}: {needs} needs a flat (classes,) output, the model gives {list(classes)}")
    if data == BITSTREAM or data.startswith(f"{BITSTREAM}:"):
        return _bitstream(data, network.input_shape, classes[0])
    return load_dataset(data, network.input_shape, classes[0])


def write_or_fail(option: str, path: pathlib.Path, write: Callable[[], object]) -> None:
    """Run ``write`` (which writes ``path``); an OS error is one line naming the option and file."""
    try:
        write()
    except OSError as error:
        fail(f"{option} {path}: cannot write: {error.strerror or error}")


def backend_or_fail(device: str) -> Any:
    """The backend (:func:`sparse_scan.backend.get`) of ``--device``; an unusable GPU is one line."""
    from sparse_scan import backend  # noqa: PLC0415 - imports NumPy

    try:
        return backend.get(device)
    except (backend.GPUUnavailableError, ValueError) as error:
        fail(f"--device {device}: {error}")


@contextlib.contextmanager
def model_errors(model: pathlib.Path) -> Iterator[None]:
    """Errors of loading, planning and running MODEL, one line each: a spec or data error names its
    own file, a product over the FLOP limit says what to try, running out of memory says so."""
    from sparse_scan import ScanCostError, ScanMemoryError, SpecError  # noqa: PLC0415 - imports NumPy
    from sparse_scan.train import DataError  # noqa: PLC0415

    try:
        yield
    except (SpecError, DataError) as error:
        fail(str(error))
    except ScanCostError as error:
        # the planning limit's message says how to raise it; the FLOP limit's is this command's option
        limit = "" if "SPARSE_SCAN_MAX_PLAN_SECONDS" in str(error) else "raise --max-step-flops, or "
        fail(f"{model}: {error} ({limit}use --method linear or auto, the default)")
    except (ScanMemoryError, ValueError) as error:
        fail(f"{model}: {error}")
    except MemoryError as error:
        fail(f"{model}: out of memory: {error}")


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (Agg), or a one-line error naming the extra to install."""
    try:
        import matplotlib  # noqa: PLC0415 - optional extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        fail("--plot needs matplotlib: pip install 'sparse-scan[plot]'")
    return plt


def write_gradients(path: Any, layers: Sequence[Any], grads: Sequence[Any], parameters: dict[str, Any],
                    to_host: Callable[[Any], Any] = lambda array: array) -> None:
    """Write ``input.grad``, ``<layer>.out.grad`` and ``<parameter>.grad`` atomically to ``path``."""
    from sparse_scan.weights import write_npz_atomically  # noqa: PLC0415 - imports NumPy

    arrays = {"input.grad": to_host(grads[0])}
    arrays.update({f"{layer.name}.out.grad": to_host(g) for layer, g in zip(layers, grads[1:], strict=True)})
    arrays.update({f"{name}.grad": to_host(g) for name, g in parameters.items()})
    write_npz_atomically(path, arrays)


CHECKS = {"linear": ("linear scan", "back-propagation by the engine's linear scan"),
          "layerwise": ("layer-by-layer back-propagation", "each layer's JT applied by SciPy, no scan"),
          "blelloch": ("blelloch scan", "the engine's blelloch scan"),
          "one process": ("linear scan in one process", "the linear scan in one process")}
"""What ``run --check`` compares the gradients with (the report's ``check["reference"]``), never the
computation that made them: its name, and what it is."""


def check_line(check: dict[str, Any]) -> str:
    """The line of ``run --check``: the error, against what, and what was checked."""
    short, long = CHECKS[check["reference"]]
    return (f"  max relative error vs {short}: {check['max_rel_error']:.3g} ({check['computed']} checked "
            f"against {long})")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 epoch``, ``2 epochs``, ``23 batches``: a count and its noun, in the plural (``nouns``, by
    default the noun and an ``s``) but for one.

    >>> plural(1, "epoch"), plural(2, "MPI rank"), plural(23, "batch", "batches"), plural(0, "iteration")
    ('1 epoch', '2 MPI ranks', '23 batches', '0 iterations')
    """
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def schedule_label(method: str, levels: int | str | None) -> str:
    """A schedule as every command states it: ``linear``, ``blelloch``, ``hybrid N`` (or, where the
    request is stated rather than the plan, ``auto`` or ``hybrid auto``)."""
    return method if levels is None else f"{method} {levels}"


def schedule_lines(schedule: dict[str, Any]) -> list[str]:
    """Text lines of :meth:`sparse_scan.ScanPlan.explain`: the schedule and its figures, then
    every other schedule an automatic choice considered, with why it was set aside."""
    label = schedule_label(schedule["method"], schedule["levels"])
    requested = schedule["requested"]
    why = ("as requested" if "candidates" not in schedule
           else f"chosen by --method {requested}: {schedule['reason']}" if requested == "auto"
           else f"depth chosen by --method hybrid: {schedule['reason']}")
    lines = [f"  schedule: {label} ({why})",
             f"    critical path {schedule['critical_flops']:,} FLOPs in {schedule['critical_steps']} "
             f"steps, work {schedule['work_flops']:,} FLOPs, peak memory {size_text(schedule['peak_bytes'])} "
             f"+ plan {size_text(schedule['plan_bytes'])}, predicted {seconds_text(schedule['predicted_s'])}"]
    fill = schedule["fill_flops"]
    if fill["work"]:
        lines.append(f"    of which JT fills (residual blocks' own products, before the scan): critical path "
                     f"{fill['critical']:,} FLOPs, work {fill['work']:,} FLOPs")
    for candidate in schedule.get("candidates", []):
        if candidate["verdict"] == "chosen":
            continue
        estimated = "~" if candidate["estimated"] else ""
        predicted = candidate.get("predicted_s")
        time = "" if predicted is None else f", predicted {estimated}{seconds_text(predicted)}"
        lines.append(f"    {schedule_label(candidate['method'], candidate['levels']):10} critical path "
                     f"{estimated}{candidate['critical_flops']:.3g} FLOPs{time}: {candidate['verdict']}")
    return lines


def seconds_text(seconds: float) -> str:
    """A duration in ms (s from 10 s), three significant digits.

    Examples
    --------
    >>> seconds_text(0.000123), seconds_text(0.25), seconds_text(42.0)
    ('0.123 ms', '250 ms', '42 s')
    """
    return f"{seconds:.3g} s" if seconds >= 10 else f"{1e3 * seconds:.3g} ms"
