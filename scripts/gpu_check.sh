#!/usr/bin/env bash
# What can only be checked on a GPU machine, checked where the machine allows it:
#
#   1. CUDA (torch.cuda.is_available()): the PyTorch engine on CUDA against itself on the CPU
#      and against Hugging Face transformers (tests/unit/engine/test_parity.py::
#      test_cuda_matches_cpu).
#   2. TensorRT-LLM (tensorrt_llm imports): one disaggregated request per prompt, a
#      context-only request on one engine and a generation-only request on another pulling
#      the KV through TensorRT-LLM's cache transceiver, against the same prompt run whole
#      (scripts/trtllm_disagg_check.py).
#
# Each check the machine lacks the means for is skipped, with the reason. Prints a summary;
# exits 0 when nothing that ran failed (skips included), 1 otherwise.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]   (OUT_DIR receives the logs and a JSON report)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
OUT=${1:-$(mktemp -d -t pdserve-gpu-check-XXXXXX)}
mkdir -p "$OUT"

names=()
verdicts=()
details=()
failed=0

record() {  # name verdict detail
    names+=("$1")
    verdicts+=("$2")
    details+=("$3")
    [ "$2" = FAIL ] && failed=1
    return 0
}

# -- 1. the PyTorch engine on CUDA ------------------------------------------------------------
if $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    device=$($PY -c "import torch; print(torch.cuda.get_device_name(0))")
    echo "== torch CUDA parity on $device"
    if $PY -m pytest -q -p no:cacheprovider -rs \
        "tests/unit/engine/test_parity.py::test_cuda_matches_cpu" 2>&1 | tee "$OUT/cuda_parity.log"; then
        if grep -q "1 passed" "$OUT/cuda_parity.log"; then
            record "torch-cuda-parity" PASS "$device"
        else
            record "torch-cuda-parity" FAIL "did not run: see $OUT/cuda_parity.log"
        fi
    else
        record "torch-cuda-parity" FAIL "$device: see $OUT/cuda_parity.log"
    fi
else
    record "torch-cuda-parity" SKIP "no CUDA device (torch.cuda.is_available() is False)"
fi

# -- 2. a disaggregated request on TensorRT-LLM -----------------------------------------------
reason=$($PY -c "from pdserve.backends.tensorrt_llm_api import unavailable; print(unavailable() or '')" 2>&1)
if [ -z "$reason" ]; then
    echo "== TensorRT-LLM: context-only + generation-only against whole requests"
    $PY scripts/trtllm_disagg_check.py --json "$OUT/trtllm_disagg.json" 2>&1 | tee "$OUT/trtllm_disagg.log"
    rc=${PIPESTATUS[0]}
    line=$(tail -n 1 "$OUT/trtllm_disagg.log")
    if [ "$rc" -eq 0 ]; then
        record "tensorrt-llm-disaggregated" PASS "$line"
    else
        record "tensorrt-llm-disaggregated" FAIL "$line (see $OUT/trtllm_disagg.log)"
    fi
else
    record "tensorrt-llm-disaggregated" SKIP "$reason"
fi

# -- summary -----------------------------------------------------------------------------------
echo
echo "GPU check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname), logs in $OUT)"
for i in "${!names[@]}"; do
    printf '  %-4s  %-27s  %s\n' "${verdicts[$i]}" "${names[$i]}" "${details[$i]}"
done
exit $failed
