#!/usr/bin/env python3
"""Bit-for-bit equality of the gradients of two checkouts of sparse-scan, on every bundled spec.

    python tools/compare_gradients.py OLD_TREE NEW_TREE [--specs NAME ...] [--dtypes float32 float64]
    python tools/compare_gradients.py save OUT_FOLDER [--specs NAME ...] [--dtypes ...]

``save`` runs in the current interpreter (whatever ``sparse_scan`` it imports) and writes, per case, every
activation gradient and every parameter gradient (``.npz``) and the schedule the plan states (its
``explain()``, ``.json``). A case is a spec of ``data/`` (its own seeded or stored weights), a dtype,
and a schedule: ``linear``, ``blelloch``, ``hybrid K`` for every depth ``K`` from 0 to ``depth(n)``, and
``auto``; each explicit schedule is first planned under the command line's default limit
(``--max-step-flops`` 1e10): one the planner refuses (:class:`~sparse_scan.ScanCostError`,
:class:`~sparse_scan.ScanMemoryError`) is recorded as refused, not run. The batch is 2 samples of a
seeded standard normal input, the upstream gradient seeded too.

Comparing runs ``save`` for each tree in its own interpreter with ``PYTHONPATH`` set to that tree (so
each imports its own ``sparse_scan``, from the tree's root), then compares case by case: the same cases
refused, the same arrays under the same names, each equal by :func:`numpy.array_equal` (NaNs
included), the same schedules (their figures: :data:`SCHEDULE_FIGURES`; why ``auto`` chose, its
candidates and a predicted time are not arithmetic). A case only the new tree refuses, from its
estimate before building anything (a planning limit the old tree did not have), is listed under
``refused_in_new_only``, not as a difference. Prints a JSON summary; exits 1 on any difference. The
workload uses only what both trees offer: ``load_model``, ``plan``, ``forward``, ``backward``,
``parameter_gradients``, ``explain``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

SPECS = ("tiny", "lenet5", "lenet5-digits", "cnn-bn", "vgg11", "vgg11-pruned", "resnet20", "resnet20-pruned",
         "lstm-bitstream")
DTYPES = ("float32", "float64")
MAX_STEP_FLOPS = int(1e10)
"""The command line's default ``--max-step-flops``."""
BATCH = 2
SCHEDULE_FIGURES = ("method", "levels", "requested", "critical_flops", "work_flops", "critical_steps",
                    "plan_bytes", "peak_bytes", "fill_flops")
"""The keys of a plan's ``explain()`` compared: the schedule that ran and its figures."""


def _schedules(n: int) -> list[tuple[str, int | None]]:
    """Every schedule of a chain of ``n`` elements: linear, blelloch, hybrid 0..depth(n), auto."""
    from sparse_scan.engine.schedule import depth  # noqa: PLC0415 - the tree's own

    return ([("linear", None), ("blelloch", None)] + [("hybrid", k) for k in range(depth(n) + 1)]
            + [("auto", None)])


def _explained(plan: object) -> dict:
    try:
        return plan.explain(BATCH, 4)  # type: ignore[attr-defined]
    except TypeError:
        return plan.explain()  # type: ignore[attr-defined]


