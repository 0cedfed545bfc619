"""Run a Python script with the CuPy stand-in as ``cupy``, its device on:

    python -m cupy_standin SCRIPT [ARGS...]        (with tests/ on PYTHONPATH)

For smoke runs of the GPU code paths of scripts (the benchmarks of ``tools/gpu_run.sh``) on a machine
without a GPU. Exits with the script's status.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

from . import AVAILABLE, install


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m cupy_standin SCRIPT [ARGS...]")
    install()
    AVAILABLE["value"] = True
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(pathlib.Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
