"""The cost model: a schedule's predicted time on a backend, for both plan kinds (issue 38).

A backward's predicted time is a sum of *features* of its plan, each a count of something that costs
time, times the backend's seconds per unit of it (:class:`CostModel`):

- per-step fixed costs: ``call`` (one backward), ``layer`` (per layer: binding, values, reshapes),
  ``level`` (a level's synchronisation), ``pool_level`` (a level of several steps handed to the
  thread pool and waited for), ``mv_step`` and ``mm_step`` (an mv's or a product's launch:
  its dispatch, buffers, and the thread pool a level of several steps runs on), ``mm_sample`` (a
  product's cost per sample it runs for, whatever its size), ``mv_call`` (an operator applied
  through a layer's weights: a residual block counts one per inner layer), ``fill_call`` (a JT
  whose values a run fills); the recurrent scans' ``dense_level`` (a level of batched block
  products), ``dense_chain_step`` (a step of a chain's tight loop), ``factored_step`` and
  ``factored_sample`` (a back-propagation step with the blocks left factored, and per sample) and
  ``block_fill`` (filling one scan's blocks);
- work over the backend's throughput for that kind of product, in FLOPs (docs/design.md's counting)
  times the samples it runs for (one for a product of sample-independent JTs): ``mv_spmv``, ``mv_gemm``
  (an mv through a layer's weights: the dense layer's multiply-adds, pruned or not; ``mv_weights``,
  the weights it reads once for the batch; ``mv_taps``, the values a transposed convolution adds into
  place after its GEMM), ``mv_csr`` (an mv by a layer's CSR weights), ``mv_scale``,
  ``mm_scale`` (a scaling by a diagonal), ``mm_gather`` (a max-pool's selection), ``mm_block`` (dense
  channel blocks), ``mm_general`` (stored multiply-adds, ``rowwise`` included), ``fill`` (JT entries
  whose values a run fills; and ``fill_flops``, a residual block's products inside its fill),
  ``dense_flops`` (block products and mvs of a recurrent scan), ``factored_flops`` (back-propagation
  with the blocks factored: its mvs and the cell's gradients, one kernel), ``block_fill_values`` (the
  blocks' entries), ``step_values`` (the state gradients every recurrent schedule passes over),
  ``cell_flops`` (the gate and parameter gradients after a recurrent scan) and ``exit_values`` (the
  values a back-propagation from the last state alone passes over where it stops early, its gradient
  vanished: the saved rows it checks, the totals it zeroes);
- the multiply-adds an x86 processor slows down with a microcode assist, as last observed
  (:mod:`sparse_scan.engine.subnormals`): those of the mvs that read a subnormal gradient value,
  ``mv_subnormal`` for the compiled SpMVs (a scalar loop: an assist per multiply-add) and
  ``gemm_subnormal`` for the GEMMs through a layer's weights and the scalings by a diagonal;
- the backend's parallelism: the steps of one level run side by side on the CPU's threads (the GPU's
  lanes), so a step of a level of ``s`` steps adds ``1 / min(threads, s)`` of its features.

:func:`sparse_features` and :func:`dense_features` count a plan's features; :meth:`CostModel.predict`
weighs them. The constants come from a short calibration per backend
(:func:`sparse_scan.calibration.calibrate`, ``sparse-scan calibrate``), cached on disk per machine and
library version (:func:`cache_path`), or else from :data:`DEFAULTS`; :func:`current` says which one a
run uses (``SPARSE_SCAN_COST_MODEL``: ``defaults`` for the defaults whatever the cache, as the tests
do, or the path of a calibration file). Planning's own cost is counted too: ``plan_unit`` seconds per
unit of an estimate's symbolic work (pattern entries and multiply-adds enumerated,
:attr:`~sparse_scan.engine.plan.ScanPlan.symbolic_work`), which bounds what planning may cost
(:data:`MAX_PLAN_SECONDS`).

This module is pure bookkeeping (no NumPy): plan modules import it.

Examples
--------
>>> model = CostModel("cpu", 2, (("call", 1e-5), ("level", 1e-5), ("mv_step", 2e-6), ("mv_spmv", 1e-9)))
>>> model.predict({"call": 1, "level": 3, "mv_step": 3, "mv_spmv": 2e6})
0.002046
>>> model.seconds["fill"]        # a feature the calibration did not see costs nothing
0.0
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .. import _environment
from .._threads import cpu_threads
from .._version import __version__
from .schedule import Element

if TYPE_CHECKING:
    from .subnormals import Subnormals

__all__ = ["COST_MODEL_VARIABLE", "DEFAULTS", "FEATURES", "MAX_PLAN_SECONDS", "PLAN_SECONDS_VARIABLE",
           "CostModel", "cache_path", "current", "dense_features", "load", "max_plan_seconds",
           "predicted_plan_seconds", "save", "sparse_features"]

FEATURES = ("call", "layer", "level", "pool_level", "mv_step", "mm_step", "mm_sample", "mv_call", "mv_spmv",
            "mv_gemm", "mv_weights", "mv_taps", "mv_csr", "mv_scale", "mm_scale", "mm_gather", "mm_block",
            "mm_general", "fill", "fill_call", "fill_flops", "dense_level", "dense_chain_step",
            "factored_step", "factored_sample", "factored_flops", "dense_flops", "block_fill",
            "block_fill_values", "step_values", "cell_flops", "exit_values", "mv_subnormal", "gemm_subnormal",
            "plan_unit")
"""Every feature a cost model weighs (module docstring), ``plan_unit`` being planning's."""

