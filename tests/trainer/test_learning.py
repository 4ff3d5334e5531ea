"""Learning: a seeded 20-step ``hpa train`` with the default mixed PPO + DPO + hierarchical-KL objective
raises the task reward of a partly trained policy by a clear margin.

The rule reward is exact match, so a random policy scores 0 and gives PPO nothing to work with. The
start is a short ``hpa sft`` (110 steps) on an easy slice of the demo task, ``reverse`` of 2-3
symbols: its greedy answers are right on 0.78 of the 64 held-out prompts, its samples at ``launch``'s
temperature 1.0 about 0.3 of the time. HPA then runs the embedded tiny_cpu objective (GRPO, lr 2e-4,
adaptive KL, shaped reward, w_ppo/w_dpo/w_kl = 0.4/0.4/0.2) on 32 prompts x 8 samples per step in 4
PPO mini-batches, so that 20 steps carry a clear signal. About 20 s on the 2-core CPU machine (SFT
~7 s, HPA ~9 s, the rest data, tokenizer and start-up).
"""

import json

import pytest

from trainer_runs import launch, make_task, sft

pytestmark = pytest.mark.e2e

SEED = 1  # of the SFT and of the HPA run
SFT_STEPS = 110
STEPS = 20
WINDOW = 5  # steps averaged at each end of the reward curve
# Measured rise of the mean rollout reward (last 5 steps minus first 5): 0.127 at seed 1 (the same
# in 3 runs); 0.14-0.18 at HPA seeds 2, 3, 4, 1234 from this start; 0.13-0.17 from the SFT starts of
# seeds 2, 3, 7, 1234 (SFT and HPA at that seed), and 0.13-0.16 at 4 HPA seeds from seed 3's start.
# Over 5 HPA seeds from one start the 5-step means spread by ~0.02; the threshold is ~4x that.
MIN_REWARD_GAIN = 0.08


def hpa_overrides(policy, seed):
    """``launch``'s overrides with the tiny_cpu model, estimator and eval, and the run's size."""
    return ["model.num_layers=2", f"model.policy_path={policy}", "algorithm.advantage.estimator=grpo",
            "rollout.max_new_tokens=8", f"trainer.total_steps={STEPS}", "trainer.global_batch_size=32",
            "rollout.n=8", "trainer.ppo_mini_batch_size=8", "trainer.micro_batch_size=64",
            "trainer.preference_batch_size=16", "trainer.eval_interval=10", "checkpoint.save_interval=0",
            f"trainer.seed={seed}", f"rollout.seed={seed}"]


def test_twenty_hpa_steps_raise_the_task_reward(tmp_path):
    root = make_task(tmp_path, 1024, 64, tasks=("reverse",), min_len=2, max_len=3)
    policy = sft(root, root / "sft_run", ["model.num_layers=2", f"sft.total_steps={SFT_STEPS}", f"trainer.seed={SEED}",
                                          "trainer.micro_batch_size=32"])
    records = launch(root, root / "hpa", 1, hpa_overrides(policy, SEED))
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    raw = [r["reward/raw_mean"] for r in records[1:]]
    score = {r["step"]: r["eval/score"] for r in records if "eval/score" in r}
    first, last = sum(raw[:WINDOW]) / WINDOW, sum(raw[-WINDOW:]) / WINDOW
    summary = json.dumps({"raw_first": round(first, 4), "raw_last": round(last, 4), "eval": score,
                          "kl_token_last": round(records[-1]["kl/token"], 4)})
    print(summary)
    # the start must be partly right, as calibrated: no signal near 0, no headroom near 1
    assert 0.15 <= first <= 0.6, f"the SFT start is outside the range this test was calibrated for: {summary}"
    assert last - first >= MIN_REWARD_GAIN, summary
    # held-out greedy accuracy: measured 0.78 -> 0.84-0.89 over 5 HPA seeds from this start
    assert score[STEPS] >= score[0], f"held-out accuracy fell: {summary}"
