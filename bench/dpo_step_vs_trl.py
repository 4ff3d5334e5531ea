"""DPO training throughput: hpa's DPO path against TRL's ``DPOTrainer``, on CPU, fp32.

Usage::

    python bench/dpo_step_vs_trl.py [--steps N --warmup W --batch B --seq S --hidden H --layers L
                                     --vocab V --threads T] [--varied-lengths (below)]

Both sides train the same Llama-style architecture (RMSNorm, SwiGLU, RoPE, untied embeddings; random
weights, not equal across sides) on the same synthetic preference pairs, in the same order, with the
same batch (B pairs per optimizer step, one micro-batch), the same number of steps, sigmoid DPO with
beta 0.1, Adam lr 1e-6, gradient clipping at 1.0, and a reference forward every step (TRL's
``precompute_ref_log_probs=False``; hpa's trainer does so with ``data.cache_reference_log_probs=false``,
there one pair a reference micro-batch; by default it reads the values from its cache instead).

- hpa: ``hpa.distributed.initialize`` (TP1/PP1/DP1, gloo, one process), ``build_policy`` /
  ``build_reference`` from the ``ModelConfig``, megatron DDP + optimizer; one step is what
  ``phases.preference_micro_batches`` + ``phases.update_policy`` do with ``w_ppo = w_kl = 0``:
  ``forward.pair_sequence_log_probs`` (reference), ``objective.make_policy_loss`` through
  ``forward_backward`` (``capture_hidden=True`` as in the trainer), ``optimizer_step``,
  ``objective.step_metrics``.
- TRL: ``DPOTrainer`` with a ``LlamaForCausalLM`` of the same sizes and a local word-level tokenizer
  (one word per token id, so TRL's tokenisation gives exactly the ids hpa trains on; checked).

Timing: each side runs in its own spawned process with ``torch.set_num_threads(T)`` (and OMP/MKL set
to T); the two processes take turns, one step at a time (hpa then TRL, the order swapped every step),
so background load on a shared machine hits both alike and they never compete for the cores (each
side's untimed work, between steps and at teardown, also runs in its own turns). The
first ``--warmup`` steps are excluded. A step is timed from the reference forward to the end of the
optimizer step (TRL: ``on_step_begin`` to ``on_step_end``); batch collation is outside the
window on both sides. Tokens per step are counted the same way on both sides: the non-pad tokens of
the sequences the step trains on, i.e. prompt+chosen plus prompt+rejected for every pair (both
implementations run the prompt once per sequence); the counts of the two sides are checked equal.

Prints one JSON object: ``{"hpa_tokens_per_s", "trl_tokens_per_s", "ratio" (hpa / trl), "config",
"torch", "trl", ...}``.

``--varied-lengths``: pairs of varied length, each side in its fastest configuration
---------------------------------------------------------------------------------------

Usage::

    python bench/dpo_step_vs_trl.py --varied-lengths [--seq 512 --trl-config precompute --hpa-layout auto ...]

The default mode above gives both sides uniform lengths and a reference forward every step. This mode
asks what each side does with a real preference set's lengths when it runs as fast as it can on CPU.

- Lengths (``LENGTHS``, also in the JSON ``config``): for every pair, independently, the prompt length
  is log-normal with median 64 tokens and sigma 1.0 (in log space), rounded and clipped to
  ``[4, seq // 2]`` (a ``max_prompt_length`` of half the sequence); the chosen and the rejected
  response lengths (EOS included) are each log-normal with median 80 and sigma 0.9, clipped to
  ``[2, seq - prompt]`` (truncation at ``max_length = --seq``, which defaults to 512 in this mode).
  The parameters are chosen to resemble, not fitted to, HH-RLHF's and UltraFeedback's token counts
  (heavy-tailed, lengths varying 10x and more within a batch): the middle 80 % of prompts
  spans 18..230 tokens, of responses 25..253, and the tails reach the clip (the JSON's
  ``config.lengths`` reports the drawn min / median / p90 / max). The same pairs, in the same order,
  on both sides, as in the default mode.
- Reference log-probs once, before the timed steps, on both sides. hpa: as its trainer's reference
  cache (``hpa.trainer.reference_cache``, the default ``data.cache_reference_log_probs=true``)
  computes them, with ``phases.reference_pair_log_probs`` (one pair a reference micro-batch) over all
  pairs; a timed step attaches its pairs' cached values (``ref_seq_logp`` rows of its micro-batches)
  and runs the policy forward/backward, the optimizer step and the step
  metrics. TRL: ``precompute_ref_log_probs=True`` and no ``ref_model`` (TRL then computes them with
  the initial policy in ``DPOTrainer.__init__`` and keeps no reference model), so its timed step
  has no reference forward either.
- hpa's layout (``--hpa-layout``, JSON ``hpa_layout``): ``auto`` (the default) collates with
  ``hpa.engine.collate.pair_micro_batches(..., packed=True)`` when that function takes a ``packed``
  keyword (sequence packing; checked with ``inspect.signature``), else right-padded as today;
  ``padded`` / ``packed`` force one (``packed`` fails where it does not exist).
- TRL's configuration (``--trl-config``, JSON ``trl_config``): TRL 1.16 offers, for a CPU run, the
  reference's log-probs precomputed or a reference forward each step, and padding or padding-free.
  ``padding_free=True`` is not available: TRL 1.16's ``DPOTrainer`` warns that it is "temporarily
  unavailable after a refactor" and sets it back to ``False`` (the bench records the trainer's
  effective settings). The model side would allow it on CPU: HF Llama with SDPA, given
  ``position_ids`` that restart at 0 and no attention mask, builds a block-diagonal causal mask
  (``masking_utils.find_packed_sequence_indices``), so attention stays within each sequence (checked
  against separate forwards to 4e-7); but TRL does not send such batches. So TRL's fastest valid CPU
  configuration is ``precompute``: ``precompute_ref_log_probs=True``, ``padding_free=False``, SDPA,
  fp32, no gradient checkpointing, no ``pad_to_multiple_of`` (``"auto"`` pads only on Neuron), the
  batch right-padded to its longest sequence. ``ref-forward`` (``precompute_ref_log_probs=False``,
  a reference model and a reference forward every step, as the default mode) and ``padding-free``
  (``precompute`` plus ``padding_free=True``, which TRL turns off) can be measured with the flag.
  Not tried: ``group_by_length`` / length-sorted sampling (it changes which pairs share a step, and
  the bench keeps the order fixed on both sides), ``torch_compile`` (recompiles for each batch shape
  with varied lengths), Liger kernels (GPU only; deprecated in TRL 1.16).
- Timing as in the default mode, plus one untimed setup turn per side before the first step (hpa,
  then TRL): everything a side does before its first step (imports, model building, tokenisation,
  the reference log-probs, TRL's trainer set-up and first batch) runs in it, so neither side's
  precomputation overlaps the other side's steps.
- Pad share (JSON ``pad_share``) over the measured steps: TRL ``1 - sum(attention_mask) / numel`` of
  its padded batches; hpa ``1 - real tokens / tokens the model computed on`` (the elements of its
  micro-batches' ``input_ids``). Tokens per step are the non-pad tokens as in the default mode,
  checked equal on both sides.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from lockstep import Turn  # bench/lockstep.py (scripts run from bench/)

PAD, UNK, EOS = 0, 1, 2  # token ids; words "t3".."t{V-1}" are ids 3..V-1
BETA, LR, CLIP = 0.1, 1e-6, 1.0
DEFAULT_SEQ, VARIED_DEFAULT_SEQ = 128, 512
# --varied-lengths: log-normal token counts (median, sigma of the log), per pair, independently
LENGTHS = {"prompt": {"median": 64, "sigma": 1.0, "min": 4, "max": "seq // 2"},
           "response": {"median": 80, "sigma": 0.9, "min": 2, "max": "seq - prompt", "eos": "included"}}
TRL_CONFIGS = {  # --trl-config: name -> DPOConfig settings (a reference model is passed only without precompute)
    "precompute": {"precompute_ref_log_probs": True, "padding_free": False},
    "ref-forward": {"precompute_ref_log_probs": False, "padding_free": False},
    "padding-free": {"precompute_ref_log_probs": True, "padding_free": True},
}

Pair = Tuple[List[int], List[int], List[int]]  # prompt ids, chosen ids (EOS last), rejected ids (EOS last)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="measured optimizer steps per side")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    p.add_argument("--batch", type=int, default=8, help="preference pairs per step (one micro-batch)")
    p.add_argument("--seq", type=int, default=None,
                   help=f"longest prompt+response (tokens; default {DEFAULT_SEQ}, {VARIED_DEFAULT_SEQ} with "
                        "--varied-lengths)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=None, help="default hidden / 64")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--varied-lengths", action="store_true",
                   help="pairs of varied (log-normal) length, reference log-probs precomputed on both sides")
    p.add_argument("--trl-config", choices=sorted(TRL_CONFIGS), default=None,
                   help="with --varied-lengths: TRL's configuration (default: precompute, its fastest on CPU)")
    p.add_argument("--hpa-layout", choices=("auto", "padded", "packed"), default="auto",
                   help="with --varied-lengths: hpa's pair micro-batches (auto: packed where hpa has it)")
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = VARIED_DEFAULT_SEQ if args.varied_lengths else DEFAULT_SEQ
    if not args.varied_lengths and (args.trl_config is not None or args.hpa_layout != "auto"):
        p.error("--trl-config and --hpa-layout go with --varied-lengths")
    if args.varied_lengths and args.trl_config is None:
        args.trl_config = "precompute"
    if args.heads is None:
        args.heads = max(1, args.hidden // 64)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        p.error("--steps and --batch must be at least 1, --warmup at least 0")
    if args.seq < 8:
        p.error("--seq must be at least 8")
    if args.vocab < 16:
        p.error("--vocab must be at least 16")
    return args


def model_sizes(args) -> Dict[str, int]:
    ffn = -(-(8 * args.hidden // 3) // 64) * 64  # Llama's 8/3·h rounded up to a multiple of 64
    return {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
            "num_query_groups": args.heads, "ffn_hidden_size": ffn, "vocab_size": args.vocab,
            "max_sequence_length": args.seq}


def make_pairs(args) -> List[Pair]:
    """``(warmup + steps) · batch`` random pairs; prompt ``[s/4, s/2]``, each response up to the rest
    (with ``--varied-lengths``: ``make_varied_pairs``)."""
    if args.varied_lengths:
        return make_varied_pairs(args)
    rng = random.Random(args.seed)
    s = args.seq
    word = lambda: rng.randrange(3, args.vocab)  # noqa: E731
    pairs = []
    for _ in range((args.warmup + args.steps) * args.batch):
        p = rng.randint(s // 4, s // 2)
        prompt = [word() for _ in range(p)]
        chosen = [word() for _ in range(rng.randint(max(1, s // 8), s - p - 1))] + [EOS]
        rejected = [word() for _ in range(rng.randint(max(1, s // 8), s - p - 1))] + [EOS]
        pairs.append((prompt, chosen, rejected))
    return pairs


def _lognormal_length(rng: random.Random, spec: Dict, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(spec["median"]), spec["sigma"]))))


def make_varied_pairs(args) -> List[Pair]:
    """``(warmup + steps) · batch`` random pairs with lengths as ``LENGTHS`` states: prompt log-normal
    (median 64, sigma 1.0) in ``[4, seq // 2]``, each response (EOS last) log-normal (median 80, sigma
    0.9) in ``[2, seq - prompt]``."""
    rng = random.Random(args.seed)
    s = args.seq
    word = lambda: rng.randrange(3, args.vocab)  # noqa: E731
    pl, rl = LENGTHS["prompt"], LENGTHS["response"]
    pairs = []
    for _ in range((args.warmup + args.steps) * args.batch):
        p = _lognormal_length(rng, pl, pl["min"], s // 2)
        c = _lognormal_length(rng, rl, rl["min"], s - p)
        r = _lognormal_length(rng, rl, rl["min"], s - p)
        pairs.append(([word() for _ in range(p)], [word() for _ in range(c - 1)] + [EOS],
                      [word() for _ in range(r - 1)] + [EOS]))
    return pairs


def length_summary(pairs: List[Pair]) -> Dict[str, Dict[str, int]]:
    """min / median / p90 / max of the prompt, response and prompt+response lengths of ``pairs``."""
    def stats(xs: List[int]) -> Dict[str, int]:
        xs = sorted(xs)
        return {"min": xs[0], "median": xs[len(xs) // 2], "p90": xs[min(len(xs) - 1, (9 * len(xs)) // 10)],
                "max": xs[-1]}

    return {"prompt": stats([len(p) for p, _, _ in pairs]),
            "response": stats([len(x) for _, c, r in pairs for x in (c, r)]),
            "sequence": stats([len(p) + len(x) for p, c, r in pairs for x in (c, r)])}


def pair_tokens(pairs: List[Pair]) -> int:
    return sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------- hpa


def hpa_pair_micro_batches(examples, *, micro_batch_size: int, pad_id: int, layout: str = "auto"
                           ) -> Tuple[List[dict], str]:
    """hpa's pair micro-batches of ``examples`` and their layout, ``"packed"`` or ``"padded"``.

    ``layout="auto"`` packs where ``pair_micro_batches`` takes a ``packed`` keyword
    (hpa's sequence packing) and right-pads where it does not; ``"packed"`` / ``"padded"`` force one."""
    fn = _hpa_pair_micro_batches()
    can_pack = "packed" in inspect.signature(fn).parameters
    if layout == "packed" and not can_pack:
        raise RuntimeError("--hpa-layout packed: this hpa's pair_micro_batches has no `packed` keyword")
    if layout == "packed" or (layout == "auto" and can_pack):
        return fn(examples, micro_batch_size=micro_batch_size, pad_id=pad_id, packed=True), "packed"
    return fn(examples, micro_batch_size=micro_batch_size, pad_id=pad_id), "padded"


def _hpa_pair_micro_batches():
    """hpa's pair collation: ``hpa.engine.collate`` since 2026-11-27, ``hpa.trainer.micro_batches`` before."""
    try:
        from hpa.engine.collate import pair_micro_batches
    except ImportError:
        from hpa.trainer.micro_batches import pair_micro_batches
    return pair_micro_batches


def _attach_ref(mbs, per_pair, size: int) -> None:
    """Each pair micro-batch's rows of the reference's values: ``per_pair`` ``[B, 2]`` (chosen, rejected),
    ``size`` pairs a micro-batch (its chosen rows, then its rejected rows)."""
    for i, mb in enumerate(mbs):
        mb["ref_seq_logp"] = per_pair[i * size:(i + 1) * size].T.reshape(-1)


def run_hpa(args, turn: "Turn") -> Dict:
    if args.varied_lengths:
        turn.begin()  # the setup turn: everything before the first step, the reference log-probs included
    _set_threads(args.threads)
    import torch

    from hpa.config.algorithm import AlgorithmConfig
    from hpa.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from hpa.data.preferences import PreferenceExample
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.models import build_policy, build_reference
    from hpa.engine import forward
    from hpa.trainer import objective, phases
    from hpa.engine.optimizer import build_lr_scheduler, build_optimizer, wrap_ddp
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad

    total = args.warmup + args.steps
    model_cfg = ModelConfig(**model_sizes(args), make_vocab_size_divisible_by=128, params_dtype="float32",
                            transformer_impl="local")
    parallel = ParallelConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, backend="gloo")
    optim = OptimConfig(lr=LR, clip_grad=CLIP)
    algo = AlgorithmConfig()
    assert algo.dpo.loss == "sigmoid" and algo.dpo.beta == BETA
    weights = objective.StepWeights(w_ppo=0.0, w_dpo=1.0, w_kl=0.0, lambda_token=0.0, lambda_semantic=0.0,
                                 entropy_coef=0.0, reward_kl_coef=0.0)
    groups = initialize(parallel, seed=args.seed, launch=LaunchEnv(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single"))
    try:
        policy = build_policy(model_cfg, parallel, groups)
        reference = build_reference(model_cfg, parallel, groups)
        reference.load_state_dict(policy.state_dict())  # as HPATrainer: the reference is the initial policy
        policy = wrap_ddp(policy, parallel, groups)
        opt = build_optimizer(policy, optim, parallel, groups)
        sched = build_lr_scheduler(opt, optim, total)
        examples = [PreferenceExample(prompt_ids=p, chosen_ids=c, rejected_ids=r) for p, c, r in make_pairs(args)]
        ref_table, layout = None, "padded"
        if args.varied_lengths:  # as the trainer's reference cache: every pair's values once, one pair a micro-batch
            from hpa.engine.batching import Batching

            ctx = phases.StepContext(groups=groups, algorithm=None, trainer=None, vocab_size=model_cfg.vocab_size,
                                     batching=Batching(micro_batch_size=args.batch, pad_id=PAD), temperature=1.0,
                                     hidden_size=model_cfg.hidden_size)
            ref_table = phases.reference_pair_log_probs(examples, reference, ctx)  # [N, 2] (chosen, rejected)
            del reference
            turn.end()
        times, tokens, computed = [], [], []
        for step in range(total):
            turn.begin()
            batch = examples[step * args.batch:(step + 1) * args.batch]
            if ref_table is None:
                mbs = _hpa_pair_micro_batches()(batch, micro_batch_size=args.batch, pad_id=PAD)  # collation
            else:
                mbs, layout = hpa_pair_micro_batches(batch, micro_batch_size=args.batch, pad_id=PAD,
                                                     layout=args.hpa_layout)
            start = time.perf_counter()
            if ref_table is None:
                ref = forward.pair_sequence_log_probs(reference, mbs, groups, vocab_size=model_cfg.vocab_size)
                for mb, values in zip(mbs, ref.split([mb.num_rows for mb in mbs])):  # in the micro-batches' rows
                    mb["ref_seq_logp"] = values
            else:
                cached = ref_table[step * args.batch:(step + 1) * args.batch]  # [B, 2]
                _attach_ref(mbs, cached, args.batch)
            counts = objective.global_counts([], mbs, groups)
            loss_fn = objective.make_policy_loss(algo, weights, counts, groups, vocab_size=model_cfg.vocab_size,
                                              temperature=1.0)
            zero_grad(policy, opt)
            records = forward_backward(policy, mbs, loss_fn, groups, capture_hidden=True)
            optimizer_step(opt, sched)
            metrics = objective.step_metrics(records, groups)
            times.append(time.perf_counter() - start)
            # non-pad tokens of prompt+chosen and prompt+rejected, as TRL's attention_mask counts them
            tokens.append(sum(len(e.chosen_input_ids) + len(e.rejected_input_ids) for e in batch))
            computed.append(sum(mb["input_ids"].numel() for mb in mbs))  # what the model ran on, padding included
            turn.end()
        turn.begin()  # the finishing turn: teardown never overlaps the other side's steps
        return {"times": times, "tokens": tokens, "computed": computed, "layout": layout,
                "last_loss": metrics.get("dpo/loss"), "torch_threads": torch.get_num_threads()}
    finally:
        destroy()


# ---------------------------------------------------------------------------------------------- trl


def _tokenizer(vocab_size: int, out_dir: str):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<unk>": UNK, "</s>": EOS, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(out_dir)
    return PreTrainedTokenizerFast.from_pretrained(out_dir)


def _text(ids: List[int]) -> str:
    return " ".join("</s>" if i == EOS else f"t{i}" for i in ids)


def run_trl(args, turn: "Turn") -> Dict:
    if args.varied_lengths:
        turn.begin()  # the setup turn: up to the first step, the precomputed reference log-probs included
    _set_threads(args.threads)
    import copy

    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    sizes = model_sizes(args)
    pairs = make_pairs(args)
    total = args.warmup + args.steps
    settings = TRL_CONFIGS[args.trl_config if args.varied_lengths else "ref-forward"]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(args.vocab, os.path.join(tmp, "tokenizer"))
        # the response strings start with a space: TRL tokenises prompt + chosen as one string
        data = Dataset.from_list([{"prompt": _text(p), "chosen": " " + _text(c), "rejected": " " + _text(r)}
                                  for p, c, r in pairs])
        config = LlamaConfig(vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                             intermediate_size=sizes["ffn_hidden_size"], num_hidden_layers=sizes["num_layers"],
                             num_attention_heads=sizes["num_attention_heads"],
                             num_key_value_heads=sizes["num_query_groups"],
                             max_position_embeddings=sizes["max_sequence_length"], rms_norm_eps=1e-5,
                             rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                             pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
        model = LlamaForCausalLM(config).float()
        # precomputing, TRL takes the reference's log-probs from the initial policy and keeps no reference model
        ref_model = None if settings["precompute_ref_log_probs"] else copy.deepcopy(model)
        dpo_args = DPOConfig(
            output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=1, max_steps=total, learning_rate=LR, lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=CLIP, beta=BETA, loss_type=["sigmoid"],
            precompute_ref_log_probs=settings["precompute_ref_log_probs"], padding_free=settings["padding_free"],
            max_length=None, bf16=False, fp16=False,
            gradient_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no", eval_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=args.seed,
            train_sampling_strategy="sequential")
        times: List[float] = []
        tokens: List[int] = []
        numels: List[int] = []

        class Timer(TrainerCallback):
            """All of TRL's work between steps (logging, the next batch's collation) runs inside its
            own turn: a step's turn ends only after the next turn has begun; the last one's
            ``begin`` is the finishing turn, in which the trainer winds down."""

            def on_step_begin(self, *a, **k):
                if not times:
                    if args.varied_lengths:
                        turn.end()  # the setup turn, which ran TRL's train() up to here
                    turn.begin()
                self.start = time.perf_counter()

            def on_step_end(self, *a, **k):
                times.append(time.perf_counter() - self.start)
                turn.end()
                turn.begin()

        trainer = DPOTrainer(model=model, ref_model=ref_model, args=dpo_args, train_dataset=data,
                             processing_class=tokenizer, callbacks=[Timer()])
        # TRL's tokenisation must give exactly the ids hpa trains on
        ds = trainer.train_dataset
        for i in (0, len(ds) - 1):
            got = (ds[i]["prompt_ids"], ds[i]["chosen_ids"], ds[i]["rejected_ids"])
            if tuple(map(list, got)) != pairs[i]:
                raise RuntimeError(f"TRL tokenised pair {i} differently from the hpa side: {got} vs {pairs[i]}")
        collate = trainer.data_collator

        def counting_collator(examples):
            batch = collate(examples)
            tokens.append(int(batch["attention_mask"].sum()))
            numels.append(batch["attention_mask"].numel())
            return batch

        trainer.data_collator = counting_collator
        trainer.train()
        return {"times": times, "tokens": tokens[:len(times)], "computed": numels[:len(times)],
                "torch_threads": torch.get_num_threads(), "attn_implementation": model.config._attn_implementation,
                "effective": {"precompute_ref_log_probs": bool(trainer.precompute_ref_logps),
                              "padding_free": bool(trainer.padding_free),
                              "ref_model": trainer.ref_model is not None}}


# ---------------------------------------------------------------------------------------------- driver


def _child(side: str, argv: List[str], go, done, results) -> None:
    sys.stdout = sys.stderr  # TRL prints its train summary; the driver's JSON is the only stdout
    args = parse_args(argv)
    try:
        result = (run_hpa if side == "hpa" else run_trl)(args, Turn(go, done))
        results.put((side, "ok", result))
    except BaseException:
        import traceback

        results.put((side, "error", traceback.format_exc()))
        done.set()


def run_both(args, argv: List[str]) -> Dict[str, Dict]:
    """Both sides in their own spawned process; steps alternate hpa/trl (order swapped every step)."""
    import multiprocessing as mp

    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                      WANDB_DISABLED="true", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    events = {side: (ctx.Event(), ctx.Event()) for side in ("hpa", "trl")}
    procs = {side: ctx.Process(target=_child, args=(side, argv, *events[side], results), daemon=True)
             for side in events}
    for p in procs.values():
        p.start()
    out: Dict[str, Dict] = {}

    def collect(block: bool) -> None:
        while not results.empty() or block:
            side, status, value = results.get(timeout=600)
            if status != "ok":
                raise RuntimeError(f"the {side} side failed:\n{value}")
            out[side] = value
            block = False

    def take_turn(side: str, what) -> None:
        go, done = events[side]
        go.set()
        while not done.wait(timeout=5):
            if not procs[side].is_alive():
                collect(block=False)
                raise RuntimeError(f"the {side} side exited (code {procs[side].exitcode}) at step {what}")
        done.clear()
        collect(block=False)

    try:
        if args.varied_lengths:  # the setup turns (--varied-lengths), one side at a time
            for side in ("hpa", "trl"):
                take_turn(side, "setup")
        for step in range(args.warmup + args.steps):
            for side in (("hpa", "trl") if step % 2 == 0 else ("trl", "hpa")):
                take_turn(side, step)
        for side in ("hpa", "trl"):  # the finishing turns, one side at a time
            events[side][0].set()
            while side not in out:
                collect(block=True)
    finally:
        for p in procs.values():
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return out


def _throughput(result: Dict, warmup: int) -> Tuple[float, int, float]:
    times, tokens = result["times"][warmup:], result["tokens"][warmup:]
    return sum(tokens) / sum(times), sum(tokens), statistics.median(times)


def _pad_share(result: Dict, warmup: int) -> float:
    """1 - real tokens / tokens the model computed on, over the measured steps."""
    return 1.0 - sum(result["tokens"][warmup:]) / sum(result["computed"][warmup:])


def varied_output(args, hpa_result: Dict, trl_result: Dict, torch_version: str, trl_version: str) -> Dict:
    """The JSON of ``--varied-lengths``."""
    hpa_tps, tokens, hpa_med = _throughput(hpa_result, args.warmup)
    trl_tps, _, trl_med = _throughput(trl_result, args.warmup)
    settings = TRL_CONFIGS[args.trl_config]
    return {
        "hpa_tokens_per_s": round(hpa_tps, 1),
        "trl_tokens_per_s": round(trl_tps, 1),
        "ratio": round(hpa_tps / trl_tps, 3),
        "trl_config": {"name": args.trl_config, **settings, "effective": trl_result["effective"],
                       "attn_implementation": trl_result.get("attn_implementation")},
        "hpa_layout": hpa_result["layout"],
        "pad_share": {"hpa": round(_pad_share(hpa_result, args.warmup), 4),
                      "trl": round(_pad_share(trl_result, args.warmup), 4)},
        "config": {**model_sizes(args), "batch_pairs": args.batch, "max_seq": args.seq, "steps": args.steps,
                   "warmup_steps": args.warmup, "threads": args.threads, "dtype": "float32", "device": "cpu",
                   "dpo": f"sigmoid beta={BETA}", "varied_lengths": True,
                   "lengths": {"distribution": LENGTHS, "drawn": length_summary(make_pairs(args))},
                   "ref_log_probs": {"hpa": "cached before the timed steps (one pair a reference micro-batch)",
                                     "trl": "precomputed before the timed steps"
                                     if settings["precompute_ref_log_probs"] else "reference forward every step"},
                   "measured_tokens": tokens, "cpu_count": os.cpu_count()},
        "step_s_median": {"hpa": round(hpa_med, 4), "trl": round(trl_med, 4)},
        "step_s": {"hpa": [round(t, 3) for t in hpa_result["times"][args.warmup:]],
                   "trl": [round(t, 3) for t in trl_result["times"][args.warmup:]]},
        "computed_tokens": {"hpa": hpa_result["computed"][args.warmup:], "trl": trl_result["computed"][args.warmup:]},
        "torch": torch_version,
        "trl": trl_version,
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch
    import trl

    both = run_both(args, argv)
    hpa_result, trl_result = both["hpa"], both["trl"]
    total = args.warmup + args.steps
    for name, r in (("hpa", hpa_result), ("trl", trl_result)):
        if len(r["times"]) != total:
            raise RuntimeError(f"the {name} side ran {len(r['times'])} steps, expected {total}")
    if hpa_result["tokens"] != trl_result["tokens"]:
        raise RuntimeError(f"token counts differ: hpa {hpa_result['tokens']} vs trl {trl_result['tokens']}")
    hpa_tps, tokens, hpa_med = _throughput(hpa_result, args.warmup)
    trl_tps, _, trl_med = _throughput(trl_result, args.warmup)
    if args.varied_lengths:
        print(json.dumps(varied_output(args, hpa_result, trl_result, torch.__version__, trl.__version__)))
        return 0
    out = {
        "hpa_tokens_per_s": round(hpa_tps, 1),
        "trl_tokens_per_s": round(trl_tps, 1),
        "ratio": round(hpa_tps / trl_tps, 3),
        "config": {**model_sizes(args), "batch_pairs": args.batch, "max_seq": args.seq, "steps": args.steps,
                   "warmup_steps": args.warmup, "threads": args.threads, "dtype": "float32", "device": "cpu",
                   "dpo": f"sigmoid beta={BETA}", "ref_forward_every_step": True,
                   "measured_tokens": tokens, "cpu_count": os.cpu_count(),
                   "trl_attn_implementation": trl_result.get("attn_implementation")},
        "step_s_median": {"hpa": round(hpa_med, 4), "trl": round(trl_med, 4)},
        "step_s": {"hpa": [round(t, 3) for t in hpa_result["times"][args.warmup:]],
                   "trl": [round(t, 3) for t in trl_result["times"][args.warmup:]]},
        "torch": torch.__version__,
        "trl": trl.__version__,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