COST_MODEL_VARIABLE = _environment.COST_MODEL.name
"""Environment variable: ``defaults`` (use :data:`DEFAULTS`, ignore any calibration: the tests set
it, so that no verdict depends on the machine), or the path of a calibration file to use."""

MAX_PLAN_SECONDS = 60.0
"""The default bound on a plan's predicted building time (:func:`predicted_plan_seconds`): an explicit
schedule over it is refused before anything is built (``max_plan_seconds`` of
:class:`sparse_scan.Sequential`, or :data:`PLAN_SECONDS_VARIABLE`)."""

PLAN_SECONDS_VARIABLE = _environment.MAX_PLAN_SECONDS.name
"""Environment variable: the planning limit in seconds where a model sets none (default
:data:`MAX_PLAN_SECONDS`); the command line's way to raise it."""

_CPU_DEFAULTS = (
    ("call", 1.7e-04), ("layer", 1.2e-06), ("level", 1.2e-05), ("pool_level", 2.4e-04), ("mv_step", 6.1e-07),
    ("mm_step", 1.4e-04), ("mm_sample", 6.4e-08), ("mv_call", 6.0e-06), ("mv_spmv", 5.5e-10),
    ("mv_gemm", 2.3e-11), ("mv_weights", 1.8e-10), ("mv_taps", 1.2e-09), ("mv_csr", 1.9e-10),
    ("mv_scale", 1.0e-09), ("mm_scale", 4.4e-09), ("mm_gather", 9.0e-10), ("mm_block", 6.9e-11),
    ("mm_general", 8.0e-10), ("fill", 3.5e-09), ("fill_call", 4.3e-06), ("fill_flops", 1.2e-10),
    ("dense_level", 3.1e-06), ("dense_chain_step", 3.0e-06), ("factored_step", 0.0e+00),
    ("factored_sample", 7.0e-07), ("factored_flops", 1.8e-10), ("dense_flops", 2.0e-11),
    ("block_fill", 7.9e-04), ("block_fill_values", 0.0e+00), ("step_values", 6.1e-09),
    ("cell_flops", 1.7e-09), ("exit_values", 0.0e+00), ("mv_subnormal", 7.5e-08), ("gemm_subnormal", 2.5e-09),
    ("plan_unit", 3.0e-07))
# CPU: the median of three `sparse-scan calibrate` runs on the 2-core development machine
# (OPENBLAS_NUM_THREADS=1, 2026-11-28 11:20 UTC), rounded; mv_scale and mm_gather, which its workloads
# do not tell apart from the fixed costs, are hand-set (about 1e9 entries/s), dense_flops is the bound
# its RNN of 64x64 blocks sets (Blelloch at batch 16: 840 MFLOP of batched block products in 19 ms;
# the fit puts that time on the levels), plan_unit the 160-470 ns per pattern entry or multiply-add
# measured of building plans. mv_subnormal and gemm_subnormal: the median of three calibrations of
# 13:12 UTC, whose workloads include a 512-layer MLP through subnormal gradients (timed directly, the
# same backwards with the upstream gradient scaled by 1e30, none subnormal: 70-90 ns more per SpMV
# multiply-add at batch 16, 3-15 ns per GEMM's, whose 1-10 ms more on a 10-25 ms backward the noisy
# machine blurs; the fit's 2.5 ns keeps every such schedule within 2x of its time, bench/auto_regret.py).
# GPU: placeholders, to be filled from the first lent GPU's timings (no GPU has run a calibration yet:
# docs/gpu.md): a launch of a few microseconds per level, a chain step inside the one launch of a
# chain, throughputs a conservative fraction of an H100's.
_GPU_DEFAULTS = (
    ("call", 1.0e-04), ("layer", 2.0e-05), ("level", 5.0e-06), ("pool_level", 0.0e+00), ("mv_step", 2.0e-07),
    ("mm_step", 2.0e-07), ("mm_sample", 1.0e-08), ("mv_call", 2.0e-06), ("mv_spmv", 2.0e-11),
    ("mv_gemm", 2.0e-11), ("mv_weights", 1.0e-12), ("mv_taps", 1.0e-12), ("mv_csr", 2.0e-11),
    ("mv_scale", 1.0e-11), ("mm_scale", 1.0e-11), ("mm_gather", 2.0e-11), ("mm_block", 2.0e-12),
    ("mm_general", 4.0e-11), ("fill", 1.0e-11), ("fill_call", 1.0e-06), ("fill_flops", 2.0e-12),
    ("dense_level", 5.0e-06), ("dense_chain_step", 2.0e-06), ("factored_step", 2.0e-06),
    ("factored_sample", 1.0e-08), ("factored_flops", 2.0e-13), ("dense_flops", 2.0e-13),
    ("block_fill", 5.0e-05), ("block_fill_values", 1.0e-11), ("step_values", 1.0e-11),
    ("cell_flops", 2.0e-13), ("exit_values", 0.0e+00), ("mv_subnormal", 0.0e+00), ("gemm_subnormal", 0.0e+00),
    ("plan_unit", 3.0e-07))