def save(folder: pathlib.Path, specs: list[str], dtypes: list[str]) -> None:
    """Every case's gradients into ``folder`` (``<spec>-<dtype>-<schedule>.npz`` and ``.json``)."""
    import numpy as np  # noqa: PLC0415 - the tree's interpreter

    import sparse_scan  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        for dtype in dtypes:
            model = sparse_scan.load_model(pathlib.Path("data") / f"{spec}.yaml", dtype=dtype)  # the tree's
            recurrent = not hasattr(model, "chain_info")
            rng = np.random.default_rng(0)
            x = rng.standard_normal((BATCH,) + tuple(model.input_shape)).astype(dtype)
            out_shape = model.shapes(model.input_shape)[-1]
            g = rng.standard_normal((BATCH,) + tuple(out_shape)).astype(dtype)
            n = model.input_shape[0] if recurrent else len(model.layers)
            for method, levels in _schedules(n):
                name = f"{spec}-{dtype}-{method}{'' if levels is None else levels}"
                start = time.perf_counter()
                record: dict = {"method": method, "levels": levels}
                try:
                    if recurrent:
                        plan = model.plan(model.input_shape, method, levels, batch=BATCH, device="cpu")
                    else:
                        plan = model.plan(model.input_shape, method, levels,
                                          max_step_flops=None if method == "auto" else MAX_STEP_FLOPS)
                except (sparse_scan.ScanCostError, sparse_scan.ScanMemoryError) as error:
                    record["refused"] = f"{type(error).__name__}: {error}"
                else:
                    record["schedule"] = _explained(plan)
                    model.forward(x)
                    grads = model.backward(g, method=method, levels=levels)
                    parameters = model.parameter_gradients(grads)
                    arrays = {f"activation{i}": np.asarray(a) for i, a in enumerate(grads)}
                    arrays.update({f"parameter:{key}": np.asarray(value)
                                   for key, value in parameters.items()})
                    np.savez(folder / f"{name}.npz", **arrays)
                record["seconds"] = round(time.perf_counter() - start, 3)
                (folder / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
                print(f"{name}: {'refused' if 'refused' in record else 'saved'} ({record['seconds']} s)",
                      file=sys.stderr, flush=True)


def _save_in(tree: str, folder: pathlib.Path, specs: list[str], dtypes: list[str]) -> None:
    """:func:`save` in a fresh interpreter importing ``tree``'s sparse_scan."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONWARNINGS="ignore")
    probe = subprocess.run([sys.executable, "-c", "import sparse_scan; print(sparse_scan.__file__)"],
                           cwd=tree, env=env, check=True, capture_output=True, text=True)
    imported = pathlib.Path(probe.stdout.strip()).resolve()
    if not imported.is_relative_to(pathlib.Path(tree).resolve()):
        raise SystemExit(f"{tree}: the interpreter imports {imported}, not the tree's sparse_scan")
    subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "save", str(folder), "--specs",
                    *specs, "--dtypes", *dtypes], cwd=tree, env=env, check=True)


def compare(old: pathlib.Path, new: pathlib.Path) -> dict:
    """Case by case: refusals, array names and values (bit for bit), schedules."""
    import numpy as np  # noqa: PLC0415

    names = sorted({path.stem for path in old.glob("*.json")} | {path.stem for path in new.glob("*.json")})
    differences, compared, refused, arrays, newly_refused = [], 0, 0, 0, []
    for name in names:
        if not (old / f"{name}.json").exists() or not (new / f"{name}.json").exists():
            differences.append(f"{name}: in one tree only")
            continue
        before, after = (json.loads((tree / f"{name}.json").read_text()) for tree in (old, new))
        if ("refused" in before) != ("refused" in after):
            why = before.get("refused") or after.get("refused")
            if "refused" in after and "before building anything" in why:
                newly_refused.append(f"{name}: {why}")
            else:
                differences.append(f"{name}: refused in one tree only: {why}")
            continue
        if "refused" in before:
            refused += 1
            continue
        figures = [{key: record["schedule"].get(key) for key in SCHEDULE_FIGURES}
                   for record in (before, after)]
        if figures[0] != figures[1]:
            differences.append(f"{name}: schedules differ: {figures[0]} != {figures[1]}")
        with np.load(old / f"{name}.npz") as a, np.load(new / f"{name}.npz") as b:
            if sorted(a.files) != sorted(b.files):
                differences.append(f"{name}: arrays differ: {sorted(set(a.files) ^ set(b.files))}")
                continue
            for key in a.files:
                arrays += 1
                if a[key].dtype != b[key].dtype or not np.array_equal(a[key], b[key], equal_nan=True):
                    differences.append(f"{name}: {key} differs")
        compared += 1
    return {"cases": len(names), "compared": compared, "refused_in_both": refused, "arrays": arrays,
            "refused_in_new_only": newly_refused, "differences": differences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", help="OLD_TREE, or 'save'")
    parser.add_argument("second", help="NEW_TREE, or the folder to save into")
    parser.add_argument("--specs", nargs="+", default=list(SPECS), choices=SPECS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--keep", help="save the trees' cases under this folder (old/, new/) and keep them")
    args = parser.parse_args()
    if args.first == "save":
        save(pathlib.Path(args.second), args.specs, args.dtypes)
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = pathlib.Path(args.keep or scratch)
        for label, tree in (("old", args.first), ("new", args.second)):
            _save_in(tree, folder / label, args.specs, args.dtypes)
        report = compare(folder / "old", folder / "new")
    print(json.dumps(report, indent=1))
    sys.exit(1 if report["differences"] or not report["compared"] else 0)


if __name__ == "__main__":
    main()
