#!/usr/bin/env bash
# The update's and the rollout's pace, in one call on a bare CUDA machine (no network, no pytest run): install the
# carried wheels (bench/gpu_setup.sh, as bench/gpu_check.sh does), then bench/gpu_perf.py: the GPU check's config
# and the perf config (configs/qwen2_0.5b_gpu_perf.yaml), 5 steps each timed over steps 3-5, one profiler pass,
# the rollout at 64 and 256 rows; prints its one JSON line. At most 8 minutes (GPU_PERF_TIMEOUT_S, default 450 s
# for the Python part). Logs go to $GPU_PERF_LOG_DIR (default runs/gpu_perf).
#
#   bench/gpu_perf.sh [WHEEL_DIR]      (default: ./wheels; how to fill it: docs/gpu.md, "GPU check")
#
# Needs on the machine: Python 3.12, torch with CUDA, transformers, sentencepiece, safetensors.
set -euo pipefail
WHEELS="${1:-wheels}"   # relative to the repository root
source "$(dirname "$0")/gpu_setup.sh"   # cd to the repository root, PYTHONPATH, CUDA present, the wheels installed
LOG_DIR="${GPU_PERF_LOG_DIR:-runs/gpu_perf}"
mkdir -p "$LOG_DIR"

rc=0
timeout "${GPU_PERF_TIMEOUT_S:-450}" python bench/gpu_perf.py --run-dir "$LOG_DIR" > "$LOG_DIR/figures.json" \
  2> "$LOG_DIR/gpu_perf.log" || rc=$?
figures="$(tail -n 1 "$LOG_DIR/figures.json")"
if [ -z "$figures" ]; then
  tail -n 20 "$LOG_DIR/gpu_perf.log" >&2
  # the parts that finished (bench/gpu_perf.py writes them as it goes), marked as not ok
  figures="$(python - "$LOG_DIR/figures.partial.json" "$rc" <<'PY'
import json, sys
try:
    out = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    out = {}
why = "past the time limit" if sys.argv[2] in ("124", "137") else f"exit {sys.argv[2]}"
out["failed"] = out.get("failed", []) + [f"bench/gpu_perf.py printed nothing ({why}): the parts that finished"]
out["ok"] = False
print(json.dumps(out))
PY
)"
fi
echo "$figures"
exit "$rc"
