#!/usr/bin/env bash
# One device call that checks and times the CUDA path (scripts/device/run_on_gpu.md, A.2):
# gpu_check.py (all sections, or $SECTIONS) within $BUDGET_S seconds, then the CUDA tests of
# the suite (tests/gpu, real kernels only) within $PYTEST_S. Everything lands in $OUT (or
# ./gpu_check_out): gpu_check.json, gpu_check.log, stdout.log, pytest_gpu.log, nvidia-smi.txt.
# Run from the repository root with .device_carry/ carried (scripts/device/pack_flashinfer.py):
#     bash scripts/device/run_all.sh            # with the device tool's timeout_s at 600
# GPU_CHECK_ARGS: more arguments of gpu_check.py (--dry-run: the logic on a CPU machine).
# Exits with gpu_check.py's status (non-zero when a section raised), else pytest's.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
sections=()
if [ -n "${SECTIONS:-}" ]; then sections=(--sections "$SECTIONS"); fi
timeout $((${BUDGET_S:-400} + 60)) python3 scripts/device/gpu_check.py --out "$out" --budget-s "${BUDGET_S:-400}" \
    "${sections[@]}" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$out/stdout.log"
rc=${PIPESTATUS[0]}
PYTHONPATH="$(python3 scripts/device/gpu_check.py --install-only)"
export PYTHONPATH
timeout "${PYTEST_S:-90}" python3 -m pytest -q -p no:cacheprovider tests/gpu -k "gpu or bf16" 2>&1 | tee "$out/pytest_gpu.log" | tail -30
prc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && exit "$rc"
exit "$prc"
