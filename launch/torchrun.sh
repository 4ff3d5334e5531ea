#!/usr/bin/env bash
# One node, N processes (GPUs, or CPU processes with gloo):
#
#   launch/torchrun.sh CONFIG [NPROC] [section.key=value ...]
#
#   launch/torchrun.sh configs/llama2_7b.yaml 8 trainer.total_steps=1000
#   launch/torchrun.sh configs/tiny_cpu.yaml 2 parallel.tensor_model_parallel_size=2   # a laptop
#
# runs  torchrun --standalone --nproc_per_node NPROC --max-restarts 3 -m hpa.cli train --config CONFIG ...
# NPROC defaults to the number of visible GPUs (1 without GPUs). A worker that dies makes torchrun
# restart all of them (they resume from the newest good checkpoint). Environment:
#   HPA_COMMAND       hpa subcommand to run (default: train; e.g. sft, train-rm, generate)
#   HPA_MAX_RESTARTS  worker restarts after a failure (default 3; 0: fail at once)
#   TORCHRUN          the torchrun executable (default: torchrun on PATH)
set -euo pipefail

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -ge 1 && "$1" != "-h" && "$1" != "--help" ]] || usage
CONFIG=$1
shift
[[ -f "$CONFIG" ]] || { echo "torchrun.sh: no such config file: $CONFIG" >&2; exit 2; }

if [[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]]; then
    NPROC=$1
    shift
elif command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
else
    NPROC=0
fi
[[ "$NPROC" -ge 1 ]] || NPROC=1

# one thread per process unless the user chose otherwise (torchrun would warn and pick 1 anyway)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

exec "${TORCHRUN:-torchrun}" --standalone --nproc_per_node "$NPROC" --max-restarts "${HPA_MAX_RESTARTS:-3}" \
    -m hpa.cli "${HPA_COMMAND:-train}" --config "$CONFIG" "$@"
