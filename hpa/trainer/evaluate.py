"""Evaluation of the policy during training: held-out prompts (``eval/*``) and the adversarial set,
whose numbers feed the reward-hacking monitor (``hacking/*``)."""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Sequence

import torch

from hpa.config.data import DataConfig
from hpa.config.reward import RewardConfig
from hpa.config.schema import RolloutConfig
from hpa.data.prompts import PromptDataset
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine.batching import Batching
from hpa.engine.forward import response_kl
from hpa.reward import RewardHackingMonitor, RewardInputs
from hpa.reward.rules import RuleReward
from hpa.reward.shaping import ngram_copy_rate
from hpa.rollout.base import SamplingParams

logger = logging.getLogger("hpa")


class Evaluator:
    """Greedy responses of the policy to the held-out and adversarial prompts, DP-sharded.

    Owns the reward-hacking monitor (a stateful part of the run: ``state_dict`` / ``load_state_dict``).
    """

    def __init__(self, data: DataConfig, rollout: RolloutConfig, reward_cfg: RewardConfig, groups: ParallelGroups,
                 tokenizer, *, rejects_dir: str, reward, model_reward, batching: Batching):
        """
        Args:
            reward: the shaped reward of the run (``.base`` gives r̂: reward-model heads and rules).
            model_reward: the reward-model ensemble alone (what a policy can exploit), or None.
            batching: the micro-batches of the KL forwards.
        """
        self.rollout_cfg, self.groups, self.tokenizer = rollout, groups, tokenizer
        self.copy_ngram = reward_cfg.shaping.copy_ngram
        self.reward, self.model_reward, self.batching = reward, model_reward, batching
        self.gold = RuleReward.from_names(reward_cfg.rules or ("exact_match",), 1.0, None)
        self.eval_prompts = (PromptDataset.from_config(data, tokenizer, rejects_dir=rejects_dir, split="eval")
                             if data.eval_prompt_path else None)
        # the held-out prompts' categories, sorted (the same list on every DP rank: the whole set's)
        self.categories = (sorted({self.eval_prompts[i].category for i in range(len(self.eval_prompts))} - {None})
                           if self.eval_prompts is not None else [])
        self.adversarial_prompts = (PromptDataset.from_config(data, tokenizer, rejects_dir=rejects_dir,
                                                              split="adversarial")
                                    if data.adversarial_prompt_path else None)
        self.monitor = RewardHackingMonitor.from_config(reward_cfg.monitor)

    def state_dict(self) -> Dict:
        return self.monitor.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.monitor.load_state_dict(state)

    def evaluate(self, policy, reference, generate, step: int,
                 trust: Optional[Callable[[object], torch.Tensor]] = None) -> Dict[str, float]:
        """``eval/*`` of the held-out prompts and ``hacking/*`` of the adversarial set (alerts logged).

        Args:
            generate: ``(prompt_ids, SamplingParams) -> RolloutBatch`` on the policy's current weights.
            trust: with the coverage trust on, its per-row weight of a ``RolloutBatch`` ``[b]``: the held-out
                responses' mean trust is logged overall and per category (``eval/trust``, ``eval/trust/<c>``).
        """
        metrics: Dict[str, float] = {}
        if self.eval_prompts is not None:
            held_out = self.evaluate_prompts(self.eval_prompts, policy, reference, generate, self.categories,
                                             trust=trust)
            metrics.update({f"eval/{k}": v for k, v in held_out.items()})
        if self.adversarial_prompts is not None:
            adv = self.evaluate_prompts(self.adversarial_prompts, policy, reference, generate)
            alerts, hacking = self.monitor.update(model_reward=adv["model_reward"], gold_score=adv["score"],
                                                  copy_rate=adv["copy_rate"],
                                                  mean_response_length=adv["response_length"])
            metrics.update(hacking)
            for alert in alerts if self.groups.is_main else ():
                logger.warning("reward-hacking monitor at step %d: %s", step, alert)
        return metrics

    def evaluate_prompts(self, dataset: PromptDataset, policy, reference, generate,
                         categories: Sequence[str] = (),
                         trust: Optional[Callable[[object], torch.Tensor]] = None) -> Dict[str, float]:
        """Greedy responses to ``dataset`` and their means over the whole set: the gold rule ``score``
        (``reward.rules``, exact match by default), the configured base ``reward`` (r̂: reward-model
        heads and rules), the ``model_reward`` (the reward models' heads alone, what a policy can
        exploit; r̂ without a reward model), the k1 ``kl`` to the reference per response token at
        temperature 1, the n-gram ``copy_rate`` and the ``response_length``; and ``score/<c>``, the gold
        score of the prompts of each of ``categories`` (their ``category`` field); with ``trust``, the responses'
        mean coverage ``trust`` and ``trust/<c>`` per category."""
        g = self.groups
        mine = list(range(g.dp_rank, len(dataset), g.data_parallel_size))
        n = comm.all_reduce_max(torch.tensor([len(mine)]), g.dp_group).item()
        mine = (mine + mine[:1] * n)[:n]  # equal work on every DP rank (the repeat is not counted)
        examples = [dataset[i] for i in mine]
        params = SamplingParams.from_config(self.rollout_cfg, n=1, temperature=0.0)
        batch = generate([e.prompt_ids for e in examples], params)
        policy.eval()
        with torch.no_grad():
            inputs = RewardInputs.from_batch(batch, self.tokenizer, [e.ground_truth for e in examples])
            gold = self.gold(inputs).rewards[:, 0]
            reward = self.reward.base(inputs).rewards.float().mean(dim=1)  # [b]
            learned = (self.model_reward(inputs).rewards.float().mean(dim=1) if self.model_reward is not None
                       else reward)  # [b]
            copy = ngram_copy_rate(batch.response_ids, batch.response_mask, batch.prompt_ids, batch.prompt_mask,
                                   self.copy_ngram)  # [b]
            kl = response_kl(policy, reference, batch, g, batching=self.batching,
                             vocab_size=self.tokenizer.vocab_size).sum(dim=1)  # [b]
            weight = trust(batch).cpu().float() if trust is not None else None  # [b]
        policy.train()
        lengths = batch.response_mask.float().sum(dim=1)  # [b]
        counted = len(set(mine))
        gold = gold.cpu().float()
        in_category = torch.tensor([[float(e.category == c) for e in examples] for c in categories]).reshape(
            len(categories), len(examples))  # [c, b]
        trusted = weight if weight is not None else torch.zeros_like(lengths)  # [b]
        sums = torch.cat([torch.stack([gold, reward.cpu(), learned.cpu(), copy.cpu().float(), lengths, kl,
                                       torch.ones_like(lengths), trusted]), in_category * gold, in_category,
                          in_category * trusted])
        sums = sums[:, :counted].sum(dim=1).double()
        comm.all_reduce_sum(sums, g.dp_group)
        score, reward_sum, learned_sum, copy_sum, tokens, kl_sum, rows, trust_sum, *per_category = sums.tolist()
        out = {"score": score / rows, "reward": reward_sum / rows, "model_reward": learned_sum / rows,
               "copy_rate": copy_sum / rows, "response_length": tokens / rows, "kl": kl_sum / max(tokens, 1.0)}
        n = len(categories)
        counts = per_category[n:2 * n]
        out.update({f"score/{c}": s / max(k, 1.0) for c, s, k in zip(categories, per_category[:n], counts)})
        if weight is not None:
            out["trust"] = trust_sum / rows
            out.update({f"trust/{c}": s / max(k, 1.0) for c, s, k in zip(categories, per_category[2 * n:], counts)})
        return out
