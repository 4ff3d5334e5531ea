"""The reference log-prob cache of the preference pairs (``hpa.trainer.reference_cache``): cached values are
the live forward's bits, a step runs no reference forward over its pairs, the cache is reused across resumes
and rebuilt when its key changes or a file is corrupt; ``hpa train`` under DP2 gives the same metrics with
the cache as without it."""

import json
import logging
import re
import types

import pytest
import torch

from multirank import run_ranks
from trainer_runs import launch, overrides, read_metrics

VOLATILE = ("timing_s/", "perf/")


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


def _parts(root, pair_file=None):
    """Config, tokenizer, pairs and reference (the demo's initial policy) of the demo task."""
    from hpa.config import load_config
    from hpa.data.preferences import PreferenceDataset
    from hpa.data.tokenizer import build_tokenizer

    d = root / "data"
    cfg = load_config(None, ["model.num_layers=4", f"data.tokenizer_path={d / 'tok.model'}",
                             f"data.prompt_path={d / 'prompts.jsonl'}",
                             f"data.preference_path={pair_file or d / 'preferences.jsonl'}"])
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path, model_vocab_size=cfg.model.vocab_size)
    pairs = PreferenceDataset.from_config(cfg.data, tokenizer, rejects_dir=None)
    return cfg, tokenizer, pairs


def _reference(cfg, groups, root):
    from hpa.models import build_reference
    from hpa.models.weights import load_model_weights

    reference = build_reference(cfg.model, cfg.parallel, groups)
    load_model_weights(reference, root / "init", groups)
    return reference


def _ctx(cfg, groups, tokenizer, micro_batch_size):
    from hpa.trainer import phases

    import dataclasses

    ctx = phases.StepContext.from_config(cfg, groups, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    return dataclasses.replace(ctx, temperature=1.0,
                               batching=dataclasses.replace(ctx.batching, micro_batch_size=micro_batch_size))


def _cache(cfg, groups, tokenizer, pairs, reference, directory, calls):
    """``load_or_build`` as the trainer calls it; ``calls`` counts the pairs the reference computed."""
    from hpa.trainer import phases, reference_cache

    ctx = _ctx(cfg, groups, tokenizer, 4)

    def compute(examples):
        calls.append(len(examples))
        return phases.reference_pair_log_probs(examples, reference, ctx)

    key = reference_cache.cache_key(pairs, reference, groups, preference_path=cfg.data.preference_path,
                                    model_cfg=cfg.model, parallel_cfg=cfg.parallel, vocab_size=tokenizer.vocab_size,
                                    pad_id=tokenizer.pad_id)
    return reference_cache.load_or_build(directory, key, pairs, compute, groups)


def _cached_equals_live(groups, root, run_dir):
    """The live path's reference values of shuffled steps (4 pairs a micro-batch) against the cache's; with the
    cache, ``preference_micro_batches`` never calls the reference."""
    import torch

    from hpa.data.sampler import DistributedBatchSampler
    from hpa.engine import forward
    from hpa.trainer import phases

    cfg, tokenizer, pairs = _parts(root, run_dir / "preferences.jsonl")
    reference = _reference(cfg, groups, root)
    table = _cache(cfg, groups, tokenizer, pairs, reference, run_dir / "reference_log_probs", [])
    ctx = _ctx(cfg, groups, tokenizer, 4)
    sampler = DistributedBatchSampler(len(pairs), global_batch_size=8 * groups.data_parallel_size,
                                      dp_rank=groups.dp_rank, dp_size=groups.data_parallel_size, seed=3)
    live_calls = []
    original = forward.pair_sequence_log_probs

    def counted(model, *args, **kwargs):
        live_calls.append(model is reference)
        return original(model, *args, **kwargs)

    forward.pair_sequence_log_probs = counted
    compared = 0
    try:
        for _ in range(6):
            indices = sampler.next_batch()
            examples = [pairs[i] for i in indices]
            live = phases.preference_micro_batches(examples, reference, ctx)
            before = len(live_calls)
            cached = phases.preference_micro_batches(examples, reference, ctx, table[indices])
            assert len(live_calls) == before, "the cached path ran the reference"
            for a, b in zip(live, cached):
                assert torch.equal(a["input_ids"], b["input_ids"])
                assert torch.equal(a["ref_seq_logp"], b["ref_seq_logp"]), (a["ref_seq_logp"] - b["ref_seq_logp"])
                compared += a["ref_seq_logp"].numel()
    finally:
        forward.pair_sequence_log_probs = original
    return compared, torch.isfinite(table).all().item()


@pytest.mark.multirank
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), pytest.param(1, 2, 2, marks=pytest.mark.slow)],
                         ids=["tp1_pp1_dp1", "tp1_pp2_dp2"])
