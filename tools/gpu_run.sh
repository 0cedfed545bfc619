#!/usr/bin/env bash
# The GPU checks and the headline GPU benchmarks, sized for the device tool's 15 minutes.
#
#   OUT=DIR bash tools/gpu_run.sh [--dry-run] [one|sanitizer] [STEP...]      (default: one, every step)
#
# The budget (docs/gpu.md): a lent GPU comes for 15 minutes in all, the machine's start (1-2 minutes)
# and its idle time included, at most 600 s per command and at most 8 files (16 MiB each) back from
# $OUT per command. So:
#
#   start 1-2 min + part one <= 400 s (6.7 min) + transfers and margin ~1 min  = 9-10 min,
#   leaving 5-6 min: the sanitizer part (<= 240 s, 4 min) or one short fix-and-rerun of a few steps
#   (`bash tools/gpu_run.sh one rnn-30000`), run at once while the machine is still warm, then give the
#   machine back (a fresh start costs 1-2 min and none starts with under 4 min left).
#
# A part is a list of steps, each with its own time limit; a step past its limit is killed (its process
# group: benchmark workers too) and the next one runs. The limits add up to TOTAL_S (400 s for part one,
# 240 s for the sanitizer part); a step that no longer fits in what is left of TOTAL_S is skipped. Steps
# come in the order of the value of what they return, and every step leaves its evidence as it goes:
#
#   env.txt    written first, always: kernel, GPU name, driver and CUDA (nvidia-smi), nvcc, Python, the
#              versions of numpy, numba, scipy, cupy (its CUDA runtime, NVRTC and driver), torch (its
#              CUDA and cuDNN), setuptools, pytest, pytest-timeout; then the CuPy probe's output and
#              result (success or the error), then the install's output.
#   parts.txt  one line per step, rewritten after every step: name, status (ok / failed exit N /
#              killed at limit / skipped / running / pending), seconds used, limit, reason (a failure's
#              last log line, or why a step was skipped), tab-separated.
#   gpu-tests.log, *.log   pytest -v: one line per test, named before it runs, so a step killed by
#              its limit still says which test hung; a per-test timeout (--timeout) where pytest-timeout
#              is installed, so a hang costs one test; faulthandler_timeout dumps a hung test's stacks.
#   <bench>-<gpu>.jsonl    the benchmarks' --rows files: one JSON line per measured row, appended the
#              moment it is measured (bench/common.py's Rows; read back by read_rows), so a benchmark
#              killed by its limit keeps the rows it finished. Their stderr goes to bench.log.
#
# The gates: the CuPy probe (a device, a kernel launched) and the install (pip install --no-deps
# --no-build-isolation -e .) both always run, probe first; if either fails, every later step is
# skipped with the reason in parts.txt, and the script exits non-zero in seconds with env.txt and
# parts.txt written. In the sanitizer part compute-sanitizer is probed on a trivial CuPy program
# first; where it refuses the device ("Device not supported", as on gVisor machines) the part says
# so in parts.txt and stops.
#
#   one        env, probe, install; every test marked gpu (SPARSE_SCAN_REQUIRE_GPU=1: a missing GPU
#              fails them); P=2 GPU ranks sharing
#              the GPU through host staging and, where the MPI is CUDA-aware, CUDA-aware MPI, equal to
#              one process, timed, with each transport's latency and bandwidth (bench/distributed.py
#              --device gpu; its rows go to the scan's file); RNN backward vs cuDNN at T=1000 and at the
#              paper's largest point T=30000
#              (B=16, H=20); the planned SpGEMM vs cupyx (cuSPARSE), 97%-pruned VGG-11; the whole
#              97%-pruned VGG-11 backward vs PyTorch autograd on CUDA; the LSTM backward vs cuDNN; a
#              training iteration (Adam) of the 97%-pruned VGG-11 (torch.nn.utils.prune masks: the
#              sparse forward, scan and sampled weight gradient) and of the paper's LSTM classifier
#              through sparse_scan.torch.bppsa vs PyTorch autograd on CUDA (cuDNN) (bench/bridge.py
#              --burst 1, within its 25 s; its rows go to the LSTM's file).
#              Files (8): env.txt parts.txt gpu-tests.log rnn-<gpu>.jsonl spgemm-<gpu>.jsonl
#              scan-<gpu>.jsonl lstm-<gpu>.jsonl bench.log
#              Limits (s): env 20, probe 15, install 25, tests 150, distributed 35, rnn-1000 20,
#              rnn-30000 30, spgemm 25, scan 35, lstm 20, bridge 25 = 400.
#   sanitizer  env, probe, install, the compute-sanitizer probe; memcheck over the kernel-launching gpu
#              tests at small sizes (CuPy's memory pool off: SPARSE_SCAN_NO_MEMPOOL=1); racecheck over
#              the kernels with barriers (the dense scan's tiled and chain kernels).
#              Files (5): env.txt parts.txt sanitizer-probe.log memcheck.log racecheck.log
#              Limits (s): env 20, probe 15, install 25, sanitizer-probe 20, memcheck 110, racecheck 50
#              = 240.
#
# STEP...: run only these steps of the part (env, probe and install always run), for a short rerun;
# their files in $OUT are appended to (a rows file then holds both runs, each with its first line).
# --dry-run prints the steps, their limits and the files without running anything
# (tests/test_gpu_run.py checks the sums and the file counts through it).
#
# Environment: OUT (default bench/results/gpu-run), PYTHON (default python3), TOTAL_S, SANITIZER (the
# compute-sanitizer command). Hooks for the tests on machines without a GPU: GPU_RUN_INSTALL replaces
# the install command (e.g. "true", or "false" to simulate a failed install), GPU_RUN_PROBE replaces
# the CuPy probe (a command; a line "GPU=<name>" in its output names the device).
#
# TF32 is off (NVIDIA_TF32_OVERRIDE=0): the cuDNN/cuBLAS baselines compute in float32 like our kernels.
# Commit the results under bench/results/ with the device named, and quote them in the closing note.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
    echo "usage: OUT=DIR bash tools/gpu_run.sh [--dry-run] [one|sanitizer] [STEP...]" >&2
    exit 2
}

