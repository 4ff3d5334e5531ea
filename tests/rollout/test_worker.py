"""The rollout worker: jobs sample with the weights of the version they were submitted at, while the trainer's
own copy changes; a weight push that does not arrive is an error naming the tensors, never silent staleness.
With partial rollouts a push stops the job in flight between two decode steps and its tokens span two versions."""

import dataclasses
import threading
import time

import pytest
import torch

from hpa.rollout.base import PartialRollout, RolloutBatch, RolloutEngine, SamplingParams
from hpa.rollout.queue import TOKEN_VERSIONS, RolloutQueue, rollout_batch, rollout_entry
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


class Steps(RolloutEngine):
    """Resumable: one token per decode step, its log-prob the head's [0, 0] weight when the step ran; ``hold_at``
    holds the job before that step (``at_hold`` set) until ``go``."""

    name = "steps"
    can_resume = True

    def __init__(self, module):
        self.module, self.hold_at = module, None
        self.at_hold, self.go = threading.Event(), threading.Event()
        self.calls = []  # the first step of each resume call

    def generate(self, prompts, params):
        return self.resume(PartialRollout.start(prompts, params))

    def resume(self, partial, *, stop=None):
        b, ids, logp = partial.response_ids.shape[0], [partial.response_ids], [partial.log_probs]
        self.calls.append(partial.steps)
        for step in range(partial.steps, partial.params.max_new_tokens):
            if step == self.hold_at:
                self.at_hold.set()
                self.go.wait()
            if stop is not None and stop():
                ids, logp = torch.cat(ids, 1), torch.cat(logp, 1)
                return dataclasses.replace(partial, response_ids=ids, response_mask=torch.ones_like(ids, dtype=bool),
                                           log_probs=logp)
            ids.append(torch.full((b, 1), step + 2))
            logp.append(torch.full((b, 1), float(self.module.head[0, 0])))
        ids, logp = torch.cat(ids, 1), torch.cat(logp, 1)
        b_prompts = torch.ones((b, 1), dtype=torch.int64)
        return RolloutBatch(prompt_ids=b_prompts, prompt_mask=b_prompts, response_ids=ids,
                            response_mask=torch.ones(ids.shape), log_probs=logp, finish_reasons=["length"] * b,
                            group_ids=partial.group_ids)


def _partial_worker():
    module = Policy()
    return RolloutWorker(Steps(module), module, version=0, partial=True)


def _wait_for(predicate):
    for _ in range(1000):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_a_partial_push_stops_the_job_in_flight_and_its_tokens_span_two_versions():
    worker = _partial_worker()
    trainer = Policy()
    with torch.no_grad():
        trainer.head.fill_(3.0)
    engine = worker.engine
    engine.hold_at = 2  # steps 0 and 1 decoded by version 0
    worker.submit([[1]], SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=0), tag="s1")
    assert engine.at_hold.wait(10)
    pushed = threading.Thread(target=worker.push_weights, args=(1, dict(trainer.named_parameters())))
    pushed.start()
    _wait_for(worker._jobs.stop.is_set)  # the push asked the job to stop; it does before step 2
    engine.go.set()
    pushed.join(timeout=10)
    assert not pushed.is_alive() and worker.version == 1
    result = worker.wait("s1")
    assert engine.calls == [0, 2]  # stopped after two steps, continued from there
    versions = result.batch.get(TOKEN_VERSIONS)
    assert versions.dtype == torch.int64 and versions.tolist() == [[0, 0, 1, 1, 1]] * 2
    assert result.batch.log_probs.tolist() == [[0.0, 0.0, 3.0, 3.0, 3.0]] * 2  # each step by its version's weights
    assert result.batch.response_ids.tolist() == [[2, 3, 4, 5, 6]] * 2
    assert result.version == 0  # the oldest token's
    entry = rollout_entry(result.batch, result.version)
    assert entry.versions.equal(versions) and TOKEN_VERSIONS not in rollout_batch(entry).extras
    queue = RolloutQueue(1, version=1)
    queue.put(entry)
    (taken,) = queue.get()
    assert queue.metrics()["async/lag_max"] == 1.0  # the oldest token counts


def test_a_partial_push_with_no_job_in_flight_copies_at_once_and_the_next_job_is_all_new():
    worker = _partial_worker()
    trainer = Policy()
    with torch.no_grad():
        trainer.head.fill_(2.0)
    worker.push_weights(4, dict(trainer.named_parameters()))
    worker.submit([[1]], SamplingParams(n=1, temperature=1.0, max_new_tokens=3, seed=0), tag=0)
    result = worker.wait(0)
    assert result.version == 4 and result.batch.get(TOKEN_VERSIONS).tolist() == [[4, 4, 4]]
    assert result.batch.log_probs.tolist() == [[2.0, 2.0, 2.0]]


def test_a_queued_job_that_starts_during_a_push_samples_every_token_with_the_new_weights():
    worker = _partial_worker()
    trainer = Policy()
    with torch.no_grad():
        trainer.head.fill_(6.0)
    engine = worker.engine
    engine.hold_at = 1
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=3, seed=0)
    worker.submit([[1]], params, tag="a")
    worker.submit([[1]], params, tag="b")  # queued behind "a"
    assert engine.at_hold.wait(10)
    pushed = threading.Thread(target=worker.push_weights, args=(1, dict(trainer.named_parameters())))
    pushed.start()
    _wait_for(worker._jobs.stop.is_set)
    engine.go.set()
    pushed.join(timeout=10)
    a, b = worker.wait("a"), worker.wait("b")
    assert a.batch.get(TOKEN_VERSIONS).tolist() == [[0, 1, 1]] and a.version == 0
    assert b.batch.get(TOKEN_VERSIONS).tolist() == [[1, 1, 1]] and b.version == 1
    assert b.batch.log_probs.tolist() == [[6.0, 6.0, 6.0]]


def test_partial_with_an_engine_that_cannot_resume_a_row_names_the_key():
    from hpa.config.errors import ConfigError

    module = Policy()
    with pytest.raises(ConfigError, match="cannot stop a row") as err:
        RolloutWorker(ReadsWeights(module), module, partial=True)
    assert err.value.key == "rollout.partial"
