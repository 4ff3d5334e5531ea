"""``rollout.placement`` and ``rollout.num_ranks``: what a disaggregated launch refuses, each error naming its key
in one line; the trainer ranks are what the data-parallel checks count."""

import pytest

from hpa.config import ConfigError, load_config
from hpa.config.schema import data_parallel_size, trainer_world_size

DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.num_ranks=1"]


@pytest.mark.parametrize("overrides,world_size,key,message", [
    (["rollout.placement=disaggregated"], None, "rollout.num_ranks", "num_ranks >= 1"),
    (["rollout.placement=disaggregated", "rollout.num_ranks=-1"], None, "rollout.num_ranks", "num_ranks >= 1"),
    (["rollout.num_ranks=2"], None, "rollout.num_ranks", "need placement: disaggregated"),
    (["rollout.placement=elsewhere"], None, "rollout.placement", "colocated"),
    ([*DISAGGREGATED, "rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"], None,
     "rollout.vllm_tensor_parallel_size", "its vLLM runs at TP 1, got 2"),
    ([*DISAGGREGATED, "rollout.engine=vllm", "rollout.partial=true", "rollout.max_staleness=1"], None,
     "rollout.partial", "engine=vllm cannot stop a row"),
    ([*DISAGGREGATED, "parallel.tensor_model_parallel_size=2"], None, "rollout.placement", "tensor and pipeline"),
    ([*DISAGGREGATED, "parallel.pipeline_model_parallel_size=2"], None, "rollout.placement", "tensor and pipeline"),
    ([*DISAGGREGATED, "rollout.max_staleness=-1"], None, "rollout.max_staleness", "integer >= 0"),
    (["rollout.placement=disaggregated", "rollout.num_ranks=2"], 2, "rollout.num_ranks", "leave no trainer rank"),
    (["rollout.placement=disaggregated", "rollout.num_ranks=3"], 2, "rollout.num_ranks", "leave no trainer rank"),
    (["rollout.placement=disaggregated", "rollout.num_ranks=2"], 3, "rollout.num_ranks", "use at most 1"),
    # 4 ranks less 1: 3 trainer ranks, which a global batch of 4 prompts does not divide
    ([*DISAGGREGATED, "trainer.global_batch_size=4"], 4, "trainer.global_batch_size", "data-parallel size 3"),
])
def test_a_launch_that_cannot_be_split_names_the_key(overrides, world_size, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides, world_size=world_size)
    assert err.value.key == key, str(err.value)
    assert "\n" not in str(err.value)


def test_vllm_on_rollout_ranks_is_accepted_at_tp1_and_at_every_staleness():
    """Disaggregated, vLLM samples on the rollout ranks for the trainer at k >= 1 as well (colocated it has no
    worker thread, and k >= 1 stays refused)."""
    for extra in ([], ["rollout.vllm_tensor_parallel_size=1"],
                  ["rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token"]):
        cfg = load_config(None, [*DISAGGREGATED, "rollout.engine=vllm", *extra], world_size=2)
        assert (cfg.rollout.engine, cfg.rollout.placement) == ("vllm", "disaggregated")
    with pytest.raises(ConfigError, match="engine=vllm has none") as err:
        load_config(None, ["rollout.engine=vllm", "rollout.max_staleness=1",
                           "algorithm.rollout_correction.rollout_is=token"])
    assert err.value.key == "rollout.max_staleness"


def test_the_trainer_ranks_are_the_launch_less_the_rollout_ranks():
    cfg = load_config(None, [*DISAGGREGATED, "trainer.global_batch_size=4", "trainer.preference_batch_size=4",
                             "sft.global_batch_size=4", "trainer.micro_batch_size=2"], world_size=3)
    assert trainer_world_size(cfg.rollout, 3) == 2
    assert data_parallel_size(cfg.parallel, trainer_world_size(cfg.rollout, 3)) == 2
    colocated = load_config(None, [])
    assert trainer_world_size(colocated.rollout, 3) == 3
    assert (colocated.rollout.placement, colocated.rollout.num_ranks) == ("colocated", 0)
