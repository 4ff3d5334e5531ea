# Sourced by bench/gpu_check.sh and bench/gpu_perf.sh: the set-up of a bare CUDA machine (no network). Goes to the
# repository root, installs the carried wheels of $WHEELS (a folder, relative to the root: megatron-core, psutil;
# docs/gpu.md, "GPU check") and says what runs; hpa itself runs from the checkout ($PYTHONPATH). Under the
# caller's `set -e`, a machine without CUDA stops it there.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' >&2
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  # --no-deps: the wheels are the whole list (docs/gpu.md); nothing may be fetched
  python -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl >&2
fi
python -c 'import megatron.core, hpa; print("megatron-core", megatron.core.__version__)' >&2