def test_cached_values_equal_the_live_forward_bit_for_bit(demo, tmp_path, tp, pp, dp):
    """Shuffled steps group different pairs into a micro-batch each time; the cached value of every pair
    is still the live one, bit for bit (under PP2 x DP2 too: each DP rank computes its shard, the first
    stage writes it, every rank gets the whole table)."""
    lines = (demo / "data" / "preferences.jsonl").read_text().splitlines()[:64]  # 4 steps an epoch under DP2
    (tmp_path / "preferences.jsonl").write_text("\n".join(lines) + "\n")
    results = run_ranks(_cached_equals_live, tp=tp, pp=pp, dp=dp, args=(demo, tmp_path))
    for compared, finite in results:
        assert compared == 6 * 8 * 2 and finite
    assert len(list((tmp_path / "reference_log_probs").glob("shard_*.pt"))) == dp


def _rebuilds(groups, root, tmp):
    """Builds, reuses, then changes one thing at a time; returns what the reference computed each time and the
    log messages."""
    import torch

    handler = _Messages()
    logging.getLogger("hpa").addHandler(handler)
    logging.getLogger("hpa").setLevel(logging.INFO)
    directory = tmp / "run" / "reference_log_probs"
    cfg, tokenizer, pairs = _parts(root)
    reference = _reference(cfg, groups, root)
    counts, tables = {}, {}

    def run(name, cfg=cfg, pairs=pairs, reference=reference):
        calls = []
        tables[name] = _cache(cfg, groups, tokenizer, pairs, reference, directory, calls)
        counts[name] = sum(calls)

    run("first")
    run("again")
    shard = directory / "shard_00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    run("flipped")
    shard.write_bytes(shard.read_bytes()[:-7])
    run("truncated")
    # a pair file with one chosen response changed
    lines = (root / "data" / "preferences.jsonl").read_text().splitlines()
    record = json.loads(lines[5])
    record["chosen"] = record["chosen"] + " 7"
    lines[5] = json.dumps(record)
    changed_file = tmp / "preferences.jsonl"
    changed_file.write_text("\n".join(lines) + "\n")
    cfg2, _, pairs2 = _parts(root, changed_file)
    run("pair_file", cfg=cfg2, pairs=pairs2)
    run("pair_file_again", cfg=cfg2, pairs=pairs2)
    # another reference checkpoint: the same architecture, one weight moved
    other = _reference(cfg, groups, root)
    with torch.no_grad():
        next(p for p in other.parameters()).add_(1e-3)
    run("reference", reference=other)
    same = {name: torch.equal(tables[name], tables["first"]) for name in tables}
    return counts, same, handler.messages


@pytest.mark.multirank
def test_reuse_and_every_rebuild(demo, tmp_path):
    """Reused when nothing changed (no pair computed); a flipped byte or a truncated shard is detected with a
    warning naming the file and rebuilt; a changed pair file or reference checkpoint rebuilds it."""
    [(counts, same, messages)] = run_ranks(_rebuilds, args=(demo, tmp_path))
    n = counts["first"]
    assert n > 200
    assert counts == {"first": n, "again": 0, "flipped": n, "truncated": n, "pair_file": n, "pair_file_again": 0,
                      "reference": n}
    assert same["again"] and same["flipped"] and same["truncated"]
    assert not same["pair_file"] and not same["reference"]
    warnings = [m for level, m in messages if level == "WARNING"]
    shard = str(tmp_path / "run" / "reference_log_probs" / "shard_00000.pt")
    assert len(warnings) == 2 and all(shard in w for w in warnings), warnings
    assert "checksum mismatch" in warnings[0] and "truncated" in warnings[1]
    built = [m for _, m in messages if "reference log-prob cache: built" in m]
    assert len(built) == 5 and "pairs_sha256" in built[3] and "reference_sha256" in built[4], built
    assert len([m for _, m in messages if "reference log-prob cache: reused" in m]) == 2


