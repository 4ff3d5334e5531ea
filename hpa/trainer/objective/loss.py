"""The loss closures the pipeline schedule calls, computed from the table of terms
(``hpa.trainer.objective.terms``), and the metrics of an optimizer step.

With every term normalised by its global count, each micro-batch contributes ``w · (its share of the
term)``, so the gradient of the optimizer step is exactly ``w_ppo·∇L_ppo + w_dpo·∇L_dpo + w_kl·∇L_hier_kl``
whatever the number of micro-batches of each kind or the DP size; with ``w_dpo = 0`` the step is plain
PPO, with ``w_ppo = w_kl = 0`` it is plain DPO.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from hpa.algorithms.losses import Aggregation
from hpa.algorithms.ppo import value_loss
from hpa.config.algorithm import AlgorithmConfig
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine.micro_batch import MicroBatch
from hpa.trainer.objective.streams import GlobalCounts, LossInputs, stream_of
from hpa.trainer.objective.terms import TERMS, hpa_objective
from hpa.trainer.objective.weights import StepWeights


def _aggregation(algo: AlgorithmConfig, counts: GlobalCounts) -> Aggregation:
    return Aggregation(mode=algo.ppo.loss_agg_mode, num_global_tokens=counts.tokens,
                       num_global_seqs=counts.sequences, dp_size=1, loss_scale_factor=algo.ppo.loss_scale_factor)


def make_policy_loss(algo: AlgorithmConfig, weights: StepWeights, counts: GlobalCounts, groups: ParallelGroups,
                     *, vocab_size: int, temperature: float,
                     observe_rollout: Optional[Callable[[MicroBatch, Dict[str, torch.Tensor]], None]] = None):
    """The loss closure of the mixed step: the micro-batch's stream (its ``kind``) prepares what its terms
    read, each term of that stream in ``TERMS`` gives its value and metrics, and ``hpa_objective`` weights
    and sums them, each term's weight times its factor of ``weights.factors`` (the balance's ``pairs``:
    ``w_dpo · b``). ``observe_rollout(batch, outputs)``, when given, sees each rollout micro-batch's outputs.
    """
    inputs = LossInputs(algo=algo, weights=weights, counts=counts, aggregation=_aggregation(algo, counts))
    step_weights = weights.scheduled()
    factors = weights.factors.scales()

    def part_loss(batch, logits, hidden):
        stream = stream_of(batch)
        outputs = stream.prepare(batch, logits, hidden, groups, vocab_size, temperature)
        if observe_rollout is not None and stream.name == "rollout":
            observe_rollout(batch, outputs)
        values, metrics = {}, {}
        for term in TERMS:
            if term.stream == stream.name:
                values[term.name], term_metrics = term.loss(batch, outputs, inputs)
                metrics.update(term_metrics)
        total, _ = hpa_objective(values, step_weights, factors=factors)
        return total, metrics

    def loss_fn(batch, logits, hidden):
        # a mixed micro-batch (rows of several streams in one sequence): each stream's terms on its own rows;
        # a metric of several parts of one stream is their sum (a loss share) or their mean
        parts = MicroBatch.of(batch).split(logits, hidden)
        total, metrics, seen = None, {}, {}
        for part, (part_logits, part_hidden) in parts:
            value, part_metrics = part_loss(part, part_logits, part_hidden)
            total = value if total is None else total + value
            for k, v in part_metrics.items():
                metrics[k] = metrics[k] + v if k in metrics else v
                seen[k] = seen.get(k, 0) + 1
        return total, {k: v if k in SHARE_KEYS or seen[k] == 1 else v / seen[k] for k, v in metrics.items()}

    return loss_fn


def make_critic_loss(algo: AlgorithmConfig, counts: GlobalCounts):
    aggregation = _aggregation(algo, counts)

    def loss_fn(batch, values, hidden):
        batch = MicroBatch.of(batch)
        vpreds = batch.response(batch.unpack(values[..., 0]))  # [b, r]
        loss, m = value_loss(vpreds, batch["returns"], batch["values"], batch["mask"],
                             clip_range_value=algo.ppo.value_clip, aggregation=aggregation)
        return loss, {f"critic/{k}": v for k, v in m.items()}

    return loss_fn


# metrics that are a micro-batch's share of a globally normalised loss: summed, not averaged
SHARE_KEYS = frozenset({key for term in TERMS for key in term.shares} | {"critic/vf_loss"})


def step_metrics(records: Sequence[Dict], groups: ParallelGroups,
                 share_keys: frozenset = SHARE_KEYS) -> Dict[str, float]:
    """Metrics of one optimizer step from its per-micro-batch records (only the last stage has them).

    Loss shares (``SHARE_KEYS``) are summed over micro-batches and DP ranks, which gives the loss of
    the whole mini-batch; every other metric is a micro-batch mean, averaged over micro-batches and
    then over DP ranks.
    """
    local = local_metrics(records, share_keys)
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


def local_metrics(records: Sequence[Dict], share_keys: frozenset) -> Dict[str, float]:
    """This rank's sums (``share_keys``) and means of the micro-batches' metrics. Values on a device are summed
    there and read to the host in one copy, not one read per metric per micro-batch."""
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    on_device: Dict[str, List[torch.Tensor]] = {}
    for record in records:
        for k, v in record.items():
            counts[k] = counts.get(k, 0) + 1
            if torch.is_tensor(v) and v.device.type != "cpu":
                on_device.setdefault(k, []).append(v.detach().reshape(()))
            else:
                sums[k] = sums.get(k, 0.0) + float(v)
    if on_device:
        keys = sorted(on_device)
        totals = torch.stack([torch.stack(on_device[k]).double().sum() for k in keys]).tolist()  # the one read
        for k, total in zip(keys, totals):
            sums[k] = sums.get(k, 0.0) + total
    return {k: (total if k in share_keys else total / counts[k]) for k, total in sums.items()}


def average(dicts: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Mean over optimizer steps (ppo_epochs × mini-batches)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}
