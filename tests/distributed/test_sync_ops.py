"""``SyncOps``: the CPU detector of operations that make the host wait for a CUDA device, in the test device mode
(``DeviceTensor`` values), forward and backward, with the file and line of each."""

import torch

from hpa.distributed.device_mode import StrictDeviceMode, on_device
from hpa.distributed.sync_ops import SyncOps

DEVICE = torch.device("lazy", 0)


def test_counts_each_syncing_operation_on_device_values_only():
    with StrictDeviceMode(DEVICE):
        host = torch.arange(6)
        with SyncOps() as syncs:
            host.tolist(), host[host > 2], host.nonzero(), torch.repeat_interleave(host, host)  # host work: none
            host.to(DEVICE, non_blocking=True)
        assert syncs.count == 0, syncs.by_site
        with SyncOps() as syncs:
            d = host.to(DEVICE)  # blocking copy
            host.view(2, 3).t().to(DEVICE, non_blocking=True)  # non-contiguous: staged through pageable memory
            torch.tensor([1, 2], device=DEVICE)
            d.tolist(), d[0].item(), bool(d[0] > 0), d.cpu()
            d[d > 2], d.nonzero(), torch.unique(d), torch.repeat_interleave(d, d), torch.unravel_index(d, (2, 3))
            torch.repeat_interleave(d, d, output_size=15)  # the size given: none
            z = torch.zeros(6, 3, device=DEVICE)
            z.index_put_((d[:2],), torch.ones(2, 3, device=DEVICE), accumulate=True)
            z.index_add_(0, d[:2], torch.ones(2, 3, device=DEVICE))  # none
    assert syncs.by_op == {"blocking host-to-device copy": 2, "tensor(host data, device=...)": 1, "tolist": 1,
                           "_local_scalar_dense": 2, "cpu": 1, "index": 1, "nonzero": 1, "_unique2": 1,
                           "repeat_interleave": 1, "unravel_index": 1, "index_put_": 1}, syncs.by_op
    assert all(site.startswith("tests/distributed/test_sync_ops.py:") for site in syncs.by_site), syncs.by_site


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        grad = grad * 2
        grad.index_put_((index,), grad[index], accumulate=True)  # a sync on CUDA, in a backward pass
        return grad, None


def test_sees_the_backward_pass_but_not_autograds_own_unchecked_index_put():
    with StrictDeviceMode(DEVICE):
        x = on_device(torch.randn(5, 3)).requires_grad_()
        index = torch.tensor([0, 2]).to(DEVICE, non_blocking=True)
        with SyncOps() as syncs:
            y = _Twice.apply(x, index)[index]  # index's derivative: CUDA's unchecked _index_put_impl_, no sync
            y.sum().backward()
    assert dict(syncs.by_op) == {"index_put_": 1}, syncs.by_site
    (site,) = syncs.by_site
    assert site.startswith("tests/distributed/test_sync_ops.py:") and x.grad is not None


def test_a_host_tensor_built_from_device_tensors_reads_each_of_them():
    """``torch.tensor([t.norm() for t in ts])`` copies every device value to the host (megatron's gradient-norm
    fallback without TE or apex did this once per tensor: on one H200, 510 syncs a step the counter missed)."""
    with StrictDeviceMode(DEVICE):
        ts = [on_device(torch.ones(3) * i) for i in range(4)]
        with SyncOps() as syncs:
            torch.tensor([t.norm() for t in ts])
            torch.stack([t.norm() for t in ts])  # stays on the device: none
            torch.tensor([[1.0, 2.0]])  # host data only: none
    assert syncs.by_op == {"tensor(list of device tensors)": 4}, syncs.by_op
