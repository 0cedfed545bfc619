"""The public API, pinned (issue 19): ``sparse_scan.__all__`` and the documented modules' ``__all__``.

Public are the names in ``sparse_scan.__all__`` and in the ``__all__`` of the modules the documentation
names (README.md, docs/, the docstrings of :mod:`sparse_scan` and :mod:`sparse_scan.engine`); every
other module is private by name (``_...``).

A change of the public API changes this file, on purpose. :data:`UNDOCUMENTED` and :data:`DIR_EXTRAS`
list what is being fixed elsewhere: the tests pass while each stays as it is, and fail once it is
fixed (so that it leaves the list) or when a new one appears.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import subprocess
import sys
import types

import pytest
import torch_optional

import sparse_scan

REPO = pathlib.Path(__file__).resolve().parents[1]

TOP_LEVEL = ["SCHEDULES", "BatchedCSR", "GPUUnavailableError", "Model", "Pattern", "ScanCostError",
             "ScanMemoryError", "ScanPlan", "Sequential", "SpecError", "__version__", "backend",
             "calibration", "check_environment", "cpu_threads", "csr", "default_memory_budget",
             "distributed", "engine", "export_torch", "flops", "layers", "load_model", "loss", "model",
             "optim", "recurrent", "torch", "train", "weights"]

PUBLIC = {
    "sparse_scan.backend": ["Backend", "Device", "GPUUnavailableError", "get", "gpu_usable", "of", "twin"],
    "sparse_scan.calibration": ["Measurement", "calibrate", "fit", "measure", "workloads"],
    "sparse_scan.csr": ["BatchedCSR", "Pattern", "choose_index_dtype"],
    "sparse_scan.distributed": ["CHAIN_PRODUCT_FACTOR", "COMBINES", "DistributedError", "DistributedResult",
                                "MPIUnavailableError", "RankTimeoutError", "RemoteRankError", "TRANSPORTS",
                                "TransportUnavailableError", "abort", "backward", "balanced_split",
                                "import_mpi", "launched", "launcher", "layer_costs", "slices"],
    "sparse_scan.engine": ["METHODS", "SCHEDULES", "ChainInfo", "DenseScanPlan", "Element", "ElementInfo",
                           "PlanBudgetError", "ProductPlan", "ScanCostError", "ScanMemoryError", "ScanPlan",
                           "ScanPlanLike", "SizedDenseScanPlan", "Step", "WeightsPath", "WeightsPlan",
                           "auto_levels", "build_dense_plan", "build_plan", "checked_levels",
                           "count_multiply_adds", "critical_path", "dense_scan", "depth", "estimate_plan",
                           "live_schedule", "multiply", "operands_needing_patterns", "plan_product",
                           "run_plan", "through_inputs", "through_weights"],
    "sparse_scan.engine.dense_plan": ["DenseGroup", "DenseOp", "DenseScanPlan", "DenseShape", "DenseStep",
                                      "Location", "SizedDenseScanPlan", "auto_levels", "build_dense_plan",
                                      "dense_shape", "scan_features"],
    "sparse_scan.engine.cost": ["COST_MODEL_VARIABLE", "DEFAULTS", "FEATURES", "MAX_PLAN_SECONDS",
                                "PLAN_SECONDS_VARIABLE", "CostModel", "cache_path", "current",
                                "dense_features", "load", "max_plan_seconds", "predicted_plan_seconds",
                                "save",
                                "sparse_features"],
    "sparse_scan.engine.figures": ["TOTALS", "ScanPlanLike", "StepFigures", "critical_path", "size_text",
                                   "totals"],
    "sparse_scan.engine.plan": ["Candidate", "ChainInfo", "ElementInfo", "ScanCostError", "ScanMemoryError",
                                "ScanPlan", "ScheduleChoice", "Step", "WeightsPath", "WeightsPlan",
                                "build_plan", "estimate_plan", "operands_needing_patterns"],
    "sparse_scan.engine.products": ["PlanBudgetError", "ProductPlan", "count_multiply_adds", "plan_product"],
    "sparse_scan.engine.run": ["dense_scan", "multiply", "run_plan", "through_inputs", "through_weights"],
    "sparse_scan.engine.subnormals": ["OBSERVE_EVERY", "SubnormalWatch", "Subnormals", "count_subnormals"],
    "sparse_scan.engine.schedule": ["IDENTITY", "METHODS", "SCHEDULES", "Element", "checked_levels", "depth",
                                    "live_schedule", "live_segments", "scan_outputs", "schedule",
                                    "schedule_at_depth"],
    "sparse_scan.flops": ["CONVENTIONS", "analyse", "layer_stats", "live"],
    "sparse_scan.layers": ["AdaptiveAvgPool2d", "Affine", "AvgPool2d", "BatchNorm2d", "Block",
                           "ChannelShuffle", "Conv2d", "Narrow",
                           "Dropout", "ELU", "Flatten", "GELU", "Hardtanh", "Identity", "Layer", "LeakyReLU",
                           "Linear", "LogSoftmax", "MaxPool2d", "ReLU", "Residual", "SiLU", "Sigmoid",
                           "Softmax", "Softplus", "Tanh",
                           "Hardsigmoid", "Hardswish", "Mish", "LayerNorm", "LayerScale", "Upsample",
                           "StochasticDepth", "DropPath"],
    "sparse_scan.loss": ["softmax_cross_entropy"],
    "sparse_scan.model": ["JacobianSize", "Model", "ModelPlan"],
    "sparse_scan.optim": ["SGD", "Adam", "Optimizer", "check_built_on"],
    "sparse_scan.recurrent": ["GRU", "LSTM", "REDUCTIONS", "RNN", "Bitstream", "CellSequence", "GRUCell",
                              "Horizon", "LSTMCell", "RNNCell", "RecurrentClassifier", "RecurrentPlan",
                              "chain_through_factors"],
    "sparse_scan.spec": ["LAYER_TYPES", "MAX_SPEC_BYTES", "MAX_SPEC_NODES", "RECURRENT_TYPES",
                         "SAMPLE_COPIES", "SpecError", "load_model", "model_from_spec", "sample_bytes"],
    "sparse_scan.torch": ["BPPSA", "Capture", "CaptureError", "PrunedAdam", "Source", "bppsa", "capture",
                          "export_torch"],
    "sparse_scan.train": ["RECORD_KEYS", "DataError", "Dataset", "DivergenceError", "epoch_summary",
                          "evaluate", "load_dataset", "train", "train_iterations"],
    "sparse_scan.weights": ["MAX_FILE_LINKS", "as_float_array", "budget_problem", "check_writable",
                            "every_layer", "load_state_dict", "named_layers", "open_regular_file", "read_npz",
                            "scoped_name", "state_dict", "write_atomically", "write_npz_atomically",
                            "write_target"],
}
"""The documented public modules -> their ``__all__`` (``sparse_scan.spec``: the home of
:func:`~sparse_scan.load_model`, named by the package docstring)."""

UNDOCUMENTED: set[str] = set()
DIR_EXTRAS: dict[str, set[str]] = {"sparse_scan": set(), "sparse_scan.engine": set()}
"""Names that the lazy modules' ``dir()`` shows beside ``__all__`` and submodules (their own imports),
being fixed elsewhere: empty it as they are."""

SHADOWED: set[str] = set()
"""Names in a package's ``__all__`` that are not its submodule of that name, though it has one (once
the submodule is imported, the package's attribute is the module): being fixed elsewhere."""


