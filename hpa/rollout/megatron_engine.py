"""Native rollout engine: incremental decoding on the policy GPTModel as it is sharded for training.

Three KV-cache modes (``kv_cache=``):

- ``"hpa"`` (default): ``hpa.rollout.kv_cache.CachedDecoder`` walks the GPTModel's own modules with
  a cache of keys rotated once, when written, and SDPA attention over it (see that module for why
  megatron's static context is not the default). Falls back to ``"megatron"`` for architectures it
  does not implement, and says why.
- ``"megatron"``: megatron-core's ``StaticInferenceContext`` passed as ``inference_context=`` to
  ``GPTModel.forward``. Its attention layers allocate per-layer key/value buffers
  ``[max_seq, b, groups/tp, head_dim]`` on the prefill call, append each step's keys and values at
  ``sequence_len_offset`` and re-apply RoPE to the whole cached prefix; the last stage returns only
  the last position's logits, gathered over TP (``runtime_gather_output``), ``[b, 1, v_padded]``.
- ``"none"``: recompute the whole sequence every step (same mask, no cache): slow, for checking.

Layout of one ``generate`` call (``b = prompts · n`` rows, ``p`` = longest prompt):

- Prompts are left-padded to ``p``; step 0 (prefill) runs ``[b, p]``, every later step ``[b, 1]``.
- Attention mask: megatron's local ``DotProductAttention`` uses a given ``attention_mask`` *instead of*
  its causal mask (``FusedScaleMaskSoftmax`` only builds the causal mask when the mask is None), so
  the engine passes the full ``causal | padded key`` mask ``[b, 1, s_q, s_k]`` (True = masked).
  Masked scores become -10000 and get exactly zero weight in fp32.
- RoPE rotates by the position in the padded row (megatron ignores ``position_ids`` for RoPE); RoPE is
  relative, so a left shift changes attention scores only by rounding.
- TP: every TP rank of the last stage holds the same gathered ``[b, v]`` logits; TP rank 0 samples
  (``hpa.rollout.sampling``, generator seeded with ``SamplingParams.seed``), broadcasts over the TP
  group, and the last stage broadcasts over the PP group, so every rank feeds the same token.
- PP: each step the stages hand ``[s_q, b, h]`` activations forward with point-to-point send/recv.
- A row stops on EOS, a stop id or ``max_new_tokens``; finished rows are fed padding (masked, never
  attended to by other rows) until every row has stopped.

Decode modes (``decode=``; the ``"hpa"`` cache at TP 1 and PP 1 only, the others decode eagerly):

- ``"eager"``: every step is a forward of ``[b, 1]`` over the cache prefix, one launch per op: on a GPU
  the host is the bottleneck (about 25 ms per step for 24 layers at any batch on an H100).
- ``"static"``: the rows are padded up to a power-of-two bucket and the cache slots to a multiple of
  ``SLOT_BLOCK``; after an eager prefill, each step is ``CachedDecoder.decode_step`` with those fixed shapes,
  its position a device tensor (``kv_cache.StaticDecodeStep``). The loop reads the device only to check
  whether every row has finished, every ``FINISHED_CHECK_EVERY`` steps.
- ``"graph"``: ``"static"`` with the step captured in a CUDA graph (``hpa.rollout.cuda_graph.CUDAGraphWrapper``)
  once per bucket for the run and replayed per token. The graph reads the parameters where they are, so the
  optimizer's in-place updates need no new capture; ``sync_weights`` and ``sleep`` keep the buckets (their
  caches stay allocated between rollouts), and a bucket captures again only when a parameter got new storage.
  One bucket is kept per row count: a request runs in the held bucket of its rows when that has enough slots
  (``bucket_for``), else a new bucket with its slots replaces it, so prompts of varying length hold one
  cache per row count (``hpa plan`` counts the rollout's).
- ``"auto"`` (default): ``"graph"`` on CUDA where it applies, else ``"eager"``; a capture that fails
  logs a warning and the engine decodes eagerly from then on. ``decoded`` says which decode the last
  ``generate`` ran, ``captures`` how many captures the engine made.

``generate`` drives one decoder interface (``_Decoding``: ``prefill``, then ``step`` per token), eager over
the engine's KV cache or static over a bucket's (with the graph wrapper, which replays or falls through).

Sampling runs after the step, eagerly and on the real rows only, so a bucket's padding rows change
neither the tokens nor the random stream.

Partial rollouts (``resume``, ``rollout.partial``): ``stop`` is read before every decode step; when it says so the
request comes back as a ``PartialRollout``: every row (finished ones too) with its tokens, mask and log-probs of
the ``j`` steps done, and the sampling generator's state. ``resume`` continues it, possibly with new weights: the
same left-padded layout, one prefill of ``[0, p + j)`` (the prompts and the ``j`` tokens, through the current
weights: their keys and values are recomputed, so every later token is sampled by the current model alone), then
steps ``j .. max_new_tokens - 1``. The generator continues from the saved state (``torch.Generator.set_state``; a
fresh request seeds ``SamplingParams.seed``), and a step draws its noise for all rows, so a continued row draws the
noise the uninterrupted call would at that step. With the same weights the continuation is the uninterrupted call
but for rounding: the prefill of ``j`` response tokens at once does different matmul shapes than ``j`` one-token
steps (exactly equal in the ``"none"`` mode, which recomputes every position every step).

Limits: in the ``"megatron"`` and ``"none"`` modes Transformer Engine attention drops
``attention_mask`` under a causal mask type, so with the TE spec prompts of different lengths are
refused there (the ``"hpa"`` mode masks padding itself); sequence parallelism is refused (a decode
step has one position). The batch comes back on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple, Union

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpa.distributed.groups import ParallelGroups
from hpa.models.builders import compute_device
from hpa.models.heads import unwrap

from . import cuda_graph
from .base import (FINISH_LENGTH, FINISH_STOP, GenerationStopped, PartialRollout, RolloutBatch, RolloutEngine,
                   SamplingParams, TokenizerInfo, prompt_token_lists)
from .kv_cache import CachedDecoder, StaticDecodeStep, unsupported_reason
from .sampling import sample_tokens


logger = logging.getLogger(__name__)

KV_CACHE_MODES = ("hpa", "megatron", "none")
DECODE_MODES = ("auto", "eager", "static", "graph")
FINISHED_CHECK_EVERY = 8  # static decode: steps between the host reads of "has every row finished"
SLOT_BLOCK = 128  # static decode: cache slots are a multiple of this (or the model's context)


def row_bucket(n: int) -> int:
    """The power of two at or above ``n``: the rows of a static decode step."""
    return 1 << (n - 1).bit_length()


def slot_bucket(n: int, max_sequence_length: int) -> int:
    """``n`` rounded up to a multiple of ``SLOT_BLOCK``, at most ``max_sequence_length``: the cache slots."""
    return min(-(-n // SLOT_BLOCK) * SLOT_BLOCK, max_sequence_length)


def bucket_for(buckets, rows: int, slots: int) -> Tuple[int, int]:
    """The ``(rows, slots)`` bucket a decode of ``rows`` rows and ``slots`` slots runs in: the existing bucket of
    those rows when it has at least ``slots`` slots (its extra slots stay masked), else ``(rows, slots)``, new.
    One bucket per row count is kept (the engine drops the shorter one when a longer request comes): prompts of
    varying length then hold one cache per row count, not one per length, and capture again only when a
    request is longer than any before it."""
    held = [k for k in buckets if k[0] == rows and k[1] >= slots]
    return min(held, key=lambda k: k[1]) if held else (rows, slots)


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _group_src(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def attention_mask(key_valid: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Causal + padding mask for queries at positions ``[start, end)`` over keys ``[0, end)``.

    Args:
        key_valid: ``[b, >= end]`` bool, True where a key position holds a real token.

    Returns:
        ``[b, 1, end - start, end]`` bool, True = masked (megatron's convention).
    """
    device = key_valid.device
    q = torch.arange(start, end, device=device).unsqueeze(1)  # [s_q, 1]
    k = torch.arange(end, device=device).unsqueeze(0)  # [1, s_k]
    causal = k > q  # [s_q, s_k]
    padded = ~key_valid[:, :end]  # [b, s_k]
    return causal.unsqueeze(0).unsqueeze(0) | padded.unsqueeze(1).unsqueeze(2)


