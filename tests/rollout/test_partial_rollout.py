"""Partial rollouts on the native engine (``MegatronRolloutEngine.resume``, ``rollout.partial``).

One TP1/PP1 spawn runs every generate call; the tests compare what it returned:
- stopped after j decode steps and continued with the same weights, a request gives the tokens, masks, finish
  reasons and log-probs of the uninterrupted call, greedy and sampled (the generator's state travels with the
  rows): exactly in the ``"none"`` cache mode (every step recomputes every position, as the continuation's prefill
  does), within 1e-5 with hpa's cache (the prefill of j tokens at once rounds differently from j steps), eager and
  static decode, and with megatron's static inference context; a row that stopped before the cut stays stopped; cut twice equals cut once;
- continued with changed weights, the tokens before the cut and their log-probs are the old call's, and every
  log-prob after the cut is the new model's training forward on the tokens (the old one's differs), greedy tokens
  after the cut are the new model's argmax; the same cut and weights give the same tokens twice.
"""

import pytest
import torch

import training_forward
from multirank import run_ranks

pytestmark = pytest.mark.multirank

VOCAB = 64
MAX_NEW = 8
CUT = 3
PROMPTS = [[5, 6, 7], [9, 3], [11, 12, 13, 14, 15]]
SAMPLED = dict(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
GREEDY = dict(n=1, temperature=0.0, max_new_tokens=MAX_NEW)


def stop_before(step):
    """A ``stop`` that says yes at its ``step + 1``-th call (before decode step ``step`` of a fresh request)."""
    calls = [0]

    def stop():
        calls[0] += 1
        return calls[0] > step

    return stop


def training_log_probs(model, groups, batch, temperature):
    """``[b, r]`` log-probs of the batch's tokens from the training forward (last stage; None elsewhere)."""
    return training_forward.training_log_probs(model, groups, batch, temperature, VOCAB)


def fields(batch):
    return {"response_ids": batch.response_ids, "response_mask": batch.response_mask, "log_probs": batch.log_probs,
            "finish_reasons": batch.finish_reasons, "group_ids": batch.group_ids}


def engine_worker(groups):
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import PartialRollout, SamplingParams, TokenizerInfo
    from hpa.rollout.megatron_engine import MegatronRolloutEngine

    torch.manual_seed(0)
    model = build_policy(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                     ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=32,
                                     make_vocab_size_divisible_by=16, init_method_std=0.1), ParallelConfig(), groups)
    model.eval()

    def engine(kv_cache="hpa", decode="eager", eos=1):
        return MegatronRolloutEngine(model, groups, TokenizerInfo(vocab_size=VOCAB, eos_token_id=eos, pad_token_id=0),
                                     kv_cache=kv_cache, decode=decode)

    out = {"same": {}, "stopped_rows": {}}
    # an EOS that row 0 samples at step 1 (before the cut): a row that finished before the cut is carried over
    eos = int(engine().generate(PROMPTS, SamplingParams(**SAMPLED)).response_ids[0, 1])
    for kv_cache, decode in (("none", "eager"), ("hpa", "eager"), ("hpa", "static"), ("megatron", "eager")):
        for name, params in (("sampled", SamplingParams(**SAMPLED)), ("greedy", SamplingParams(**GREEDY))):
            e = engine(kv_cache, decode, eos)
            whole = e.generate(PROMPTS, params)
            part = e.resume(PartialRollout.start(PROMPTS, params), stop=stop_before(CUT))
            assert isinstance(part, PartialRollout) and part.steps == CUT, part
            once = e.resume(part)
            first = e.resume(PartialRollout.start(PROMPTS, params), stop=stop_before(2))
            second = e.resume(first, stop=stop_before(3))  # 2 + 3 steps
            twice = e.resume(second)
            out["same"][kv_cache, decode, name] = (fields(whole), fields(once), fields(twice), second.steps)
            out["stopped_rows"][kv_cache, decode, name] = (part.stopped.clone(), whole.finish_reasons)
    e = engine()
    # a stop before the first step gives the request back untouched, the seeded generator's state with it
    nothing = e.resume(PartialRollout.start(PROMPTS, SamplingParams(**SAMPLED)), stop=lambda: True)
    out["nothing"] = (nothing.steps, fields(e.resume(nothing)), fields(e.generate(PROMPTS, SamplingParams(**SAMPLED))))

    changed = {}
    for name, params in (("sampled", SamplingParams(**SAMPLED)), ("greedy", SamplingParams(**GREEDY))):
        old = e.generate(PROMPTS, params)
        old_forward = training_log_probs(model, groups, old, 1.0)
        part = e.resume(PartialRollout.start(PROMPTS, params), stop=stop_before(CUT))
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        new = e.resume(part)
        again = e.resume(part)
        new_forward = training_log_probs(model, groups, new, 1.0)
        old_weights_forward = None
        with torch.no_grad():
            tweaked = {n: p.detach().clone() for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                p.copy_(saved[n])
            old_weights_forward = training_log_probs(model, groups, new, 1.0)
            for n, p in model.named_parameters():
                p.copy_(tweaked[n])
        # greedy after the cut: each unfinished row's continuation is the new model's greedy answer to the prompt
        # followed by the row's first CUT tokens
        extended = []
        if name == "greedy":
            for i, prompt in enumerate(PROMPTS):
                extended.append(e.generate([prompt + part.response_ids[i].tolist()],
                                           SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW - CUT)))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        changed[name] = dict(old=fields(old), old_forward=old_forward, new=fields(new), again=fields(again),
                             new_forward=new_forward, old_weights_forward=old_weights_forward,
                             extended=[fields(x) for x in extended])
    out["changed"] = changed
    return out


