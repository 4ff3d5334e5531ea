"""The response-only head (``hpa.engine.head``) against today's path, the vocab-parallel ops over every
position then ``unpack``/``response``: values and logit gradients, padded and packed, TP1 and TP2; and the
mixed loss of ``objective.make_policy_loss`` (rollout and pair closures) with the head against the same
closures on today's path."""

import numpy as np
import pytest
import torch

from hpa.engine.micro_batch import MicroBatch
from hpa.ops.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs
from tests.multirank import run_ranks

WIDTH, VOCAB_SIZE, TEMPERATURE, HIDDEN = 16, 13, 0.7, 4  # 16 columns, 3 of them vocab padding
LENGTHS = [7, 4, 5, 6]


def reference_response(batch, logits, tp_group, *, vocab_size, temperature=1.0, entropy=False, **_):
    logp = batch.response(batch.unpack(vocab_parallel_log_probs(logits, batch.labels, tp_group, vocab_size,
                                                                temperature)))
    ent = batch.response(batch.unpack(vocab_parallel_entropy(logits, tp_group, vocab_size, temperature)))
    return logp, ent if entropy else None


def reference_labels(batch, logits, tp_group, *, vocab_size, temperature=1.0, **_):
    return batch.unpack(vocab_parallel_log_probs(logits, batch.labels, tp_group, vocab_size, temperature))


def _batch(kind, packed):
    """Four rows of lengths 7, 4, 5, 6 in a width of 7; response positions past row 1's length (clamped
    padding) and a label position past it too."""
    g = torch.Generator().manual_seed(0)
    n, s = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(0, VOCAB_SIZE, (n, s), generator=g)
    labels = torch.randint(0, VOCAB_SIZE, (n, s), generator=g)
    label_mask = (torch.rand(n, s, generator=g) < 0.6).float() * (torch.arange(s) < torch.tensor(LENGTHS)[:, None])
    label_mask[1, 5] = 1.0  # beyond row 1's length: no logit there when packed
    rows = dict(label_mask=label_mask,
                response_index=torch.tensor([[3, 4, 5], [2, 3, 6], [1, 2, 3], [4, 5, 5]]),
                mask=torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]]),
                old_log_probs=-2.5 + 0.3 * torch.randn(n, 3, generator=g),
                ref_log_probs=-2.7 + 0.3 * torch.randn(n, 3, generator=g),
                advantages=torch.randn(n, 3, generator=g), ref_pooled=torch.randn(n, HIDDEN, generator=g),
                pool_mask=(torch.rand(n, s, generator=g) < 0.5).float(),
                ref_seq_logp=-6.0 + torch.randn(n, generator=g))
    return MicroBatch.from_padded(kind, ids, labels, torch.tensor(LENGTHS), packed=packed, **rows)


def _logits(batch, tp_rank, tp):
    g = torch.Generator().manual_seed(1)
    full = 3.0 * torch.randn(*batch.input_ids.shape, WIDTH, generator=g)
    full[..., VOCAB_SIZE:] = 1e6
    hidden = torch.randn(*batch.input_ids.shape, HIDDEN, generator=g)
    width = WIDTH // tp
    return full[..., tp_rank * width:(tp_rank + 1) * width].contiguous(), hidden


def _grad(fn, logits):
    x = logits.clone().requires_grad_()
    value = fn(x)
    return value, torch.autograd.grad(value, x)[0]


