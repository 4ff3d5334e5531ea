"""TP2 x PP2 x DP2 on 8 gloo ranks: megatron's pipeline schedule, DDP and optimizer (plain and
distributed) train a tiny model; the loss goes down and both optimizers take the same path, and so do
the same rows packed into one sequence a micro-batch under sequence parallelism."""

import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank

STEPS = 5


def train_worker(groups, steps):
    from hpa.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from hpa.distributed import set_seed
    from hpa.models import build_policy
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.micro_batch import MicroBatch
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad

    model_cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            vocab_size=64, max_sequence_length=32, make_vocab_size_divisible_by=16)
    # a learnable stream: next token = (token + 1) mod 16, different data on each DP rank
    g = torch.Generator().manual_seed(100 + groups.dp_rank)
    starts = [torch.randint(0, 16, (2, 1), generator=g) for _ in range(4)]
    lengths = torch.tensor([8, 5])  # the second row of each micro-batch ends early (padded: 3 pads)

    def micro_batches(packed):
        return [MicroBatch.from_padded("rows", (s + torch.arange(8)) % 16, (s + torch.arange(1, 9)) % 16, lengths,
                                       packed=packed, label_mask=(torch.arange(8)[None, :] < lengths[:, None]).float())
                for s in starts]

    num_tokens = float(lengths.sum()) * len(starts) * groups.data_parallel_size

    def nll(batch, logits, hidden):
        token_nll = -batch.unpack(vocab_parallel_log_probs(logits, batch.labels, groups.tp_group)) * batch["label_mask"]
        return token_nll.sum() / num_tokens, {"nll": (token_nll.sum() / batch["label_mask"].sum()).detach()}

    curves = {}
    for name, distributed_optimizer, packed in (("plain", False, False), ("distributed", True, False),
                                                ("packed_sp", False, True)):
        mbs = micro_batches(packed)
        parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  use_distributed_optimizer=distributed_optimizer, sequence_parallel=packed)
        set_seed(1234)
        ddp = wrap_ddp(build_policy(model_cfg, parallel, groups), parallel, groups)
        opt = build_optimizer(ddp, OptimConfig(lr=1e-2), parallel, groups)
        curve = []
        for _ in range(steps):
            zero_grad(ddp, opt)
            metrics = forward_backward(ddp, mbs, nll, groups)
            updated, _ = optimizer_step(opt)
            assert updated
            curve.append(float(sum(m["nll"] for m in metrics) / len(metrics)) if metrics else None)
        curves[name] = curve
    return curves


def test_tp2_pp2_dp2_training_lowers_loss():
    results = run_ranks(train_worker, tp=2, pp=2, dp=2, args=(STEPS,))
    last_stage = [r for r in results if r["plain"][0] is not None]
    assert len(last_stage) == 4  # TP2 x DP2 ranks on the last stage
    for r in last_stage:
        plain, dist_opt = r["plain"], r["distributed"]
        assert plain[-1] < plain[0] - 0.3, plain
        assert dist_opt == pytest.approx(plain, abs=1e-5)
        assert r["packed_sp"] == pytest.approx(plain, abs=1e-5)
    # TP peers of one DP replica see identical losses
    assert last_stage[0]["plain"] == pytest.approx(last_stage[1]["plain"], abs=1e-6)
