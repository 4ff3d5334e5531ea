"""``hpa train`` end to end on CPU: the full HPA step under TP1/DP2 and TP2xPP2xDP2 gives the same
metrics, the metrics file holds every documented key, and resumable pieces are in place."""

import json
import math
from typing import List, NamedTuple

import pytest

from trainer_runs import launch

pytestmark = pytest.mark.e2e

REQUIRED_KEYS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/kl_loss", "actor/kl_coef",
    "actor/entropy", "actor/grad_norm", "actor/lr", "dpo/loss", "dpo/reward_acc", "dpo/margin", "kl/token",
    "kl/semantic", "hpa/w_ppo", "hpa/w_dpo", "hpa/w_kl", "hpa/lambda_token", "hpa/lambda_semantic",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "reward/raw_mean", "reward/sigma_mean",
    "reward/diversity_mean", "reward/length_penalty_mean", "reward/copy_rate", "reward/shaped_mean",
    "reward/shaped_std", "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "perf/throughput", "perf/mfu", "perf/max_memory_gb",
    "timing_s/rollout", "timing_s/reward", "timing_s/reference", "timing_s/old_logprob", "timing_s/values",
    "timing_s/update_actor", "timing_s/update_critic", "timing_s/step",
]


EVAL_KEYS = ["eval/score", "eval/score/add", "eval/score/copy", "eval/score/reverse", "eval/reward", "eval/model_reward", "eval/kl", "eval/copy_rate", "eval/response_length", "hacking/gap",
             "hacking/gap_growth", "hacking/model_reward", "hacking/gold_score", "hacking/copy_rate",
             "hacking/length_ratio", "hacking/alert_count"]


def adversarial(demo):
    return f"data.adversarial_prompt_path={demo / 'data' / 'adversarial_prompts.jsonl'}"


class Runs(NamedTuple):
    """The two runs' metrics (one record a step) and the TP1xDP2 run's log."""

    dp2: List[dict]
    tp2pp2dp2: List[dict]
    dp2_log: str


@pytest.fixture(scope="module")
def runs(demo) -> Runs:
    output = []
    dp2 = launch(demo, demo / "tp1_pp1_dp2", 2, [adversarial(demo)], output=output)
    # token TIS on here only: on CPU the rollout and training log-probs agree to ~1e-6, so the
    # weights are ~1 and the metrics must still equal the TP1 run's
    tp2pp2dp2 = launch(demo, demo / "tp2_pp2_dp2", 8, ["parallel.tensor_model_parallel_size=2",
                                                          "parallel.pipeline_model_parallel_size=2",
                                                          "algorithm.rollout_correction.rollout_is=token",
                                                          adversarial(demo)])
    return Runs(dp2=dp2, tp2pp2dp2=tp2pp2dp2, dp2_log=output[0])


def test_metrics_file_has_every_key(runs):
    dp2, log = runs.dp2, runs.dp2_log
    assert [r["step"] for r in dp2] == [0, 1, 2]
    for key in REQUIRED_KEYS:
        assert key in dp2[-1], key
    for record in dp2[1:]:  # the KL loss is the hierarchical KL (the KL loss is on by default)
        assert record["actor/kl_loss"] == pytest.approx(record["kl/hier"], rel=1e-6, abs=1e-12)
    assert dp2[-1]["kl/hier"] > 0  # step 1 starts at the reference; step 2 has moved away
    for key in EVAL_KEYS:
        assert key in dp2[0] and key in dp2[-1], key
    from hpa.ablate import check_metric

    for key in (k for k in dp2[-1] if k.startswith("eval/")):  # every logged eval number is a valid ablate.metric
        check_metric(key)
    for record in (dp2[0], dp2[-1]):  # 12 held-out prompts, 4 of each category, over 2 DP ranks
        per_category = [record[f"eval/score/{c}"] for c in ("add", "copy", "reverse")]
        assert record["eval/score"] == pytest.approx(sum(per_category) / 3, abs=1e-9)
        assert all(4 * v == pytest.approx(round(4 * v), abs=1e-9) for v in per_category)
    # the objective's table at the start lists the default's terms; the SFT replay (off by default) has no row
    # and logs nothing
    assert "| ppo | rollout | w_ppo" in log and "| dpo | pairs | w_dpo" in log
    assert "| replay |" not in log and all("replay/nll" not in r for r in dp2)


