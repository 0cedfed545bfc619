"""Run a Python script or module with the CuPy stand-in as ``cupy``, its device on:

    python -m cupy_standin SCRIPT [ARGS...]        (with tests/ on PYTHONPATH)
    python -m cupy_standin -m MODULE [ARGS...]     (as ``python -m MODULE``: the command line,
                                                    ``-m sparse_scan.cli``)

For smoke runs of the GPU code paths of scripts (the benchmarks of ``tools/gpu_run.sh``) on a machine
without a GPU. Exits with the script's status.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

from . import AVAILABLE, install


def main() -> None:
    if len(sys.argv) < 2 or (sys.argv[1] == "-m" and len(sys.argv) < 3):
        sys.exit("usage: python -m cupy_standin SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    install()
    AVAILABLE["value"] = True
    if sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module] + sys.argv[3:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(pathlib.Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
