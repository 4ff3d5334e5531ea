"""A tiny-dimension twin of ``configs/llama2_70b_lora.yaml`` on 8 gloo ranks: the same layout (TP8 x PP1 x DP1,
distributed optimizer), LoRA (all four linears) over one frozen base that is also the reference, group
advantages, and a reward model of its own, smaller size (recorded in its ``hpa_reward_model.json``) scoring the
policy. The native rollout engine stands in for vLLM (no vLLM on CPU), and with it sequence parallelism is off
(the native engine decodes one position a step). ``hpa plan`` for the twin is checked beside the run: the
reference adds nothing, the reward model is planned with its recorded size."""

import json
import math

import pytest

from multirank import run_ranks
from trainer_runs import launch

pytestmark = pytest.mark.multirank

TP = 8
# the policy: 8 query heads in 8 groups (Llama-2-70B: 64 in 8), so every TP8 rank holds one of each
POLICY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=8",
          "model.ffn_hidden_size=176"]
# the reward model: half the width and one layer, still 8 heads and groups (it runs under the policy's TP8)
REWARD = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=8", "model.num_query_groups=8",
          "model.ffn_hidden_size=88"]
LAYOUT = [f"parallel.tensor_model_parallel_size={TP}", "parallel.pipeline_model_parallel_size=1",
          "parallel.use_distributed_optimizer=true", "parallel.sequence_parallel=false"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]


def save_twin_models(groups, policy_dir, reward_dir):
    """The twin's initial policy and its smaller reward model (4 heads, architecture recorded), saved at TP1."""
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy, build_reward
    from hpa.models.weights import save_model_weights
    from hpa.reward.model import write_reward_model_info

    policy = load_config(None, POLICY).model
    torch.manual_seed(0)
    save_model_weights(build_policy(policy, load_config(None).parallel, groups), policy_dir, groups)
    reward = load_config(None, REWARD).model
    torch.manual_seed(1)
    save_model_weights(build_reward(reward, load_config(None).parallel, groups, num_heads=4), reward_dir, groups)
    if groups.is_main:
        write_reward_model_info(reward_dir, num_heads=4, model=reward)


def test_70b_lora_twin_trains_on_8_ranks(demo, tmp_path):
    from hpa.config import load_config
    from hpa.plan import plan

    policy_dir, reward_dir = tmp_path / "policy", tmp_path / "rm"
    run_ranks(save_twin_models, args=(str(policy_dir), str(reward_dir)))
    extra = [*LAYOUT, *POLICY, *LORA, f"model.policy_path={policy_dir}", "algorithm.advantage.estimator=grpo",
             f"reward.model_paths=[{reward_dir}]", "reward.num_heads=4", "reward.shaping.beta=0.1",
             "trainer.total_steps=2", "trainer.eval_interval=0", "checkpoint.save_interval=1",
             "guard.kl_rollback_threshold=null"]

    cfg = load_config(None, extra, world_size=TP)
    planned = plan(cfg, world_size=TP, gpu_memory_gb=80)
    assert planned["layout"]["tensor_model_parallel_size"] == TP and planned["layout"]["data_parallel_size"] == 1
    assert planned["models"]["reference"]["static_gb"] == 0
    assert planned["models"]["reward"]["parameters"] < planned["models"]["policy"]["parameters"] / 2

    output = []
    records = launch(demo, tmp_path / "run", TP, extra, output=output)
    steps = [r for r in records if r.get("step", 0) > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0
        assert math.isfinite(r["reward/raw_mean"]) and r["reward/sigma_mean"] > 0  # the 4 heads of the small model
    checkpoints = tmp_path / "run" / "checkpoints"
    marker = checkpoints / "step_00000002" / "policy" / "lora.json"
    if steps[-1]["checkpoint/save_failures"] > 0:
        # Found by this twin (2026-11-27): with parallel.use_distributed_optimizer (every shipped GPU config)
        # a run checkpoint's optimizer part is megatron's 'fully_sharded_model_space' sharded state dict, whose
        # ShardedTensors carry a flattened_range that megatron-core 0.16.1's dist_checkpointing refuses
        # ("ShardedTensor.flattened_range is not supported."), with or without LoRA; training goes on
        # (checkpoint.on_save_failure=continue). Passing metadata={"distrib_optim_sharding_type":
        # "dp_reshardable"} saves on CPU; its load and exact resume are untested.
        saves = [line for line in output[0].splitlines() if "flattened_range" in line]
        pytest.xfail("distributed-optimizer checkpoints fail to save: " + (saves[0][-300:] if saves else "?"))
    assert json.loads(marker.read_text())["rank"] == 4  # the checkpoint holds the adapters only