def worker(groups):
    from hpa.config.algorithm import AlgorithmConfig
    from hpa.engine import head
    from hpa.engine.head import HeadInput
    from hpa.trainer import objective
    from hpa.trainer.objective import streams

    tp, tp_group = groups.tensor_model_parallel_size, groups.tp_group
    kw = dict(vocab_size=VOCAB_SIZE, temperature=TEMPERATURE)
    weights = objective.StepWeights(w_ppo=0.5, w_dpo=0.3, w_kl=0.2, lambda_token=0.7, lambda_semantic=0.5,
                                    entropy_coef=0.05, reward_kl_coef=0.0)
    counts = objective.GlobalCounts(tokens=9.0, sequences=4.0, pairs=2.0, chosen_tokens=5.0)
    out = {}
    for packed in (False, True):
        batch = _batch("rollout", packed)
        logits, hidden = _logits(batch, groups.tp_rank, tp)
        full, _ = _logits(batch, 0, 1)  # the linear head's hidden states: the identity's shard rows make the logits
        columns = slice(groups.tp_rank * (WIDTH // tp), (groups.tp_rank + 1) * (WIDTH // tp))
        identity = torch.eye(WIDTH)[columns]  # [v/tp, WIDTH]
        w = torch.randn(2, *batch["mask"].shape, generator=torch.Generator().manual_seed(2))
        label_w = torch.randn(*batch["label_mask"].shape, generator=torch.Generator().manual_seed(3))
        for name, response, labels in (("fused", head.response_log_probs, head.label_log_probs),
                                       ("linear", head.response_log_probs, head.label_log_probs),
                                       ("today", reference_response, reference_labels)):
            def output(x, name=name):
                return HeadInput(x, identity) if name == "linear" else x

            def rollout(x):
                logp, ent = response(batch, output(x), tp_group, entropy=True, chunk_tokens=2, **kw)
                return (w[0] * logp + w[1] * ent).sum()

            def pairs(x):
                logp = labels(batch, output(x), tp_group, chunk_tokens=2, **kw)
                return (logp * batch["label_mask"] * label_w).sum()

            streams.response_log_probs, streams.label_log_probs = response, labels
            loss_fn = objective.make_policy_loss(AlgorithmConfig(), weights, counts, groups, vocab_size=VOCAB_SIZE,
                                                 temperature=TEMPERATURE)
            for key, fn in (("rollout", rollout), ("pairs", pairs),
                            ("rollout_loss", lambda x: loss_fn(batch, output(x), hidden)[0]),
                            ("pair_loss", lambda x: loss_fn(_batch("pairs", packed), output(x), hidden)[0])):
                value, grad = _grad(fn, full if name == "linear" else logits)
                grad = grad[..., columns] if name == "linear" else grad  # d hidden on the shard's columns
                out[(packed, name, key)] = (value.item(), grad.numpy())
    return dict(tp_rank=groups.tp_rank, out=out)


_RESULTS = {}


def results_for(tp):
    if tp not in _RESULTS:
        ranks = sorted(run_ranks(worker, tp=tp), key=lambda r: r["tp_rank"])
        _RESULTS[tp] = {k: (v[0], np.concatenate([r["out"][k][1] for r in ranks], axis=-1))
                        for k, v in ranks[0]["out"].items()}
    return _RESULTS[tp]


@pytest.mark.parametrize("name", ["fused", "linear"])
@pytest.mark.parametrize("key", ["rollout", "pairs", "rollout_loss", "pair_loss"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_head_equals_todays_path(tp, packed, key, name):
    """The head on logits ("fused") and on hidden states (HeadInput, "linear": the gradient is d hidden on the
    shard's columns, which the identity weight makes the logits' gradient)."""
    results = results_for(tp)
    got, want = results[(packed, name, key)], results[(packed, "today", key)]
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5)
    assert np.abs(got[1]).max() > 0  # the loss reaches the logits
    assert not got[1][..., VOCAB_SIZE:].any()


def test_only_the_read_positions_get_gradient():
    """Positions no loss reads (prompts, pads, rows' ends past the last response token) get none."""
    from hpa.engine.head import response_log_probs

    batch = _batch("rollout", packed=False)
    logits, _ = _logits(batch, 0, 1)
    _, grad = _grad(lambda x: response_log_probs(batch, x, None, vocab_size=VOCAB_SIZE)[0].sum(), logits)
    read = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    read.scatter_(1, batch["response_index"], True)
    assert grad.abs().sum(-1)[read].min() > 0 and not grad[~read].any()


@pytest.mark.parametrize("name", ["fused", "linear"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_heads_make_the_host_wait_for_nothing_forward_and_backward(packed, name):
    """Both heads on a micro-batch on the (test) device, with the backward pass: no operation that would
    synchronise with a CUDA device (``SyncOps``), and the same values and gradients as on the host."""
    from hpa.distributed.device_mode import StrictDeviceMode, on_device, on_host
    from hpa.distributed.sync_ops import SyncOps
    from hpa.engine.head import label_log_probs, response_log_probs

    from hpa.engine.head import HeadInput

    device = torch.device("lazy", 0)
    batch = _batch("rollout", packed)
    logits, _ = _logits(batch, 0, 1)
    identity = torch.eye(WIDTH)

    def loss(b, x):
        if name == "linear":
            x = HeadInput(x, identity if x.device.type == "cpu" else on_device(identity))
        logp, ent = response_log_probs(b, x, None, vocab_size=VOCAB_SIZE, entropy=True, chunk_tokens=2)
        labels = label_log_probs(b, x, None, vocab_size=VOCAB_SIZE, chunk_tokens=2)
        return (logp * b["mask"]).sum() + (ent * b["mask"]).sum() + (labels * b["label_mask"]).sum()

    want, want_grad = _grad(lambda x: loss(batch, x), logits)
    with StrictDeviceMode(device):
        x = on_device(logits.clone()).requires_grad_()
        with SyncOps() as syncs:
            on = batch.to(device)
            got = loss(on, x)
            got.backward()
        assert syncs.count == 0, dict(syncs.by_site)
        got, grad = on_host(got.detach()), on_host(x.grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the head from hidden states, in a model

def model_worker(groups, sequence_parallel, tied):
    """The mixed log-prob + entropy + label loss through ``forward_backward`` on a tiny policy, the model's logits
    (``hidden_head=False``) against the hidden head (``True``): loss, records and every gradient buffer."""
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.engine.head import HeadInput, label_log_probs, response_log_probs
    from hpa.engine.optimizer import wrap_ddp
    from hpa.engine.step import forward_backward, snapshot_grads
    from hpa.models import build_policy

    torch.manual_seed(0)
    vocab = 45  # padded to 48: three padded columns
    model_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=vocab,
                            max_sequence_length=32, make_vocab_size_divisible_by=16,
                            untie_embeddings_and_output_weights=not tied)
    parallel = ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                              sequence_parallel=sequence_parallel)
    ddp = wrap_ddp(build_policy(model_cfg, parallel, groups), parallel, groups)
    seen = []

    def loss_fn(batch, output, hidden):
        seen.append(type(output).__name__)
        logp, ent = response_log_probs(batch, output, groups.tp_group, vocab_size=vocab, temperature=TEMPERATURE,
                                       entropy=True, chunk_tokens=3)
        labels = label_log_probs(batch, output, groups.tp_group, vocab_size=vocab, chunk_tokens=3)
        loss = (logp * batch["mask"]).sum() - 0.1 * (ent * batch["mask"]).sum() \
            + 0.5 * (labels * batch["label_mask"]).sum()
        return loss, {"loss": loss.detach()}

    out = {}
    for packed in (False, True):
        mbs = [_batch("rollout", packed)]
        for hidden_head in (False, True):
            ddp.zero_grad_buffer()
            records = forward_backward(ddp, mbs, loss_fn, groups, capture_hidden=True, hidden_head=hidden_head)
            out[(packed, hidden_head)] = (float(records[0]["loss"]), [g.clone() for g in snapshot_grads(ddp)])
    return dict(out=out, seen=seen, head_input=HeadInput.__name__)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp1", "tp1_tied", "tp2", "tp2_sp"])
def test_hidden_head_equals_the_model_logits_in_a_model(layout):
    """Through megatron's output layer (TP region functions, sequence parallelism, a tied embedding): the loss
    and every parameter gradient of the hidden head equal those of the model's logits."""
    tp = 2 if layout.startswith("tp2") else 1
    ranks = run_ranks(model_worker, tp=tp, args=(layout.endswith("_sp"), layout.endswith("_tied")))
    for rank in ranks:
        assert rank["seen"] == ["Tensor", rank["head_input"]] * 2  # the logits, then the head's input
        for packed in (False, True):
            (want, want_grads), (got, got_grads) = rank["out"][(packed, False)], rank["out"][(packed, True)]
            assert got == pytest.approx(want, rel=1e-6, abs=1e-5)
            assert sum(float(g.abs().sum()) for g in got_grads) > 0
            for g, w in zip(got_grads, want_grads):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_head_input_carries_its_kernel_choice(monkeypatch):
    """``HeadInput.kernel`` reaches ``linear_log_probs_entropy`` (kept when a mixed micro-batch slices it)."""
    from hpa.engine.head import HeadInput, response_log_probs
    from hpa.ops import linear_head

    seen = []
    original = linear_head._kernels
    monkeypatch.setattr(linear_head, "_kernels", lambda device, kernel, *rest: seen.append(kernel) or
                        original(device, "torch", *rest))
    batch = _batch("rollout", packed=False)
    _, hidden = _logits(batch, 0, 1)
    weight = torch.randn(WIDTH, HIDDEN)
    head = HeadInput(hidden, weight, "regions")
    assert head[0:2].kernel == "regions"
    response_log_probs(batch, head, None, vocab_size=VOCAB_SIZE)
    assert seen == ["regions"]
    with pytest.raises(ValueError, match="kernel must be one of"):
        response_log_probs(batch, HeadInput(hidden, weight, "cuda"), None, vocab_size=VOCAB_SIZE)
