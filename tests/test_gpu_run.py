"""``tools/gpu_run.sh`` fits the GPU time we get and brings back evidence even when it breaks, and the
GPU code of its benchmarks runs.

A lent GPU comes for 15 minutes in all (the machine's start included), at most 600 s per command and at
most 8 files back, so part one must plan its steps within 400 s and the sanitizer part within 240 s
(``--dry-run`` lists both). A run whose CuPy cannot start, or whose install fails, must still return
``env.txt`` and ``parts.txt`` saying why, within seconds; a benchmark killed by its limit must keep the
rows it finished (``--rows``). The benchmarks' GPU paths are run here through the CuPy stand-in at small
sizes, so that the first GPU call measures instead of crashing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import STANDIN

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_run.sh"
BENCH = ROOT / "bench"
MAX_FILES = 8
BUDGET_S = {"one": 400, "sanitizer": 240}  # of command time, inside the 15 minutes (docs/gpu.md)
PART_ONE = ["env", "probe", "install", "tests", "distributed", "rnn-1000", "rnn-30000", "spgemm", "scan",
            "lstm", "bridge"]


def dry_run(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                            check=True, cwd=ROOT, env=env)
    return result.stdout


def planned_steps(out: str) -> dict[str, str]:
    """The dry run's steps: name -> the line that shows its limit, gate and command."""
    return {line.split()[0]: line for line in out.splitlines() if re.match(r"  \S+ +\d+ s ", line)}


@pytest.mark.parametrize("part", ["one", "sanitizer"])
def test_each_part_fits_its_budget_and_brings_back_at_most_eight_files(part):
    out = dry_run(part)
    planned, total = map(int, re.search(r"limits adding up to (\d+) s of TOTAL_S=(\d+) s", out).groups())
    assert planned <= total <= BUDGET_S[part], out
    limits = [int(re.match(r"  \S+ +(\d+) s ", line).group(1)) for line in planned_steps(out).values()]
    assert sum(limits) == planned
    files = re.search(r"files \((\d+)\): (.*)", out)
    names = files.group(2).split()
    assert int(files.group(1)) == len(names) == len(set(names)) <= MAX_FILES
    assert {"env.txt", "parts.txt"} <= set(names)
    written = set(re.findall(r"\$OUT/([\w$.-]+)", out))
    assert written <= set(names), written - set(names)
    assert all(re.fullmatch(r"[\w$.-]+", name) for name in names)  # names the device tool brings back


def test_part_one_runs_its_steps_in_the_order_of_their_value():
    out = dry_run("one")
    steps = planned_steps(out)
    assert list(steps) == PART_ONE
    tests = steps["tests"]
    assert "pytest -m gpu -v" in tests and "faulthandler_timeout=" in tests and " -k " not in tests
    assert "--steps 1000 --batches --gru " in steps["rnn-1000"]  # T = 1000, B = 16
    assert "--steps 30000 --batches --gru " in steps["rnn-30000"]  # the paper's largest point
    for name, script in [("rnn-1000", "rnn"), ("rnn-30000", "rnn"), ("spgemm", "spgemm"), ("scan", "scan"),
                         ("lstm", "lstm")]:
        assert f"bench/{script}.py --device gpu" in steps[name]
        assert f"--rows $OUT/{script}-$GPU.jsonl" in steps[name]  # flushed row by row
    assert "bench/bridge.py --device gpu" in steps["bridge"]
    assert "--rows $OUT/lstm-$GPU.jsonl" in steps["bridge"]  # the LSTM's file: part one keeps 8 files
    # P = 2 GPU ranks sharing the GPU, host staging and CUDA-aware MPI (where the MPI is), in the
    # scan's file (the mpirun tests of GPU ranks are not marked gpu: the tests step runs none of them)
    distributed = steps["distributed"]
    assert "bench/distributed.py --device gpu --ranks 2 --transports staging,cuda-aware" in distributed
    assert "--rows $OUT/scan-$GPU.jsonl" in distributed
    assert steps["probe"].split()[3] == steps["install"].split()[3] == "always"  # the gates