@pytest.fixture(scope="module")
def results():
    [out] = run_ranks(engine_worker)
    return out


@pytest.mark.parametrize("name", ["sampled", "greedy"])
@pytest.mark.parametrize("kv_cache,decode", [("none", "eager"), ("hpa", "eager"), ("hpa", "static"),
                                             ("megatron", "eager")])
def test_stop_and_continue_with_the_same_weights_is_the_uninterrupted_call(results, kv_cache, decode, name):
    whole, once, twice, steps = results["same"][kv_cache, decode, name]
    assert steps == 5
    for got in (once, twice):
        for key in ("response_ids", "response_mask", "finish_reasons", "group_ids"):
            assert got[key] == whole[key] if key == "finish_reasons" else got[key].equal(whole[key]), key
        if kv_cache == "none":
            assert got["log_probs"].equal(whole["log_probs"])
        else:
            torch.testing.assert_close(got["log_probs"], whole["log_probs"], atol=1e-5, rtol=0)
    if name == "sampled":
        assert whole["response_mask"].sum() < whole["response_mask"].numel()  # some row stopped on EOS


def test_a_row_that_stopped_before_the_cut_is_carried_over(results):
    stopped, reasons = results["stopped_rows"]["hpa", "eager", "sampled"]
    assert bool(stopped[0]) and not bool(stopped.all())
    assert reasons[0] == "stop"


def test_a_stop_before_the_first_step_gives_the_request_back_to_continue(results):
    steps, resumed, whole = results["nothing"]
    assert steps == 0
    for key in ("response_ids", "response_mask", "log_probs"):
        assert resumed[key].equal(whole[key]), key


