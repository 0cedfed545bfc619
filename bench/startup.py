"""How long ``sparse-scan --help`` and ``--version`` take against a bare ``python -c "import click"``:
fresh processes, taken in turn (a round runs each once, in a new random order), medians over the rounds,
and each command's ratio to the bare import of the same round order. JSON on stdout.

Usage: ``python bench/startup.py [--rounds 40]``. Issue 47 asks for ``--help`` within 1.5x the bare
import; the modules ``--help`` imports beyond click and the standard library are listed too (what a
change would defer). The time is the child's whole life (interpreter start, site, imports, output),
measured by the parent with ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time

from common import cpu_model

BARE = "import click"


def _commands() -> dict[str, list[str]]:
    """What is timed: the bare import, and the installed console script's --help and --version (else
    ``python -m sparse_scan.cli``)."""
    script = shutil.which("sparse-scan", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "sparse-scan")
    cli = [script] if script else [sys.executable, "-m", "sparse_scan.cli"]
    return {"import click": [sys.executable, "-c", BARE], "sparse-scan --help": [*cli, "--help"],
            "sparse-scan --version": [*cli, "--version"]}


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _imported(arguments: list[str]) -> set[str]:
    """The modules ``python -X importtime ARGUMENTS`` imports."""
    done = subprocess.run([sys.executable, "-X", "importtime", *arguments], capture_output=True, text=True,
                          check=True)
    fields = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time:")]
    return {field[-1].strip() for field in fields if field[0].split(":")[1].strip().isdigit()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds, each command once per round")
    parser.add_argument("--seed", type=int, default=0, help="the rounds' random orders")
    args = parser.parse_args()
    commands = _commands()
    for command in commands.values():  # warm the page cache and the .pyc files
        _seconds(command)
    order = random.Random(args.seed)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        names = list(commands)
        order.shuffle(names)
        for name in names:
            times[name].append(_seconds(commands[name]))
    bare = statistics.median(times["import click"])
    report = {
        "machine": {"processor": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_average": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": " ".join(sys.argv)},
        "rounds": args.rounds,
        "median_s": {name: statistics.median(values) for name, values in times.items()},
        "p10_p90_s": {name: statistics.quantiles(values, n=10)[::8] for name, values in times.items()},
        "ratio_to_import_click": {name: statistics.median(values) / bare for name, values in times.items()
                                  if name != "import click"},
        "help_imports_beyond_click": sorted(_imported(["-m", "sparse_scan.cli", "--help"])
                                            - _imported(["-c", BARE])),
    }
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
