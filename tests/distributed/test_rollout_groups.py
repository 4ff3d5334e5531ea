"""Which rollout rank serves which trainer rank, and how a launch splits into the two worlds."""

import torch

from hpa.distributed.rollout_groups import ROLLOUT, TRAINER, Placement, split_world


def _placement(rank, trainers, rollouts):
    role = TRAINER if rank < trainers else ROLLOUT
    return Placement(role=role, global_rank=rank, num_trainer_ranks=trainers, num_rollout_ranks=rollouts,
                     bridge=None, push=None, device=torch.device("cpu"))


def test_trainer_ranks_are_dealt_to_the_rollout_ranks_in_turn():
    # 4 trainer ranks (0..3), 2 rollout ranks (4, 5): 0 and 2 to rank 4, 1 and 3 to rank 5
    assert [_placement(t, 4, 2).server_of(t) for t in range(4)] == [4, 5, 4, 5]
    assert _placement(4, 4, 2).clients() == [0, 2] and _placement(5, 4, 2).clients() == [1, 3]
    assert _placement(2, 2, 1).clients() == [0, 1] and _placement(0, 2, 1).rollout_ranks == [2]


def test_the_launch_splits_trainers_first():
    assert split_world(rank=1, world_size=3, num_rollout_ranks=1) == (TRAINER, 1, 2, "hpa/trainer")
    assert split_world(rank=2, world_size=3, num_rollout_ranks=1) == (ROLLOUT, 0, 1, "hpa/rollout")
    assert split_world(rank=6, world_size=8, num_rollout_ranks=3) == (ROLLOUT, 1, 3, "hpa/rollout")