@pytest.mark.parametrize("name", ["sampled", "greedy"])
def test_continue_with_changed_weights_samples_after_the_cut_from_the_new_model(results, name):
    r = results["changed"][name]
    old, new, again = r["old"], r["new"], r["again"]
    mask = new["response_mask"].bool()
    assert new["response_ids"][:, :CUT].equal(old["response_ids"][:, :CUT])
    assert new["log_probs"][:, :CUT].equal(old["log_probs"][:, :CUT])
    # before the cut: the old model's log-probs (its training forward); after: the new model's
    before, after = mask.clone(), mask.clone()
    before[:, CUT:] = False
    after[:, :CUT] = False
    assert after.sum() >= 3
    torch.testing.assert_close(new["log_probs"][before], r["old_forward"][before], atol=1e-4, rtol=0)
    torch.testing.assert_close(new["log_probs"][after], r["new_forward"][after], atol=1e-4, rtol=0)
    assert (new["log_probs"][after] - r["old_weights_forward"][after]).abs().max() > 1e-2  # the weights changed
    for key in ("response_ids", "log_probs", "response_mask"):
        assert again[key].equal(new[key]), key  # reproducible
    if name == "greedy":
        for i, ext in enumerate(r["extended"]):
            if mask[i, CUT - 1]:  # the row was still running at the cut
                n = int(ext["response_mask"].sum())
                assert new["response_ids"][i, CUT:CUT + n].equal(ext["response_ids"][0, :n]), i
                torch.testing.assert_close(new["log_probs"][i, CUT:CUT + n], ext["log_probs"][0, :n],
                                           atol=1e-5, rtol=0)
    else:
        assert not new["response_ids"][:, CUT:].equal(old["response_ids"][:, CUT:])


def worker_push_mid_job(groups):
    """A ``RolloutWorker`` with ``partial`` on the native engine's detached copy: a push while the job is held in
    the forward of decode step ``CUT - 1``; and the same cut made by hand on the trainer's engine."""
    import threading
    import time

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import PartialRollout, SamplingParams, TokenizerInfo
    from hpa.rollout.megatron_engine import MegatronRolloutEngine
    from hpa.rollout.queue import TOKEN_VERSIONS
    from hpa.rollout.worker import RolloutWorker

    torch.manual_seed(0)
    model = build_policy(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                     vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16,
                                     init_method_std=0.1), ParallelConfig(), groups)
    engine = MegatronRolloutEngine(model, groups, TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=0),
                                   decode="eager")
    copy = engine.detached_copy()
    worker = RolloutWorker(copy, copy.module, version=0, partial=True)
    params = SamplingParams(**SAMPLED)
    whole = engine.generate(PROMPTS, params)
    part = engine.resume(PartialRollout.start(PROMPTS, params), stop=stop_before(CUT))
    with torch.no_grad():  # the trainer's update
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    by_hand = engine.resume(part)

    at_hold, go, calls = threading.Event(), threading.Event(), [0]
    forward = copy._forward

    def held_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == CUT:  # the forward of decode step CUT - 1: the stop is read before step CUT
            at_hold.set()
            go.wait()
        return forward(*args, **kwargs)

    copy._forward = held_forward
    worker.submit(PROMPTS, params, tag="job")
    assert at_hold.wait(60)
    pushed = threading.Thread(target=worker.push_weights, args=(1, dict(model.named_parameters())))
    pushed.start()
    while not worker._jobs.stop.is_set():
        time.sleep(0.01)
    go.set()
    pushed.join(timeout=60)
    result = worker.wait("job")
    return dict(whole=fields(whole), by_hand=fields(by_hand), got=fields(result.batch), version=result.version,
                token_versions=result.batch.get(TOKEN_VERSIONS), calls=calls[0])


def test_a_worker_push_mid_job_continues_the_rows_with_the_new_weights():
    [r] = run_ranks(worker_push_mid_job)
    got, by_hand, whole = r["got"], r["by_hand"], r["whole"]
    for key in ("response_ids", "response_mask", "log_probs", "finish_reasons"):
        assert got[key] == by_hand[key] if key == "finish_reasons" else got[key].equal(by_hand[key]), key
    assert got["response_ids"][:, :CUT].equal(whole["response_ids"][:, :CUT])
    assert not got["log_probs"].equal(whole["log_probs"])  # after the cut: the new weights
    width = got["response_ids"].shape[1]
    assert r["token_versions"].tolist() == [[0] * CUT + [1] * (width - CUT)] * len(got["finish_reasons"])
    assert r["version"] == 0
    assert r["calls"] > CUT + 1  # the continuation prefilled and decoded on