def _documentation() -> str:
    """README.md, docs/*.md and the package's docstring."""
    paths = [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
    return "\n".join([path.read_text(encoding="utf-8") for path in paths] + [sparse_scan.__doc__])


def _documented(module: str, documentation: str) -> bool:
    """Whether the documentation names ``module``, or its package's docstring does (``:mod:`.name```)."""
    package, _, name = module.rpartition(".")
    return (re.search(rf"\b{re.escape(module)}\b", documentation) is not None
            or f":mod:`.{name}`" in (importlib.import_module(package).__doc__ or ""))


def _public_named_modules() -> set[str]:
    """Every module under sparse_scan/ whose dotted name has no part starting with ``_``."""
    root = REPO / "sparse_scan"
    names = set()
    for path in root.rglob("*.py"):
        parts = ["sparse_scan", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if not any(part.startswith("_") for part in parts):
            names.add(".".join(parts))
    return names


def test_the_top_level_api():
    assert sorted(sparse_scan.__all__) == sorted(TOP_LEVEL)
    assert len(set(sparse_scan.__all__)) == len(sparse_scan.__all__)
    for name in sparse_scan.__all__:
        assert getattr(sparse_scan, name) is not None, name
    modules = {name for name in TOP_LEVEL if isinstance(getattr(sparse_scan, name), types.ModuleType)}
    assert {f"sparse_scan.{name}" for name in modules} <= set(PUBLIC)


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_a_public_modules_api(module):
    """Without PyTorch, the names whose modules need it are checked up to their resolution (skipped)."""
    imported = importlib.import_module(module)
    assert sorted(imported.__all__) == sorted(PUBLIC[module])
    assert len(set(imported.__all__)) == len(imported.__all__)
    unresolved = []
    for name in imported.__all__:
        try:
            value = torch_optional.resolve(imported, name)
        except AttributeError:
            pytest.fail(f"{module}.{name} is in __all__ but does not resolve")
        if value is torch_optional.MISSING:
            unresolved.append(name)
    if unresolved:
        pytest.skip(f"{module}: {', '.join(unresolved)} need PyTorch, which is not installed")


def test_the_engines_names_are_its_modules_names():
    import sparse_scan.engine as engine

    homes = [importlib.import_module(module) for module in PUBLIC if module.startswith("sparse_scan.engine.")]
    for name in sorted(set(engine.__all__) - {name.rpartition(".")[2] for name in SHADOWED}):
        assert any(getattr(engine, name) is getattr(home, name, None) for home in homes), name


def test_a_name_means_one_object():
    """A name in several public ``__all__`` (``ScanPlan``: sparse_scan, engine, engine.plan) is one
    object, but for a module's name at the top (``sparse_scan.train`` and its ``train``)."""
    places: dict[str, list[tuple[str, object]]] = {}
    for module in ["sparse_scan", *PUBLIC]:
        imported = importlib.import_module(module)
        for name in imported.__all__:
            value = torch_optional.resolve(imported, name)  # without PyTorch, its bridge's names are left out
            if value is not torch_optional.MISSING and not isinstance(value, types.ModuleType):
                places.setdefault(name, []).append((module, value))
    differ = {name: [module for module, _ in found] for name, found in places.items()
              if any(value is not found[0][1] for _, value in found)}
    assert not differ


@pytest.mark.parametrize("module", ["sparse_scan", "sparse_scan.engine"])
def test_dir_shows_the_api(module):
    imported = importlib.import_module(module)
    shown = set(dir(imported))
    assert set(imported.__all__) <= shown
    extras = {name for name in shown - set(imported.__all__) if not name.startswith("_")
              and getattr(getattr(imported, name), "__name__", None) != f"{module}.{name}"}  # submodules
    assert extras == DIR_EXTRAS[module]


PACKAGES = sorted(module for module in ["sparse_scan", *PUBLIC]
                  if REPO.joinpath(*module.split("."), "__init__.py").exists())


@pytest.mark.parametrize("package", PACKAGES)
def test_no_public_name_is_shadowed_by_a_submodule(package):
    """``from package import name`` must give the same object whether or not ``package.name`` (a
    submodule) was imported before: a fresh interpreter reads the package's names first."""
    probe = ("import importlib, json, pkgutil, sys, types\n"
             "package = importlib.import_module(sys.argv[1])\n"
             "submodules = {info.name for info in pkgutil.iter_modules(package.__path__)}\n"
             "names = sorted(set(package.__all__) & submodules)\n"
             "print(json.dumps([f'{sys.argv[1]}.{name}' for name in names\n"
             "                  if not isinstance(getattr(package, name), types.ModuleType)]))\n")
    result = subprocess.run([sys.executable, "-c", probe, package], capture_output=True, text=True,
                            check=True)
    assert set(json.loads(result.stdout)) == {name for name in SHADOWED if name.rpartition(".")[0] == package}


def test_the_public_modules_are_documented():
    documentation = _documentation()
    assert not [module for module in sorted(PUBLIC)
                if not _documented(module, documentation)]


def test_every_other_module_is_private_by_name():
    undocumented = _public_named_modules() - set(PUBLIC) - {"sparse_scan"}
    new, fixed = sorted(undocumented - UNDOCUMENTED), sorted(UNDOCUMENTED - undocumented)
    assert not new, f"public by name, undocumented: make them private (_name) or document them: {new}"
    assert not fixed, f"fixed: remove them from UNDOCUMENTED: {fixed}"


def test_the_package_and_its_light_names_import_no_numpy():
    probe = ("import sys\n"
             "import sparse_scan\n"
             "from sparse_scan import SCHEDULES, __version__, check_environment, cpu_threads\n"
             "from sparse_scan.engine import SCHEDULES as ENGINE_SCHEDULES\n"
             "assert SCHEDULES is ENGINE_SCHEDULES and cpu_threads() >= 1 and __version__\n"
             "check_environment()\n"
             "print(sorted(name for name in ('numpy', 'scipy') if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