def _attention_honours_masks(module) -> bool:
    """Whether every layer's core attention is megatron's local ``DotProductAttention``, which uses a
    given ``attention_mask`` in place of its causal mask (TE's ignores it under a causal mask type)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m for name, m in module.named_modules() if name.endswith("core_attention")]
    return all(isinstance(m, DotProductAttention) for m in cores)


class MegatronRolloutEngine(RolloutEngine):
    """Samples from the training policy in place (no weight copy, so ``sync_weights`` is a no-op).

    Args:
        model: the policy GPTModel (possibly DDP-wrapped), sharded as for training.
        groups: its ``ParallelGroups``; ``generate`` is collective over the TP×PP model-parallel
            group, and every DP rank samples its own prompts.
        tokenizer_info: vocab size, EOS and pad ids.
        kv_cache: ``"hpa"`` (default), ``"megatron"`` or ``"none"`` (see the module docstring).
        decode: ``"auto"`` (default), ``"eager"``, ``"static"`` or ``"graph"`` (see the module docstring).
        compile_decode: ``torch.compile`` the static decode step before it runs and is captured
            (``kv_cache.StaticDecodeStep``); None (default): on CUDA (static and graph decode), off on CPU unless
            asked for; ignored by eager decode.
    """

    name = "megatron"
    has_async_worker = True
    can_resume = True

    def __init__(self, model, groups: ParallelGroups, tokenizer_info: TokenizerInfo, *, kv_cache: str = "hpa",
                 decode: str = "auto", compile_decode: Optional[bool] = None):
        self.model = model
        self.module = unwrap(model)
        self.groups = groups
        self.device = compute_device(groups)  # the parameters' (groups.device but in the lazy-device test mode)
        self.tokenizer_info = tokenizer_info
        self.config = self.module.config
        if self.config.sequence_parallel:
            raise ValueError("the native rollout engine decodes one token per step and cannot split it over "
                             "the sequence: set parallel.sequence_parallel=false or rollout.engine=vllm")
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {kv_cache!r}")
        if kv_cache == "hpa":
            reason = unsupported_reason(self.module)
            if reason is not None:
                logger.warning("native rollout engine: hpa's KV-cache decode does not implement %s; "
                               "using megatron's StaticInferenceContext instead", reason)
                kv_cache = "megatron"
        self.kv_cache = kv_cache
        self.max_sequence_length = self.module.max_sequence_length
        self.masks_padding = kv_cache == "hpa" or _attention_honours_masks(self.module)
        self.decode = self._decode_mode(decode)
        self._graph_by_default = decode == "auto" and self.decode == "graph"  # a failed capture falls back
        if compile_decode is None:
            compile_decode = self.device.type == "cuda"  # static and graph decode alike: a graph equals its step
        self.compile_decode = compile_decode and self.decode != "eager"
        self._steps = {}  # (rows, slots) -> StaticDecodeStep, kept for the run
        self.decoded = None  # the decode the last generate ran: "eager", "static" or "graph"
        self._reports_decode = self.decode != "eager"

    def _decode_mode(self, decode: str) -> str:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        g = self.groups
        why_not = ("it needs kv_cache='hpa'" if self.kv_cache != "hpa" else
                   "it runs at tensor and pipeline parallel size 1" if (g.tensor_model_parallel_size,
                                                                         g.pipeline_model_parallel_size) != (1, 1)
                   else None)
        cuda = cuda_graph.GRAPHS.available(self.device)
        if decode == "auto":
            return "graph" if why_not is None and cuda else "eager"
        if decode in ("static", "graph") and why_not is not None:
            raise ValueError(f"{decode} decode: {why_not}; set rollout.cuda_graphs=false")
        if decode == "graph" and not cuda:
            raise ValueError(f"graph decode needs the parameters on CUDA, they are on {self.device}; "
                             f"set rollout.cuda_graphs=false")
        return decode

    def detached_copy(self) -> "MegatronRolloutEngine":
        """An engine like this one over its own deep copy of the module (weights only, no grads), for a
        ``RolloutWorker`` that samples while the trainer updates this one's weights."""
        import copy

        module = copy.deepcopy(self.module, memo=_shared_objects(self.module))
        for param in module.parameters():
            param.requires_grad_(False)
            param.grad = None
        engine = copy.copy(self)
        engine.model = engine.module = module
        engine.config = module.config
        engine._steps = {}  # a graph reads fixed addresses: the copy captures its own
        engine.decoded = None
        return engine

    def sync_weights(self, *args, **kwargs) -> None:
        """The weights are used in place (the optimizer writes them where a captured graph reads them)."""

    def sleep(self) -> None:
        """Nothing to free: the buckets' caches and graphs stay, so the next rollout replays without a capture
        (a graph reads fixed addresses; freeing them would mean capturing again, with its synchronisations)."""

    def decode_metrics(self) -> dict:
        """Which decode the last ``generate`` ran and the captures so far, where a static or graph decode was
        asked for (``"auto"`` on CUDA included; nothing on an engine that decodes eagerly from the start):
        ``rollout/decode_graph`` (1 graph, 0 not: a failed ``"auto"`` capture), ``rollout/graph_captures``
        and ``rollout/decode_buckets`` (the buckets used, each captured once while the parameters stay put); with
        ``compile_decode``, ``rollout/decode_compiled`` (1: every bucket's step compiled, 0: a compilation failed
        and the step runs uncompiled)."""
        if not self._reports_decode:
            return {}
        metrics = {"rollout/decode_graph": float(self.decoded == "graph"),
                   "rollout/graph_captures": float(self.captures), "rollout/decode_buckets": float(len(self._steps))}
        if self.compile_decode:
            metrics["rollout/decode_compiled"] = float(all(s.compiled is not False for s in self._steps.values()))
        return metrics

    @property
    def captures(self) -> int:
        """CUDA-graph captures so far (one per bucket while the parameters keep their storage)."""
        return sum(step.captures for step in self._steps.values())

    def _static_step(self, rows: int, slots: int):
        """The ``StaticDecodeStep`` of a bucket, built once, its graph captured again only when a parameter's
        storage moved (see the module docstring); None when an ``"auto"`` capture failed."""
        key = bucket_for(self._steps, rows, slots)
        if key not in self._steps:  # a longer request than any before at these rows: the shorter buckets go
            for shorter in [k for k in self._steps if k[0] == rows]:
                del self._steps[shorter]
            self._steps[key] = StaticDecodeStep(self.module, rows, slots, capture=self.decode == "graph",
                                                compile=self.compile_decode)
        step = self._steps[key]
        try:
            step.step.ready()
        except RuntimeError as err:
            if not self._graph_by_default:
                raise
            logger.warning("native rollout engine: capturing the decode step in a CUDA graph failed (%s); "
                           "decoding eagerly from now on (rollout.cuda_graphs=false skips the attempt)", err)
            self.decode = "eager"
            self._steps.clear()
            return None
        return step

    def _decoding(self, b: int, total: int) -> "_Decoding":
        """The decoder of one ``generate`` call of ``b`` rows and ``total`` positions (``self.decoded`` says
        which)."""
        static = None
        if self.decode != "eager":
            static = self._static_step(row_bucket(b), slot_bucket(total, self.max_sequence_length))
        self.decoded = self.decode
        if static is not None:
            return _StaticDecoding(self, static, total)
        return _EagerDecoding(self, b, total)

    def _check_request(self, rows: List[List[int]], r_max: int) -> int:
        """The longest prompt, after checking the request fits the model."""
        p = max(len(x) for x in rows)
        if p + r_max > self.max_sequence_length:
            raise ValueError(f"longest prompt ({p}) + max_new_tokens ({r_max}) = {p + r_max} exceeds the model's "
                             f"max_sequence_length {self.max_sequence_length}; lower rollout.max_new_tokens "
                             f"or data.max_prompt_length")
        if not self.masks_padding and len({len(x) for x in rows}) > 1:
            raise NotImplementedError(
                "prompts of different lengths need a padding mask, which this model's attention ignores "
                "(Transformer Engine attention with a causal mask type drops attention_mask); use "
                "model.transformer_impl=local, rollout.engine=vllm, or equal-length prompt batches")
        return p

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        return self.resume(PartialRollout.start(prompts, params))

    @torch.no_grad()
    def resume(self, partial: PartialRollout, *,
               stop: Optional[Callable[[], bool]] = None) -> Union[RolloutBatch, PartialRollout]:
        """Continue ``partial`` with the current weights (see "Partial rollouts" in the module docstring).

        Args:
            partial: the rows so far (``PartialRollout.start`` for a new request).
            stop: read before every decode step (OR-ed over the model-parallel ranks); True stops there.

        Returns:
            The finished ``RolloutBatch``, or the rows so far as a ``PartialRollout`` when ``stop`` said so.
        """
        params, rows = partial.params, partial.rows
        p = self._check_request(rows, params.max_new_tokens)
        was_training = self.module.training
        self.module.eval()  # before a graph is captured
        try:
            decoding = self._decoding(len(rows), p + params.max_new_tokens)
            state = _DecodeState.start(decoding, rows, p, params, self.tokenizer_info, self.device, partial)
            generator = None
            if not params.greedy:
                generator = torch.Generator(device=self.device)
                if partial.generator_state is None:
                    generator.manual_seed(int(params.seed))
                else:
                    generator.set_state(partial.generator_state)
            stopped = self._decode(decoding, state, params, generator, stop)
        finally:
            self.module.set_input_tensor(None)
            self.module.train(was_training)
        if stopped:
            return state.partial(partial, None if generator is None else generator.get_state())
        return state.batch(partial.group_ids, self.tokenizer_info.pad_token_id)

    def _decode(self, decoding: "_Decoding", state: "_DecodeState", params: SamplingParams,
                generator: Optional[torch.Generator], stop: Optional[Callable[[], bool]]) -> bool:
        """Prefill the prompts and the steps done, then one step per token until every row stopped (checked every
        ``decoding.check_every``); True when ``stop`` ended it first."""
        r_max, p, b, first = params.max_new_tokens, state.p, state.b, state.steps
        if first > 0 and bool(state.finished.all()):
            return False
        for step in range(first, r_max):
            if self.should_stop is not None and self.should_stop():
                raise GenerationStopped(f"generation stopped after {step} of {r_max} decode steps")
            if stop is not None and self._agreed(bool(stop())):
                return True
            end = p + step
            logits = decoding.prefill(state, end) if step == first else decoding.step(state, end)  # [b_pad, v]
            new_tokens, new_log_probs = self._sample_and_broadcast(
                logits[:b] if logits is not None else None, params, generator, b)  # the real rows only
            state.append(step, new_tokens, new_log_probs)
            if state.steps % decoding.check_every == 0 and bool(state.finished.all()):
                break
        return False

    def _agreed(self, flag: bool) -> bool:
        """``flag`` OR-ed over the model-parallel (TP × PP) ranks, which must all stop at the same step."""
        g = self.groups
        if _group_size(g.tp_group) == 1 and _group_size(g.pp_group) == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        for group in (g.tp_group, g.pp_group):
            if _group_size(group) > 1:
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())

    # ----------------------------------------------------------------------------------------------
    def _new_context(self, batch_size: int, max_sequence_length: int):
        if self.kv_cache == "hpa":
            return CachedDecoder(self.module, batch_size, max_sequence_length)
        if self.kv_cache == "megatron":
            from megatron.core.inference.contexts import StaticInferenceContext

            return StaticInferenceContext(batch_size, max_sequence_length)
        return None

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_valid: torch.Tensor,
                 start: int, end: int, context) -> Optional[torch.Tensor]:
        """One pipelined forward of positions ``[start, end)`` (``input_ids`` ``[b, s_q]``); the last
        stage returns ``[b, v_padded]`` logits of the last position (gathered over TP), others None."""
        g = self.groups
        b, s_q = input_ids.shape
        hidden = None
        if not g.is_first_stage:
            hidden = torch.empty((s_q, b, self.config.hidden_size), dtype=self.config.pipeline_dtype,
                                 device=self.device)  # [s_q, b, h]
            dist.recv(hidden, src=_group_src(g.pp_group, g.pp_rank - 1), group=g.pp_group)
        if self.kv_cache == "hpa":
            out = context.forward(input_ids, hidden, start, end, key_valid)
        else:
            if hidden is not None:
                self.module.set_input_tensor(hidden)
            mask = attention_mask(key_valid, start, end)
            if context is not None:
                out = self.module(input_ids, position_ids, mask, inference_context=context, runtime_gather_output=True)
            else:
                out = self.module(input_ids, position_ids, mask)
        if not g.is_last_stage:
            dist.send(out.contiguous(), dst=_group_src(g.pp_group, g.pp_rank + 1), group=g.pp_group)
            return None
        if self.kv_cache == "hpa":
            return out  # [b, v_padded]
        if context is not None:
            return out[:, -1, :]  # [b, v_padded]
        last = out[:, -1, :].contiguous()  # [b, v/tp]
        if _group_size(g.tp_group) > 1:
            parts = [torch.empty_like(last) for _ in range(_group_size(g.tp_group))]
            dist.all_gather(parts, last, group=g.tp_group)
            last = torch.cat(parts, dim=-1)
        return last  # [b, v_padded]

    def _sample_and_broadcast(self, logits: Optional[torch.Tensor], params: SamplingParams,
                              generator: Optional[torch.Generator], b: int):
        """TP rank 0 of the last stage samples; tokens and log-probs reach every TP and PP rank."""
        g = self.groups
        packed = torch.empty((2, b), dtype=torch.float64, device=self.device)  # [token; log-prob]
        if g.is_last_stage:
            if g.tp_rank == 0:
                tok, logp = sample_tokens(logits, temperature=params.temperature, top_k=params.top_k,
                                          top_p=params.top_p, generator=generator,
                                          vocab_size=self.tokenizer_info.vocab_size)
                packed[0], packed[1] = tok.double(), logp.double()
            if _group_size(g.tp_group) > 1:
                dist.broadcast(packed, src=_group_src(g.tp_group, 0), group=g.tp_group)
        if _group_size(g.pp_group) > 1:
            dist.broadcast(packed, src=g.last_stage_global_rank(), group=g.pp_group)
        return packed[0].long(), packed[1].float()


