"""``MicroBatch``'s host-built positions: built once on the host, copied to the device without blocking, and kept
by the copies ``to`` makes (``unpack``/``pack``, the heads' row offsets and label positions)."""

import torch

from hpa.distributed.device_mode import StrictDeviceMode, on_device, on_host
from hpa.distributed.sync_ops import SyncOps
from hpa.engine.micro_batch import MicroBatch, host_to_device

DEVICE = torch.device("lazy", 0)


def _packed():
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.float32)
    return MicroBatch.from_padded("rows", ids, ids, torch.tensor([3, 1, 4]), packed=True, label_mask=mask)


def test_unpack_and_pack_on_the_device_sync_nothing_and_build_positions_once_per_batch():
    host = _packed()
    values = torch.arange(8.0)[None, :, None]  # [1, T, 1]
    with StrictDeviceMode(DEVICE):
        with SyncOps() as syncs:
            first, second = host.to(DEVICE), host.to(DEVICE)  # e.g. two passes over one micro-batch
            rows = first.unpack(on_device(values))
            again = first.pack(rows)
            assert second._positions(DEVICE) is first._positions(DEVICE)  # one copy for the batch's copies
        assert syncs.count == 0, syncs.by_site
    assert on_host(rows)[..., 0].tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    assert on_host(again).tolist() == values.tolist()


def test_label_positions_from_the_hosts_mask_and_rebuilt_when_it_changes():
    host = _packed()
    with StrictDeviceMode(DEVICE):
        on = host.to(DEVICE)
        rows, cols, flat = (on_host(t).tolist() for t in on.label_positions(DEVICE))
        assert (rows, cols, flat) == ([0, 0, 1, 2, 2], [1, 2, 0, 2, 3], [1, 2, 3, 6, 7])
        on["label_mask"] = torch.zeros(3, 4).to(DEVICE, non_blocking=True)  # made on the device: not known here
        assert on.label_positions(DEVICE) is None
        host["label_mask"] = torch.ones(3, 4)  # past each row's length: no token
        assert on_host(host.label_positions("cpu")[2]).tolist() == list(range(8))


def test_host_to_device_copies_a_strided_view_contiguously():
    with StrictDeviceMode(DEVICE), SyncOps() as syncs:
        out = host_to_device(torch.arange(6).view(2, 3).t(), DEVICE)
    assert syncs.count == 0, syncs.by_site
    assert on_host(out).tolist() == [[0, 3], [1, 4], [2, 5]]