def test_a_per_test_timeout_is_used_only_where_pytest_timeout_is_installed(tmp_path):
    without = dry_run("one", env=dict(os.environ, PYTHON=sys.executable))
    (tmp_path / "pytest_timeout.py").write_text("")  # importable: the script takes it as installed
    env = dict(os.environ, PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with_plugin = dry_run("one", env=env)
    installed = subprocess.run([sys.executable, "-c", "import pytest_timeout"],
                               capture_output=True).returncode == 0
    assert ("--timeout=" in planned_steps(without)["tests"]) == installed
    assert "--timeout=60" in planned_steps(with_plugin)["tests"]
    assert "--timeout=60" in planned_steps(dry_run("sanitizer", env=env))["memcheck"]


def test_a_rerun_keeps_the_gates_and_the_named_steps_only():
    out = dry_run("one", "rnn-30000", "lstm")
    assert list(planned_steps(out)) == ["env", "probe", "install", "rnn-30000", "lstm"]
    assert re.search(r"files \(5\): env.txt parts.txt rnn-\$GPU.jsonl bench.log lstm-\$GPU.jsonl", out)
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "one", "memcheck"], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 2 and "no step memcheck" in result.stderr


def test_an_unknown_part_is_a_usage_error():
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "everything"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


# --- simulated runs, on this machine without a GPU ------------------------------------------------------

def real_gpu_usable() -> bool:
    probe = "import cupy, sys; sys.exit(0 if cupy.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode == 0


def simulated_run(out: pathlib.Path, *args: str, **hooks: str) -> tuple[subprocess.CompletedProcess, float,
                                                                        dict[str, list[str]]]:
    """Run the script for real into ``out`` (PYTHON: this interpreter; ``hooks``: GPU_RUN_INSTALL,
    GPU_RUN_PROBE, SANITIZER, TOTAL_S); returns the process, its seconds and parts.txt by step name."""
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, **hooks)
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    seconds = time.monotonic() - start
    lines = (out / "parts.txt").read_text().splitlines()
    assert lines[0].startswith("# tools/gpu_run.sh")
    parts = {fields[0]: fields for fields in (line.split("\t") for line in lines[1:])}
    assert all(len(fields) == 5 for fields in parts.values()), lines  # name, status, seconds, limit, reason
    return result, seconds, parts


@pytest.mark.skipif(real_gpu_usable(), reason="simulates a machine whose CuPy cannot reach a GPU")
def test_a_run_whose_cupy_cannot_start_returns_env_and_parts_with_the_reason(tmp_path):
    result, seconds, parts = simulated_run(tmp_path, GPU_RUN_INSTALL="true")  # the real CuPy probe
    assert result.returncode != 0 and seconds < 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "parts.txt"]
    env = (tmp_path / "env.txt").read_text()
    for name in ("python", "numpy", "numba", "scipy", "cupy", "setuptools", "torch", "cupy NVRTC",
                 "cupy CUDA runtime", "torch CUDA"):
        assert re.search(rf"^{name} \S", env, re.M), name
    assert "== cupy probe: FAILED" in env
    error = env.split("== cupy probe\n")[1].split("== cupy probe: FAILED")[0].strip().splitlines()[-1]
    assert list(parts) == PART_ONE
    assert parts["env"][1] == "ok" and parts["install"][1] == "ok"
    assert parts["probe"][1] == "failed exit 1" and parts["probe"][4] == f"no usable GPU: {error}"
    for name in PART_ONE[3:]:
        status, used, _, reason = parts[name][1:]
        assert status == "skipped" and used == "0"
        assert reason == f"probe failed exit 1: no usable GPU: {error}"


