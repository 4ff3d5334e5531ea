"""`hpa train` with LoRA on the demo task: the trainer's reference is the base with adapters off, run
checkpoints hold the adapters only, and a resumed run's metrics equal the uninterrupted run's."""

import json

import pytest

from test_fault_tolerance import assert_same_metrics
from trainer_runs import launch

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.advantage.estimator=grpo",
        "trainer.total_steps=4", "checkpoint.save_interval=1", "guard.kl_rollback_threshold=null"]


@pytest.fixture(scope="module")
def lora_uninterrupted(demo):
    return launch(demo, demo / "lora_ref", 1, LORA)


@pytest.mark.e2e
def test_lora_run_trains_and_checkpoints_adapters_only_tp1_pp1_dp1(demo, lora_uninterrupted):
    steps = [r for r in lora_uninterrupted if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    policy = demo / "lora_ref" / "checkpoints" / "step_00000004" / "policy"
    marker = json.loads((policy / "lora.json").read_text())
    assert marker["adapters_only"] and marker["rank"] == 4 and marker["num_adapters"] == 4 * 4
    # the policy moved away from the reference (the base with adapters off): a KL that is not zero
    kl_keys = [k for k in steps[-1] if k.startswith("kl/") and isinstance(steps[-1][k], float)]
    assert kl_keys and any(abs(steps[-1][k]) > 0 for k in kl_keys), kl_keys


@pytest.mark.e2e
def test_lora_resume_equals_uninterrupted_tp1_pp1_dp1(demo, lora_uninterrupted):
    run_dir = demo / "lora_sliced"
    launch(demo, run_dir, 1, LORA + ["trainer.max_steps_per_run=2"])
    resumed = launch(demo, run_dir, 1, LORA)
    assert_same_metrics(lora_uninterrupted, resumed, steps=[3, 4])


# the critic over the same base: its own adapters + value head (hpa.models.lora.CriticView)
LORA_GAE = [o if o != "algorithm.advantage.estimator=grpo" else "algorithm.advantage.estimator=gae" for o in LORA]


@pytest.fixture(scope="module")
def lora_gae_uninterrupted(demo):
    return launch(demo, demo / "lora_gae_ref", 1, LORA_GAE)


@pytest.mark.e2e
def test_lora_gae_run_checkpoints_the_critics_adapters_and_value_head_tp1_pp1_dp1(demo, lora_gae_uninterrupted):
    from megatron.core import dist_checkpointing

    steps = [r for r in lora_gae_uninterrupted if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(isinstance(r.get("critic/vf_loss"), float) for r in steps), steps[-1].keys()
    critic = demo / "lora_gae_ref" / "checkpoints" / "step_00000004" / "critic"
    marker = json.loads((critic / "lora.json").read_text())
    assert marker["adapters_only"] and marker["num_adapters"] == 4 * 4
    keys = set(dist_checkpointing.load_common_state_dict(str(critic)) or {}) | {
        k for k in dist_checkpointing.load_tensors_metadata(str(critic))}
    model_keys = {k for k in keys if not k.startswith("optimizer")}
    assert {"value_head.weight", "value_head.bias"} <= model_keys
    assert all(k.startswith(("adapters.", "value_head.")) for k in model_keys), sorted(model_keys)[:8]


@pytest.mark.e2e
def test_lora_gae_resume_equals_uninterrupted_tp1_pp1_dp1(demo, lora_gae_uninterrupted):
    run_dir = demo / "lora_gae_sliced"
    launch(demo, run_dir, 1, LORA_GAE + ["trainer.max_steps_per_run=2"])
    resumed = launch(demo, run_dir, 1, LORA_GAE)
    assert_same_metrics(lora_gae_uninterrupted, resumed, steps=[3, 4])
