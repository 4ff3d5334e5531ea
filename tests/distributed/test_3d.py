"""TP2 x PP2 x DP2 on 8 gloo ranks: megatron's pipeline schedule, DDP and optimizer (plain and
distributed) train a tiny model; the loss goes down and both optimizers take the same path."""

import pytest
import torch

from multirank import run_ranks

STEPS = 5


def train_worker(groups, steps):
    from hpa.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from hpa.distributed import set_seed
    from hpa.models import build_policy
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad

    model_cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            vocab_size=64, max_sequence_length=32, make_vocab_size_divisible_by=16)
    # a learnable stream: next token = (token + 1) mod 16, different data on each DP rank
    g = torch.Generator().manual_seed(100 + groups.dp_rank)
    starts = [torch.randint(0, 16, (2, 1), generator=g) for _ in range(4)]
    mbs = [{"input_ids": (s + torch.arange(8)) % 16, "labels": (s + torch.arange(1, 9)) % 16,
            "position_ids": torch.arange(8).expand(2, 8)} for s in starts]
    num_tokens = sum(mb["labels"].numel() for mb in mbs) * groups.data_parallel_size

    def nll(batch, logits, hidden):
        token_nll = -vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group)
        return token_nll.sum() / num_tokens, {"nll": token_nll.mean().detach()}

    curves = {}
    for distributed_optimizer in (False, True):
        parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  use_distributed_optimizer=distributed_optimizer)
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
        curves["distributed" if distributed_optimizer else "plain"] = curve
    return curves


def test_tp2_pp2_dp2_training_lowers_loss():
    results = run_ranks(train_worker, tp=2, pp=2, dp=2, args=(STEPS,))
    last_stage = [r for r in results if r["plain"][0] is not None]
    assert len(last_stage) == 4  # TP2 x DP2 ranks on the last stage
    for r in last_stage:
        plain, dist_opt = r["plain"], r["distributed"]
        assert plain[-1] < plain[0] - 0.3, plain
        assert dist_opt == pytest.approx(plain, abs=1e-5)
    # TP peers of one DP replica see identical losses
    assert last_stage[0]["plain"] == pytest.approx(last_stage[1]["plain"], abs=1e-6)
