"""Run the command line's bad-input cases of issue 47 and print each one's outcome.

    python tools/bad_input_sweep.py [--only TEXT] [--timeout SECONDS]

Every case runs ``python -m sparse_scan.cli ...`` in a process of its own, in a scratch folder of its
own (its files made there first: specs, arrays, named pipes, symlink loops), with a timeout, an
address-space limit (:data:`ADDRESS_SPACE`) and ``SPARSE_SCAN_MEMORY_BUDGET`` at :data:`BUDGET`, so
that a regression (a read that blocks, an allocation of gigabytes) shows as a failed case, not as a
machine that stops answering. ``XDG_CACHE_HOME`` is the scratch folder (no calibration of this machine
is read) and no other ``SPARSE_SCAN_`` variable is passed on.

Expected of a refusal (most cases): exit code 2, one line on stderr, ``sparse-scan: error: ...``
holding the case's fragment, no traceback, and every file of the scratch folder as it was. A few cases
expect a run that succeeds (exit 0) and say what it must have done (debris removed, a symlink kept).

One line per case: ``ok`` or ``FAIL``, the issue's item, the case, the exit code and the first line of
stderr; the exit status is 0 when every case matched, 1 otherwise. About 30 s on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import zipfile
from typing import Callable

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "data" / "tiny.yaml")
BUDGET = "64M"
"""``SPARSE_SCAN_MEMORY_BUDGET`` of every case."""
ADDRESS_SPACE = 3 * 2**30
"""The address space a case's process may take (RLIMIT_AS): a regression that allocates gigabytes
fails with a MemoryError instead of taking the machine's memory."""
TIMEOUT = 30.0
"""Seconds a case may run (a read blocked on a named pipe would never end)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: issue 47's ``item``, a ``name``, the command line after ``sparse-scan``
    (``args``, relative to the scratch folder), what stderr's one line must hold (``fragment``), the
    files ``setup`` makes in the scratch folder first, extra environment variables, the exit code
    expected, and for a run that writes, ``after``: what it must have done (a problem, or None)."""

    item: str
    name: str
    args: tuple[str, ...]
    fragment: str
    setup: Callable[[pathlib.Path], None] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    code: int = 2
    after: Callable[[pathlib.Path], str | None] | None = None
    isolated: bool = False
    """Unsafe in the test process itself (it blocks or allocates without end when it regresses): the
    tests run these cases through :func:`run_case` (tests/test_cli_bad_input.py)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a case did: its exit code (None: it ran past the timeout), stderr's first line, and
    whether that is what the case expects (``problem``: why not)."""

    code: int | None
    first_line: str
    problem: str | None

    @property
    def matched(self) -> bool:
        return self.problem is None


