"""The on-policy shortcut (``trainer.old_log_probs_from_update``): when the old policy is the policy the update's
forward runs and nothing reads the old log-probs before the update, the step skips the old-policy forward and
takes the update forward's own, detached; a run gives the same metrics and the same weights as with the
separate forward."""

import pytest
import torch

from multirank import run_ranks
from trainer_runs import launch

VOLATILE = ("timing_s/", "perf/")
ON_POLICY = ["algorithm.kl.use_kl_in_reward=false", "reward.shaping.beta=0"]


def test_when_the_shortcut_applies():
    from hpa.config import load_config
    from hpa.config.schema import old_log_probs_from_update

    def applies(*extra):
        return old_log_probs_from_update(load_config(None, ["model.num_layers=2", *ON_POLICY, *extra]))

    assert applies()
    assert applies("trainer.ppo_mini_batch_size=8", "trainer.global_batch_size=8")  # one mini-batch
    assert applies("algorithm.rollout_filter.name=reward_above_mean_std")  # zeroes masks, refills nothing
    for off in (["trainer.old_log_probs_from_update=false"], ["trainer.ppo_epochs=2"],
                ["trainer.ppo_mini_batch_size=4", "trainer.global_batch_size=8"],
                ["algorithm.kl.use_kl_in_reward=true"], ["reward.shaping.beta=0.1"],
                ["algorithm.rollout_correction.rollout_is=token"], ["model.hidden_dropout=0.1"],
                ["model.attention_dropout=0.1"], ["model.lora.rank=4", "model.lora.dropout=0.1"],
                ["algorithm.rollout_filter.name=dapo_groups"], ["parallel.pipeline_model_parallel_size=2"]):
        assert not applies(*off), off
    assert applies("algorithm.rollout_filter.name=dapo_groups", "algorithm.rollout_filter.max_refill_rounds=0")


def _weights_worker(groups, first, second):
    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights

    cfg = load_config(None, ["model.num_layers=4"])
    out = []
    for path in (first, second):
        model = build_policy(cfg.model, cfg.parallel, groups)
        load_model_weights(model, path, groups)
        out.append({k: v.clone() for k, v in model.state_dict().items()
                    if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")})
    return sorted(out[0]) == sorted(out[1]) and all(torch.equal(out[0][k], out[1][k]) for k in out[0])


@pytest.mark.e2e
def test_a_run_with_the_shortcut_equals_one_with_the_old_policy_forward(demo):
    # step 1 measures the balance (two backward passes), step 2 runs one
    extra = [*ON_POLICY, "trainer.total_steps=2", "checkpoint.save_interval=2", "algorithm.hpa.balance.measure_steps=1"]
    runs, forwards = {}, {}
    for name, flag, env in (("shortcut", "true", {}), ("forward", "false", {}),
                            ("shortcut_on_test_device", "true", {"HPA_TEST_MODEL_DEVICE": "lazy"})):
        metrics = launch(demo, demo / f"old_lp_{name}", 1, [*extra, f"trainer.old_log_probs_from_update={flag}"],
                         env=env)
        runs[name] = [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in metrics]
        forwards[name] = [m["step"] for m in metrics if "timing_s/old_logprob" in m]
    # the old-policy forward ran without the shortcut only
    assert forwards == {"shortcut": [], "forward": [1, 2], "shortcut_on_test_device": []}
    shortcut, forward = runs["shortcut"], runs["forward"]
    assert [m["step"] for m in shortcut] == [0, 1, 2]
    for a, b, c in zip(shortcut, forward, runs["shortcut_on_test_device"]):
        assert a == b == c
    trained = [m for m in shortcut if "actor/pg_loss" in m]
    assert trained and all("rollout/logprob_diff_mean" in m and "actor/reward_kl" in m for m in trained)
    ck = "checkpoints/step_00000002"
    assert run_ranks(_weights_worker, args=(str(demo / "old_lp_shortcut" / ck), str(demo / "old_lp_forward" / ck)))[0]
