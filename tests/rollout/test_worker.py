"""The rollout worker: jobs sample with the weights of the version they were submitted at, while the trainer's
own copy changes; a weight push that does not arrive is an error naming the tensors, never silent staleness."""

import threading

import pytest
import torch

from hpa.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from hpa.rollout.worker import RolloutWorker, WeightPushError, check_delivery, checksum, watched_names


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(3, 2))
        self.middle = torch.nn.Parameter(torch.zeros(4))
        self.scale = torch.nn.Parameter(torch.zeros(1))
        self.head = torch.nn.Parameter(torch.zeros(2, 3))


class ReadsWeights(RolloutEngine):
    """Each row's 'log-prob' is the head's [0, 0] weight it sampled with; ``gate`` holds a job mid-generation."""

    name = "fake"

    def __init__(self, module):
        self.module, self.gate = module, threading.Event()
        self.gate.set()

    def generate(self, prompts, params):
        self.gate.wait()
        b = len(prompts) * params.n
        value = float(self.module.head[0, 0])
        ids = torch.ones((b, 2), dtype=torch.int64)
        return RolloutBatch(prompt_ids=ids, prompt_mask=ids, response_ids=ids, response_mask=torch.ones(b, 2),
                            log_probs=torch.full((b, 2), value), finish_reasons=["stop"] * b,
                            group_ids=torch.arange(len(prompts)).repeat_interleave(params.n))


def _worker():
    module = Policy()
    return RolloutWorker(ReadsWeights(module), module, version=0), module


def _params(n=1):
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=2, seed=0)


def test_a_job_samples_the_weights_of_its_version_while_the_trainer_updates_its_own():
    worker, _ = _worker()
    trainer = Policy()
    worker.engine.gate.clear()  # the job is in flight while the trainer's weights change
    worker.submit([[1]], _params(2), tag="s0")
    with torch.no_grad():
        trainer.head.fill_(5.0)
    worker.engine.gate.set()
    first = worker.wait("s0")
    assert (first.version, float(first.batch.log_probs[0, 0])) == (0, 0.0)
    received = worker.push_weights(1, dict(trainer.named_parameters()))
    check_delivery(1, {n: checksum(t) for n, t in trainer.named_parameters() if n in worker.watched}, received)
    worker.submit([[1], [2]], _params(), tag="s1")
    second = worker.wait("s1")
    assert second.version == 1 and second.batch.log_probs.eq(5.0).all() and second.batch.batch_size == 2
    assert worker.poll() == []


def test_a_push_waits_for_the_jobs_in_flight():
    worker, _ = _worker()
    trainer = Policy()
    with torch.no_grad():
        trainer.head.fill_(7.0)
    worker.engine.gate.clear()
    worker.submit([[1]], _params(), tag=0)
    pushed = threading.Thread(target=worker.push_weights, args=(1, dict(trainer.named_parameters())))
    pushed.start()
    pushed.join(timeout=0.3)
    assert pushed.is_alive() and worker.version == 0  # still waiting for job 0
    worker.engine.gate.set()
    pushed.join(timeout=10)
    assert not pushed.is_alive() and worker.version == 1
    (result,) = worker.poll()
    assert (result.tag, result.version, float(result.batch.log_probs[0, 0])) == (0, 0, 0.0)


class DropsATensor(RolloutWorker):
    """A push that loses one tensor on the way (a wrong name, a copy into a stale buffer)."""

    def _copy_in(self, named_tensors):
        super()._copy_in({n: t for n, t in named_tensors.items() if n != "head"})


def test_a_push_that_did_not_arrive_is_an_error_naming_the_tensor():
    module = Policy()
    worker = DropsATensor(ReadsWeights(module), module, version=0)
    assert worker.watched == ["embed", "scale", "head"]
    trainer = Policy()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.arange(p.numel()).reshape(p.shape) + 1.0)
    sent = {n: checksum(t) for n, t in trainer.named_parameters() if n in worker.watched}
    received = worker.push_weights(1, dict(trainer.named_parameters()))
    with pytest.raises(WeightPushError, match=r"version 1 .*: head differ") as info:
        check_delivery(1, sent, received)
    assert "embed" not in str(info.value) and "scale" not in str(info.value)


def test_checksum_sees_a_permutation_and_the_watched_set_spans_the_model():
    t = torch.tensor([1.0, 2.0, 3.0])
    assert checksum(t) == checksum(t.clone()) and checksum(t) != checksum(t.flip(0))
    assert watched_names(["a", "b", "c", "d", "e"]) == ["a", "c", "e"]
    assert watched_names(["a", "b"]) == ["a", "b"]


def test_an_error_in_generate_reaches_the_trainer():
    worker, _ = _worker()
    worker.engine.generate = lambda prompts, params: (_ for _ in ()).throw(RuntimeError("decode failed"))
    worker.submit([[1]], _params(), tag=3)
    with pytest.raises(RuntimeError, match="decode failed"):
        worker.wait(3)


def test_a_worker_no_longer_used_stops_its_thread():
    import gc

    def alive():
        return {t for t in threading.enumerate() if t.name == "hpa-rollout-worker"}

    gc.collect()
    before = alive()
    worker, _ = _worker()
    worker.submit([[1]], _params(), tag=0)
    assert worker.wait(0).version == 0
    (thread,) = alive() - before
    del worker
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def _detached_copy(groups):
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import TokenizerInfo
    from hpa.rollout.megatron_engine import MegatronRolloutEngine

    torch.manual_seed(0)
    model = build_policy(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                     vocab_size=64, max_sequence_length=32, make_vocab_size_divisible_by=16,
                                     init_method_std=0.3), ParallelConfig(), groups)
    engine = MegatronRolloutEngine(model, groups, TokenizerInfo(vocab_size=64, eos_token_id=1, pad_token_id=0),
                                   decode="eager")
    copy = engine.detached_copy()
    worker = RolloutWorker(copy, copy.module, version=0)
    prompts, params = [[5, 6, 7], [9, 3]], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    before = engine.generate(prompts, params)
    shared = {n for n, p in model.named_parameters()} & {n for n, p in copy.module.named_parameters()
                                                          if any(p.data_ptr() == q.data_ptr()
                                                                 for q in model.parameters())}
    with torch.no_grad():  # the trainer's update
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = engine.generate(prompts, params)
    worker.submit(prompts, params, tag="old")
    stale = worker.wait("old")
    worker.push_weights(1, dict(model.named_parameters()))
    worker.submit(prompts, params, tag="new")
    fresh = worker.wait("new")
    grads = any(p.requires_grad for p in copy.module.parameters())
    return before, after, stale, fresh, shared, grads


@pytest.mark.multirank
def test_the_native_engine_detached_copy_samples_its_own_weights_in_the_worker():
    from multirank import run_ranks

    [(before, after, stale, fresh, shared, grads)] = run_ranks(_detached_copy)
    assert not shared and not grads
    assert not before.log_probs.equal(after.log_probs)  # the update changed the policy
    for got, want in ((stale, before), (fresh, after)):  # the worker's thread samples as the engine does
        assert got.batch.response_ids.equal(want.response_ids)
        assert got.batch.log_probs.equal(want.log_probs)
    assert (stale.version, fresh.version) == (0, 1)
