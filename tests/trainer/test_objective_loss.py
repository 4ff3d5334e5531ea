"""``objective.loss.local_metrics``: the micro-batches' metrics of a step, sums for loss shares and means
otherwise, read from the device once per step (not one ``float()`` per metric per micro-batch)."""

import pytest
import torch

from hpa.distributed.device_mode import StrictDeviceMode
from hpa.distributed.sync_ops import SyncOps
from hpa.trainer.objective.loss import local_metrics

DEVICE = torch.device("lazy", 0)


def test_local_metrics_sum_shares_average_the_rest_and_read_the_device_once():
    values = [{"actor/pg_loss": 0.5, "actor/entropy": 2.0, "actor/clipfrac": 0.25},
              {"actor/pg_loss": 0.25, "actor/entropy": 3.0},
              {"actor/pg_loss": -0.125, "actor/entropy": 1.0, "actor/clipfrac": 0.75}]
    want = {"actor/pg_loss": 0.625, "actor/entropy": 2.0, "actor/clipfrac": 0.5}
    with StrictDeviceMode(DEVICE):
        records = [{k: (torch.tensor(v).to(DEVICE, non_blocking=True) if k != "actor/clipfrac" else v)
                    for k, v in r.items()} for r in values]
        with SyncOps() as syncs:
            got = local_metrics(records, frozenset({"actor/pg_loss"}))
    assert got == pytest.approx(want, abs=1e-7)
    assert syncs.count == 1, syncs.by_site  # one read of every device metric together