def test_evaluation_starts_at_the_reference_and_is_layout_invariant(runs):
    """At step 0 the policy is the reference: the eval KL is exactly 0 and the monitor's gap has not
    grown; evaluation metrics agree between TP1xDP2 and TP2xPP2xDP2."""
    dp2, tp2pp2 = runs.dp2, runs.tp2pp2dp2
    assert dp2[0]["eval/kl"] == 0.0 and dp2[0]["hacking/gap_growth"] == 0.0
    assert dp2[0]["hacking/length_ratio"] == 1.0
    assert dp2[-1]["eval/kl"] != 0.0  # two updates later the policy has moved
    for a, b in zip(dp2, tp2pp2):
        for key in EVAL_KEYS:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["step"], key)


def test_reward_hacking_alert_stops_training_when_asked(demo):
    """``guard.early_stop_on_hacking``: an alert of the monitor (here forced: any unigram of a response
    found in its prompt counts as copying) stops the run at the first evaluation after step 0."""
    run_dir = demo / "hacking_stop"
    records = launch(demo, run_dir, 1, [adversarial(demo), "trainer.total_steps=4", "trainer.eval_interval=2",
                                        "reward.shaping.copy_ngram=1", "reward.monitor.copy_rate_threshold=0.0",
                                        "guard.early_stop_on_hacking=true"])
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["hacking/alert_count"] >= 1 and records[-1]["hacking/copy_rate"] > 0
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["reason"] == "early_stop" and status["step"] == 2