def _counted_step(groups, root, run_dir, extra):
    """Two ``hpa train`` steps in this process; the reference's calls of ``pair_sequence_log_probs``."""
    from hpa.config import load_config
    from hpa.engine import forward
    from hpa.trainer.loop import HPATrainer

    cfg = load_config(None, overrides(root, run_dir, ["trainer.eval_interval=0", *extra]))
    original = forward.pair_sequence_log_probs
    trainer = None
    calls = {"start-up": 0, "steps": 0}

    def counted(model, *args, **kwargs):
        if trainer is None or model is trainer.parts.reference:
            calls["start-up" if trainer is None else "steps"] += 1
        return original(model, *args, **kwargs)

    forward.pair_sequence_log_probs = counted
    try:
        trainer = HPATrainer(cfg, groups)
        trainer.train()
    finally:
        forward.pair_sequence_log_probs = original
    return calls


@pytest.mark.multirank
def test_a_step_runs_no_reference_forward_over_its_pairs(demo, tmp_path):
    """Counted in a real training run: with the cache every reference forward over pairs happens at
    start-up, none in the steps; without it, every step runs one."""
    [cached] = run_ranks(_counted_step, args=(demo, tmp_path / "cached", []))
    [live] = run_ranks(_counted_step, args=(demo, tmp_path / "live", ["data.cache_reference_log_probs=false"]))
    assert cached == {"start-up": 1, "steps": 0}
    assert live == {"start-up": 0, "steps": 2}