dry_run=0
if [[ ${1:-} == --dry-run ]]; then
    dry_run=1
    shift
fi
part=${1:-one}
(($#)) && shift
only=("$@")
OUT=${OUT:-bench/results/gpu-run}
PYTHON=${PYTHON:-python3}
INSTALL=${GPU_RUN_INSTALL:-"$PYTHON -m pip install --quiet --no-deps --no-build-isolation -e ."}
if [[ -z ${SANITIZER:-} ]]; then  # on the PATH, else where CUDA puts it
    SANITIZER=compute-sanitizer
    if ! command -v compute-sanitizer > /dev/null && [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
        SANITIZER=/usr/local/cuda/bin/compute-sanitizer
    fi
fi
export NVIDIA_TF32_OVERRIDE=0 SPARSE_SCAN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1

# pytest over the gpu tests: one line per test (-v), a per-test timeout where pytest-timeout exists.
per_test=""
if "$PYTHON" -c "import pytest_timeout" > /dev/null 2>&1; then
    per_test="--timeout=60"
fi
pytest_gpu="$PYTHON -m pytest -m gpu -v --tb=short -p no:cacheprovider -o faulthandler_timeout=60 $per_test"
pytest_gpu=${pytest_gpu% }

# The gpu tests that launch kernels, at sizes small enough for the sanitizers' 10-100x slowdown, the
# most telling first (the step's limit cuts the list where it must).
SANITIZED_TESTS=(tests/test_gpu_paths.py
                 "tests/test_scan_gpu.py::test_gpu_backward_equals_cpu_for_every_schedule"
                 "tests/test_dense_scan_kernel.py::test_gpu_recurrent_backward_equals_numpy"
                 tests/test_pooling.py tests/test_conv.py)
# The kernels with barriers (the dense scan's tiled and chain kernels), for racecheck.
BARRIER_TESTS="tests/test_dense_scan_kernel.py::test_gpu_dense_scan_equals_numpy -k 'float32 and not 21'"
# A trivial CuPy program: allocates, compiles and launches two kernels, reads the result back.
TRIVIAL="import cupy; x = cupy.arange(1000, dtype=cupy.float32); assert float(x.sum()) == 499500.0"

# The steps: "name|limit|gate|log|files|command". gate: "gate", a failure skips every later step;
# "always", the same, and the step runs even after an earlier gate failed; "-", an ordinary step
# (skipped once a gate has failed). log: the file whose last line explains a failure ($WORK is a
# scratch folder outside $OUT). Commands run under bash -o pipefail -c.
steps=()
step() { steps+=("$1|$2|$3|$4|$5|$6"); }
step env 20 - "\$OUT/env.txt" "env.txt" "collect_env >> \$OUT/env.txt 2>&1"
step probe 15 always "\$WORK/probe.log" "env.txt" "probe_cupy"
step install 25 always "\$WORK/install.log" "env.txt" "install_package"
case $part in
    one)
        TOTAL_S=${TOTAL_S:-400}
        bench="--device gpu"
        step tests 150 - "\$OUT/gpu-tests.log" "gpu-tests.log" "$pytest_gpu --durations=15 \
>> \$OUT/gpu-tests.log 2>&1"
        step distributed 35 - "\$OUT/bench.log" "scan-\$GPU.jsonl bench.log" "$PYTHON bench/distributed.py \
$bench --ranks 2 --transports staging,cuda-aware --model lenet5.yaml --batch 16 --repeats 5 \
--rank-command $PYTHON --rows \$OUT/scan-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        step rnn-1000 20 - "\$OUT/bench.log" "rnn-\$GPU.jsonl bench.log" "$PYTHON bench/rnn.py $bench --steps 1000 \
--batches --gru --no-jax --rows \$OUT/rnn-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        step rnn-30000 30 - "\$OUT/bench.log" "rnn-\$GPU.jsonl bench.log" "$PYTHON bench/rnn.py $bench --steps 30000 \
--batches --gru --no-jax --rows \$OUT/rnn-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        step spgemm 25 - "\$OUT/bench.log" "spgemm-\$GPU.jsonl bench.log" "$PYTHON bench/spgemm.py $bench --repeats 5 \
--no-dense --rows \$OUT/spgemm-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        step scan 35 - "\$OUT/bench.log" "scan-\$GPU.jsonl bench.log" "$PYTHON bench/scan.py $bench --repeats 5 \
--no-dense --rows \$OUT/scan-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        step lstm 20 - "\$OUT/bench.log" "lstm-\$GPU.jsonl bench.log" "$PYTHON bench/lstm.py --device gpu --steps 1000 \
--batches --rows \$OUT/lstm-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        step bridge 25 - "\$OUT/bench.log" "lstm-\$GPU.jsonl bench.log" "$PYTHON bench/bridge.py --device gpu \
--repeats 5 --burst 1 --rows \$OUT/lstm-\$GPU.jsonl > /dev/null 2>> \$OUT/bench.log"
        ;;
    sanitizer)
        TOTAL_S=${TOTAL_S:-240}
        sanitize="$SANITIZER --error-exitcode 1 --print-limit 20"
        step sanitizer-probe 20 gate "\$OUT/sanitizer-probe.log" "sanitizer-probe.log" "$sanitize --tool memcheck \
$PYTHON -c '$TRIVIAL' >> \$OUT/sanitizer-probe.log 2>&1"
        step memcheck 110 - "\$OUT/memcheck.log" "memcheck.log" "SPARSE_SCAN_NO_MEMPOOL=1 $sanitize --tool memcheck \
$pytest_gpu ${SANITIZED_TESTS[*]} >> \$OUT/memcheck.log 2>&1"
        step racecheck 50 - "\$OUT/racecheck.log" "racecheck.log" "$sanitize --tool racecheck $pytest_gpu \
$BARRIER_TESTS >> \$OUT/racecheck.log 2>&1"
        ;;
    *)
        usage
        ;;
