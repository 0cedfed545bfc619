#!/usr/bin/env bash
# The GPU checks and GPU benchmarks, part by part, for a lent device machine (GPU.md: few long calls).
#
#   OUT=/path/to/results bash tools/gpu_run.sh PART [PART ...]
#
# Parts, with a suggested grouping into device calls of at most 10 minutes each:
#   tests      the tests marked gpu (a missing GPU fails them instead of skipping)   -> gpu-tests.log
#   sanitizer  compute-sanitizer memcheck over the tests of every kernel, CuPy's memory pool off
#                                                                                    -> sanitizer.log
#   jacobians  bench/jacobians.py --device gpu                                      -> jacobians-<gpu>.json
#   spgemm     bench/spgemm.py --device gpu (against cupyx / cuSPARSE)              -> spgemm-<gpu>.json
#   scan       bench/scan.py --device gpu (against PyTorch autograd on CUDA)        -> scan-<gpu>.json
#   rnn        bench/rnn.py --device gpu (against cuDNN through nn.RNN/nn.GRU)      -> rnn-<gpu>.json
#   calls: "tests", "sanitizer", "jacobians spgemm", "scan", "rnn".
# Every part gets at most LIMIT_S seconds (default 540) and the whole call at most TOTAL_S (default
# 570): a part that no longer fits is skipped and named in parts.txt. Benchmarks write their JSON to
# stdout only at the end, so a part killed by its limit leaves only its .err log. The device tool
# brings back what is under its own $OUT, so keep that OUT (or a folder inside it). TF32 is off
# (NVIDIA_TF32_OVERRIDE=0): the cuDNN/cuBLAS baselines compute in float32 like our kernels. Commit the
# results under bench/results/ with the device named, and quote them in the closing note.
set -uo pipefail
cd "$(dirname "$0")/.."
if (($# == 0)); then
    echo "usage: OUT=DIR bash tools/gpu_run.sh PART [PART ...] (parts: tests sanitizer jacobians spgemm scan rnn)" >&2
    exit 2
fi
OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
LIMIT_S=${LIMIT_S:-540}
TOTAL_S=${TOTAL_S:-570}
export NVIDIA_TF32_OVERRIDE=0 SPARSE_SCAN_REQUIRE_GPU=1

"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
gpu=$("$PYTHON" -c "import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); n = p['name']; \
print((n.decode() if isinstance(n, bytes) else n).replace(' ', '-').lower())") || exit 1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

run() {  # run NAME COMMAND...: within the limits, output kept even when it fails; notes on stderr
    local name=$1
    shift
    local left=$((TOTAL_S - SECONDS))
    local limit=$((left < LIMIT_S ? left : LIMIT_S))
    if ((limit < 60)); then
        echo "== $name: skipped, ${left} s left of TOTAL_S" >&2
        echo "$name skipped 0" >> "$OUT/parts.txt"
        return
    fi
    echo "== $name (limit ${limit} s): $*" >&2
    local start=$SECONDS
    timeout "$limit" "$@"
    local status=$?
    echo "== $name: exit $status after $((SECONDS - start)) s" >&2
    echo "$name $status $((SECONDS - start))" >> "$OUT/parts.txt"
}

tests=(tests/test_dense_scan_kernel.py tests/test_scan_gpu.py tests/test_conv.py tests/test_pooling.py)
for part in "$@"; do
    case $part in
        tests) run tests "$PYTHON" -m pytest -m gpu -q -rs -o faulthandler_timeout=120 \
            > "$OUT/gpu-tests.log" 2>&1 ;;
        sanitizer)
            if command -v compute-sanitizer > /dev/null; then
                SPARSE_SCAN_NO_MEMPOOL=1 run sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
                    "$PYTHON" -m pytest -m gpu -q "${tests[@]}" > "$OUT/sanitizer.log" 2>&1
            else
                echo "sanitizer missing 0" >> "$OUT/parts.txt"
            fi ;;
        jacobians) run jacobians "$PYTHON" bench/jacobians.py --device gpu --json \
            > "$OUT/jacobians-$gpu.json" 2> "$OUT/jacobians.err" ;;
        spgemm) run spgemm "$PYTHON" bench/spgemm.py --device gpu --repeats 5 --json \
            > "$OUT/spgemm-$gpu.json" 2> "$OUT/spgemm.err" ;;
        scan) run scan "$PYTHON" bench/scan.py --device gpu --repeats 5 --json \
            > "$OUT/scan-$gpu.json" 2> "$OUT/scan.err" ;;
        rnn) run rnn "$PYTHON" bench/rnn.py --device gpu --json \
            > "$OUT/rnn-$gpu.json" 2> "$OUT/rnn.err" ;;
        *) echo "unknown part: $part" >&2; exit 2 ;;
    esac
done
cat "$OUT/parts.txt" >&2
