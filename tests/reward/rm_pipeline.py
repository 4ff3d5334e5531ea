"""One shared reward-model pipeline for tests/reward/test_train_rm.py and test_reward_model.py.

Three spawns in all (imports cost ~10 s per process here), run once per pytest session:

* tp1_pp1_dp1: save a random K=3 initial checkpoint, ``run_train_rm`` from it on the demo task
  (bootstrap on) and its first step again with ``trainer.sequence_packing`` on, then score a fixed batch with ``ModelReward`` (the trained model; the trained model
  twice as two reward models; a K=1 model) and run ``UncertaintyAwareReward`` on it. Then, in the same
  process, ``run_train_rm`` from scratch on the separable set (the demo task without flipped labels).
* one 2-process spawn, first as tp2_pp1_dp1, then re-initialised as tp1_pp2_dp1: one training step from the same initial checkpoint (its loss must
  equal TP1's first step) and the same ``ModelReward`` scores of the TP1-trained checkpoint.

The demo task is ``copy`` of one symbol (the model must match the response symbol to the prompt's):
the full task is beyond a 2-layer, hidden-32 model in the ~80 steps a test can afford.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path


from multirank import run_ranks

NUM_HEADS = 3
STEPS = 80
SEPARABLE_STEPS = 400
# lr 1e-2 with a short warmup and cosine decay: over trainer seeds 0-6 and 1234 the held-out accuracy
# after 400 steps was 0.96-1.0 (a constant lr leaves some seeds at ~0.8 through loss spikes)
SEPARABLE_OPTIM = ("optim.lr_warmup_fraction=0.05", "optim.lr_decay_style=cosine")
_CACHE: dict = {}


def make_config(root: str, run_dir: str, *, tp: int = 1, pp: int = 1, steps: int = STEPS, num_heads: int = NUM_HEADS,
                init_path: str | None = None, extra=()):
    from hpa.config import load_config

    overrides = [
        f"data.tokenizer_path={root}/tok.model", f"data.prompt_path={root}/prompts.jsonl",
        f"data.preference_path={root}/preferences.jsonl", f"data.sft_path={root}/sft.jsonl",
        f"data.eval_prompt_path={root}/eval_prompts.jsonl",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.make_vocab_size_divisible_by=16",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        "parallel.backend=gloo", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
        "trainer.preference_batch_size=32", "trainer.micro_batch_size=16", "logging.log_interval=1000",
        "optim.lr=1e-2", "optim.lr_warmup_fraction=0", "checkpoint.save_interval=0",
        f"reward.num_heads={num_heads}", "reward.rules=[]", "reward.training.eval_fraction=0.1",
        *( [f"reward.training.init_path={init_path}"] if init_path else []), *extra]
    return load_config(None, overrides)


def make_data(root: str) -> None:
    from data_tools.make_demo_task import make_demo_task
    from data_tools.train_tokenizer import read_corpus, train_sentencepiece

    make_demo_task(root, 1000, seed=0, tasks=("copy",), min_len=1, max_len=1, num_eval_prompts=3)
    train_sentencepiece(read_corpus(f"{root}/corpus.txt"), f"{root}/tok", vocab_size=128)


def make_copy_data(root: str, tokenizer_root: str, **task) -> None:
    """A demo ``copy`` task over the same 8 symbols as ``make_data`` (so its tokenizer is copied rather
    than trained again); ``task``: ``make_demo_task``'s arguments that differ from ``make_data``'s."""
    from data_tools.make_demo_task import make_demo_task

    make_demo_task(root, task.pop("num", 1000), seed=task.pop("seed", 0), tasks=("copy",), **task)
    shutil.copy(f"{tokenizer_root}/tok.model", f"{root}/tok.model")


def make_separable_data(root: str, tokenizer_root: str) -> None:
    """No flipped labels and all 8 symbols as prompts (none held out as eval prompts, so chosen and
    rejected responses range over the same symbols)."""
    make_copy_data(root, tokenizer_root, min_len=1, max_len=1, num_eval_prompts=0, flip_fraction=0.0)


def make_varied_data(root: str, tokenizer_root: str) -> None:
    """Strings of 1 to 4 symbols: rows of different lengths, so a padded micro-batch computes pad
    positions and a packed one does not."""
    make_copy_data(root, tokenizer_root, num=200, seed=1, min_len=1, max_len=4, num_eval_prompts=0)


def scoring_inputs(root: str, num: int = 12):
    """RewardInputs-like tensors of the first eval pairs: left-padded prompts, right-padded responses
    (chosen rows first, then rejected)."""
    from hpa.data import build_tokenizer
    from hpa.data.collate import pad_left, pad_right

    tok = build_tokenizer("sentencepiece", f"{root}/tok.model")
    records = [json.loads(line) for line in open(f"{root}/preferences.jsonl")][:num]
    prompts = [tok.encode(r["prompt"]) for r in records] * 2
    responses = [tok.encode(r[k]) + [tok.eos_id] for k in ("chosen", "rejected") for r in records]
    prompt_ids, prompt_mask = pad_left(prompts, tok.pad_id)
    response_ids, response_mask = pad_right(responses, tok.pad_id)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask, "pad_id": tok.pad_id}


def _score(groups, cfg, paths, num_heads, inputs, *, shaped: bool = False):
    import dataclasses

    from hpa.config.reward import RewardConfig
    from hpa.reward import RewardInputs, build_reward
    from hpa.engine.batching import Batching
    from hpa.reward.model import ModelReward

    reward_cfg = RewardConfig(model_paths=tuple(paths), num_heads=num_heads)
    mr = ModelReward.from_config(reward_cfg, cfg.model, cfg.parallel, groups,
                                 batching=Batching(micro_batch_size=5, pad_id=inputs["pad_id"]))
    ri = RewardInputs(response_ids=inputs["response_ids"], response_mask=inputs["response_mask"],
                      prompt_ids=inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"])
    out = mr(ri)
    result = {"rewards": out.rewards.numpy(), "embeddings": None if out.embeddings is None else out.embeddings.numpy()}
    if shaped:
        uar = build_reward(dataclasses.replace(reward_cfg), mr)
        first, second = uar(ri), uar(ri)
        result["shaped"] = {k: getattr(first, k).numpy() for k in ("rewards", "raw", "sigma", "diversity", "valid")}
        result["shaped_second_diversity"] = second.diversity.numpy()
        result["shaped_metrics"] = first.metrics
    return result


def _first_metrics_line(run_dir: str) -> dict:
    with open(Path(run_dir) / "rm_metrics.jsonl") as f:
        return json.loads(f.readline())


@contextlib.contextmanager
def _scored_rows():
    """Record the real and the computed tokens of every micro-batch ``score_sequences`` collates (the
    held-out evaluation's; training collates "pairs") while the block runs: ``{"tokens", "computed_tokens"}``."""
    import hpa.reward.model as reward_model

    seen = {"tokens": 0, "computed_tokens": 0}
    collate = reward_model.collate

    def recording(kind, *args, **kwargs):
        micro_batches = collate(kind, *args, **kwargs)
        if kind == "rows":
            seen["tokens"] += sum(mb.tokens for mb in micro_batches)
            seen["computed_tokens"] += sum(mb.computed_tokens for mb in micro_batches)
        return micro_batches

    reward_model.collate = recording
    try:
        yield seen
    finally:
        reward_model.collate = collate


def separable_run(groups, root, out) -> dict:
    """``run_train_rm`` from a seeded random init on the separable set, timed."""
    from hpa.reward.train_rm import run_train_rm

    cfg = make_config(root, f"{out}/separable", steps=SEPARABLE_STEPS, extra=SEPARABLE_OPTIM)
    start = time.time()
    final = run_train_rm(cfg, groups=groups)
    return {"final": final, "train_seconds": time.time() - start, "seed": cfg.trainer.seed,
            "eval_fraction": cfg.reward.training.eval_fraction}


def tp1_worker(groups, root, out, separable_root, varied_root):
    from hpa.distributed import set_seed
    from hpa.models import build_reward as build_reward_model
    from hpa.reward.model import write_reward_model_info
    from hpa.reward.train_rm import run_train_rm
    from hpa.models.weights import save_model_weights

    cfg = make_config(root, f"{out}/tp1")
    set_seed(0)  # megatron's RNG tracker too: torch.manual_seed alone leaves the init run-dependent
    save_model_weights(build_reward_model(cfg.model, cfg.parallel, groups, num_heads=NUM_HEADS), f"{out}/init", groups)
    write_reward_model_info(f"{out}/init", num_heads=NUM_HEADS, model=cfg.model)
    save_model_weights(build_reward_model(cfg.model, cfg.parallel, groups, num_heads=1), f"{out}/k1", groups)

    cfg = make_config(root, f"{out}/tp1", init_path=f"{out}/init")
    start = time.time()
    final = run_train_rm(cfg, groups=groups)
    train_seconds = time.time() - start
    trained = f"{out}/tp1/reward_model"
    inputs = scoring_inputs(root)
    lines = [json.loads(line) for line in open(f"{out}/tp1/rm_metrics.jsonl")]
    first = {}  # the first step from the same start on rows of varied length, padded and packed
    for name, packing in (("padded_first", "false"), ("packed_first", "true")):
        with _scored_rows() as scored:  # what the held-out evaluation computed (it scores "rows")
            run_train_rm(make_config(varied_root, f"{out}/tp1_{name}", steps=1, init_path=f"{out}/init",
                                     extra=(f"trainer.sequence_packing={packing}",)), groups=groups)
        first[name] = {**_first_metrics_line(f"{out}/tp1_{name}"), "eval_scored": scored}
    return {"final": final, "lines": lines, "train_seconds": train_seconds,
            **first,
            "score": _score(groups, cfg, [trained], NUM_HEADS, inputs, shaped=True),
            "score_two_models": _score(groups, cfg, [trained, trained], NUM_HEADS, inputs),
            "score_k1": _score(groups, cfg, [f"{out}/k1"], 1, inputs),
            "separable": separable_run(groups, separable_root, out)}


def layout_worker(groups, root, out, tp, pp):
    from hpa.reward.train_rm import run_train_rm

    run_dir = f"{out}/tp{tp}_pp{pp}"
    cfg = make_config(root, run_dir, tp=tp, pp=pp, steps=1, init_path=f"{out}/init")
    final = run_train_rm(cfg, groups=groups)
    return {"final": final, "first": _first_metrics_line(run_dir),
            "score": _score(groups, cfg, [f"{out}/tp1/reward_model"], NUM_HEADS, scoring_inputs(root))}


def two_rank_worker(groups, root, out):
    """tp2_pp1_dp1, then the same two processes re-initialised as tp1_pp2_dp1 (saves a spawn)."""
    from hpa.config.schema import ParallelConfig
    from hpa.distributed import LaunchEnv, initialize

    tp2 = layout_worker(groups, root, out, 2, 1)
    pp_groups = initialize(ParallelConfig(pipeline_model_parallel_size=2, backend="gloo"),
                           launch=LaunchEnv(rank=groups.rank, world_size=groups.world_size, local_rank=groups.rank,
                                            master_addr="127.0.0.1", master_port=0, launcher="torchrun"))
    return {"tp2": tp2, "pp2": layout_worker(pp_groups, root, out, 1, 2)}


def results() -> dict:
    """Run the pipeline once per session; returns the per-layout results and the data root."""
    if not _CACHE:
        tmp = tempfile.mkdtemp(prefix="hpa_rm_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        root, out, separable_root = f"{tmp}/data", f"{tmp}/runs", f"{tmp}/separable_data"
        varied_root = f"{tmp}/varied_data"
        make_data(root)
        make_separable_data(separable_root, root)
        make_varied_data(varied_root, root)
        _CACHE["root"], _CACHE["out"], _CACHE["separable_root"] = root, out, separable_root
        _CACHE["tp1"] = run_ranks(tp1_worker, args=(root, out, separable_root, varied_root))[0]
        two = run_ranks(two_rank_worker, tp=2, args=(root, out))
        _CACHE["tp2"], _CACHE["pp2"] = [r["tp2"] for r in two], [r["pp2"] for r in two]
    return _CACHE