@pytest.mark.parametrize("key", ["reward/raw_mean", "response_length/mean", "dpo/loss", "kl/token", "kl/semantic",
                                 "actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "rollout/logprob_diff_max"])
def test_tp2_pp2_matches_tp1(runs, key):
    dp2, tp2pp2 = runs.dp2, runs.tp2pp2dp2
    for a, b in zip(dp2[1:], tp2pp2[1:]):
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["step"], key)


def test_rollout_logprobs_match_training_forward(runs):
    for run in (runs.dp2, runs.tp2pp2dp2):
        for record in run[1:]:
            assert record["rollout/logprob_diff_max"] < 1e-4
    for record in runs.tp2pp2dp2[1:]:
        assert record["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert "rollout_corr/rollout_is_mean" not in runs.dp2[-1]


def test_token_budget_micro_batches_give_the_same_step(demo):
    """Dynamic micro-batches under ``ppo_max_token_len_per_rank`` (each cut to its longest row) change
    the compute, not the update: the step's losses and grad norm equal those of fixed micro-batches."""
    common = ["trainer.total_steps=1", "trainer.eval_interval=0", "trainer.micro_batch_size=8"]
    fixed = launch(demo, demo / "budget_off", 1, common)
    budget = launch(demo, demo / "budget_on", 1, common + ["trainer.ppo_max_token_len_per_rank=24"])
    for key in ("actor/pg_loss", "kl/token", "kl/semantic", "dpo/loss", "critic/vf_loss", "actor/grad_norm",
                "actor/entropy"):
        assert budget[-1][key] == pytest.approx(fixed[-1][key], rel=1e-5, abs=1e-7), key


def test_lr_schedule_advances_once_per_step_whatever_the_mini_batches(demo):
    """Linear decay over total_steps = 3 with 2 PPO mini-batches (2 updates a step): the LR of step k
    is lr·(1 − (k−1)/3), as with one update a step (the scheduler counts HPA steps, not updates;
    counting updates would give lr·(1 − 2(k−1)/3))."""
    records = launch(demo, demo / "lr_schedule", 1, ["trainer.total_steps=3", "trainer.eval_interval=0",
                                                     "trainer.ppo_mini_batch_size=2", "optim.lr=1e-4",
                                                     "optim.lr_decay_style=linear", "checkpoint.save_interval=0"])
    lrs = [r["actor/lr"] for r in records]
    assert lrs == pytest.approx([1e-4 * (1 - k / 3) for k in range(3)], rel=1e-6)


# each rollout filter and each sequence-level policy loss through `hpa train` (group advantages: the
# filters refuse gae); the DAPO run's random policy solves nothing, so every group ties, the refill round
# finds nothing either and no row trains: the run must still go through, on both DP ranks
FILTER_RUNS = {
    "reward_above_mean_std_gspo": ["algorithm.rollout_filter.name=reward_above_mean_std",
                                   "algorithm.ppo.policy_loss=gspo", "algorithm.ppo.loss_agg_mode=seq-mean-token-mean"],
    "dapo_groups_cispo": ["algorithm.rollout_filter.name=dapo_groups", "algorithm.rollout_filter.max_refill_rounds=1",
                          "algorithm.ppo.policy_loss=cispo", "algorithm.ppo.clip_ratio_low=10"],
    "group_scope_geo_mean": ["algorithm.rollout_filter.name=reward_above_mean_std", "algorithm.rollout_filter.k=0",
                             "algorithm.rollout_filter.scope=group", "algorithm.ppo.policy_loss=geo_mean"],
}


@pytest.mark.parametrize("name", list(FILTER_RUNS))
def test_hpa_train_with_a_rollout_filter_and_a_sequence_level_loss_tp1_pp1_dp2(demo, name):
    records = launch(demo, demo / f"filter_{name}", 2, ["algorithm.advantage.estimator=grpo",
                                                         "trainer.eval_interval=0", *FILTER_RUNS[name]])
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["filter/kept_fraction"] <= 1.0
        assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/grad_norm"])
    if name.startswith("dapo"):
        assert all(r["filter/refill_rounds"] == 1.0 and r["filter/kept_fraction"] == 0.0 for r in records)
        assert all(r["actor/pg_loss"] == 0.0 for r in records)  # nothing trains the PPO term; DPO still does
        assert all(r["dpo/loss"] > 0.0 for r in records)
    else:  # (step 1's shaped rewards all tie at 0, the diversity bank being empty: nothing is kept there)
        assert any(0.0 < r["filter/kept_fraction"] < 1.0 for r in records)
        assert all(math.isfinite(r["filter/threshold"]) for r in records)
        assert all(r["filter/kept_reward"] > r["filter/dropped_reward"] for r in records
                   if 0 < r["filter/kept_fraction"] < 1)


def test_rollout_filter_and_gspo_under_tp2_pp2_dp2_match_tp1_pp1_dp2(demo):
    """The recipe's filter with GSPO on 8 ranks (TP2 x PP2 x DP2): the kept rows, the threshold and the
    update are the TP1 x DP2 run's (the filter's decision is taken over the DP group only, whatever TP/PP)."""
    extra = ["algorithm.advantage.estimator=grpo", "trainer.eval_interval=0", *FILTER_RUNS["reward_above_mean_std_gspo"]]
    dp2 = launch(demo, demo / "filter_3d_dp2", 2, extra)
    three_d = launch(demo, demo / "filter_3d_tp2_pp2_dp2", 8, ["parallel.tensor_model_parallel_size=2",
                                                               "parallel.pipeline_model_parallel_size=2", *extra])
    assert any(0.0 < r["filter/kept_fraction"] < 1.0 for r in dp2)  # the filter had something to decide
    for a, b in zip(dp2, three_d):
        for key in ["filter/kept_fraction", "filter/threshold", "reward/shaped_mean", "actor/pg_loss",
                    "actor/grad_norm", "dpo/loss"]:
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["step"], key)
