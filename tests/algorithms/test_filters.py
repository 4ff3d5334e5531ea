"""Rollout filters on hand-made batches: which rows each keeps and the threshold it held them to."""

import math

import pytest
import torch

from hpa.algorithms.filters import ROLLOUT_FILTERS, rollout_filter
from hpa.config import algorithm as A
from hpa.registry import UnknownNameError

T, F = True, False


def _run(name, metric, valid, group_ids, **kw):
    return rollout_filter(torch.tensor(metric), torch.tensor(valid), torch.tensor(group_ids), name=name, **kw)


def test_names_equal_the_config_tuple_and_unknown_names_list_them():
    assert A.ROLLOUT_FILTER_NAMES == ROLLOUT_FILTERS.names()
    with pytest.raises(UnknownNameError, match="reward_above_mean_std"):
        _run("reward_above_mean", [1.0], [T], [0])


def test_none_keeps_every_valid_row():
    keep, threshold = _run("none", [1.0, 2.0, 0.0], [T, T, F], [0, 0, 1])
    assert keep.tolist() == [T, T, F] and torch.isnan(threshold).all()


def test_reward_above_mean_std_over_the_batch():
    # valid rewards 1, 2, 3, 4: mean 2.5, unbiased std sqrt(5/3) = 1.2910 (the recipe's rewards.std())
    metric, valid, groups = [1.0, 2.0, 3.0, 4.0, 9.0], [T, T, T, T, F], [0, 0, 1, 1, 2]
    keep, threshold = _run("reward_above_mean_std", metric, valid, groups, k=1.0, scope="batch")
    assert keep.tolist() == [F, F, F, T, F]  # 4 > 3.791; the invalid 9 never counts nor stays
    assert threshold[0].item() == pytest.approx(2.5 + math.sqrt(5 / 3))
    keep, _ = _run("reward_above_mean_std", metric, valid, groups, k=0.0, scope="batch")
    assert keep.tolist() == [F, F, T, T, F]  # strictly above the mean


def test_reward_above_mean_std_per_group():
    # group 0: 1, 3 -> mean 2, std sqrt(2); k = 0.5 -> 2.707: keeps 3
    # group 1: 0, 0, 6 -> mean 2, std sqrt(12); -> 3.732: keeps 6
    keep, threshold = _run("reward_above_mean_std", [1.0, 3.0, 0.0, 0.0, 6.0], [T] * 5, [0, 0, 1, 1, 1], k=0.5,
                           scope="group")
    assert keep.tolist() == [F, T, F, F, T]
    assert threshold.tolist() == pytest.approx([2 + 0.5 * math.sqrt(2)] * 2 + [2 + 0.5 * math.sqrt(12)] * 3)


def test_reward_above_mean_std_keeps_nothing_from_ties_or_a_single_row():
    assert not _run("reward_above_mean_std", [0.5] * 4, [T] * 4, [0, 0, 1, 1], k=1.0, scope="batch")[0].any()
    keep, threshold = _run("reward_above_mean_std", [0.5, 7.0], [T, F], [0, 0], k=1.0, scope="group")
    assert not keep.any() and threshold[0].item() == 0.5  # one valid row: std 0, nothing strictly above
    keep, threshold = _run("reward_above_mean_std", [0.5, 7.0], [F, F], [0, 0], k=1.0, scope="batch")
    assert not keep.any() and torch.isnan(threshold).all()


def test_dapo_groups_drops_tied_groups_and_single_valid_rows():
    metric = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 5.0]
    valid = [T, T, T, T, T, T, T, F]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    keep, threshold = _run("dapo_groups", metric, valid, groups)
    # group 0 varies: kept; groups 1 (all 1) and 2 (all 0) tie: dropped; group 3 has one valid row: dropped
    assert keep.tolist() == [T, T, F, F, F, F, F, F]
    assert torch.isnan(threshold).all()
    # an invalid row inside a varying group is not kept, its valid siblings are
    keep, _ = _run("dapo_groups", [1.0, 0.0, 3.0], [T, T, F], [0, 0, 0])
    assert keep.tolist() == [T, T, F]


def test_shapes_must_agree():
    with pytest.raises(ValueError, match=r"\[B\]"):
        rollout_filter(torch.zeros(3), torch.ones(2, dtype=torch.bool), torch.zeros(3, dtype=torch.long), name="none")


def test_config_errors_name_the_keys():
    from hpa.config import load_config
    from hpa.config.errors import ConfigError

    cfg = load_config(None, ["algorithm.rollout_filter.name=dapo_groups"])
    assert cfg.algorithm.rollout_filter.resolved_metric == "raw"
    assert load_config(None, ["algorithm.rollout_filter.name=reward_above_mean_std"]) \
        .algorithm.rollout_filter.resolved_metric == "shaped"
    with pytest.raises(ConfigError, match="algorithm.advantage.estimator") as err:
        load_config(None, ["algorithm.rollout_filter.name=reward_above_mean_std", "algorithm.advantage.estimator=gae"])
    assert err.value.key == "algorithm.rollout_filter.name"
    with pytest.raises(ConfigError, match="rollout.n") as err:
        load_config(None, ["algorithm.rollout_filter.name=dapo_groups", "rollout.n=1"], world_size=1)
    assert err.value.key == "algorithm.rollout_filter.name"
    with pytest.raises(ConfigError, match="scope=batch"):
        load_config(None, ["algorithm.rollout_filter.name=reward_above_mean_std", "algorithm.rollout_filter.scope=group",
                           "rollout.n=1"], world_size=1)
    assert load_config(None, ["algorithm.rollout_filter.name=reward_above_mean_std", "rollout.n=1"], world_size=1)
    for bad, key in (("algorithm.rollout_filter.scope=prompt", "scope"), ("algorithm.rollout_filter.metric=acc", "metric"),
                     ("algorithm.rollout_filter.max_refill_rounds=-1", "max_refill_rounds")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [bad])
        assert err.value.key == f"algorithm.rollout_filter.{key}"


def test_the_old_reward_filter_key_says_where_it_went():
    from hpa.config import load_config
    from hpa.config.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.rollout_filter") as err:
        load_config(None, ["reward.filter.mode=top_std"])
    assert err.value.key == "reward.filter"