class _Decoding:
    """The decoder interface ``generate`` drives: ``prefill`` the prompts, then ``step`` one token at a time.

    Attributes:
        rows: rows decoded (the request's, or its bucket's: the extra rows are padding, finished from the start).
        key_valid: ``[rows, p + r]`` bool, True where a position holds a real token (the steps read it).
        check_every: steps between the host's reads of "has every row finished".
    """

    rows: int
    key_valid: torch.Tensor
    check_every: int

    def prefill(self, state: "_DecodeState", end: int) -> Optional[torch.Tensor]:
        """``[rows, v_padded]`` logits of position ``end - 1``, positions ``[0, end)`` run at once: the prompts and,
        when a partial rollout continues, the response tokens it had (None off the last stage)."""
        raise NotImplementedError

    def step(self, state: "_DecodeState", end: int) -> Optional[torch.Tensor]:
        """``[rows, v_padded]`` logits of position ``end - 1``, whose token ``state.tokens`` holds."""
        raise NotImplementedError


class _EagerDecoding(_Decoding):
    """Every step a forward through the engine's KV cache (``kv_cache``), one launch per op."""

    def __init__(self, engine: MegatronRolloutEngine, b: int, total: int):
        self.engine, self.rows, self.check_every = engine, b, 1
        self.key_valid = torch.zeros((b, total), dtype=torch.bool, device=engine.device)  # [b, p + r]
        self.context = engine._new_context(b, total)

    def prefill(self, state, end):
        return self._run(state, 0, end)

    def step(self, state, end):
        return self._run(state, 0 if self.context is None else end - 1, end)  # no cache: the whole sequence

    def _run(self, state, start: int, end: int):
        logits = self.engine._forward(state.tokens[:, start:end], state.positions[:, start:end], self.key_valid,
                                      start, end, self.context)
        if self.engine.kv_cache == "megatron":
            self.context.increment_sequence_len_offset(end - start)
            self.context.enable_decode_mode()
        return logits


