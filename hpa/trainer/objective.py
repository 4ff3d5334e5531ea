"""The objective of one HPA step: its scheduled weights, the loss closures the pipeline schedule calls,
and the metrics of an optimizer step.

Loss normalisation (what the weights mean): every loss term is normalised by a *global* count of
the current mini-batch, taken over all DP ranks and all micro-batches: PPO, entropy and the token
KL by response tokens, the semantic distance by response sequences, DPO by preference pairs. Each
micro-batch contributes ``w · (its share of the term)``, so the gradient of the optimizer step is
exactly ``w_ppo·∇L_ppo + w_dpo·∇L_dpo + w_kl·∇L_hier_kl`` whatever the number of micro-batches of
each kind or the DP size; with ``w_dpo = 0`` the step is plain PPO, with ``w_ppo = w_kl = 0`` it
is plain DPO.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch

from hpa.algorithms.dpo import anchor_nll, dpo_loss
from hpa.algorithms.hybrid import hpa_objective
from hpa.algorithms.kl import hierarchical_kl, kl_warmup_scale
from hpa.algorithms.losses import Aggregation
from hpa.algorithms.masked import mean_pool
from hpa.algorithms.ppo import entropy_bonus, policy_loss, value_loss
from hpa.algorithms.schedules import make_schedule
from hpa.config.algorithm import AlgorithmConfig
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine.micro_batch import MicroBatch
from hpa.engine.head import label_log_probs, response_log_probs


@dataclasses.dataclass(frozen=True)
class StepWeights:
    """The scheduled coefficients of one step (progress p = step / total_steps)."""

    w_ppo: float
    w_dpo: float
    w_kl: float
    lambda_token: float
    lambda_semantic: float
    entropy_coef: float
    reward_kl_coef: float


class WeightSchedules:
    """The schedules of the step weights (``algorithm.hpa`` and the entropy coefficient)."""

    NAMES = ("w_ppo", "w_dpo", "w_kl", "lambda_token", "lambda_semantic")

    def __init__(self, algo: AlgorithmConfig):
        self.algo = algo
        self.schedules = {name: make_schedule(**dataclasses.asdict(getattr(algo.hpa, name))) for name in self.NAMES}
        self.schedules["entropy_coef"] = make_schedule(**dataclasses.asdict(algo.ppo.entropy_coef))

    def at(self, p: float, kl_coef: float) -> StepWeights:
        """The weights at progress ``p``; the in-reward KL coefficient is the controller's ``kl_coef``
        times the KL warm-up scale."""
        values = {name: schedule(p) for name, schedule in self.schedules.items()}
        return StepWeights(**values, reward_kl_coef=kl_coef * kl_warmup_scale(p, self.algo.kl.warmup_fraction))

    def metrics(self, w: StepWeights) -> Dict[str, float]:
        return {"hpa/w_ppo": w.w_ppo, "hpa/w_dpo": w.w_dpo, "hpa/w_kl": w.w_kl,
                "hpa/lambda_token": w.lambda_token, "hpa/lambda_semantic": w.lambda_semantic}


@dataclasses.dataclass(frozen=True)
class GlobalCounts:
    """Counts over all DP ranks of one mini-batch (what makes every loss term's weight exact)."""

    tokens: float
    sequences: float
    pairs: float
    chosen_tokens: float = 1.0  # response tokens of the pairs' chosen rows (the anchor's normaliser)


def _chosen_tokens(mb: MicroBatch) -> float:
    return float(mb["label_mask"][:mb.num_rows // 2].sum())


def global_counts(rollout_mbs: Sequence[MicroBatch], pair_mbs: Sequence[MicroBatch],
                  groups: ParallelGroups) -> GlobalCounts:
    rollout_mbs = [MicroBatch.of(mb) for mb in rollout_mbs]
    pair_mbs = [MicroBatch.of(mb) for mb in pair_mbs]
    local = torch.tensor([
        sum(float(mb["mask"].sum()) for mb in rollout_mbs),
        sum(float((mb["mask"].sum(dim=1) > 0).sum()) for mb in rollout_mbs),
        sum(mb.num_rows / 2 for mb in pair_mbs),
        sum(_chosen_tokens(mb) for mb in pair_mbs),
    ], dtype=torch.float64)
    comm.all_reduce_sum(local, groups.dp_group)
    tokens, seqs, pairs, chosen = local.tolist()
    return GlobalCounts(tokens=max(tokens, 1.0), sequences=max(seqs, 1.0), pairs=max(pairs, 1.0),
                        chosen_tokens=max(chosen, 1.0))


def make_policy_loss(algo: AlgorithmConfig, weights: StepWeights, counts: GlobalCounts, groups: ParallelGroups,
                     *, vocab_size: int, temperature: float, pair_scale: float = 1.0):
    """The loss closure of the mixed step; dispatches on the micro-batch's ``kind`` (``rollout`` or ``pairs``).

    Per-token quantities (log-probs, entropy) are computed only at the positions the terms read, by the fused
    head (``hpa.engine.head``), and come back in the row layout, where every loss term reads them: packing
    changes no term.

    Args:
        pair_scale: the balance factor on the pair term (DPO and its anchor): it enters as
            ``w_dpo · pair_scale`` (``hpa.trainer.balance``).
    """
    aggregation = Aggregation(mode=algo.ppo.loss_agg_mode, num_global_tokens=counts.tokens,
                              num_global_seqs=counts.sequences, dp_size=1,
                              loss_scale_factor=algo.ppo.loss_scale_factor)
    ppo, dpo = algo.ppo, algo.dpo
    step_weights = dataclasses.asdict(weights)

    def rollout_loss(batch, logits, hidden):
        logp, ent_r = response_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size,
                                         temperature=temperature, entropy=True)  # [b, r] each
        mask = batch["mask"]
        pg, pg_m = policy_loss(batch["old_log_probs"], logp, batch["advantages"], mask, name=ppo.policy_loss,
                               clip_ratio=ppo.clip_ratio, clip_ratio_low=ppo.clip_ratio_low,
                               clip_ratio_high=ppo.clip_ratio_high, clip_ratio_c=ppo.clip_ratio_c,
                               aggregation=aggregation, importance_weights=batch.get("is_weights"))
        ent, ent_m = entropy_bonus(ent_r, mask, weights.entropy_coef, aggregation=aggregation)
        pooled = mean_pool(batch.unpack(hidden).float(), batch["pool_mask"])  # [b, h]
        hier, hier_m = hierarchical_kl(logp, batch["ref_log_probs"], mask, pooled, batch["ref_pooled"],
                                       lambda_token=weights.lambda_token,
                                       lambda_semantic=weights.lambda_semantic, kind=algo.kl.estimator,
                                       distance=algo.hpa.semantic_distance, aggregation=aggregation)
        if not algo.kl.use_kl_loss:
            hier = hier * 0.0
        total, _ = hpa_objective({"ppo": pg, "hier_kl": hier, "entropy": ent}, step_weights)
        metrics = {f"actor/{k}": v for k, v in pg_m.items()}
        metrics.update({"actor/entropy": ent_m["entropy"], "kl/token": hier_m["token_kl"],
                        "kl/semantic": hier_m["semantic_distance"], "kl/hier": hier_m["hier_kl"],
                        # the KL term as it enters the loss (before w_kl): kl/hier, or 0 without the KL loss
                        "actor/kl_loss": hier.detach()})
        return total, metrics

    def pair_loss(batch, logits, hidden):
        logp_s = label_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size)  # [2m, s]
        seq = (logp_s * batch["label_mask"]).sum(dim=1)  # [2m]
        m = seq.shape[0] // 2
        lengths = batch["label_mask"].sum(dim=1)
        loss, d_m = dpo_loss(seq[:m], seq[m:], batch["ref_seq_logp"][:m], batch["ref_seq_logp"][m:],
                             beta=dpo.beta, variant=dpo.loss, label_smoothing=dpo.label_smoothing,
                             chosen_lengths=lengths[:m], rejected_lengths=lengths[m:],
                             num_global_pairs=counts.pairs, dp_size=1)
        metrics = {"dpo/loss": d_m["dpo_loss"], "dpo/reward_acc": d_m["dpo_reward_accuracy"],
                   "dpo/margin": d_m["dpo_reward_margin"], "dpo/chosen_reward": d_m["dpo_chosen_reward"],
                   "dpo/rejected_reward": d_m["dpo_rejected_reward"]}
        if dpo.rpo_alpha is not None:
            anchor, a_m = anchor_nll(logp_s[:m], batch["label_mask"][:m], alpha=dpo.rpo_alpha,
                                     num_global_tokens=counts.chosen_tokens, dp_size=1)
            loss = loss + anchor
            metrics["dpo/anchor_nll"] = a_m["anchor_nll"]
        total, _ = hpa_objective({"dpo": loss}, step_weights, group_scale={"pairs": pair_scale})
        return total, metrics

    def loss_fn(batch, logits, hidden):
        batch = MicroBatch.of(batch)
        return rollout_loss(batch, logits, hidden) if batch.kind == "rollout" else pair_loss(batch, logits, hidden)

    return loss_fn


def make_critic_loss(algo: AlgorithmConfig, counts: GlobalCounts):
    aggregation = Aggregation(mode=algo.ppo.loss_agg_mode, num_global_tokens=counts.tokens,
                              num_global_seqs=counts.sequences, dp_size=1,
                              loss_scale_factor=algo.ppo.loss_scale_factor)

    def loss_fn(batch, values, hidden):
        batch = MicroBatch.of(batch)
        vpreds = batch.response(batch.unpack(values[..., 0]))  # [b, r]
        loss, m = value_loss(vpreds, batch["returns"], batch["values"], batch["mask"],
                             clip_range_value=algo.ppo.value_clip, aggregation=aggregation)
        return loss, {f"critic/{k}": v for k, v in m.items()}

    return loss_fn


# metrics that are a micro-batch's share of a globally normalised loss: summed, not averaged
SHARE_KEYS = frozenset({"actor/pg_loss", "actor/entropy", "kl/token", "kl/semantic", "kl/hier", "actor/kl_loss",
                        "dpo/loss", "dpo/anchor_nll", "critic/vf_loss"})


def step_metrics(records: Sequence[Dict], groups: ParallelGroups,
                 share_keys: frozenset = SHARE_KEYS) -> Dict[str, float]:
    """Metrics of one optimizer step from its per-micro-batch records (only the last stage has them).

    Loss shares (``SHARE_KEYS``) are summed over micro-batches and DP ranks, which gives the loss of
    the whole mini-batch; every other metric is a micro-batch mean, averaged over micro-batches and
    then over DP ranks.
    """
    values: Dict[str, List[float]] = {}
    for record in records:
        for k, v in record.items():
            values.setdefault(k, []).append(float(v))
    local = {k: (sum(v) if k in share_keys else sum(v) / len(v)) for k, v in values.items()}
    last = groups.last_stage_global_rank()
    keys = sorted(local)
    if groups.pipeline_model_parallel_size > 1:
        keys = comm.broadcast_object(keys, src=last, group=groups.pp_group)
    vec = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64)
    if groups.pipeline_model_parallel_size > 1:
        comm.broadcast_tensor(vec, src=last, group=groups.pp_group)
    share = torch.tensor([k in share_keys for k in keys])
    summed = comm.all_reduce_sum(vec.clone(), groups.dp_group)
    out = torch.where(share, summed, summed / groups.data_parallel_size)
    return dict(zip(keys, out.tolist()))


def average(dicts: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Mean over optimizer steps (ppo_epochs × mini-batches)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}
