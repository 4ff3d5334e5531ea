import dataclasses

import pytest
import torch

from hpa.algorithms.dpo import dpo_loss
from hpa.trainer.objective import hpa_objective
from hpa.algorithms.kl import hierarchical_kl
from hpa.algorithms.ppo import entropy_bonus, policy_loss

W = {"w_ppo": 0.4, "w_dpo": 0.4, "w_kl": 0.2}


def test_weighted_sum_by_hand():
    ppo, dpo, kl = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)
    total, m = hpa_objective({"ppo": ppo, "dpo": dpo, "hier_kl": kl, "entropy": torch.tensor(-0.05)}, W)
    # the entropy bonus is part of the PPO term: w_ppo·(L_ppo + L_ent)
    assert total.item() == pytest.approx(0.4 * (1.0 - 0.05) + 0.8 + 0.6)
    assert m["ppo_loss"].item() == 1.0 and m["dpo_loss"].item() == 2.0 and m["hier_kl_loss"].item() == 3.0
    assert m["weighted_dpo"].item() == pytest.approx(0.8)
    assert m["entropy_loss"].item() == pytest.approx(-0.05)
    assert m["weighted_entropy"].item() == pytest.approx(0.4 * -0.05)
    assert (m["w_ppo"].item(), m["w_dpo"].item(), m["w_kl"].item()) == pytest.approx((0.4, 0.4, 0.2))
    assert m["loss"].item() == pytest.approx(total.item())


def test_zero_ppo_weight_removes_the_entropy_bonus_too():
    """w_ppo = w_kl = 0 is plain DPO even on a micro-batch that carries rollouts."""
    total, m = hpa_objective({"ppo": torch.tensor(1.0), "hier_kl": torch.tensor(3.0), "entropy": torch.tensor(-0.05)},
                             {"w_ppo": 0.0, "w_dpo": 0.4, "w_kl": 0.0})
    assert total.item() == 0.0 and m["weighted_entropy"].item() == 0.0


def test_missing_terms_are_skipped():
    total, m = hpa_objective({"ppo": None, "dpo": torch.tensor(2.0)}, {"w_ppo": 0.4, "w_dpo": 0.5, "w_kl": 0.2})
    assert total.item() == pytest.approx(1.0)
    assert "ppo_loss" not in m and "hier_kl_loss" not in m
    with pytest.raises(ValueError, match="at least one"):
        hpa_objective({}, {"w_ppo": 1, "w_dpo": 1, "w_kl": 1})
    with pytest.raises(ValueError, match="unknown objective terms.*anchor"):
        hpa_objective({"anchor": torch.tensor(1.0)}, {"w_ppo": 1, "w_dpo": 1, "w_kl": 1})


def test_the_balance_scales_the_pair_group_only():
    values = {"ppo": torch.tensor(1.0), "dpo": torch.tensor(2.0), "hier_kl": torch.tensor(3.0)}
    total, m = hpa_objective(values, W, factors={"pairs": 2.5})
    assert total.item() == pytest.approx(0.4 * 1.0 + 0.4 * 2.5 * 2.0 + 0.2 * 3.0)
    assert m["w_dpo"].item() == pytest.approx(1.0) and m["w_ppo"].item() == pytest.approx(0.4)


def test_the_table_lists_every_term_with_its_group_weight_and_normaliser():
    from hpa.trainer.objective import GROUPS, TERMS, describe

    from hpa.trainer.objective import GlobalCounts, StepWeights

    weight_fields = {f.name for f in dataclasses.fields(StepWeights)}
    count_fields = {f.name for f in dataclasses.fields(GlobalCounts)}
    for term in TERMS:
        assert term.group in GROUPS and term.weight in weight_fields
        assert term.normaliser.split(" ")[0] in count_fields
    text = describe(W, {"pairs": 2.0, "learned_advantage": 0.5})
    assert "| dpo | pairs | w_dpo = 0.8 |" in text and "(gate 0.5)" in text


def test_the_replay_term_is_listed_only_when_it_is_on():
    from hpa.config.algorithm import AlgorithmConfig, ReplayConfig
    from hpa.trainer.objective import active_terms, describe

    off, on = AlgorithmConfig(), AlgorithmConfig(replay=ReplayConfig(coef=0.5))
    assert [t.name for t in active_terms(off)] == ["ppo", "dpo", "hier_kl", "entropy"]
    assert [t.name for t in active_terms(on)][-1] == "replay"
    assert "| replay |" not in describe(W, {"pairs": 2.0}, active_terms(off))
    assert "| replay | replay | w_dpo = 0.8 | replay_tokens |" in describe(W, {"pairs": 2.0}, active_terms(on))


def test_the_replay_coefficient_refuses_a_negative_value():
    from hpa.config import ConfigError
    from hpa.config.algorithm import ReplayConfig

    with pytest.raises(ConfigError, match="coef"):
        ReplayConfig(coef=-0.1)
    assert not ReplayConfig().enabled and ReplayConfig(coef=0.1).enabled


def test_end_to_end_gradients_flow_to_every_component():
    torch.manual_seed(0)
    b, r, h = 3, 4, 5
    log_prob = torch.randn(b, r, dtype=torch.float64, requires_grad=True)
    pooled = torch.randn(b, h, dtype=torch.float64, requires_grad=True)
    chosen = torch.randn(b, dtype=torch.float64, requires_grad=True)
    ent = torch.rand(b, r, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(b, r, dtype=torch.float64)
    pg, _ = policy_loss(log_prob.detach() + 0.1, log_prob, torch.randn(b, r, dtype=torch.float64), mask)
    dl, _ = dpo_loss(chosen, torch.randn(b, dtype=torch.float64), torch.randn(b, dtype=torch.float64),
                     torch.randn(b, dtype=torch.float64))
    hk, _ = hierarchical_kl(log_prob, torch.randn(b, r, dtype=torch.float64), mask, pooled,
                            torch.randn(b, h, dtype=torch.float64), lambda_token=1.0, lambda_semantic=0.2)
    et, _ = entropy_bonus(ent, mask, 0.01)
    total, _ = hpa_objective({"ppo": pg, "dpo": dl, "hier_kl": hk, "entropy": et}, W)
    total.backward()
    for t in (log_prob, pooled, chosen, ent):
        assert t.grad is not None and t.grad.abs().sum() > 0