esac

# STEP...: keep env, probe, install and the named steps.
if ((${#only[@]})); then
    kept=()
    for name in "${only[@]}"; do
        found=0
        for entry in "${steps[@]}"; do
            [[ ${entry%%|*} == "$name" ]] && found=1
        done
        ((found)) || { echo "tools/gpu_run.sh: part $part has no step $name" >&2; usage; }
    done
    for entry in "${steps[@]}"; do
        name=${entry%%|*}
        if [[ $name =~ ^(env|probe|install)$ || " ${only[*]} " == *" $name "* ]]; then
            kept+=("$entry")
        fi
    done
    steps=("${kept[@]}")
fi

planned=0
files="parts.txt"
for entry in "${steps[@]}"; do
    IFS='|' read -r _ limit _ _ outputs _ <<< "$entry"
    planned=$((planned + limit))
    for output in $outputs; do
        [[ " $files " == *" $output "* ]] || files="$files $output"
    done
done
files="env.txt ${files/ env.txt/}"
if ((dry_run)); then
    echo "part $part: ${#steps[@]} steps, limits adding up to ${planned} s of TOTAL_S=${TOTAL_S} s"
    for entry in "${steps[@]}"; do
        IFS='|' read -r name limit gate _ outputs command <<< "$entry"
        printf '  %-16s %4d s  %-6s %s\n' "$name" "$limit" "$gate" "$command"
    done
    echo "files ($(wc -w <<< "$files")): $files"
    exit 0
fi

# ---------------------------------------------------------------------------------------------------
# The run. Builtin steps (functions exported to the steps' bash -c).
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
GPU=unknown-gpu
export OUT WORK GPU PYTHON INSTALL SANITIZER part
# env.txt and parts.txt start afresh; a whole part's other files too (the rows files append), while a
# rerun of named steps appends to what an earlier run left in the same folder.
for pattern in $files; do
    if [[ $pattern == env.txt || $pattern == parts.txt ]] || ((${#only[@]} == 0)); then
        rm -f -- "$OUT"/${pattern//\$GPU/*}
    fi
done

collect_env() {
    echo "== tools/gpu_run.sh $part, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null \
|| echo unknown), kernel $(uname -r)"
    if command -v nvidia-smi > /dev/null; then
        timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
            | sed 's/^/gpu: /'
        timeout 5 nvidia-smi | grep -m 1 "Driver Version"  # the driver's and its CUDA's versions
    else
        echo "nvidia-smi: not on PATH"
    fi
    if command -v nvcc > /dev/null; then echo "nvcc: $(nvcc --version | tail -n 1)"; else echo "nvcc: not on PATH"; fi
    if command -v "${SANITIZER%% *}" > /dev/null; then
        echo "compute-sanitizer: $(command -v "${SANITIZER%% *}"), \
$(timeout 10 "${SANITIZER%% *}" --version 2>&1 | grep -i -m 1 version)"
    else
        echo "compute-sanitizer: not on PATH"
    fi
    "$PYTHON" - <<'EOF'
import importlib
import sys

print("python", sys.version.replace("\n", " "), flush=True)
for name in ("numpy", "numba", "scipy", "cupy", "mpi4py", "setuptools", "pytest", "pytest_timeout", "torch"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no __version__)"), flush=True)
    except Exception as error:  # missing, or failing to import: say which
        print(name, "not importable:", f"{type(error).__name__}: {error}", flush=True)


def report(label, fn):
    try:
        print(label, fn(), flush=True)
    except Exception as error:
        print(label, "unknown:", f"{type(error).__name__}: {error}", flush=True)


report("cupy CUDA runtime", lambda: __import__("cupy").cuda.runtime.runtimeGetVersion())
report("cupy NVRTC", lambda: ".".join(map(str, __import__("cupy").cuda.nvrtc.getVersion())))
report("cupy CUDA driver", lambda: __import__("cupy").cuda.runtime.driverGetVersion())
report("torch CUDA", lambda: __import__("torch").version.cuda)
report("torch cuDNN", lambda: __import__("torch").backends.cudnn.version())
report("torch CUDA available", lambda: __import__("torch").cuda.is_available())
EOF
}

probe_cupy() {
    local status
    echo "== cupy probe" >> "$OUT/env.txt"
    if [[ -n ${GPU_RUN_PROBE:-} ]]; then
        bash -c "$GPU_RUN_PROBE" 2>&1 | tee "$WORK/probe.log" >> "$OUT/env.txt"
    else
        "$PYTHON" - 2>&1 <<'EOF' | tee "$WORK/probe.log" >> "$OUT/env.txt"
import cupy

count = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
x = cupy.arange(1000, dtype=cupy.float32)
assert float(x.sum()) == 499500.0, "a kernel gave a wrong sum"
print(f"ok: {count} device(s); 0: {name}, sm_{props['major']}{props['minor']}, "
      f"{props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.1f} GiB; kernels ran")
print("GPU=" + "-".join(name.lower().split()))
EOF
    fi
    status=$?
    if ((status)); then
        echo "== cupy probe: FAILED (exit $status): every GPU step is skipped" >> "$OUT/env.txt"
    else
        echo "== cupy probe: ok" >> "$OUT/env.txt"
    fi
    return $status
}

install_package() {
    local status
    echo "== install: $INSTALL" >> "$OUT/env.txt"
    bash -c "$INSTALL" 2>&1 | tee "$WORK/install.log" >> "$OUT/env.txt"
    status=$?
    echo "== install: exit $status" >> "$OUT/env.txt"
    return $status
}
export -f collect_env probe_cupy install_package

# One record per step: "status|seconds|limit|reason"; parts.txt is rewritten after each step.
declare -A record
write_parts() {
    local entry name limit status seconds used reason
    {
        printf '# tools/gpu_run.sh %s, TOTAL_S=%s: step, status, seconds, limit, reason\n' "$part" "$TOTAL_S"
        for entry in "${steps[@]}"; do
            IFS='|' read -r name limit _ _ _ _ <<< "$entry"
            IFS='|' read -r status seconds used reason <<< "${record[$name]:-pending|0|$limit|}"
            printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$seconds" "$used" "$reason"
        done
    } > "$OUT/parts.txt"
}
last_line() {  # the last non-empty line of a file, on one line, at most 300 characters
    [[ -f $1 ]] && grep -v '^[[:space:]]*$' "$1" | tail -n 1 | tr -d '\r|\t' | cut -c 1-300
}

write_parts
stopped=""   # why the steps after a failed gate are skipped
status_all=0
for entry in "${steps[@]}"; do
    IFS='|' read -r name limit gate log _ command <<< "$entry"
    log=${log//\$OUT/$OUT}
    log=${log//\$WORK/$WORK}
    left=$((TOTAL_S - SECONDS))
    if [[ -n $stopped && $gate != always ]]; then
        record[$name]="skipped|0|$limit|$stopped"
        status_all=1
        write_parts
        continue
    fi
    if ((left < limit / 2)); then
        record[$name]="skipped|0|$limit|only ${left} s left of TOTAL_S=${TOTAL_S} s"
        status_all=1
        write_parts
        continue
    fi
    ((limit > left)) && limit=$left
    record[$name]="running|0|$limit|started at ${SECONDS} s"
    write_parts
    [[ $log == "$OUT"/*.log ]] && echo "== $name (limit ${limit} s, $(date -u +%H:%M:%S)): $command" >> "$log"
    echo "== $name (limit ${limit} s): $command" >&2
    start=$SECONDS
    timeout -k 5 "$limit" bash -o pipefail -c "$command"
    status=$?
    seconds=$((SECONDS - start))
    reason=$(last_line "$log")
    if ((status == 0)); then
        outcome=ok reason=""
    elif ((status == 124 || status == 137)) && ((seconds >= limit - 1)); then  # timeout's TERM, then KILL
        outcome="killed at limit" reason="killed after ${seconds} s; last line: ${reason}"
    else
        outcome="failed exit $status"
    fi
    if [[ $name == probe && $status != 0 ]]; then
        reason="no usable GPU: $reason"
    elif [[ $name == sanitizer-probe && $status != 0 ]]; then
        if grep -qi "not supported" "$log" 2>/dev/null; then
            reason="not supported: compute-sanitizer refuses this device: $(grep -i -m 1 "not supported" "$log" \
| tr -d '\t|' | cut -c 1-200)"
        else
            reason="compute-sanitizer does not run here: $reason"
        fi
    fi
    record[$name]="$outcome|$seconds|$limit|$reason"
    echo "== $name: $outcome after ${seconds} s${reason:+: $reason}" >&2
    if ((status)); then
        status_all=1
        if [[ $gate != - ]]; then
            stopped="${stopped:+$stopped; }$name $outcome${reason:+: $reason}"
        fi
    fi
    if [[ $name == probe && $status == 0 ]]; then
        GPU=$(sed -n 's/^GPU=\([A-Za-z0-9_.-]*\).*/\1/p' "$log" | tail -n 1)
        GPU=${GPU:-unknown-gpu}
        export GPU
    fi
    write_parts
done
cat "$OUT/parts.txt" >&2
exit $status_all
