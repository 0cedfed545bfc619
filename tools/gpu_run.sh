#!/usr/bin/env bash
# Every GPU check and GPU benchmark in one pass, for a lent device machine (GPU.md: few long calls).
#
#   OUT=/path/to/results bash tools/gpu_run.sh [part ...]
#
# Parts (default: all, in this order; each under its own time limit, so that one call of at most
# 10 minutes can run a few of them and the next call the rest):
#   tests      make test-gpu (offline install, the tests marked gpu)            -> gpu-tests.log
#   sanitizer  compute-sanitizer memcheck over the dense-scan kernel tests       -> sanitizer.log
#   jacobians  bench/jacobians.py --device gpu                                  -> jacobians-<gpu>.json
#   spgemm     bench/spgemm.py --device gpu (against cupyx / cuSPARSE)          -> spgemm-<gpu>.json
#   scan       bench/scan.py --device gpu (against PyTorch autograd on CUDA)    -> scan-<gpu>.json
#   rnn        bench/rnn.py --device gpu (against cuDNN through nn.RNN/nn.GRU)  -> rnn-<gpu>.json, .png
# Results go to $OUT (default bench/results/gpu-run); commit them under bench/results/ with the
# device named, and quote them in the closing note.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
LIMIT_S=${LIMIT_S:-540}
parts=("$@")
((${#parts[@]})) || parts=(tests sanitizer jacobians spgemm scan rnn)

"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
gpu=$("$PYTHON" -c "import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); n = p['name']; \
print((n.decode() if isinstance(n, bytes) else n).replace(' ', '-').lower())") || exit 1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

run() {  # run NAME COMMAND...: time-limited, output kept even when it fails
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$LIMIT_S" "$@"
    local status=$?
    echo "== $name: exit $status after $((SECONDS - start)) s"
    echo "$name $status $((SECONDS - start))" >> "$OUT/parts.txt"
}

for part in "${parts[@]}"; do
    case $part in
        tests) run tests "$PYTHON" -m pytest -m gpu -q -rs > "$OUT/gpu-tests.log" 2>&1 ;;
        sanitizer) run sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
            "$PYTHON" -m pytest -m gpu -q tests/test_dense_scan_kernel.py > "$OUT/sanitizer.log" 2>&1 ;;
        jacobians) run jacobians "$PYTHON" bench/jacobians.py --device gpu --json \
            > "$OUT/jacobians-$gpu.json" 2> "$OUT/jacobians.err" ;;
        spgemm) run spgemm "$PYTHON" bench/spgemm.py --device gpu --repeats 5 --json \
            > "$OUT/spgemm-$gpu.json" 2> "$OUT/spgemm.err" ;;
        scan) run scan "$PYTHON" bench/scan.py --device gpu --repeats 5 --json \
            > "$OUT/scan-$gpu.json" 2> "$OUT/scan.err" ;;
        rnn) run rnn "$PYTHON" bench/rnn.py --device gpu --json --plot "$OUT/rnn-$gpu.png" \
            > "$OUT/rnn-$gpu.json" 2> "$OUT/rnn.err" ;;
        *) echo "unknown part: $part" >&2; exit 2 ;;
    esac
done
cat "$OUT/parts.txt"
