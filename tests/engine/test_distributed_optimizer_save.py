"""The distributed optimizer's state as a run checkpoint saves it (``hpa.trainer.checkpoint``) through
megatron-core 0.16.1's dist_checkpointing. megatron's default sharding, 'fully_sharded_model_space', makes
ShardedTensors with a flattened_range, which 0.16.1 refuses: every run with
``parallel.use_distributed_optimizer`` (all shipped GPU configs) used to fail its checkpoint saves and go on
(``checkpoint.on_save_failure: continue``). Found by the 70B LoRA twin (tests/trainer/test_70b_lora_twin.py).
The checkpoint now saves 'dp_reshardable' and records it in the checkpoint, so a load uses what was saved."""

import dataclasses

import pytest

from multirank import run_ranks

pytestmark = pytest.mark.multirank


def save_load_worker(groups, directory):
    import os

    import torch
    from megatron.core import dist_checkpointing

    from hpa.config import load_config
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import optimizer_step, zero_grad
    from hpa.models import build_policy
    from hpa.models.weights import dist_save, sharded_state_dict
    from hpa.trainer.checkpoint import optim_metadata, prime_for_load, restore_steps

    cfg = load_config(None, ["parallel.use_distributed_optimizer=true"])
    parallel = dataclasses.replace(cfg.parallel, backend="gloo")

    def built():
        ddp = wrap_ddp(build_policy(cfg.model, parallel, groups), parallel, groups)
        return ddp, build_optimizer(ddp, cfg.optim, parallel, groups)

    ddp, opt = built()
    zero_grad(ddp, opt)
    for p in ddp.parameters():
        p.main_grad.fill_(1e-3)
    optimizer_step(opt)
    metadata = optim_metadata(opt)
    os.makedirs(directory)
    model_sd = sharded_state_dict(ddp)
    dist_save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata)}, directory,
              content_metadata=metadata)  # as checkpoint.py

    fresh_ddp, fresh = built()  # a fresh optimizer (zero moments, step 0) loads what was saved
    recorded = dist_checkpointing.load_content_metadata(directory)
    model_sd = sharded_state_dict(fresh_ddp)
    prime_for_load(fresh)  # as checkpoint.py
    loaded = dist_checkpointing.load({"optimizer": fresh.sharded_state_dict(model_sd, is_loading=True,
                                                                            metadata=recorded)}, directory)
    with torch.no_grad():  # as checkpoint.py
        fresh.load_state_dict(loaded["optimizer"])
    restore_steps(fresh)
    moments = list(zip(_moments(opt), _moments(fresh)))
    return (metadata, recorded, len(moments) > 0 and all(torch.equal(a, b) for a, b in moments),
            all(float(a.abs().sum()) > 0 for a, _ in moments))


def _moments(optimizer):
    """This rank's shard of the torch optimizer state (exp_avg, exp_avg_sq, step per parameter), in order."""
    out = []
    for part in optimizer.chained_optimizers:
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                state = part.optimizer.state[p]
                out += [state["exp_avg"], state["exp_avg_sq"], state["step"]]
    return out


def test_distributed_optimizer_state_saves_and_loads_back_tp1_pp1_dp1(tmp_path):
    ((metadata, recorded, equal, nonzero),) = run_ranks(save_load_worker, args=(str(tmp_path / "ckpt"),),
                                                        parallel_kwargs={"use_distributed_optimizer": True})
    assert metadata == recorded == {"distrib_optim_sharding_type": "dp_reshardable"}
    assert nonzero, (equal, nonzero)  # the step moved every moment and the step count: the comparison is not of zeros
    assert equal, (equal, nonzero)
