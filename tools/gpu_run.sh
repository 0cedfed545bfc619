#!/usr/bin/env bash
# The GPU checks and the headline GPU benchmarks, sized for the device tool: one call of at most 10
# minutes (600 s) for everything that matters, a second optional call for compute-sanitizer.
#
#   OUT=DIR bash tools/gpu_run.sh [--dry-run] [one|sanitizer]      (default: one)
#
# Budget arithmetic (docs/gpu.md): GPU time comes in calls of at most 600 s of command time, about 30
# minutes per session in all, each new machine costing 1-2 minutes to start, and at most 8 files of
# under 16 MiB come back from $OUT per call. So a part is a list of steps, each with its own time limit
# (a step past its limit is killed and the next one runs), whose limits add up to TOTAL_S = 480 s: 2
# minutes of margin inside the 600 s call for the transfers and a slow start of Python. A step that no
# longer fits in what is left of TOTAL_S is skipped, named in parts.txt. Each part writes at most 8
# files (checked by tests/test_gpu_run.py through --dry-run, which prints the steps, their limits and
# the files without running anything).
#
#   one        install; every test marked gpu (SPARSE_SCAN_REQUIRE_GPU=1: a missing GPU fails them);
#              RNN backward vs cuDNN at T=1000, B=16; the planned SpGEMM vs cupyx (cuSPARSE); the whole
#              97%-pruned VGG-11 backward vs PyTorch autograd on CUDA.
#              Files: env.txt parts.txt gpu-tests.log rnn-<gpu>.json spgemm-<gpu>.json scan-<gpu>.json
#              bench.log (7)
#   sanitizer  compute-sanitizer memcheck over the kernel-launching gpu tests at small sizes (CuPy's
#              memory pool off: SPARSE_SCAN_NO_MEMPOOL=1), racecheck and synccheck over the kernels with
#              barriers (the dense scan's tiled and chain kernels).
#              Files: env.txt parts.txt memcheck.log racecheck.log synccheck.log (5)
#
# TF32 is off (NVIDIA_TF32_OVERRIDE=0): the cuDNN/cuBLAS baselines compute in float32 like our kernels.
# Benchmarks print their JSON at the end, so a step killed by its limit leaves only bench.log. Commit
# the results under bench/results/ with the device named, and quote them in the closing note.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [[ ${1:-} == --dry-run ]]; then
    dry_run=1
    shift
fi
part=${1:-one}
OUT=${OUT:-bench/results/gpu-run}
PYTHON=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-480}
export NVIDIA_TF32_OVERRIDE=0 SPARSE_SCAN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1

# The gpu tests that launch kernels, at sizes small enough for the sanitizers' 10-100x slowdown.
SANITIZED_TESTS=(tests/test_gpu_paths.py tests/test_conv.py tests/test_pooling.py
                 "tests/test_scan_gpu.py::test_gpu_backward_equals_cpu_for_every_schedule"
                 "tests/test_dense_scan_kernel.py::test_gpu_recurrent_backward_equals_numpy")
# The kernels with barriers (the dense scan's tiled and chain kernels), for racecheck and synccheck.
BARRIER_TESTS="tests/test_dense_scan_kernel.py::test_gpu_dense_scan_equals_numpy -k 'float32 and not 21'"

steps=()   # "name|limit|output files|command"
step() { steps+=("$1|$2|$3|$4"); }
pytest_gpu="$PYTHON -m pytest -m gpu -q -rs -p no:cacheprovider -o faulthandler_timeout=120"
case $part in
    one)
        step install 45 "" "$PYTHON -m pip install --quiet --no-deps --no-build-isolation -e ."
        step tests 210 "gpu-tests.log" "$pytest_gpu --durations=15 > \$OUT/gpu-tests.log 2>&1"
        step rnn 60 "rnn-\$GPU.json" "$PYTHON bench/rnn.py --device gpu --steps 1000 --batches --gru \
--no-jax --json > \$OUT/rnn-\$GPU.json 2>> \$OUT/bench.log"
        step spgemm 45 "spgemm-\$GPU.json" "$PYTHON bench/spgemm.py --device gpu --repeats 5 --json \
> \$OUT/spgemm-\$GPU.json 2>> \$OUT/bench.log"
        step scan 90 "scan-\$GPU.json" "$PYTHON bench/scan.py --device gpu --repeats 5 --no-dense --json \
> \$OUT/scan-\$GPU.json 2>> \$OUT/bench.log"
        step lstm 30 "lstm-\$GPU.json" "$PYTHON bench/lstm.py --device gpu --steps 1000 --batches 16 \
> \$OUT/lstm-\$GPU.json 2>> \$OUT/bench.log"
        files="env.txt parts.txt gpu-tests.log rnn-\$GPU.json spgemm-\$GPU.json scan-\$GPU.json lstm-\$GPU.json \
bench.log"
        ;;
    sanitizer)
        sanitizer="compute-sanitizer --error-exitcode 1 --print-limit 20"
        step install 45 "" "$PYTHON -m pip install --quiet --no-deps --no-build-isolation -e ."
        step memcheck 255 "memcheck.log" "SPARSE_SCAN_NO_MEMPOOL=1 $sanitizer --tool memcheck $pytest_gpu \
${SANITIZED_TESTS[*]} > \$OUT/memcheck.log 2>&1"
        for tool in racecheck synccheck; do
            step $tool 90 "$tool.log" "$sanitizer --tool $tool $pytest_gpu $BARRIER_TESTS > \$OUT/$tool.log 2>&1"
        done
        files="env.txt parts.txt memcheck.log racecheck.log synccheck.log"
        ;;
    *)
        echo "usage: OUT=DIR bash tools/gpu_run.sh [--dry-run] [one|sanitizer]" >&2
        exit 2
        ;;
esac

planned=0
for entry in "${steps[@]}"; do
    IFS='|' read -r _ limit _ _ <<< "$entry"
    planned=$((planned + limit))
done
if ((dry_run)); then
    echo "part $part: ${#steps[@]} steps, limits adding up to ${planned} s of TOTAL_S=${TOTAL_S} s"
    for entry in "${steps[@]}"; do
        IFS='|' read -r name limit output command <<< "$entry"
        printf '  %-10s %4d s  %-22s %s\n' "$name" "$limit" "${output:--}" "$command"
    done
    count=$(wc -w <<< "$files")
    echo "files ($count): $files"
    exit 0
fi

mkdir -p "$OUT"
GPU=$("$PYTHON" -c "import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); n = p['name']; \
print((n.decode() if isinstance(n, bytes) else n).replace(' ', '-').lower())") || exit 1
export OUT GPU
{
    nvidia-smi
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    "$PYTHON" -c "import sys, numpy, scipy, cupy; print(sys.version); print('numpy', numpy.__version__, \
'scipy', scipy.__version__, 'cupy', cupy.__version__)"
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
    command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
} > "$OUT/env.txt" 2>&1

status_all=0
for entry in "${steps[@]}"; do
    IFS='|' read -r name limit _ command <<< "$entry"
    left=$((TOTAL_S - SECONDS))
    if ((left < limit / 2)); then
        echo "== $name: skipped, ${left} s left of TOTAL_S" >&2
        echo "$name skipped 0 $limit" >> "$OUT/parts.txt"
        continue
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s): $command" >&2
    start=$SECONDS
    timeout "$limit" bash -c "$command"
    status=$?
    ((status)) && status_all=1
    echo "== $name: exit $status after $((SECONDS - start)) s" >&2
    echo "$name $status $((SECONDS - start)) $limit" >> "$OUT/parts.txt"
done
cat "$OUT/parts.txt" >&2
exit $status_all
