#!/usr/bin/env bash
# CI tier: the wheel is the tested artifact, installed as an image would install it (README, "Install",
# "A wheel for an image").
#
#   .ci/wheel_tier.sh            (from a clone; needs python3 with venv and the package index)
#
# 1. Builds the sdist and, from that sdist, the wheel (python -m build) out of a copy of the clone's
#    tracked files, so nothing a local or editable install left in the tree (egg-info, build/) gets in.
# 2. Installs the wheel into a fresh virtualenv next to the pinned torch (torch first, so nothing pulls
#    another torch) and checks that the torch is still the pinned one.
# 3. From a directory outside the source tree, with nothing of it on the path: hpa --version (the wheel's
#    version), hpa --help, hpa doctor, the demo task's data and tokenizer (data_tools, from the wheel), and a
#    few steps of hpa train on the embedded default config (hpa.configs, tiny_cpu.yaml) without --config.
# Any failure exits non-zero. Environment: HPA_WHEEL_KEEP=1 keeps the work directory, HPA_WHEEL_STEPS sets
# the number of training steps (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
STEPS=${HPA_WHEEL_STEPS:-3}
TORCH_PIN=torch==2.13.0  # README, "Install"
start=$(date +%s)

elapsed() { echo "wheel tier: $* ($(( $(date +%s) - start )) s)"; }

WORK=$(mktemp -d /tmp/hpa-wheel.XXXXXX)
cleanup() {
    local rc=$?
    set +e
    [[ $rc != 0 ]] && echo "wheel tier: FAILED (exit $rc)" >&2
    [[ "${HPA_WHEEL_KEEP:-0}" == 1 ]] && echo "wheel tier: work directory kept: $WORK" || rm -rf "$WORK"
    [[ $rc == 0 ]] && elapsed "passed: build, install, hpa --version/--help/doctor, $STEPS steps of hpa train"
    exit "$rc"
}
trap cleanup EXIT
fail() { echo "wheel tier: $*" >&2; exit 1; }
unset PYTHONPATH  # the installed wheel alone must be what runs

# ------------------------------------------------------------------------------------ build
mkdir "$WORK/src"
git -C "$REPO" ls-files -z | (cd "$REPO" && tar --null -T - --ignore-failed-read -cf -) | tar -xf - -C "$WORK/src"
python3 -m venv "$WORK/build-env"
"$WORK/build-env/bin/python" -m pip install --quiet --upgrade pip build
"$WORK/build-env/bin/python" -m build --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log" >&2; fail "python -m build failed"; }
shopt -s nullglob
sdists=("$WORK"/dist/hpa-*.tar.gz)
wheels=("$WORK"/dist/hpa-*.whl)
[[ ${#sdists[@]} == 1 && ${#wheels[@]} == 1 ]] || fail "expected one sdist and one wheel in dist/, got: $(ls "$WORK/dist")"
SDIST=${sdists[0]}
WHEEL=${wheels[0]}
elapsed "built $(basename "$SDIST") and, from it, $(basename "$WHEEL")"
python3 - "$WHEEL" "$SDIST" <<'EOF'
import sys, tarfile, zipfile

wheel = set(zipfile.ZipFile(sys.argv[1]).namelist())
for f in ("hpa/engine/__init__.py", "hpa/engine/step.py", "hpa/configs/tiny_cpu.yaml", "megatron_patches/__init__.py",
          "data_tools/make_demo_task.py"):
    assert f in wheel, f"{sys.argv[1]} has no {f}"
sdist = {name.split("/", 1)[-1] for name in tarfile.open(sys.argv[2]).getnames()}
for f in ("setup.py", "hpa/engine/__init__.py", "configs/tiny_cpu.yaml"):
    assert f in sdist, f"{sys.argv[2]} has no {f}"
EOF

# ------------------------------------------------------------------------------------ install
python3 -m venv "$WORK/venv"
# shellcheck disable=SC1091
. "$WORK/venv/bin/activate"
python -m pip install --quiet --upgrade pip
pip install --quiet "$TORCH_PIN"
pip install --quiet "$WHEEL"
python - "$TORCH_PIN" <<'EOF'
import sys
from importlib.metadata import version

pinned = sys.argv[1].split("==")[1]
assert version("torch").split("+")[0] == pinned, f"installing the wheel replaced torch {pinned} by {version('torch')}"
EOF
elapsed "installed the wheel next to $TORCH_PIN in a fresh virtualenv"

# ------------------------------------------------------------------------------------ run, outside the tree
mkdir "$WORK/run"
cd "$WORK/run"
python - "$REPO" <<'EOF'
import pathlib, sys

import data_tools, hpa, megatron_patches

repo = pathlib.Path(sys.argv[1]).resolve()
for module in (hpa, data_tools, megatron_patches):
    where = pathlib.Path(module.__file__).resolve()
    assert "site-packages" in where.parts and repo not in where.parents, f"{module.__name__} imported from {where}"
print("wheel tier: hpa", hpa.__version__, "imported from", pathlib.Path(hpa.__file__).parent)
EOF
wheel_version=$(basename "$WHEEL" | cut -d- -f2)
[[ "$(hpa --version)" == "hpa $wheel_version" ]] || fail "hpa --version says '$(hpa --version)', the wheel is $wheel_version"
hpa --help > /dev/null
hpa doctor
# the embedded default reads its data from runs/demo/data, relative to the working directory
python -m data_tools.make_demo_task --out-dir runs/demo/data --num-prompts 256 --num-eval-prompts 16 --num-sft 16 \
    --seed 0 > /dev/null
python -m data_tools.train_tokenizer --input runs/demo/data/corpus.txt --model-prefix runs/demo/data/tok \
    --vocab-size 128 > /dev/null 2>&1
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} hpa train trainer.total_steps="$STEPS" logging.progress_bar=false
python - "$STEPS" <<'EOF'
import json, pathlib, sys

steps = [json.loads(line)["step"] for line in pathlib.Path("runs/demo/metrics.jsonl").read_text().splitlines()]
assert steps and steps[-1] == int(sys.argv[1]), f"metrics.jsonl ends at step {steps[-1:]}, expected {sys.argv[1]}"
assert pathlib.Path("runs/demo/config.yaml").is_file(), "the run wrote no resolved config.yaml"
EOF
deactivate
elapsed "hpa --version, --help, doctor, demo data and $STEPS steps of hpa train on the embedded config, outside the tree"
