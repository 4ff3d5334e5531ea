#!/usr/bin/env bash
# The GPU check, in one call, on a bare CUDA machine (no network): install the carried wheels, run the
# gpu-marked tests, run a few bf16 HPA steps of the Qwen2-0.5B-shaped random model with the native engine,
# and print one JSON line of figures (bench/gpu_check.py). Ran on one H100 (docs/gpu.md, "GPU check").
#
#   bench/gpu_check.sh [WHEEL_DIR]      (default: ./wheels; how to fill it: docs/gpu.md, "GPU check")
#
# Needs on the machine: Python 3.12, torch with CUDA, transformers, sentencepiece, safetensors, pytest.
set -euo pipefail
WHEELS="${1:-wheels}"   # relative to the repository root, as before
source "$(dirname "$0")/gpu_setup.sh"   # cd to the repository root, PYTHONPATH, CUDA present, the wheels installed
LOG_DIR="${GPU_CHECK_LOG_DIR:-runs/gpu_check}"
mkdir -p "$LOG_DIR"

tests_rc=0
python -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$LOG_DIR/gpu_tests.log" 2>&1 || tests_rc=$?
tail -n 5 "$LOG_DIR/gpu_tests.log" >&2

python bench/gpu_check.py --run-dir "$LOG_DIR" > "$LOG_DIR/figures.json" 2> "$LOG_DIR/gpu_check.log" || true
figures="$(tail -n 1 "$LOG_DIR/figures.json")"
[ -n "$figures" ] || figures='{"ok": false, "error": "bench/gpu_check.py printed nothing (see gpu_check.log)"}'
# exits 1 when the gpu tests failed or a path the check is meant to exercise did not run ("failed" says which)
python - "$figures" "$tests_rc" <<'PY'
import json, sys
out = json.loads(sys.argv[1])
out["gpu_tests_rc"] = int(sys.argv[2])
print(json.dumps(out))
sys.exit(0 if out.get("ok") and out["gpu_tests_rc"] == 0 else 1)
PY