@pytest.mark.e2e
def test_hpa_train_tp1_pp1_dp2_with_the_cache_equals_without_and_a_resume_reuses_it(demo):
    """DP2: the run with the cache, stopped after one step and resumed, logs the same metrics bit for bit as
    the run without it; the cache is built once, by the first launch, and the resume reuses it."""
    fast = ["trainer.eval_interval=0", "checkpoint.save_interval=1"]
    live = launch(demo, demo / "cache_off", 2, [*fast, "data.cache_reference_log_probs=false"])
    logs = []
    launch(demo, demo / "cache_on", 2, [*fast, "trainer.max_steps_per_run=1"], output=logs)
    shards = sorted((demo / "cache_on" / "reference_log_probs").glob("shard_*.pt"))
    written = [s.stat().st_mtime_ns for s in shards]
    cached = launch(demo, demo / "cache_on", 2, fast, output=logs)
    assert [s.name for s in shards] == ["shard_00000.pt", "shard_00001.pt"]
    assert [s.stat().st_mtime_ns for s in shards] == written
    built = [len(re.findall(r"reference log-prob cache: built .* in [0-9.]+ s", log)) for log in logs]
    reused = [len(re.findall(r"reference log-prob cache: reused .* in [0-9.]+ s", log)) for log in logs]
    assert built == [1, 0] and reused == [0, 1], (built, reused)
    assert "resumed from" in logs[1]
    assert not (demo / "cache_off" / "reference_log_probs").exists()
    assert [r["step"] for r in cached] == [r["step"] for r in live] == [1, 2]
    for a, b in zip(live, cached):
        a = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        b = {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert a == b


def test_a_key_with_a_tuple_is_reused_after_its_json_round_trip(tmp_path):
    """One process: a key holding a tuple (the model section's lora.target_modules) is stored as JSON, which
    reads it back as a list; the second load must still reuse the cache, not rebuild it."""
    from hpa.trainer import reference_cache

    groups = types.SimpleNamespace(is_main=True, data_parallel_size=1, dp_rank=0, tp_rank=0, pp_rank=0, cp_rank=0,
                                   dp_group=None)
    key = {"model": {"lora": {"target_modules": ("linear_qkv", "linear_proj")}}, "num_pairs": 3}
    calls = []

    def compute(examples):
        calls.append(len(examples))
        return torch.arange(2.0 * len(examples)).reshape(-1, 2)

    first = reference_cache.load_or_build(tmp_path / "cache", key, [0, 1, 2], compute, groups)
    again = reference_cache.load_or_build(tmp_path / "cache", key, [0, 1, 2], compute, groups)
    assert calls == [3] and torch.equal(first, again)


# ------------------------------------------------------------------------------------------------
# weights_digest in one process: the reference's fingerprint in the cache's key

LARGE = (1 << 20) + 5  # more elements than one chunk of the device-side hash


class _Weights:
    """What ``weights_digest`` reads of a model: its state dict."""

    def __init__(self, tensors):
        self.tensors = tensors

    def state_dict(self):
        return dict(self.tensors)


def _weights(num_layers=2, large=LARGE):
    g = torch.Generator().manual_seed(0)
    tensors = {"embedding.word_embeddings.weight": torch.randn(6, 4, generator=g),
               "decoder.final_layernorm.weight": torch.randn(7, generator=g).bfloat16(),  # 14 bytes: not whole words
               "output_layer.weight": torch.randn(large, generator=g),
               "decoder.counts": torch.arange(5, dtype=torch.uint8)}
    for i in range(num_layers):
        tensors[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.randn(3, 5, generator=g).bfloat16()
    return tensors


_ONE_RANK = types.SimpleNamespace(pp_rank=0, tp_rank=0)


def _digest(tensors):
    from hpa.trainer.reference_cache import weights_digest

    return weights_digest(_Weights(tensors), _ONE_RANK)


def _flipped(tensors, name, index, bit=0):
    """``tensors`` with one bit of one element of ``name`` flipped."""
    out = {k: v.clone() for k, v in tensors.items()}
    t = out[name]
    words = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).reshape(-1)
    words[index] ^= 1 << bit
    return out


def test_the_weights_digest_is_the_same_in_another_process(tmp_path):
    import subprocess
    import sys

    torch.save(_weights(), tmp_path / "w.pt")
    code = ("import sys, torch, types; sys.path[:0] = ['.', 'tests', 'tests/trainer']; "
            "from test_reference_cache import _digest; "
            f"print(_digest(torch.load({str(tmp_path / 'w.pt')!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    assert out.stdout.strip() == _digest(_weights()) == _digest(_weights())


def test_the_weights_digest_changes_with_any_one_element():
    weights = _weights()
    base = _digest(weights)
    flips = [("embedding.word_embeddings.weight", 0, 0), ("embedding.word_embeddings.weight", 23, 31),
             ("decoder.final_layernorm.weight", 3, 0), ("decoder.final_layernorm.weight", 6, 0),  # the last: a tail
             ("decoder.final_layernorm.weight", 6, 15), ("output_layer.weight", LARGE - 1, 0),
             ("output_layer.weight", 1 << 20, 0), ("decoder.counts", 4, 7),
             ("decoder.layers.1.mlp.linear_fc1.weight", 14, 0)]
    digests = [_digest(_flipped(weights, *flip)) for flip in flips]
    assert base not in digests and len(set(digests)) == len(flips)
    swapped = dict(weights)
    swapped["decoder.layers.0.mlp.linear_fc1.weight"], swapped["decoder.layers.1.mlp.linear_fc1.weight"] = \
        weights["decoder.layers.1.mlp.linear_fc1.weight"], weights["decoder.layers.0.mlp.linear_fc1.weight"]
    assert _digest(swapped) != base
    as_fp32 = {**weights, "decoder.final_layernorm.weight": weights["decoder.final_layernorm.weight"].float()}
    assert _digest(as_fp32) != base  # the same values in another dtype


def test_the_weights_digest_leaves_out_the_adapters():
    weights = _weights()
    adapters = {"decoder.layers.0.self_attention.linear_qkv_lora.A": torch.randn(4, 4),
                "decoder.layers.0.self_attention.linear_qkv_lora.B": torch.zeros(4, 4)}
    assert _digest({**weights, **adapters}) == _digest(weights)


def test_the_weights_digest_reads_the_device_once_however_many_tensors():
    """One device-to-host copy for the whole shard (it was one a tensor, a full copy of the shard on the host),
    and the digest of the weights on the device is that of the same weights on the host."""
    from hpa.distributed.device_mode import StrictDeviceMode, on_device
    from hpa.distributed.sync_ops import SyncOps

    counts = {}
    for num_layers in (1, 20):
        host = _weights(num_layers, large=1000)
        with StrictDeviceMode(torch.device("lazy", 0)):
            device = {k: on_device(v) for k, v in host.items()}
            with SyncOps() as syncs:
                digest = _digest(device)
        counts[num_layers] = syncs.count
        assert digest == _digest(host)
    assert counts == {1: 1, 20: 1}, counts


def test_a_weight_that_starts_mid_word_in_its_storage_hashes_as_its_copy():
    """A view at an odd place in its storage (a parameter in a flat buffer) reads as the same words as its copy."""
    storage = torch.arange(11, dtype=torch.int16)
    assert _digest({"w": storage[1:]}) == _digest({"w": storage[1:].clone()})
    assert _digest({"w": storage[1:]}) != _digest({"w": storage[:-1]})
