"""The rollout ranks of a disaggregated run (``rollout.placement: disaggregated``): build the policy (a whole
copy, TP = PP = 1, its weights replaced by the first push) and the native engine over it, then serve the
trainer ranks' jobs and weight pushes until they stop (``hpa/rollout/remote.py``). A ``kill@step:rank`` fault
(``hpa/trainer/faults.py``) naming a rollout rank fires as the push that starts that step arrives."""

from __future__ import annotations

import dataclasses
import logging
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
    engine = build_rollout_engine(cfg.rollout, module, groups, TokenizerInfo.from_tokenizer(tokenizer),
                                  model_cfg=cfg.model, checkpoint_path=cfg.model.policy_path)
    logger.info("rollout rank %d serves trainer ranks %s", placement.global_rank, placement.clients())
    # a push of version v starts step v + 1 (counted from 1, as the trainer's faults count)
    counts = serve(engine, module, placement, partial=cfg.rollout.partial,
                   on_push=lambda version: faults.maybe_kill(version + 1, placement.global_rank))
    logger.info("rollout rank %d: %d jobs, %d weight pushes", placement.global_rank, counts["jobs"], counts["pushes"])
    return counts
