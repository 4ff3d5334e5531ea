"""vLLM rollout engine (``rollout.engine: vllm``; GPU only, vllm imported when the engine is built).

Colocated layout (as verl does it): every trainer rank builds its own ``vllm.LLM`` with
``distributed_executor_backend="external_launcher"``, so vLLM reuses the already initialised
torch.distributed world and groups each ``rollout.vllm_tensor_parallel_size`` consecutive ranks into
one vLLM TP group. Megatron's TP ranks are consecutive, so with ``vllm_tensor_parallel_size`` equal to
the trainer's TP every vLLM group sees one DP rank's prompts. The model runs in this process, and
``sync_weights`` loads the Megatron weights into it in place, tensor by tensor, through the model's
own ``load_weights`` (which shards them for vLLM's TP).

Log-probs: vLLM is built with ``logprobs_mode="processed_logprobs"`` where the installed vLLM knows
the option, i.e. log-probs of the distribution after temperature *and* top-k/top-p. Without top-k/top-p
this is ``log softmax(logits / T)``, the convention of ``hpa.rollout.base``; with them vLLM's numbers
are renormalised over the kept tokens (the native engine's are not). Older vLLM returns raw (T = 1)
log-probs. Either way the trainer recomputes old log-probs with its own forward.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Dict, List, Optional

import torch

from hpa.distributed.groups import ParallelGroups

from .base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, RolloutEngine, SamplingParams, TokenizerInfo
from .base import prompt_token_lists

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
# Where the in-process model lives, across vLLM versions (V1 in-proc engine core, V1/V0 executors).
_MODEL_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
    ("llm_engine", "engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner",
     "model"),
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def _import_vllm():
    if not torch.cuda.is_available():
        raise RuntimeError("rollout.engine=vllm needs a CUDA GPU; use rollout.engine=megatron on CPU")
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError("rollout.engine=vllm needs the vllm package (pip install hpa[gpu]); "
                           "or set rollout.engine=megatron") from exc
    return vllm


def _engine_arg_names() -> set:
    """Names ``vllm.LLM`` accepts through ``EngineArgs`` (empty if vLLM's internals moved)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        return {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:  # pass only the universal arguments
        return set()


def _walk(obj, path):
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


class VLLMRolloutEngine(RolloutEngine):
    """Generation with vLLM on weights synced from the Megatron policy.

    Args:
        model: the Megatron policy (source of ``sync_weights``).
        groups: the policy's ``ParallelGroups``.
        tokenizer_info: vocab size, EOS and pad ids.
        model_cfg: the policy's ``ModelConfig`` (for ``hf_tensors_from_megatron``).
        hf_model_path: a directory with the HF ``config.json`` of the same architecture (e.g.
            ``model.policy_path`` or an ``hpa convert`` export); with ``load_format="dummy"`` its
            weights are not read and ``sync_weights`` must run before the first ``generate``.
        tensor_parallel_size: vLLM's TP (``rollout.vllm_tensor_parallel_size``).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache).
        seed: vLLM's global seed.
        max_model_len: prompt + response limit (default: ``model_cfg.max_sequence_length``).
        dtype: vLLM dtype (default: the policy's params dtype).
        load_format: ``"dummy"`` (weights come from ``sync_weights``) or ``"auto"``.
        enable_sleep_mode: needed for ``sleep``/``wake``.
        llm_kwargs: further ``vllm.LLM`` arguments (e.g. ``enforce_eager``).
    """

    name = "vllm"

    def __init__(self, model, groups: ParallelGroups, tokenizer_info: TokenizerInfo, *, model_cfg,
                 hf_model_path: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 seed: int = 0, max_model_len: Optional[int] = None, dtype: Optional[str] = None,
                 load_format: str = "dummy", enable_sleep_mode: bool = True,
                 llm_kwargs: Optional[Dict[str, Any]] = None):
        vllm = _import_vllm()
        self._vllm = vllm
        self.model, self.groups, self.tokenizer_info, self.model_cfg = model, groups, tokenizer_info, model_cfg
        if groups.world_size % tensor_parallel_size:
            raise ValueError(f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} must divide the world "
                             f"size {groups.world_size}")
        # vLLM groups consecutive ranks; megatron's TP ranks are consecutive, and one vLLM TP group
        # must hold the ranks of one DP replica (they pass the same prompts).
        if groups.data_parallel_size > 1 and groups.tensor_model_parallel_size % tensor_parallel_size:
            raise ValueError(f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} must divide "
                             f"parallel.tensor_model_parallel_size={groups.tensor_model_parallel_size} "
                             f"when data parallel size > 1")
        kwargs: Dict[str, Any] = dict(
            model=hf_model_path, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            max_model_len=max_model_len or model_cfg.max_sequence_length,
            dtype=dtype or model_cfg.params_dtype, load_format=load_format,
            enable_sleep_mode=enable_sleep_mode, skip_tokenizer_init=True,
            enable_prefix_caching=False,
        )
        if groups.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if "logprobs_mode" in _engine_arg_names():
            kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs.update(llm_kwargs or {})
        # Keep vLLM's engine core in this process, so that sync_weights reaches the model directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(**kwargs)
        self._synced = load_format != "dummy"
        self._sleeping = False

    # ----------------------------------------------------------------------------------------------
    def _inference_model(self):
        for path in _MODEL_PATHS:
            model = _walk(self.llm, path)
            if model is not None:
                return model
        return None

    @torch.no_grad()
    def sync_weights(self, tensors=None) -> int:
        """Load the policy's current weights into vLLM in place.

        Collective over the policy's model-parallel group (``hf_tensors_from_megatron`` gathers TP
        shards and broadcasts over PP). Wakes the weights first if the engine sleeps, and the KV
        cache after.

        Args:
            tensors: an iterable of ``(hf_name, full_tensor)``; default
                ``hf_tensors_from_megatron(model, model_cfg, groups)``.

        Returns:
            The number of tensors loaded.
        """
        if tensors is None:
            from hpa.models.convert import hf_tensors_from_megatron

            tensors = hf_tensors_from_megatron(self.model, self.model_cfg, self.groups)
        was_sleeping = self._sleeping
        if was_sleeping:
            self._wake_up(["weights"])
        count = [0]

        def counted():
            for name, tensor in tensors:
                count[0] += 1
                yield name, tensor

        model = self._inference_model()
        if model is not None:
            model.load_weights(counted())
        else:  # the engine runs in other processes: ship CPU copies (slow; external_launcher avoids it)
            batch: List = []
            for name, tensor in counted():
                batch.append((name, tensor.detach().cpu()))
                if len(batch) == 16:
                    self._remote_load(batch)
                    batch = []
            if batch:
                self._remote_load(batch)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        if was_sleeping:
            self._wake_up(["kv_cache"])
            self._sleeping = False
        self._synced = True
        return count[0]

    def _remote_load(self, batch) -> None:
        def load(model):
            model.load_weights(iter(batch))

        self.llm.apply_model(load)

    def _wake_up(self, tags: Optional[List[str]] = None) -> None:
        try:
            self.llm.wake_up(tags=tags) if tags else self.llm.wake_up()
        except TypeError:  # vLLM without tagged wake-up
            self.llm.wake_up()

    def sleep(self) -> None:
        """Offload the weights to CPU and drop the KV cache (``LLM.sleep(level=1)``)."""
        if not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def wake(self) -> None:
        if self._sleeping:
            self._wake_up()
            self._sleeping = False

    # ----------------------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        if not self._synced:
            raise RuntimeError("VLLMRolloutEngine built with load_format='dummy' holds random weights: call "
                               "sync_weights() before generate()")
        if self._sleeping:
            self.wake()
        info = self.tokenizer_info
        token_lists = prompt_token_lists(prompts)
        rows = [p for p in token_lists for _ in range(params.n)]
        # One request per response, each with its own seed, so that results do not depend on how vLLM
        # batches or expands n.
        requests = [{"prompt_token_ids": list(p)} for p in rows]
        sampling = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos, seed=None if params.greedy else (params.seed * 1_000_003 + i) % 2 ** 63,
            logprobs=0, detokenize=False) for i in range(len(rows))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)

        responses, log_probs, reasons = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            responses.append(ids)
            log_probs.append([float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)])
            if completion.finish_reason not in _FINISH:
                raise RuntimeError(f"vLLM finished a request with reason {completion.finish_reason!r}")
            reasons.append(_FINISH[completion.finish_reason])

        from hpa.data.collate import pad_left, pad_right

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

        from hpa.distributed.comm import broadcast_object

        g = self.groups
        if g.mp_group is None or not dist.is_initialized() or dist.get_world_size(g.mp_group) == 1:
            return batch
        return broadcast_object(batch, src=dist.get_global_rank(g.mp_group, 0), group=g.mp_group)


def build_vllm_engine(rollout_cfg, model, groups: ParallelGroups, tokenizer_info: TokenizerInfo, *,
                      model_cfg, hf_model_path: str, **kwargs) -> VLLMRolloutEngine:
    """``ROLLOUT_ENGINES["vllm"]``: reads ``rollout.vllm_tensor_parallel_size``, ``gpu_memory_utilization``
    and ``seed``."""
    return VLLMRolloutEngine(model, groups, tokenizer_info, model_cfg=model_cfg, hf_model_path=hf_model_path,
                             tensor_parallel_size=rollout_cfg.vllm_tensor_parallel_size,
                             gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                             seed=rollout_cfg.seed, **kwargs)