@dataclass(frozen=True)
class CostModel:
    """A backend's seconds per unit of every feature (:data:`FEATURES`).

    Attributes
    ----------
    device : {"cpu", "gpu"}
    threads : int
        The steps of one level that run side by side (the CPU's threads, the GPU's concurrent steps).
    constants : tuple of (str, float)
        Seconds per unit, by feature; a feature not listed costs nothing.
    source : str
        Where the constants come from: ``defaults``, or the calibration's file and date.
    """

    device: str
    threads: int
    constants: tuple[tuple[str, float], ...]
    source: str = "defaults"

    def __post_init__(self) -> None:
        unknown = sorted({name for name, _ in self.constants} - set(FEATURES))
        if unknown:
            raise ValueError(f"CostModel: unknown features {unknown}; known: {', '.join(FEATURES)}")
        if any(not value >= 0 for _, value in self.constants):
            raise ValueError("CostModel: every constant must be a number >= 0")

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per unit of every feature (0 for those not in :attr:`constants`)."""
        return {name: 0.0 for name in FEATURES} | dict(self.constants)

    def predict(self, features: Mapping[str, float]) -> float:
        """Predicted seconds of a run with these feature counts."""
        seconds = self.seconds
        return sum(seconds[name] * count for name, count in features.items())

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (what :func:`save` writes)."""
        return {"device": self.device, "threads": self.threads, "source": self.source,
                "seconds": dict(self.constants)}


DEFAULTS = {"cpu": _CPU_DEFAULTS, "gpu": _GPU_DEFAULTS}
"""Each backend's constants when no calibration has run (CPU: the calibration of a 2-core machine;
GPU: placeholders, see the module source)."""


def _threads(device: str) -> int:
    if device == "gpu":
        return 64  # independent steps of a level share one launch
    return cpu_threads()


def cache_path(device: str) -> pathlib.Path:
    """Where the calibration of ``device`` is cached: ``$XDG_CACHE_HOME/sparse-scan`` (by default
    ``~/.cache/sparse-scan``), one file per machine (host name, processor, cores) and library
    version."""
    machine = "-".join(part for part in (platform.node(), platform.machine(), f"{os.cpu_count()}cores")
                       if part).replace(os.sep, "_")
    return _environment.cache_home() / "sparse-scan" / f"cost-{device}-{machine}-{__version__}.json"


def save(model: CostModel, path: pathlib.Path | None = None) -> pathlib.Path:
    """Write ``model`` to ``path`` (by default :func:`cache_path`); return the path."""
    path = cache_path(model.device) if path is None else pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.as_dict(), indent=1) + "\n", encoding="utf-8")
    return path


def _model_of(fields: Any, path: pathlib.Path) -> CostModel:
    """The cost model of ``path``'s JSON ``fields``, each checked: a ``ValueError`` naming the field that
    is not what :func:`save` writes; a feature not listed (a file of an older version) at its device's
    default."""
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    missing = [name for name in ("device", "threads", "seconds") if name not in fields]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    device, threads, seconds = fields["device"], fields["threads"], fields["seconds"]
    if not isinstance(device, str) or device not in DEFAULTS:
        raise ValueError(f"device: {json.dumps(device)}, not one of {', '.join(DEFAULTS)}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads: {json.dumps(threads)}, not an int >= 1")
    if not isinstance(seconds, dict):
        raise ValueError("seconds: not an object of feature: seconds")
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"seconds.{name}: {json.dumps(value)}, not a finite number >= 0")
    constants = dict(DEFAULTS[device]) | {str(name): float(value) for name, value in seconds.items()}
    return CostModel(device, threads, tuple(constants.items()), str(fields.get("source", path)))


