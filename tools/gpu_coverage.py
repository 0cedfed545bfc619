"""Line coverage of the GPU glue, from a coverage.py data file of a ``pytest -m gpu`` run.

    python -m coverage run --source=sparse_scan -m pytest -m gpu
    python tools/gpu_coverage.py [--data-file .coverage] [--fail-under 95]

The GPU glue is every module whose whole job is the GPU (``engine/_gpu``, ``engine/_dense_gpu``,
``engine/_tables``, ``_gpu_kernels``) plus every GPU twin elsewhere in ``sparse_scan/`` (functions named
``*_gpu`` and ``BatchedCSR.to_cupyx``, found by parsing the sources). Prints one line per unit and the
total; exits 1 below ``--fail-under`` percent.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparse_scan"
GPU_MODULES = ("engine/_gpu.py", "engine/_dense_gpu.py", "engine/_tables.py", "_gpu_kernels.py")


def _statements(path: pathlib.Path) -> set[int]:
    from coverage.python import PythonParser  # noqa: PLC0415 - only with coverage installed

    parser = PythonParser(filename=str(path))
    parser.parse_source()
    return set(parser.statements)


def gpu_units() -> list[tuple[str, pathlib.Path, set[int]]]:
    """``(name, file, statement lines)`` of every GPU module and GPU twin function."""
    units = []
    for path in sorted(PACKAGE.rglob("*.py")):
        statements = _statements(path)
        if path.relative_to(PACKAGE).as_posix() in GPU_MODULES:
            units.append((str(path.relative_to(ROOT)), path, statements))
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (node.name.endswith("_gpu") or node.name == "to_cupyx"):
                body = {line for line in statements if node.body[0].lineno <= line <= node.end_lineno}
                units.append((f"{path.relative_to(ROOT)}:{node.name}", path, body))
    return units


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-file", default=".coverage")
    parser.add_argument("--fail-under", type=float, default=0.0)
    args = parser.parse_args(argv)
    import coverage  # noqa: PLC0415

    data = coverage.CoverageData(basename=args.data_file)
    data.read()
    total = hit = 0
    for name, path, statements in gpu_units():
        executed = set(data.lines(str(path)) or ())
        missing = sorted(statements - executed)
        total += len(statements)
        hit += len(statements) - len(missing)
        share = 100.0 * (len(statements) - len(missing)) / max(len(statements), 1)
        print(f"{share:6.1f} %  {len(statements):4d} lines  {name}"
              + (f"  missing {missing}" if missing else ""))
    percent = 100.0 * hit / max(total, 1)
    print(f"GPU glue: {hit} of {total} lines run ({percent:.1f} %)")
    return 1 if percent < args.fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
