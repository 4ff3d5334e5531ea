"""The process-group store of a worker that torchrun restarted: keys of the dead attempt stay invisible."""

import datetime
import logging

import torch.distributed as dist

from hpa.distributed.init import LaunchEnv, _restart_safe_store
from multirank import free_port

TIMEOUT = datetime.timedelta(seconds=10)


def launch_at(port):
    return LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=port,
                     launcher="torchrun")


def test_a_restarted_worker_sees_only_its_own_attempt():
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)  # torchrun's, kept across restarts
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}
    first = _restart_safe_store(launch_at(port), TIMEOUT, env=dict(env, TORCHELASTIC_RESTART_COUNT="0"))
    first.set("rank_1_address", "dead worker")
    again = _restart_safe_store(launch_at(port), TIMEOUT, env=dict(env, TORCHELASTIC_RESTART_COUNT="1"))
    assert not again.check(["rank_1_address"])  # a plain tcp:// init would read the dead worker's address
    again.set("rank_1_address", "new worker")
    assert agent.get("hpa/attempt_1/rank_1_address") == b"new worker"
    assert agent.get("hpa/attempt_0/rank_1_address") == b"dead worker"


def test_no_agent_store_or_several_nodes_keep_tcp_init(caplog):
    launch = launch_at(free_port())
    assert _restart_safe_store(launch, TIMEOUT, env={}) is None
    assert _restart_safe_store(launch, TIMEOUT, env={"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}
    with caplog.at_level(logging.WARNING):
        assert _restart_safe_store(launch, TIMEOUT, env=shared) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