def test_a_failed_install_stops_the_run_after_the_install_step(tmp_path):
    result, seconds, parts = simulated_run(tmp_path, GPU_RUN_PROBE="echo GPU=simulated-gpu",
                                           GPU_RUN_INSTALL="echo 'error: no setuptools here' >&2; exit 3")
    assert result.returncode != 0 and seconds < 60
    assert [parts[name][1] for name in ("env", "probe", "install")] == ["ok", "ok", "failed exit 3"]
    assert parts["install"][4] == "error: no setuptools here"
    for name in PART_ONE[3:]:
        _, status, used, _, reason = parts[name]
        assert (status, used, reason) == ("skipped", "0", "install failed exit 3: error: no setuptools here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "parts.txt"]  # no test ran
    assert "error: no setuptools here\n== install: exit 3" in (tmp_path / "env.txt").read_text()


@pytest.mark.slow
def test_a_step_past_its_limit_is_killed_and_named(tmp_path):
    """The install hangs: killed at its 25 s limit (about 30 s here), its last line kept, the rest skipped."""
    limit = int(planned_steps(dry_run("one"))["install"].split()[1])
    result, seconds, parts = simulated_run(tmp_path, GPU_RUN_PROBE="echo GPU=simulated-gpu",
                                           GPU_RUN_INSTALL="echo building the wheel; sleep 600")
    status, used, applied, reason = parts["install"][1:]
    assert status == "killed at limit" and int(applied) == limit and limit <= int(used) <= limit + 6
    assert reason == f"killed after {used} s; last line: building the wheel"
    assert all(parts[name][1] == "skipped" for name in PART_ONE[3:]) and seconds < limit + 30


def test_the_sanitizer_part_says_not_supported_and_stops(tmp_path):
    """Where compute-sanitizer refuses the device (it does on gVisor machines), its probe says so and
    the memcheck and racecheck steps are skipped with that reason."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\necho '========= COMPUTE-SANITIZER'\n"
                    "echo '========= Error: Device not supported'\nexit 1\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    result, seconds, parts = simulated_run(out, "sanitizer", GPU_RUN_PROBE="echo GPU=simulated-gpu",
                                           GPU_RUN_INSTALL="true", SANITIZER=str(fake))
    assert result.returncode != 0 and seconds < 60
    assert list(parts) == ["env", "probe", "install", "sanitizer-probe", "memcheck", "racecheck"]
    status, _, _, reason = parts["sanitizer-probe"][1:]
    assert status == "failed exit 1"
    assert reason == ("not supported: compute-sanitizer refuses this device: "
                      "========= Error: Device not supported")
    for name in ("memcheck", "racecheck"):
        assert parts[name][1] == "skipped" and parts[name][4] == f"sanitizer-probe failed exit 1: {reason}"
    assert "Device not supported" in (out / "sanitizer-probe.log").read_text()


# --- the benchmarks' rows files -------------------------------------------------------------------------

def _bench_common():
    """bench/common.py, loaded by path (bench/ is not a package; its folder stays off sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


read_rows = _bench_common().read_rows


def run_bench(script: str, *args: str, cwd: pathlib.Path, standin: bool = False) -> tuple[dict, dict]:
    """Run a benchmark with ``--rows`` (through the CuPy stand-in with ``standin``); its printed JSON and
    its rows file read back."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests")) if standin else None
    prefix = [sys.executable, "-m", "cupy_standin"] if standin else [sys.executable]
    rows = cwd / f"{script}.jsonl"
    result = subprocess.run([*prefix, str(BENCH / f"{script}.py"), *args, "--rows", str(rows)],
                            capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), read_rows(rows)


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [
    ("lstm", ["--steps", "10", "--batches"]),
    ("spgemm", ["--json", "--no-dense", "--repeats", "1", "--max-multiply-adds", "1e6",
                "--max-scalar-multiply-adds", "1e6", "--max-scipy-multiply-adds", "1e6"]),
    ("scan", ["--json", "--no-dense", "--batch", "1", "--repeats", "1", "--max-step-flops", "1e7"]),
])
def test_each_benchmark_writes_in_its_rows_file_the_rows_its_json_reports(tmp_path, script, args):
    report, rows = run_bench(script, *args, cwd=tmp_path)
    assert rows["finished"] and rows["benchmark"] == script
    assert rows["rows"] == report["rows"] and len(rows["rows"]) >= 1
    assert rows["machine"]["backend"] == report["machine"]["backend"] == "cpu"


def test_a_benchmark_killed_half_way_keeps_its_finished_rows(tmp_path):
    """What ``timeout`` does to a step at its limit (SIGTERM to the process group, the PyTorch worker
    included), done once the first row is in: the rows measured stay, whole, in the file."""
    steps = [str(t) for t in range(10, 40)]  # 30 rows of a few seconds each: far from done at the kill
    rows = tmp_path / "rnn.jsonl"
    command = [sys.executable, str(BENCH / "rnn.py"), "--steps", *steps, "--batches", "--gru", "--no-jax",
               "--json", "--rows", str(rows)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tmp_path,
                               start_new_session=True)
    deadline = time.monotonic() + 300
    while (not rows.exists() or rows.read_text().count('"row"') < 1) and process.poll() is None:
        assert time.monotonic() < deadline, "no row in 300 s"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM and stdout == b""  # killed before its final JSON
    saved = read_rows(rows)
    assert not saved["finished"] and saved["machine"]["backend"] == "cpu"
    measured = [row["T"] for row in saved["rows"]]
    assert 1 <= len(measured) < len(steps) and measured == [int(t) for t in steps[:len(measured)]]
    assert all(row["linear"]["backward_s"] > 0 for row in saved["rows"])
    if importlib.util.find_spec("matplotlib") is not None:  # and they still draw Fig. 8 (no B sweep here)
        plot = tmp_path / "rnn.png"
        subprocess.run([sys.executable, str(BENCH / "rnn.py"), "--replot", str(rows), "--plot", str(plot)],
                       check=True, capture_output=True, timeout=120)
        assert plot.stat().st_size > 0


def test_a_rows_file_cut_in_its_last_line_reads_back_to_its_whole_rows(tmp_path):
    path = tmp_path / "cut.jsonl"
    lines = [{"benchmark": "rnn", "machine": {"backend": "gpu"}}, {"benchmark": "rnn", "row": {"T": 1000}},
             {"benchmark": "rnn", "machine": {"backend": "gpu"}}, {"benchmark": "rnn", "row": {"T": 30000}}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"benchmark": "rnn", "ro')
    assert read_rows(path) == {"benchmark": "rnn", "machine": {"backend": "gpu"}, "finished": False,
                               "rows": [{"T": 1000}, {"T": 30000}]}


# --- the benchmarks' GPU paths, through the CuPy stand-in -----------------------------------------------

@pytest.mark.skipif(not STANDIN, reason="runs the benchmark through the CuPy stand-in")
def test_the_rnn_benchmark_runs_its_gpu_path(tmp_path):
    report, rows = run_bench("rnn", "--device", "gpu", "--steps", "12", "--batches", "--gru", "--no-jax",
                             "--json", cwd=tmp_path, standin=True)
    assert report["machine"]["backend"] == "gpu" and report["machine"]["gpu"] == "CuPy stand-in (CPU)"
    (row,) = report["rows"]
    assert (row["T"], row["B"]) == (12, 16) and row["linear"]["backward_s"] > 0
    assert rows["rows"] == report["rows"] and rows["finished"]
    assert rows["machine"]["gpu"] == "CuPy stand-in (CPU)"


@pytest.mark.slow
@pytest.mark.skipif(not STANDIN, reason="runs the benchmark through the CuPy stand-in")
def test_the_scan_benchmark_runs_its_gpu_path(tmp_path):
    """The pruned VGG-11 backward on the device for the schedules whose products stay small (about 12 s
    here; bench/spgemm.py's GPU path was run the same way, in 4 minutes: too long for CI)."""
    report, rows = run_bench("scan", "--device", "gpu", "--json", "--repeats", "1", "--no-dense", "--batch",
                             "1", "--max-step-flops", "1e7", cwd=tmp_path, standin=True)
    assert report["machine"]["backend"] == "gpu" and report["machine"]["gpu"] == "CuPy stand-in (CPU)"
    ran = {(row["method"], row["levels"]) for row in report["rows"] if "backward_s" in row}
    assert {("linear", None), ("hybrid", 1)} <= ran
    assert all(row["max_rel_error_vs_linear"] < 1e-4 for row in report["rows"] if "backward_s" in row)
    assert rows["rows"] == report["rows"] and rows["finished"]
