"""Exact resume with megatron's distributed optimizer (``parallel.use_distributed_optimizer``, every shipped
GPU config): a DP2 run that stops after step 2 (``trainer.max_steps_per_run``), saving a checkpoint, and is
resumed has the metrics of an uninterrupted run at steps 3 and 4; full fine-tuning, and LoRA rank 4 (with
grpo: LoRA has no critic). Before the checkpoint saved the optimizer as 'dp_reshardable', these runs saved
no checkpoint at all (the save failed and training went on)."""

import pytest

from test_fault_tolerance import FOUR_STEPS, assert_same_metrics
from trainer_runs import launch

pytestmark = pytest.mark.e2e  # three 2-rank training runs per case

DISTOPT = ["parallel.use_distributed_optimizer=true"]


LORA = ["model.lora.rank=4", "algorithm.advantage.estimator=grpo"]


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora4"])
def test_distributed_optimizer_dp2_resume_equals_uninterrupted(demo, lora):
    extra = FOUR_STEPS + DISTOPT + lora
    tag = "lora" if lora else "full"
    uninterrupted = launch(demo, demo / f"distopt_ref_{tag}", 2, extra)
    run_dir = demo / f"distopt_sliced_{tag}"
    first = launch(demo, run_dir, 2, extra + ["trainer.max_steps_per_run=2"])
    assert [r.get("checkpoint/save_failures", 0) for r in first] == [0] * len(first)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"
    resumed = launch(demo, run_dir, 2, extra)
    assert [r["step"] for r in resumed][-2:] == [3, 4]
    assert_same_metrics(uninterrupted, resumed, steps=[3, 4])