def _write(name: str, text: str) -> Callable[[pathlib.Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _spec(layer: str, shape: str, head: str = "") -> Callable[[pathlib.Path], None]:
    return _write("m.yaml", f"input_shape: {shape}\ninit: {{seed: 0}}\nlayers:\n  - {layer}\n{head}")


def _integers(folder: pathlib.Path) -> None:
    x = np.zeros((2, 1, 8, 8), np.int64)
    x[1, 0, 2, 3] = 2**24 + 1  # float32 rounds it to 2**24
    np.save(folder / "x.npy", x)


def _bomb(folder: pathlib.Path) -> None:
    """Ten levels of nine aliases in 600 bytes: 3.9e9 nodes once expanded (the issue's 'billion laughs')."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    (folder / "m.yaml").write_text(f"input_shape: [4]\ninit: {{seed: [{', '.join(levels)}]}}\n"
                                   "layers: [{type: relu}]\n")


def _pipe(name: str) -> Callable[[pathlib.Path], None]:
    return lambda folder: os.mkfifo(folder / name)


def _loop(name: str) -> Callable[[pathlib.Path], None]:
    def make(folder: pathlib.Path) -> None:
        (folder / name).symlink_to(f"{name}.back")
        (folder / f"{name}.back").symlink_to(name)
    return make


def _data(folder: pathlib.Path) -> None:
    rng = np.random.default_rng(0)
    np.savez(folder / "data.npz", x_train=rng.random((20, 1, 8, 8)), y_train=rng.integers(0, 10, 20),
             x_test=rng.random((5, 1, 8, 8)), y_test=rng.integers(0, 10, 5))


def _member_not_npy(folder: pathlib.Path) -> None:
    np.savez(folder / "w.npz", **{"conv1.bias": np.zeros(4, np.float32)})
    with zipfile.ZipFile(folder / "w.npz", "a") as archive:
        archive.writestr("fc.weight", b"not an array")
    (folder / "m.yaml").write_text("input_shape: [1, 8, 8]\nweights: w.npz\nlayers: [{type: relu}]\n")


def _both(*setups: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], None]:
    def make(folder: pathlib.Path) -> None:
        for setup in setups:
            setup(folder)
    return make


def _killed_write(folder: pathlib.Path) -> None:
    """What a write of g.npz killed by SIGKILL leaves (its process gone: the id of one that ran)."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    (folder / f".g.npz.{finished.stdout.strip()}.x1y2z3.npz").write_bytes(b"PK partial")


def _debris_removed(folder: pathlib.Path) -> str | None:
    left = [path.name for path in folder.iterdir() if path.name.startswith(".g.npz.")]
    return f"debris left: {left}" if left else None


def _linked(folder: pathlib.Path) -> None:
    (folder / "store").mkdir()
    (folder / "store" / "g.npz").write_bytes(b"old")
    (folder / "link.npz").symlink_to("store/g.npz")


def _written_through(folder: pathlib.Path) -> str | None:
    if not (folder / "link.npz").is_symlink():
        return "the symlink was replaced"
    written = (folder / "store" / "g.npz").read_bytes()[:2] == b"PK"
    return None if written else "the file the link leads to was not written"


def _damaged_calibration(folder: pathlib.Path) -> None:
    (folder / "inf.json").write_text('{"device": "cpu", "threads": 2, "seconds": {"call": Infinity}}')


RANDOM = ("--random", "2")
CASES = [
    Case("3", "run --input: an int64 float32 does not hold (2^24+1)", ("run", TINY, "--input", "x.npy"),
         "holds integers float32 does not hold exactly", _integers),
    Case("3", "flops --input: the same", ("flops", TINY, "--input", "x.npy"), "does not hold exactly",
         _integers),
    Case("4", "run --out d.npz/ (a folder's name)", ("run", TINY, *RANDOM, "--out", "d.npz/"), "ends in '/'"),
    Case("4", "train --out w.npz/", ("train", TINY, "--data", "data.npz", "--out", "w.npz/"), "ends in '/'",
         _data),
    Case("5", "SPARSE_SCAN_MAX_PLAN_SECONDS=inf", ("run", TINY, *RANDOM),
         "SPARSE_SCAN_MAX_PLAN_SECONDS='inf'", env={"SPARSE_SCAN_MAX_PLAN_SECONDS": "inf"}),
    Case("5", "SPARSE_SCAN_MAX_PLAN_SECONDS=1e400", ("run", TINY, *RANDOM), "must be a finite number",
         env={"SPARSE_SCAN_MAX_PLAN_SECONDS": "1e400"}),
    Case("5", "SPARSE_SCAN_CUDA_AWARE_MPI=abc", ("run", TINY, *RANDOM), "SPARSE_SCAN_CUDA_AWARE_MPI='abc'",
         env={"SPARSE_SCAN_CUDA_AWARE_MPI": "abc"}),
    Case("5", "SPARSE_SCAN_MEMORY_BUDGET=lots", ("run", TINY, *RANDOM), "SPARSE_SCAN_MEMORY_BUDGET='lots'",
         env={"SPARSE_SCAN_MEMORY_BUDGET": "lots"}),
    Case("6", "SPARSE_SCAN_COST_MODEL: Infinity constants", ("run", TINY, *RANDOM), "not a finite number",
         _damaged_calibration, env={"SPARSE_SCAN_COST_MODEL": "inf.json"}),
    Case("6", "calibrate --output over a file that is no calibration",
         ("calibrate", "--output", "notes.json"), "exists and is not a calibration (use --force",
         _write("notes.json", '{"mine": true}')),
    Case("7", "spec: a 40000x40000 linear", ("run", "m.yaml", "--random", "1"),
         "field 'out_features': the model up to its 1,600,000,000 parameters",
         _spec("{name: fc, type: linear, out_features: 40000}", "[40000]"), isolated=True),
    Case("7", "spec: a conv2d on a 1x30000x30000 input", ("run", "m.yaml", "--random", "1"),
         "field 'input_shape'", _spec("{name: conv, type: conv2d, out_channels: 4, kernel_size: 3}",
                                      "[1, 30000, 30000]"), isolated=True),
    Case("7", "spec: an lstm of hidden_size 40000", ("flops", "m.yaml"), "field 'hidden_size'",
         _spec("{name: rnn, type: lstm, hidden_size: 40000}", "[10, 1]",
               "  - {name: fc, type: linear, out_features: 2}\n"), isolated=True),
    Case("7", "run --random 10000000", ("run", TINY, "--random", "10000000"),
         "--random 10000000: a batch of 10000000 samples", isolated=True),
    Case("7", "train --batch-size 10000000",
         ("train", TINY, "--data", "data.npz", "--batch-size", "10000000"), "--batch-size 10000000: a batch",
         _data),
    Case("7", "spec: a YAML alias bomb", ("flops", "m.yaml"), "YAML nodes once its aliases are expanded",
         _bomb, isolated=True),
    Case("7", "spec: an alias of itself", ("flops", "m.yaml"), "holds an alias of itself",
         _write("m.yaml", "input_shape: [4]\nlayers: &x [*x]\n")),
    Case("7", "spec: 5 MiB of YAML", ("flops", "m.yaml"), "larger than 4.0 MiB",
         _write("m.yaml", "input_shape: [4]\nlayers: [{type: relu}]\n" + "#" * 5 * 2**20)),
    Case("7", "spec: /dev/zero", ("flops", "/dev/zero"), "not a regular file (a device)", isolated=True),
    Case("7", "spec: /dev/urandom", ("flops", "/dev/urandom"), "not a regular file (a device)",
         isolated=True),
    Case("8", "spec: a named pipe", ("flops", "pipe.yaml"), "not a regular file (a named pipe)",
         _pipe("pipe.yaml"), isolated=True),
    Case("8", "run --input: a named pipe", ("run", TINY, "--input", "pipe.npy"),
         "not a regular file (a named pipe)", _pipe("pipe.npy"), isolated=True),
    Case("8", "run --weights: a named pipe", ("run", TINY, *RANDOM, "--weights", "pipe.npz"),
         "not a regular file (a named pipe)", _pipe("pipe.npz")),
    Case("8", "train --data: a named pipe", ("train", TINY, "--data", "pipe.npz"),
         "not a regular file (a named pipe)", _pipe("pipe.npz")),
    Case("9", "run --out: a name of 300 characters", ("run", TINY, *RANDOM, "--out", "x" * 300 + ".npz"),
         "cannot write there: File name too long"),
    Case("10", "run --weights: a member that is no .npy", ("run", TINY, *RANDOM, "--weights", "w.npz"),
         "member 'fc.weight' is not an array (.npy)", _member_not_npy),
    Case("10", "spec weights: a member that is no .npy", ("run", "m.yaml", *RANDOM),
         "member 'fc.weight' is not an array (.npy)", _member_not_npy),
    Case("10", "train --data: a member that is no .npy", ("train", TINY, "--data", "w.npz"),
         "member 'fc.weight' is not an array (.npy)", _member_not_npy),
    Case("11", "train: a learning rate that diverges", ("train", TINY, "--data", "data.npz", "--lr", "1e30",
                                                         "--optimizer", "sgd", "--epochs", "1"),
         "training diverged at iteration", _data),
    Case("12", "run --out over a killed write's debris", ("run", TINY, *RANDOM, "--out", "g.npz", "--quiet"),
         "", _killed_write, code=0, after=_debris_removed),
    Case("14", "calibrate --output under a regular file", ("calibrate", "--output", "file/c.json"),
         "file is a regular file, not a folder", _write("file", "a regular file")),
    Case("15", "spec weights: a symlink loop", ("run", "m.yaml", *RANDOM), "a symlink loop",
         _both(_loop("w.npz"),
               _write("m.yaml", "input_shape: [4]\nweights: w.npz\nlayers: [{type: relu}]\n"))),
    Case("15", "run --out: a symlink, without --force", ("run", TINY, *RANDOM, "--out", "link.npz"),
         "exists (use --force to overwrite through the symlink)", _linked),
    Case("15", "run --out: a symlink, --force writes through it", ("run", TINY, *RANDOM, "--out", "link.npz",
                                                                     "--force", "--quiet"),
         "", _linked, code=0, after=_written_through),
]
"""Issue 47's command-line cases, by item."""


def _snapshot(folder: pathlib.Path) -> dict[str, tuple]:
    """Every file under ``folder``: its kind, size, modification time and link target."""
    found = {}
    for path in sorted(folder.rglob("*")):
        status = path.lstat()
        found[str(path.relative_to(folder))] = (status.st_mode, status.st_size, status.st_mtime_ns,
                                                os.readlink(path) if path.is_symlink() else None)
    return found


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_case(case: Case, folder: pathlib.Path, timeout: float = TIMEOUT) -> Outcome:
    """Run ``case`` in ``folder`` (empty; its files made first) and say whether it did what it should."""
    if case.setup is not None:
        case.setup(folder)
    before = _snapshot(folder)
    env = {name: value for name, value in os.environ.items() if not name.startswith("SPARSE_SCAN_")}
    env |= {"SPARSE_SCAN_MEMORY_BUDGET": BUDGET, "XDG_CACHE_HOME": str(folder)} | case.env
    try:
        done = subprocess.run([sys.executable, "-m", "sparse_scan.cli", *case.args], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=timeout, preexec_fn=_limit)
    except subprocess.TimeoutExpired:
        return Outcome(None, "", f"still running after {timeout:g} s")
    lines = done.stderr.splitlines()
    first = lines[0] if lines else ""
    problem = None
    if done.returncode != case.code:
        problem = f"exit code {done.returncode}, expected {case.code}"
    elif "Traceback" in done.stderr:
        problem = "a traceback"
    elif case.code == 2 and (len(lines) != 1 or not first.startswith("sparse-scan: error: ")):
        problem = f"{len(lines)} lines on stderr, expected one 'sparse-scan: error: ...'"
    elif case.fragment not in first:
        problem = f"no {case.fragment!r} in it"
    elif case.after is not None:
        problem = case.after(folder)
    elif _snapshot(folder) != before:
        problem = "files of the folder changed"
    return Outcome(done.returncode, first, problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose item or name holds this text")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds a case may run")
    options = parser.parse_args(argv)
    cases = [case for case in CASES if options.only in f"{case.item} {case.name}"]
    failed = 0
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="bad-input-") as scratch:
            outcome = run_case(case, pathlib.Path(scratch), options.timeout)
        failed += not outcome.matched
        code = "-" if outcome.code is None else outcome.code
        verdict = "ok  " if outcome.matched else "FAIL"
        print(f"{verdict} {case.item:>2}  {case.name:56.56} exit {code}  {outcome.first_line[:160]}"
              + ("" if outcome.matched else f"  <- {outcome.problem}"), flush=True)
    print(f"{len(cases) - failed} of {len(cases)} cases as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