class _StaticDecoding(_Decoding):
    """An eager prefill into a bucket's cache, then its static step (a CUDA graph's replay in ``"graph"``)."""

    def __init__(self, engine: MegatronRolloutEngine, static, total: int):
        self.engine, self.static = engine, static
        self.rows, self.check_every = static.key_valid.shape[0], FINISHED_CHECK_EVERY
        static.key_valid.zero_()
        self.key_valid = static.key_valid[:, :total]  # [b_pad, p + r], a view: the step reads it

    def prefill(self, state, end):
        return self.engine._forward(state.tokens[:, :end], state.positions[:, :end], self.key_valid, 0, end,
                                    self.static.decoder)

    def step(self, state, end):
        self.static.input_ids.copy_(state.tokens[:, end - 1:end])
        self.static.position.fill_(end - 1)
        return self.static()


class _DecodeState:
    """The rows of one ``generate`` call as they grow: tokens, valid positions, log-probs, which rows stopped."""

    @classmethod
    def start(cls, decoding: _Decoding, rows: List[List[int]], p: int, params: SamplingParams,
              info: TokenizerInfo, device: torch.device, partial: PartialRollout) -> "_DecodeState":
        self = cls()
        j = partial.steps
        self.b, self.p, self.steps, self.pad = len(rows), p, j, info.pad_token_id
        b_pad, total = decoding.key_valid.shape
        tokens = torch.full((b_pad, total), info.pad_token_id, dtype=torch.long)  # [b_pad, p + r], on the host
        valid = torch.zeros((b_pad, total), dtype=torch.bool)
        for i, seq in enumerate(rows):  # left-padded prompts
            tokens[i, p - len(seq):p] = torch.tensor(seq, dtype=torch.long)
            valid[i, p - len(seq):p] = True
        if j:  # the steps done, where they were decoded
            tokens[:self.b, p:p + j] = partial.response_ids.cpu()
            valid[:self.b, p:p + j] = partial.response_mask.cpu().bool()
        self.tokens = tokens.to(device)
        self.key_valid = decoding.key_valid
        self.key_valid.copy_(valid)
        self.positions = (self.key_valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [b_pad, p + r]; unused by RoPE
        self.log_probs = torch.zeros((b_pad, params.max_new_tokens), dtype=torch.float32, device=device)
        self.stopped = torch.zeros(b_pad, dtype=torch.bool, device=device)
        if j:  # a fresh request copies nothing more (the host reads of a generate call are counted)
            self.log_probs[:self.b, :j] = partial.log_probs.to(device)
            self.stopped[:self.b] = partial.stopped.to(device)
        self.finished = (torch.arange(b_pad, device=device) >= self.b) | self.stopped  # [b_pad]: + bucket padding
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {info.eos_token_id})
        self.stop_tensor = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        return self

    def append(self, step: int, new_tokens: torch.Tensor, new_log_probs: torch.Tensor) -> None:
        """Write the tokens sampled for the real rows ``[b]`` at position ``p + step``; stopped rows get padding."""
        b_pad = self.tokens.shape[0]
        if b_pad > self.b:
            new_tokens = F.pad(new_tokens, (0, b_pad - self.b), value=self.pad)
            new_log_probs = F.pad(new_log_probs, (0, b_pad - self.b))
        active = ~self.finished
        new_tokens = torch.where(active, new_tokens, torch.full_like(new_tokens, self.pad))
        self.tokens[:, self.p + step] = new_tokens
        self.key_valid[:, self.p + step] = active
        self.log_probs[:, step] = torch.where(active, new_log_probs, torch.zeros_like(new_log_probs))
        hit_stop = active & torch.isin(new_tokens, self.stop_tensor)
        self.stopped |= hit_stop
        self.finished |= hit_stop
        self.steps = step + 1

    def partial(self, before: PartialRollout, generator_state: Optional[torch.Tensor]) -> PartialRollout:
        """The real rows after ``self.steps`` steps, on the CPU, to continue ``before``'s request."""
        b, p, j = self.b, self.p, self.steps
        # copies: on the CPU ``.cpu()`` is the tensor itself, and a static bucket's ``key_valid`` is reused
        return dataclasses.replace(before, response_ids=self.tokens[:b, p:p + j].clone().cpu(),
                                   response_mask=self.key_valid[:b, p:p + j].clone().cpu(),
                                   log_probs=self.log_probs[:b, :j].clone().cpu(),
                                   stopped=self.stopped[:b].clone().cpu(), generator_state=generator_state)

    def batch(self, group_ids: torch.Tensor, pad_token_id: int) -> RolloutBatch:
        """The real rows on the CPU; the responses end at the last step any row was active in (steps after
        that, checked only every ``check_every`` steps, fed padding)."""
        b, p = self.b, self.p
        response_mask = self.key_valid[:b, p:p + self.steps].cpu()  # [b, r]
        active_steps = response_mask.any(dim=0).nonzero()
        steps = int(active_steps[-1]) + 1 if len(active_steps) else 0
        return RolloutBatch(prompt_ids=self.tokens[:b, :p].clone().cpu(),
                            prompt_mask=self.key_valid[:b, :p].long().cpu(),
                            response_ids=self.tokens[:b, p:p + steps].clone().cpu(),
                            response_mask=response_mask[:, :steps].float(),
                            log_probs=self.log_probs[:b, :steps].cpu(),
                            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in self.stopped[:b].tolist()],
                            group_ids=group_ids, pad_token_id=pad_token_id)


