#!/usr/bin/env bash
# The main job on CPU, from nothing: demo task data -> SentencePiece tokenizer -> SFT policy ->
# reward-model ensemble -> HPA (PPO + DPO + hierarchical KL) -> report.
# Usage: [DEMO_FAMILY=standard|hackable|split|freetext] [DEMO_SEED=N] [DEMO_TRAIN=0] bash launch/demo.sh [OUT_DIR] [extra overrides for hpa train...]
# DEMO_SEED (default 0) re-draws the task: another data seed, and for N > 0 another seed for the SFT policy and the
# reward ensemble too (trainer.seed 1234 + N), so results can be checked on a task nobody tuned on.
# DEMO_FAMILY=hackable (launch/demo_hackable.sh): the preference pairs carry a spurious length feature and leave
# the reverse prompts uncovered, and the PPO reward is the learned ensemble alone (no rule reward), so the
# policy can exploit it; the gold score (exact match) is only evaluated.
# DEMO_TRAIN=0 stops after the reward ensemble (no HPA run, no report): a task to ablate
# (python -m experiments.tools.redraw_ablation writes its ablation file; docs/objective.md).
# DEMO_FAMILY=split: the rule reward judges only the reverse prompts (the others have no ground truth) and the
# preference pairs cover only add and copy, so each signal alone teaches part of the task.
# DEMO_FAMILY=freetext: answers without one right wording (every demonstration phrased its own way), the gold score
# graded (token_f1, the rule reward); the sound prompts have no preference pair.
set -euo pipefail
FAMILY=${DEMO_FAMILY:-standard}
SEED=${DEMO_SEED:-0}
TRAIN=${DEMO_TRAIN:-1}
[[ "$TRAIN" =~ ^[01]$ ]] || { echo "DEMO_TRAIN must be 0 or 1, got '$TRAIN'" >&2; exit 2; }
# a decimal seed without leading zeros (bash reads 010 as octal 8 and 08 not at all), at most 10 digits (no
# wrap-around), and 1234 + DEMO_SEED must stay a valid trainer.seed (at most 2^32 - 1)
MAX_SEED=$(( 4294967295 - 1234 ))
[[ "$SEED" =~ ^(0|[1-9][0-9]{0,9})$ ]] && (( 10#$SEED <= MAX_SEED )) || {
  echo "DEMO_SEED must be a decimal integer from 0 to $MAX_SEED without leading zeros, got '$SEED'" >&2; exit 2; }
SEEDED=()
(( 10#$SEED == 0 )) || SEEDED=(trainer.seed=$((1234 + 10#$SEED)))
case "$FAMILY" in
  standard) DEFAULT_OUT=runs/demo
            # the tiny ensemble is weak on this task, so the verifiable rule reward carries 4x its weight
            REWARD=(reward.rule_weight=4.0) ;;
  hackable) DEFAULT_OUT=runs/demo_hackable
            # the learned reward ensemble alone is the PPO reward (the gold rule is still evaluated)
            REWARD=("reward.rules=[]") ;;
  split)    DEFAULT_OUT=runs/demo_split
            # the rule reward judges only the prompts with a ground truth (reverse); the pairs cover the rest
            REWARD=(reward.rule_weight=4.0) ;;
  freetext) DEFAULT_OUT=runs/demo_freetext
            # the graded gold score (token F1) is the rule reward, at the standard family's weight
            REWARD=("reward.rules=[token_f1]" reward.rule_weight=4.0) ;;
  *) echo "DEMO_FAMILY must be standard, hackable, split or freetext, got '$FAMILY'" >&2; exit 2 ;;
esac
OUT=${1:-$DEFAULT_OUT}
shift || true
CONFIG=${HPA_CONFIG:-configs/tiny_cpu.yaml}
COMMON=(trainer.run_dir="$OUT" data.tokenizer_path="$OUT/data/tok.model" data.prompt_path="$OUT/data/prompts.jsonl"
        data.preference_path="$OUT/data/preferences.jsonl" data.eval_prompt_path="$OUT/data/eval_prompts.jsonl"
        data.sft_path="$OUT/data/sft.jsonl" data.adversarial_prompt_path="$OUT/data/adversarial_prompts.jsonl"
        data.heldout_preference_path="$OUT/data/heldout_preferences.jsonl")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
start=$(date +%s)

python -m data_tools.make_demo_task --out-dir "$OUT/data" --family "$FAMILY" --num-prompts 4096 --num-eval-prompts 128 \
    --num-sft 1024 --flip-fraction 0.12 --seed "$SEED"
python -m data_tools.train_tokenizer --input "$OUT/data/corpus.txt" --model-prefix "$OUT/data/tok" --vocab-size 128
hpa sft --config "$CONFIG" "${COMMON[@]}" ${SEEDED[@]+"${SEEDED[@]}"}
# the reward-model ensemble (3 bootstrap heads, backbone from the SFT policy) in its own run directory
hpa train-rm --config "$CONFIG" "${COMMON[@]}" trainer.run_dir="$OUT/rm" trainer.total_steps=400 \
    trainer.preference_batch_size=32 trainer.micro_batch_size=32 trainer.eval_interval=100 optim.lr=1e-3 \
    optim.lr_decay_style=cosine optim.lr_warmup_fraction=0.05 reward.num_heads=3 model.policy_path=null \
    reward.training.backbone_path="$OUT/sft" ${SEEDED[@]+"${SEEDED[@]}"}
if (( TRAIN == 0 )); then
  echo "task ready in $OUT ($(( $(date +%s) - start )) s): data, tokenizer, SFT policy, reward ensemble"
  exit 0
fi
hpa train --config "$CONFIG" "${COMMON[@]}" model.policy_path="$OUT/sft" trainer.total_steps=300 \
    reward.model_paths="[$OUT/rm/reward_model]" reward.num_heads=3 "${REWARD[@]}" "$@"
hpa report "$OUT" || true
echo "main job finished in $(( $(date +%s) - start )) s; metrics in $OUT/metrics.jsonl"
