"""``ParallelGroups``: the process groups of one model layout, built once and passed down.

Only ``hpa.distributed`` reads megatron's ``parallel_state``; everything else receives this frozen
object (one owner of the groups), so the policy, critic, reward and reference models could later use different
layouts without silently sharing global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """Ranks, sizes and groups of one TP × PP × CP × DP layout.

    Attributes:
        pg_collection: megatron's ``ProcessGroupCollection`` for the same groups, handed to
            megatron constructors and schedules so they make no global lookups.
        placement: with disaggregated rollouts, ``rollout_groups.Placement``; the other fields then describe
            this process's side only (``world_size``, ``rank``: within the trainer ranks, or the rollout ranks).
    """

    world_size: int
    rank: int
    local_rank: int
    backend: str
    device: torch.device
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    cp_group: Any
    dp_group: Any
    dp_cp_group: Any
    mp_group: Any
    embd_group: Any
    pg_collection: Any
    # disaggregated rollouts: this process's side of the launch and the groups between the sides
    # (``rollout_groups.Placement``); None when the rollouts are colocated
    placement: Any = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_model_parallel_size - 1

    @property
    def is_data_parallel_main(self) -> bool:
        """True on the one rank per model replica slice that writes shared outputs (tp=cp=0)."""
        return self.tp_rank == 0 and self.cp_rank == 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def layout(self) -> str:
        return (f"tp{self.tensor_model_parallel_size}_pp{self.pipeline_model_parallel_size}_"
                f"dp{self.data_parallel_size}")

    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, self.pipeline_model_parallel_size - 1) \
            if self.pipeline_model_parallel_size > 1 else self.rank