def load(path: pathlib.Path | str) -> CostModel:
    """The cost model a calibration file holds, a feature it does not list (a file of an older
    version) at its device's default.

    Raises
    ------
    ValueError
        Naming the file and what is wrong: not a file (missing, a directory), not JSON, or a field
        that is not what :func:`save` writes (an unknown device, a constant that is not a finite
        number >= 0, ``Infinity`` or ``NaN`` included, an unknown feature).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a sparse-scan calibration file")
    try:
        return _model_of(json.loads(path.read_text(encoding="utf-8")), path)
    except OSError as error:
        raise ValueError(f"{path}: cannot read the calibration file ({error.strerror or error})") from None
    except (ValueError, OverflowError) as error:  # not JSON (or not text), a field checked above, 1e999
        raise ValueError(f"{path}: not a sparse-scan calibration file ({error})") from None


_REPORTED: set[str] = set()
"""The cache problems :func:`current` has reported in this process (each once)."""


def _cached(device: str) -> CostModel | None:
    """The calibration cached for ``device`` (:func:`cache_path`), or None: none there, or one that
    cannot be used (damaged, of another device, a directory), reported once per process as one
    ``RuntimeWarning`` line naming the file, what is wrong and what to do."""
    path = cache_path(device)
    if not path.exists():
        return None
    try:
        model = load(path)
        if model.device != device:
            raise ValueError(f"{path}: a calibration of the {model.device}, not of the {device}")
        return model
    except ValueError as error:
        fix = ("it is removed and `sparse-scan calibrate` run" if path.is_dir()
               else "`sparse-scan calibrate` rewrites it")
        message = f"{error}; auto uses the default cost model until {fix}"
        if message not in _REPORTED:
            _REPORTED.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return None


def current(device: str = "cpu") -> CostModel:
    """The cost model runs on ``device`` use: ``SPARSE_SCAN_COST_MODEL``'s (``defaults``: the
    :data:`DEFAULTS`; a path: that calibration file, which must be of ``device``), else the cached
    calibration of this machine (:func:`cache_path`), else the defaults (a cache that cannot be used
    is named once, by a ``RuntimeWarning``).

    Raises
    ------
    ValueError
        ``device`` is not a backend, ``SPARSE_SCAN_COST_MODEL`` is neither ``defaults`` nor a
        file, or its file is no calibration (:func:`load`) or one of another device.
    """
    if device not in DEFAULTS:
        raise ValueError(f"cost model: device must be one of {', '.join(DEFAULTS)}; got {device!r}")
    setting = _environment.COST_MODEL.read()
    if setting is None:
        cached = _cached(device)
        if cached is not None:
            return cached
    elif setting != "defaults":
        model = load(setting)
        if model.device != device:
            raise ValueError(f"{COST_MODEL_VARIABLE}={str(setting)!r}: a calibration of the {model.device}; "
                             f"this run is on the {device}")
        return model
    return CostModel(device, _threads(device), DEFAULTS[device])


def _add(features: dict[str, float], name: str, count: float) -> None:
    features[name] = features.get(name, 0.0) + count


_MM_FEATURES = {"block": "mm_block", "gather": "mm_gather", "general": "mm_general", "rowwise": "mm_general",
                "scale_columns": "mm_scale", "scale_rows": "mm_scale", "estimate": "mm_general",
                "scale (estimate)": "mm_scale"}
_MV_FEATURES = {"spmv": "mv_spmv", "gemm": "mv_gemm", "scale": "mv_scale"}


def sparse_features(plan: Any, batch: int, threads: int,
                    subnormals: Subnormals | None = None) -> dict[str, float]:
    """The features of a run of a sparse :class:`~sparse_scan.engine.plan.ScanPlan` (built or
    estimated) for ``batch`` samples, its steps of a level spread over ``threads``.

    A product of sample-independent JTs runs once for the batch, every other step per sample. The
    JT values a run fills are those the products read and those the SpMVs read (an mv through its
    layer's weights, or by a diagonal from its layer's input, fills none); a residual block's fill
    adds its products' FLOPs (``plan.fill_flops``). ``subnormals``
    (:class:`~sparse_scan.engine.subnormals.Subnormals`, per sample as observed, where it is of
    gradients of this plan's sizes): an mv's multiply-adds per value of the gradient it reads, times
    that gradient's subnormal values.
    """
    features: dict[str, float] = {"call": 1, "layer": plan.n}
    sizes = plan.element_bytes
    paths = dict(plan.weights.paths)
    filled: set[int] = set()
    gradient_of: dict[Element, int] = {}
    if subnormals is not None and subnormals.fits(sizes.get(element, (0, 0))[1] for element in plan.outputs):
        gradient_of = {element: i for i, element in enumerate(plan.outputs)}
    for level in plan.levels_of_steps:
        share = 1.0 / max(1, min(threads, len(level)))
        _add(features, "level", 1)
        if threads > 1 and len(level) > 1:  # its steps handed to the thread pool and waited for
            _add(features, "pool_level", 1)
        for index in level:
            step = plan.steps[index]
            _add(features, f"{step.kind}_step", share)
            if step.kind == "mv":
                layer = step.right.lo if step.right.lo == step.right.hi else None
                name, flops = _MV_FEATURES.get(step.method, "mv_spmv"), step.flops
                path = paths.get(layer)
                if name == "mv_spmv" and layer in plan.weights.csr:
                    name = "mv_csr"  # the compiled product with the layer's CSR weights
                elif name == "mv_gemm" and path is not None:  # the dense layer's work, pruned or not
                    flops = 2 * path.multiply_adds
                    _add(features, "mv_weights", share * path.weights)  # read once for the batch
                    _add(features, "mv_taps", share * path.taps * batch)  # added into place after it
                if name in ("mv_gemm", "mv_csr"):
                    _add(features, "mv_call", share * (1 if path is None else path.calls))
                elif name == "mv_spmv" and layer is not None:
                    filled.add(layer)
                _add(features, name, share * flops * batch)
                if step.left in gradient_of:  # flops / 2 multiply-adds over the values it reads
                    per_value = flops / 2 / max(1, sizes[step.left][1])
                    slowed = subnormals.per_sample(gradient_of[step.left]) * per_value
                    _add(features, "mv_subnormal" if name in ("mv_spmv", "mv_csr") else "gemm_subnormal",
                         share * slowed * batch)
            else:
                samples = 1 if sizes[step.out][1] == 0 else batch
                _add(features, "mm_sample", share * samples)
                _add(features, _MM_FEATURES.get(step.method, "mm_general"), share * step.flops * samples)
                filled.update(element.lo for element in (step.left, step.right) if element.lo == element.hi)
    for j in filled:
        shared, per_sample = sizes.get(Element(j, j), (0, 0))
        _add(features, "fill", shared + per_sample * batch)
        _add(features, "fill_call", 1)
    features["fill_flops"] = plan.fill_flops[1] * batch
    return features


def dense_features(level_flops: Sequence[int], chained: Iterable[int], batch: int,
                   factored_steps: int = 0, filled_values: int = 0) -> dict[str, float]:
    """The features of one recurrent scan: per level of ``level_flops`` (FLOPs for one sample), a
    ``dense_chain_step`` where the level is in a chain (``chained``: a run of single mvs in one tight
    loop) else a ``dense_level``, and its FLOPs times ``batch``. ``factored_steps``: back-propagation
    with the blocks left factored (those steps instead, no levels, and their FLOPs as
    ``factored_flops``: the cell's own loop, not batched block products); ``filled_values``: the
    blocks' entries filled first (a ``block_fill`` and its values)."""
    chained = set(chained)
    if factored_steps:  # one mv per step and sample, in the cell's own loop: its own throughput
        return {"factored_step": factored_steps, "factored_sample": factored_steps * batch,
                "factored_flops": sum(level_flops) * batch}
    features: dict[str, float] = {"dense_flops": sum(level_flops) * batch, "dense_chain_step": len(chained),
                                  "dense_level": len(level_flops) - len(chained)}
    if filled_values:
        features["block_fill"] = 1
        features["block_fill_values"] = filled_values
    return features


def max_plan_seconds(configured: float | None = None) -> float:
    """The planning limit: ``configured``, else :data:`PLAN_SECONDS_VARIABLE`, else
    :data:`MAX_PLAN_SECONDS`."""
    if configured is not None:
        return float(configured)
    setting = _environment.MAX_PLAN_SECONDS.read()
    return MAX_PLAN_SECONDS if setting is None else setting


def predicted_plan_seconds(symbolic_work: int, model: CostModel) -> float:
    """Seconds building a plan of this estimated symbolic work takes (``plan_unit`` each)."""
    return symbolic_work * model.seconds["plan_unit"]