def _shared_objects(module: torch.nn.Module) -> dict:
    """A ``copy.deepcopy`` memo that keeps the process groups (not copyable) and the model configs shared."""
    memo, seen = {}, set()

    def visit(obj, depth: int) -> None:
        if id(obj) in seen or depth > 6 or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, dist.ProcessGroup) or type(obj).__name__.endswith("Config"):
            memo[id(obj)] = obj
            return
        if isinstance(obj, dict):
            values = obj.values()
        elif isinstance(obj, (list, tuple, set)):
            values = obj
        elif hasattr(obj, "__dict__"):
            values = vars(obj).values()
        else:
            return
        for value in list(values):
            visit(value, depth + 1)

    for sub in module.modules():
        for name, value in vars(sub).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                visit(value, 0)
    return memo


def build_megatron_engine(rollout_cfg, model, groups: ParallelGroups, tokenizer_info: TokenizerInfo,
                          **kwargs) -> MegatronRolloutEngine:
    """``ROLLOUT_ENGINES["megatron"]``; ``rollout.cuda_graphs=false`` decodes eagerly, ``rollout.compile_decode=false``
    captures the decode step uncompiled."""
    kwargs.setdefault("decode", "auto" if rollout_cfg.cuda_graphs else "eager")
    if not rollout_cfg.compile_decode:
        kwargs.setdefault("compile_decode", False)
    return MegatronRolloutEngine(model, groups, tokenizer_info, **kwargs)
