"""The rollout ranks of a disaggregated run (``rollout.placement: disaggregated``): build the policy (a whole
copy, TP = PP = 1, its weights replaced by the first push) and ``rollout.engine`` over it, then serve the
trainer ranks' jobs and weight pushes until they stop (``hpa/rollout/remote.py``). A ``kill@step:rank`` fault
(``hpa/trainer/faults.py``) naming a rollout rank fires as the push that starts that step arrives.

vLLM (``rollout.engine: vllm``) is built here only, never on a trainer rank. torch.distributed's default world of
this process is the rollout ranks' own (``hpa/distributed/rollout_groups.py``), and vLLM takes the default world
it finds initialised as its own (``vllm.distributed.parallel_state.init_distributed_environment`` skips its
``init_process_group`` then, and builds its world group from ``torch.distributed.get_world_size()``), so it
never sees a trainer rank. Each push lands in the copy and is synced into vLLM at once (``serve`` calls the
engine's ``sync_weights``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Dict

from hpa.config.schema import Config
from hpa.data.tokenizer import build_tokenizer
from hpa.distributed.groups import ParallelGroups
from hpa.models import unwrap
from hpa.models.stack import build_policy_stack
from hpa.rollout import build_rollout_engine
from hpa.rollout.base import TokenizerInfo
from hpa.rollout.remote import serve
from hpa.trainer import faults

logger = logging.getLogger("hpa")


def serve_rollouts(cfg: Config, groups: ParallelGroups) -> Dict[str, int]:
    """Run this rollout rank until every trainer rank it serves has stopped; returns its counts (``jobs``,
    ``pushes``)."""
    placement = groups.placement
    faults.record_in(cfg.trainer.run_dir)
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path, model_vocab_size=cfg.model.vocab_size)
    parallel = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                   sequence_parallel=False, use_distributed_optimizer=False)
    stack = build_policy_stack(cfg.model, parallel, groups, seed=cfg.trainer.seed, reference="none")
    module = unwrap(stack.policy)
    for param in module.parameters():
        param.requires_grad_(False)
    if cfg.rollout.engine == "vllm":
        # the launcher's RANK and WORLD_SIZE count the trainer ranks too; vLLM's external launcher (several
        # rollout ranks) reads them, and must see the rollout world it runs in
        os.environ.update(RANK=str(groups.rank), WORLD_SIZE=str(groups.world_size))
    engine = build_rollout_engine(cfg.rollout, module, groups, TokenizerInfo.from_tokenizer(tokenizer),
                                  model_cfg=cfg.model, checkpoint_path=cfg.model.policy_path)
    logger.info("rollout rank %d serves trainer ranks %s with the %s engine", placement.global_rank,
                placement.clients(), engine.name)
    # a push of version v starts step v + 1 (counted from 1, as the trainer's faults count)
    counts = serve(engine, module, placement, partial=cfg.rollout.partial,
                   on_push=lambda version: faults.maybe_kill(version + 1, placement.global_rank))
    logger.info("rollout rank %d: %d jobs, %d weight pushes", placement.global_rank, counts["jobs"], counts["pushes"])
    return counts
