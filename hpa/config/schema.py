"""The config schema: one small frozen, keyword-only dataclass per concern (docs/design.md,
rules 5 and 6).

YAML is plain data; ``hpa.config.load`` checks every key and type against these classes. Each class
validates its own fields in ``__post_init__``; checks that span sections live in ``validate``.
Sections ``algorithm``, ``reward`` and ``data`` are defined next to their owners' needs in
``algorithm.py``, ``reward.py`` and ``data.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .algorithm import DEFAULT_REPLAY_COEF, GATE_SIGNALS_ON_REWARD_MODELS, AlgorithmConfig
from .data import DataConfig
from .errors import ConfigError, check_choice, check_range
from . import linears
from .reward import RewardConfig, check_diversity_source
from .values import check_values

BACKENDS = ("auto", "nccl", "gloo")
DTYPES = ("float32", "bfloat16", "float16")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
RECOMPUTE_GRANULARITIES = ("selective", "full")
ROLLOUT_ENGINES = ("megatron", "vllm")
ROLLOUT_PLACEMENTS = ("colocated", "disaggregated")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
RESUME_MODES = ("auto", "never")
# micro-batches of one rank's policy update above which micro_batch_size is refused: each costs the host a fixed
# ~5k operations (bench/proxies/update.py), so past this the update waits on the host, not on the device
MAX_UPDATE_MICRO_BATCHES = 128
SAVE_FAILURE_ACTIONS = ("continue", "stop")
WANDB_MODES = ("offline", "online", "disabled")


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout. DP = world_size / (TP · PP · CP).

    Attributes:
        tensor_model_parallel_size: TP: ranks that split each layer's weights.
        pipeline_model_parallel_size: PP: ranks that split the layers into stages.
        context_parallel_size: reserved; must be 1 (context parallelism is not implemented).
        virtual_pipeline_model_parallel_size: reserved; must be null (virtual pipeline stages are not implemented).
        sequence_parallel: split the activations outside attention and MLP along the sequence over the TP
            ranks (needs TP > 1).
        use_distributed_optimizer: shard the optimizer state over the DP ranks (megatron's distributed optimizer).
        backend: auto (NCCL when CUDA is available, gloo otherwise) | nccl | gloo.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    backend: str = "auto"
    # a collective that waits longer fails; the waiting ranks exit naming the phase and the rank they
    # waited for (hpa.distributed.watchdog), so the launcher can restart the job
    timeout_minutes: float = 30.0

    def __post_init__(self):
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "virtual_pipeline_model_parallel_size")
        check_range("timeout_minutes", self.timeout_minutes, low=0.0, low_open=True)
        check_choice("backend", self.backend, BACKENDS)
        if self.context_parallel_size != 1:
            raise ConfigError("context_parallel_size", "context parallelism is reserved in the "
                              "config but not implemented yet; set it to 1")
        if self.virtual_pipeline_model_parallel_size is not None:
            raise ConfigError("virtual_pipeline_model_parallel_size", "virtual pipeline stages are "
                              "reserved in the config but not implemented yet; leave it null")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("sequence_parallel", "sequence parallelism needs tensor_model_parallel_size > 1")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters over one frozen base (docs/lora.md).

    With ``rank`` > 0 the base weights are frozen and shared: the policy trains its adapters and the reference is
    the same weights with the adapters off (no second copy); with ``algorithm.advantage.estimator: gae`` the critic
    is its own adapters (same rank and targets) plus a value head over the same base. ``rank: 0`` trains every
    weight as before.

    Attributes:
        rank: the adapters' rank r; 0: LoRA off (full fine-tuning). At most the width (the smaller of its
            input and output features) of every targeted linear: a larger r adds parameters, not rank.
        alpha: the scaling numerator: the update is (alpha / r) · B·A, or (alpha / sqrt(r)) · B·A with rslora.
        dropout: dropout on the adapter's input (the base path never sees it).
        target_modules: which of megatron's linear layers carry adapters: linear_qkv | linear_proj |
            linear_fc1 | linear_fc2.
        rslora: rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023) instead of alpha / r.
        adapter_path: start the adapters from this adapter checkpoint (a LoRA run's
            ``<run_dir>/checkpoints/step_N``, or the output of ``hpa convert peft-to-megatron``) over the base
            ``model.policy_path``, instead of B = 0; ``hpa generate`` and ``hpa serve`` load the policy's
            adapters from it. Its rank and scaling must be these.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Tuple[str, ...] = linears.NAMES
    rslora: bool = False
    adapter_path: Optional[str] = None

    def __post_init__(self):
        check_range("rank", self.rank, low=0)
        if self.adapter_path is not None and (not self.adapter_path or not self.rank):
            raise ConfigError("adapter_path", f"{self.adapter_path!r} needs LoRA on: set model.lora.rank (and "
                              "alpha, target_modules) to the adapters' (their run's config.yaml), or leave it out")
        check_range("alpha", self.alpha, low=0.0, low_open=True)
        check_range("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        if self.rank and not self.target_modules:
            raise ConfigError("target_modules", f"is empty; with rank {self.rank} name at least one of "
                              f"{', '.join(linears.NAMES)}")
        for name in self.target_modules:
            check_choice("target_modules", name, linears.NAMES)
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError("target_modules", f"lists a module twice: {list(self.target_modules)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        if not self.rank:
            return 0.0
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention).

    ``vocab_size`` is the tokenizer's; the embedding is padded up to a multiple of
    ``make_vocab_size_divisible_by`` · TP as megatron does.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width.
        num_attention_heads: query heads.
        vocab_size: the tokenizer's vocabulary size.
        max_sequence_length: prompt plus response tokens at most (the RoPE and KV-cache length).
        num_query_groups: key/value heads (grouped-query attention); null: one per query head.
        ffn_hidden_size: MLP width; null: megatron's default (4 × hidden_size).
        normalization: RMSNorm | LayerNorm.
        norm_epsilon: ε of the normalisation.
        activation: swiglu | gelu (the MLP's).
        add_qkv_bias: bias on the query, key and value projections (Qwen2).
        untie_embeddings_and_output_weights: separate input embedding and output layer (false: tied).
        rotary_base: RoPE base θ.
        init_method_std: std of the normal initialisation of the weights.
        hidden_dropout: dropout after attention and MLP.
        attention_dropout: dropout on the attention probabilities.
        params_dtype: float32 | bfloat16 | float16 (the CPU/gloo path runs in float32).
        transformer_impl: auto (Transformer Engine when it imports on a CUDA machine, megatron's local layers
            otherwise) | local | transformer_engine.
        make_vocab_size_divisible_by: the embedding rows are padded to a multiple of this times TP.
        recompute_granularity: activation recomputation: null (none) | selective (core attention) | full
            (whole layers).
        compile: compile each transformer layer with ``torch.compile`` (forward and backward; the model around
            the layers stays eager; docs/gpu.md, "Compiled layers"). null (auto): on where the layers are
            megatron's local ones on CUDA (not yet measured faster there), off on CPU (compiling costs more
            than it saves at test sizes) and with Transformer Engine's layers or selective recomputation;
            true: on for the local layers on any device; false: eager.
        policy_path: initial policy weights (a Megatron checkpoint directory); null: random initialisation.
        reference_path: the frozen reference's weights; null: the policy's starting weights.
        critic_path: the critic's starting weights; null: the policy's backbone with a fresh value head.
        lora: low-rank adapters over one frozen base (rank 0: off).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_sequence_length: int
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    activation: str = "swiglu"
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = True
    rotary_base: float = 10000.0
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    params_dtype: str = "float32"
    transformer_impl: str = "auto"
    make_vocab_size_divisible_by: int = 128
    recompute_granularity: Optional[str] = None
    compile: Optional[bool] = None
    policy_path: Optional[str] = None
    reference_path: Optional[str] = None
    critic_path: Optional[str] = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                  "max_sequence_length", "num_query_groups", "ffn_hidden_size",
                  "make_vocab_size_divisible_by")
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("params_dtype", self.params_dtype, DTYPES)
        check_choice("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        if self.recompute_granularity is not None:
            check_choice("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        check_range("hidden_dropout", self.hidden_dropout, low=0.0, high=1.0, high_open=True)
        check_range("attention_dropout", self.attention_dropout, low=0.0, high=1.0, high_open=True)
        check_range("norm_epsilon", self.norm_epsilon, low=0.0, low_open=True)
        if self.compile and self.recompute_granularity == "selective":
            raise ConfigError("compile", "true cannot trace recompute_granularity=selective (megatron's checkpoint "
                              "inside the layer saves the RNG states); use full or null recomputation, or "
                              "compile: false")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size", f"{self.hidden_size} is not divisible by "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError("num_query_groups", f"num_attention_heads={self.num_attention_heads} is not "
                              f"divisible by num_query_groups={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Sampling for the online (PPO) part.

    ``cuda_graphs`` (native engine): on CUDA at tensor and pipeline parallel size 1, decode with static
    shapes (rows and KV-cache slots padded to powers of two) and replay each token's step from a CUDA
    graph captured once per batch bucket and weight version; ignored on CPU and where it does not
    apply (``hpa/rollout/megatron_engine.py``). On by default since ``tests/gpu/test_graph_decode.py`` passed
    on a GPU (docs/gpu.md); ``false`` decodes eagerly, one launch per op. ``compile_decode``: the step is
    ``torch.compile``d before it is captured (fewer, fused kernels in the graph); ``false`` when compilation
    fails or takes too long on a machine (a failure already falls back to the uncompiled step, with a warning).

    Attributes:
        engine: megatron (the training policy as it is sharded, with hpa's KV cache) | vllm.
        n: responses sampled per prompt.
        temperature: sampling temperature (0: greedy).
        top_p: nucleus sampling mass (1.0: off).
        top_k: sample among the k most likely tokens; -1: off.
        max_new_tokens: response tokens at most.
        seed: sampling seed.
        vllm_tensor_parallel_size: vLLM's tensor parallelism; null: the policy's
            ``parallel.tensor_model_parallel_size``, so ``rollout.engine=vllm`` alone works on any layout.
        gpu_memory_utilization: share of each GPU vLLM takes while awake (its weights and KV cache).
        colocate: vLLM shares the training GPUs and sleeps during training (the mode implemented).
        cuda_graphs: native engine: decode from CUDA graphs (see above); false: eager decode.
        compile_decode: native engine with CUDA-graph decode: compile the decode step before its capture.
        max_staleness: the most policy versions a trained row may lag the policy that sampled it (0: every
            row is sampled by the current policy, the synchronous loop). Rows older than that are dropped
            and counted (``hpa/rollout/queue.py``). k >= 1: a rollout worker (native engine, its own copy of
            the weights, a thread of the trainer process) samples the next step's prompts while the trainer
            trains on this step's rows (``hpa/rollout/worker.py``); needs tensor and pipeline parallel size 1
            and ``algorithm.rollout_correction`` (``rollout_is`` or ``rollout_rs``: the π_old/π_behaviour
            correction).
        placement: colocated (the engine samples in the trainer processes) | disaggregated (the last
            ``num_ranks`` ranks of the launch are rollout ranks that hold the engine's own copy of the
            weights and its KV cache and only sample; the trainer pushes its weights to them before each
            rollout and checks that they arrived, ``hpa/rollout/remote.py``). Disaggregated: the native engine
            or vLLM (built on the rollout ranks only, in their own world, at TP 1, synced from the rollout rank's
            copy after every push; at any ``max_staleness``), trainer tensor and pipeline parallel size 1, each
            rollout rank a whole (TP 1) copy serving the
            trainer DP ranks ``i`` with ``i mod num_ranks`` equal to its index; at ``max_staleness`` 0 it
            samples each step's prompts after that step's push (the synchronous loop), at k >= 1 one step
            ahead.
        num_ranks: rollout ranks with ``placement: disaggregated`` (0 with colocated); the trainer gets the
            rest of the launch's ranks, and its TP·PP·CP divides them.
        partial: partial rollouts, at ``max_staleness`` k >= 1 (native engine): a weight push does not wait for
            the rollout in flight; its unfinished rows stop between two decode steps, keep their tokens and continue
            with the new weights (their prefix recomputed by them), so the rows are fresher and the push never
            waits for the longest response. Each token records the version that sampled it; the lag counts a
            row's oldest token, and the correction reads every token's behaviour log-prob. The sampling noise
            continues from where it stopped: with unchanged weights a continued row is the uninterrupted one
            (``hpa/rollout/megatron_engine.py``, "Partial rollouts"). Colocated or disaggregated (the rollout ranks'
            worker stops the row and receives the push into its paused copy).
    """

    engine: str = "megatron"
    n: int = 4
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    seed: int = 0
    vllm_tensor_parallel_size: Optional[int] = None
    gpu_memory_utilization: float = 0.85
    colocate: bool = True
    cuda_graphs: bool = True
    compile_decode: bool = True
    max_staleness: int = 0
    placement: str = "colocated"
    num_ranks: int = 0
    partial: bool = False

    def __post_init__(self):
        check_choice("engine", self.engine, ROLLOUT_ENGINES)
        check_choice("placement", self.placement, ROLLOUT_PLACEMENTS)
        if self.placement == "disaggregated":
            if isinstance(self.num_ranks, bool) or self.num_ranks < 1:
                raise ConfigError("num_ranks", f"placement=disaggregated samples on rollout.num_ranks >= 1 ranks of "
                                               f"their own, got {self.num_ranks}; set it, or placement: colocated")
            if self.engine == "vllm" and self.vllm_tensor_parallel_size not in (None, 1):
                raise ConfigError("vllm_tensor_parallel_size", f"disaggregated, each rollout rank holds a whole copy "
                                                               f"of the policy and serves trainer ranks of its own, so "
                                                               f"its vLLM runs at TP 1, got "
                                                               f"{self.vllm_tensor_parallel_size}; set 1 (or null)")
        elif self.num_ranks != 0:
            raise ConfigError("num_ranks", f"{self.num_ranks} rollout ranks need placement: disaggregated; "
                                           f"colocated placement samples in the trainer ranks (num_ranks: 0)")
        if self.max_staleness < 0:
            raise ConfigError("max_staleness", f"must be an integer >= 0 (0: synchronous), got {self.max_staleness}")
        if self.partial and self.engine != "megatron":
            raise ConfigError("partial", f"engine={self.engine} cannot stop a row at a weight push and resume it "
                                         f"(only the native engine can); set rollout.partial=false or engine=megatron")
        if self.partial and self.max_staleness == 0:
            raise ConfigError("partial", "means nothing at max_staleness 0 (every rollout is sampled by the current "
                                         "policy, no weight push comes mid-rollout); set rollout.max_staleness >= 1 "
                                         "or rollout.partial=false")
        # disaggregated, the rollout ranks sample for the trainer at every k, whichever engine they run
        if self.max_staleness > 0 and self.engine != "megatron" and self.placement != "disaggregated":
            raise ConfigError("max_staleness", f"{self.max_staleness} needs a rollout engine with an asynchronous "
                                               f"worker; engine={self.engine} has none (use engine=megatron, or 0)")
        _positive(self, "n", "max_new_tokens", "vllm_tensor_parallel_size")
        check_range("temperature", self.temperature, low=0.0)
        check_range("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, high=1.0, low_open=True)
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k", f"must be -1 (off) or a positive integer, got {self.top_k}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """megatron-core's optimizer (Adam with decoupled weight decay, i.e. AdamW).

    Attributes:
        lr: peak learning rate of the policy.
        min_lr: learning rate at the end of the decay.
        critic_lr: the critic's peak learning rate; null: ``lr``.
        weight_decay: decoupled weight decay.
        adam_beta1: Adam β1.
        adam_beta2: Adam β2.
        adam_eps: Adam ε.
        clip_grad: gradient clipping by global norm (0: off).
        lr_warmup_fraction: share of the steps with a linear warmup from 0.
        lr_decay_style: constant | linear | cosine, from ``lr`` to ``min_lr`` after the warmup.
    """

    lr: float = 1e-5
    min_lr: float = 0.0
    critic_lr: Optional[float] = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_fraction: float = 0.0
    lr_decay_style: str = "constant"

    def __post_init__(self):
        check_range("lr", self.lr, low=0.0, low_open=True)
        check_range("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_range("weight_decay", self.weight_decay, low=0.0)
        check_range("adam_beta1", self.adam_beta1, low=0.0, high=1.0, high_open=True)
        check_range("adam_beta2", self.adam_beta2, low=0.0, high=1.0, high_open=True)
        check_range("adam_eps", self.adam_eps, low=0.0, low_open=True)
        check_range("clip_grad", self.clip_grad, low=0.0)
        check_range("lr_warmup_fraction", self.lr_warmup_fraction, low=0.0, high=1.0)
        check_choice("lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.critic_lr is not None:
            check_range("critic_lr", self.critic_lr, low=0.0, low_open=True)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The loop: how long, how big, where.

    ``global_batch_size`` counts prompts per step over all DP ranks; each rolls out ``rollout.n``
    responses. ``micro_batch_size`` is per rank and per pipeline micro-batch (rollout rows, or
    preference pairs). ``max_steps_per_run`` ends this process after that many steps with a
    checkpoint (for time-sliced jobs); the next launch resumes.

    ``sequence_packing`` packs the rows of every micro-batch of the training forwards and backwards
    (policy, reference, critic; rollouts, preference pairs, SFT; ``hpa train-rm``'s pairs)
    into one sequence with attention kept
    inside each row, so no pad is computed; the numbers are those of the padded layout up to rounding.
    ``ppo_max_token_len_per_rank`` then counts real tokens per micro-batch of the update (padded tokens
    without packing). With it, every stream of the update is cut by tokens (rollout rows, preference pairs
    with their two rows together, replayed SFT examples; ``hpa sft``'s examples too) and ``micro_batch_size``
    cuts only the forward-only passes without their own budget; without it, ``micro_batch_size`` rows (pairs)
    a micro-batch, refused where that cuts one rank's update into more than 128 micro-batches.

    Attributes:
        total_steps: training steps (the schedules' progress is step / total_steps).
        seed: the run's seed (initialisation, data order, dropout).
        run_dir: where everything of a run goes (metrics, checkpoints, the resolved config).
        global_batch_size: prompts per step over all DP ranks.
        micro_batch_size: rows (rollouts or preference pairs) per rank and pipeline micro-batch, where no token
            budget cuts them.
        preference_batch_size: preference pairs per step over all DP ranks.
        replay_batch_size: SFT examples replayed per step over all DP ranks, with ``algorithm.replay.coef > 0``.
        ppo_epochs: passes over each step's rollouts.
        ppo_mini_batch_size: prompts per optimizer update within a step; null: one update per epoch.
        ppo_max_token_len_per_rank: token budget of a micro-batch of the update, every stream (rollout rows,
            preference pairs, replayed and ``hpa sft`` examples regrouped to fit it); null: ``micro_batch_size``
            rows (pairs).
        log_prob_max_token_len_per_rank: token budget of a micro-batch of the forward-only passes over the
            rollouts (old policy, reference, critic values; verl's ``log_prob_max_token_len_per_gpu``): no
            backward, so usually twice the update's; null: ``micro_batch_size`` rows.
        sequence_packing: pack each micro-batch's rows into one sequence, attention kept inside each row.
        eval_interval: greedy evaluation on ``data.eval_prompt_path`` every this many steps (and at step 0); 0: off.
        peak_tflops_per_device: the device's peak TFLOP/s, for ``perf/mfu``; null: from the CUDA device's name
            where known (dense bf16: H100 SXM and H200 SXM 989, H200 NVL 835, H100 PCIe 756), else MFU is NaN.
        max_steps_per_run: end this process after that many steps with a checkpoint; the next launch resumes.
        old_log_probs_from_update: on an on-policy step (``old_log_probs_from_update(cfg)``, docs/training.md)
            skip the old-policy forward: the update's own forward, detached, gives the old log-probs (PPO
            ratio exactly 1). false: always a separate old-policy forward.
    """

    total_steps: int
    seed: int = 1234
    run_dir: str = "runs/hpa"
    global_batch_size: int = 8
    micro_batch_size: int = 1
    preference_batch_size: int = 8
    replay_batch_size: int = 4
    ppo_epochs: int = 1
    ppo_mini_batch_size: Optional[int] = None
    ppo_max_token_len_per_rank: Optional[int] = None
    log_prob_max_token_len_per_rank: Optional[int] = None
    sequence_packing: bool = False
    eval_interval: int = 0
    peak_tflops_per_device: Optional[float] = None
    max_steps_per_run: Optional[int] = None
    old_log_probs_from_update: bool = True

    def __post_init__(self):
        _positive(self, "total_steps", "global_batch_size", "micro_batch_size", "preference_batch_size",
                  "replay_batch_size",
                  "ppo_epochs", "ppo_mini_batch_size", "ppo_max_token_len_per_rank",
                  "log_prob_max_token_len_per_rank",
                  "max_steps_per_run")
        check_range("eval_interval", self.eval_interval, low=0)
        if not self.run_dir:
            raise ConfigError("run_dir", "must name a directory")


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """``hpa sft``: supervised fine-tuning on ``data.sft_path`` before HPA.

    The weights go to ``output_dir`` (default ``<trainer.run_dir>/sft``); point
    ``model.policy_path`` there for ``hpa train``.

    Attributes:
        total_steps: SFT steps.
        global_batch_size: examples per step over all DP ranks.
        lr: SFT's peak learning rate; null: ``optim.lr``.
        output_dir: where the weights go; null: ``<trainer.run_dir>/sft``.
    """

    total_steps: int = 200
    global_batch_size: int = 32
    lr: Optional[float] = None
    output_dir: Optional[str] = None

    def __post_init__(self):
        _positive(self, "total_steps", "global_batch_size")
        if self.lr is not None:
            check_range("lr", self.lr, low=0.0, low_open=True)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving and resuming. ``resume`` is ``auto``, ``never`` or a checkpoint path.

    ``on_save_failure``: a save that fails (out of space, I/O error) leaves the previous checkpoint
    and ``latest`` as they were and removes its partial directory; then ``continue`` logs a warning,
    counts it in ``checkpoint/save_failures`` and trains on, ``stop`` exits with status 74 (EX_IOERR).

    Attributes:
        save_interval: save every this many steps (also on SIGTERM/SIGUSR1 and at ``max_steps_per_run``); 0:
            only then.
        resume: auto (from ``latest``, falling back to the previous good checkpoint) | never | a checkpoint path.
        keep_last: newest checkpoints kept.
        keep_top_k: checkpoints kept besides, the best by evaluation score.
        dir: where checkpoints go; null: ``<trainer.run_dir>/checkpoints``.
        on_save_failure: continue | stop, after a save that failed.
    """

    save_interval: int = 0
    resume: str = "auto"
    keep_last: int = 2
    keep_top_k: int = 5
    dir: Optional[str] = None
    on_save_failure: str = "continue"

    def __post_init__(self):
        check_range("save_interval", self.save_interval, low=0)
        check_range("keep_last", self.keep_last, low=1)
        check_range("keep_top_k", self.keep_top_k, low=0)
        check_choice("on_save_failure", self.on_save_failure, SAVE_FAILURE_ACTIONS)
        if not self.resume:
            raise ConfigError("resume", "use 'auto', 'never' or a checkpoint path")


GRAD_SPIKE_ACTIONS = ("skip", "clip", "none")


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The stability guard (``hpa/trainer/guard.py``).

    A non-finite gradient norm (or loss: it makes the norm non-finite) always skips the step. A grad
    norm above ``grad_spike_factor`` x the running median of the last ``grad_spike_window`` steps is
    handled by ``grad_spike_action``. A token KL above ``kl_rollback_threshold`` (the recipe: 0.05),
    or ``max_consecutive_skips`` skipped steps in a row, rolls back to the last checkpoint and
    multiplies the LR by ``rollback_lr_factor``. Early stopping (off unless ``early_stop_patience``
    is set) watches mean(reward) - 0.5 mean(KL) - 0.3 std(reward) over ``early_stop_window`` steps.
    ``early_stop_on_hacking`` also stops at an evaluation where the reward-hacking monitor alerts
    (``reward.monitor``, on ``data.adversarial_prompt_path``).

    Attributes:
        grad_spike_factor: a grad norm above this × the running median is a spike.
        grad_spike_window: steps in the running median of the grad norm.
        grad_spike_min_history: steps recorded before spikes are looked for.
        grad_spike_action: skip (the step) | clip (to the median) | none, on a spike.
        kl_rollback_threshold: token KL above which the run rolls back; null: never on KL.
        max_consecutive_skips: skipped steps in a row that roll back.
        rollback_lr_factor: the LR is multiplied by this at each rollback.
        max_rollbacks: rollbacks at most in a run; then no more.
        early_stop_patience: evaluations without improvement before stopping; null: no early stopping.
        early_stop_window: steps in the early-stopping metric's window.
        early_stop_min_delta: smallest rise of the metric that counts as an improvement.
        early_stop_kl_coef: weight of mean(KL) in the early-stopping metric.
        early_stop_std_coef: weight of std(reward) in the early-stopping metric.
        early_stop_on_hacking: stop at an evaluation where the reward-hacking monitor alerts.
    """

    grad_spike_factor: float = 10.0
    grad_spike_window: int = 50
    grad_spike_min_history: int = 10
    grad_spike_action: str = "skip"
    kl_rollback_threshold: Optional[float] = 0.05
    max_consecutive_skips: int = 3
    rollback_lr_factor: float = 0.5
    max_rollbacks: int = 5
    early_stop_patience: Optional[int] = None
    early_stop_window: int = 1000
    early_stop_min_delta: float = 0.01
    early_stop_kl_coef: float = 0.5
    early_stop_std_coef: float = 0.3
    early_stop_on_hacking: bool = False

    def __post_init__(self):
        check_range("grad_spike_factor", self.grad_spike_factor, low=1.0, low_open=True)
        _positive(self, "grad_spike_window", "grad_spike_min_history", "max_consecutive_skips",
                  "early_stop_patience", "early_stop_window")
        check_choice("grad_spike_action", self.grad_spike_action, GRAD_SPIKE_ACTIONS)
        check_range("rollback_lr_factor", self.rollback_lr_factor, low=0.0, high=1.0, low_open=True)
        check_range("max_rollbacks", self.max_rollbacks, low=0)
        if self.kl_rollback_threshold is not None:
            check_range("kl_rollback_threshold", self.kl_rollback_threshold, low=0.0, low_open=True)


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases (the API key is never read or printed by hpa).

    Attributes:
        mode: offline | online | disabled.
        project: the wandb project.
        entity: the wandb team or user; null: wandb's default.
        name: the run's name; null: wandb's default.
    """

    mode: str = "offline"
    project: str = "hpa"
    entity: Optional[str] = None
    name: Optional[str] = None

    def __post_init__(self):
        check_choice("mode", self.mode, WANDB_MODES)


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Metrics sinks besides ``metrics.jsonl`` (always written).

    Attributes:
        console: a log line with the key metrics every ``log_interval`` steps (and the last step).
        log_interval: steps between console lines of ``hpa sft``, ``hpa train-rm`` and ``hpa train`` (every
            step stays in the metrics files and wandb).
        progress_bar: one tqdm bar per phase on rank 0, on a terminal only (to stderr; log lines print above it).
        tensorboard: event files under ``<run_dir>/tensorboard`` (needs the ``tensorboard`` package).
        wandb: Weights & Biases.
        level: the level of the console's log records; DEBUG also shows megatron-core's start-up records
            (its DDP buckets, its FSDP probe), which otherwise log at WARNING and above only.
    """

    wandb: WandbConfig = field(default_factory=WandbConfig)
    console: bool = True
    log_interval: int = 25
    progress_bar: bool = True
    tensorboard: bool = False
    level: str = "INFO"

    def __post_init__(self):
        check_range("log_interval", self.log_interval, low=1)
        check_choice("level", self.level, LOG_LEVELS)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """``hpa serve``: the HTTP endpoint, its KL guard and its batching.

    ``kl_threshold`` and ``guard_temperature`` are the recipe's guard (regenerate a response whose KL to
    the reference is above 0.1 at temperature 0.5); ``guard: false`` scores no KL and regenerates nothing.
    Requests that arrive while the engine is busy join the next batch, up to ``max_batch_size`` responses;
    an idle engine waits ``batch_wait_ms`` for company before it starts. ``drain_timeout_s``: how long
    SIGTERM waits for in-flight requests (then the engine stops between decode steps and the cut requests
    get 503). ``model_name``: the id clients pass as ``model`` (default: the policy checkpoint's directory
    name). Limits: ``max_rows_per_request`` responses per request (prompts x ``n``; ``n`` itself is capped
    at 128 as OpenAI does), ``max_body_bytes`` per request body (413 above it). ``api_key``: the key
    clients send as ``Authorization: Bearer <key>`` (null: the ``HPA_SERVE_API_KEY`` environment variable,
    or no key).

    Attributes:
        host: the address to listen on.
        port: the port (0: a free one, printed at start).
        model_name: the model id; null: the policy directory's name.
        guard: score every response's KL to the reference and regenerate above ``kl_threshold``.
        kl_threshold: KL (k1, mean over the response's tokens) above which a response is sampled again.
        guard_temperature: temperature of the regeneration.
        guard_max_retries: regeneration rounds at most.
        max_batch_size: responses per engine call at most.
        batch_wait_ms: how long an idle engine waits for more requests.
        drain_timeout_s: SIGTERM's grace for in-flight requests.
        max_rows_per_request: responses per request at most (prompts x ``n``); 400 above it.
        max_body_bytes: request body size at most; 413 above it.
        api_key: the Bearer key clients must send; null: ``HPA_SERVE_API_KEY`` or no key.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: Optional[str] = None
    guard: bool = True
    kl_threshold: float = 0.1
    guard_temperature: float = 0.5
    guard_max_retries: int = 1
    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    drain_timeout_s: float = 60.0
    max_rows_per_request: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: Optional[str] = None

    def __post_init__(self):
        check_range("port", self.port, low=0, high=65535)
        check_range("kl_threshold", self.kl_threshold, low=0.0)
        check_range("guard_temperature", self.guard_temperature, low=0.0)
        check_range("guard_max_retries", self.guard_max_retries, low=0)
        _positive(self, "max_batch_size")
        check_range("batch_wait_ms", self.batch_wait_ms, low=0.0)
        check_range("drain_timeout_s", self.drain_timeout_s, low=0.0)
        if self.model_name is not None and not self.model_name:
            raise ConfigError("model_name", "must be a non-empty string or null (the policy directory's name)")
        _positive(self, "max_rows_per_request")
        check_range("max_body_bytes", self.max_body_bytes, low=1024)
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key", "must be a non-empty string or null (HPA_SERVE_API_KEY, or no key)")


@dataclass(frozen=True, kw_only=True)
class Config:
    """The root. Components receive their own section, never this object, so no component
    depends on sections it does not use."""

    model: ModelConfig
    trainer: TrainerConfig
    data: DataConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self):
        # algorithm.replay.coef None: replay the demonstrations whenever the run is given them
        if self.algorithm.replay.coef is None:
            coef = DEFAULT_REPLAY_COEF if self.data.sft_path is not None else 0.0
            object.__setattr__(self, "algorithm", dataclasses.replace(
                self.algorithm, replay=dataclasses.replace(self.algorithm.replay, coef=coef)))


def trainer_world_size(rollout: RolloutConfig, world_size: int) -> int:
    """The ranks of a launch of ``world_size`` that train: all but ``rollout.num_ranks`` with disaggregated
    rollouts (the last ranks), all of them colocated."""
    if rollout.placement != "disaggregated":
        return world_size
    trainers = world_size - rollout.num_ranks
    if trainers < 1:
        raise ConfigError("rollout.num_ranks", f"{rollout.num_ranks} rollout ranks of a launch of {world_size} "
                          f"leave no trainer rank; launch more processes or lower rollout.num_ranks")
    return trainers


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    model_parallel = (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
                      * parallel.context_parallel_size)
    if world_size % model_parallel:
        raise ConfigError(
            "parallel.tensor_model_parallel_size",
            f"world size {world_size} is not divisible by TP·PP·CP = "
            f"{parallel.tensor_model_parallel_size}·{parallel.pipeline_model_parallel_size}·"
            f"{parallel.context_parallel_size} = {model_parallel}; launch a multiple of "
            f"{model_parallel} processes or change the layout")
    return world_size // model_parallel


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Every check that spans keys or sections, wherever a config is accepted (``check-config`` with or
    without ``--world-size``, ``hpa ablate``'s pre-check, every command's start-up). Only the
    data-parallel checks need ``world_size``; every other check always runs. Raises ConfigError naming
    the first offending key."""
    check_values(cfg)
    _check_model_layout(cfg)
    _check_lengths(cfg)
    _check_trust(cfg)
    _check_replay(cfg)
    check_lora(cfg)
    _check_rewards_and_filters(cfg)
    _check_async_rollouts(cfg)
    if world_size is not None:
        _check_data_parallel(cfg, world_size)


def _check_async_rollouts(cfg: Config) -> None:
    k = cfg.rollout.max_staleness
    layout = (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
    if cfg.rollout.placement == "disaggregated" and layout != (1, 1):
        raise ConfigError("rollout.placement", f"disaggregated pushes the weights whole from trainer rank 0, which "
                          f"holds them whole at tensor and pipeline parallel size 1 only (tensor_model_parallel_size, "
                          f"pipeline_model_parallel_size = {layout}); use 1 and 1, or placement: colocated")
    if k == 0:
        return
    if layout != (1, 1):
        raise ConfigError("rollout.max_staleness", f"{k} runs the rollout worker in a thread of each trainer "
                          f"process, which cannot share the tensor/pipeline-parallel communicators "
                          f"(tensor_model_parallel_size, pipeline_model_parallel_size = {layout}); use 1 and 1, or 0")
    correction = cfg.algorithm.rollout_correction
    if correction.rollout_is is None and correction.rollout_rs is None:
        raise ConfigError("rollout.max_staleness", f"{k} trains on rows sampled by older policies: set "
                          f"algorithm.rollout_correction.rollout_is (token or sequence, e.g. token with "
                          f"rollout_is_threshold 2.0: the truncated weight π_old/π_behaviour) or rollout_rs")


def _check_model_layout(cfg: Config) -> None:
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    m = cfg.model
    if m.num_attention_heads % tp:
        raise ConfigError("model.num_attention_heads", f"{m.num_attention_heads} heads are not divisible "
                          f"by parallel.tensor_model_parallel_size={tp}")
    if m.kv_heads % tp:
        raise ConfigError("model.num_query_groups", f"{m.kv_heads} kv-heads are not divisible by "
                          f"parallel.tensor_model_parallel_size={tp}; choose a TP that divides them")
    if m.num_layers % (pp * vpp):
        raise ConfigError("model.num_layers", f"{m.num_layers} layers are not divisible by "
                          f"parallel.pipeline_model_parallel_size={pp}"
                          + (f" x virtual stages {vpp}" if vpp > 1 else ""))
    if cfg.parallel.use_distributed_optimizer and cfg.parallel.backend == "gloo" and m.params_dtype != "float32":
        raise ConfigError("model.params_dtype", "the CPU/gloo path runs in float32")


def _check_lengths(cfg: Config) -> None:
    t = cfg.trainer
    if t.ppo_mini_batch_size is not None and t.global_batch_size % t.ppo_mini_batch_size:
        raise ConfigError("trainer.ppo_mini_batch_size", f"global_batch_size={t.global_batch_size} "
                          f"is not divisible by ppo_mini_batch_size={t.ppo_mini_batch_size}")
    if cfg.rollout.max_new_tokens >= cfg.model.max_sequence_length:
        raise ConfigError("rollout.max_new_tokens", f"{cfg.rollout.max_new_tokens} leaves no room for the "
                          f"prompt within model.max_sequence_length={cfg.model.max_sequence_length}")
    if cfg.guard.early_stop_on_hacking and (cfg.data.adversarial_prompt_path is None or t.eval_interval <= 0):
        raise ConfigError("guard.early_stop_on_hacking", "the reward-hacking monitor needs "
                          "data.adversarial_prompt_path and trainer.eval_interval > 0")


def _check_replay(cfg: Config) -> None:
    if cfg.algorithm.replay.enabled and cfg.data.sft_path is None:
        raise ConfigError("algorithm.replay.coef", f"{cfg.algorithm.replay.coef} replays the SFT examples of "
                          "data.sft_path, which is not set; set it to a {prompt, response} file or coef: 0")


def _check_trust(cfg: Config) -> None:
    """The prerequisites of the trust regime named (``auto`` turns on only what its inputs allow)."""
    t = cfg.algorithm.hpa.trust
    if t.regime == "gate":
        if not component_advantages(cfg):
            raise ConfigError("algorithm.hpa.trust.regime", "gate scales the learned reward's part of the "
                              "advantage; use algorithm.advantage.estimator: grpo with per_component true")
        if cfg.data.heldout_preference_path is None:
            raise ConfigError("algorithm.hpa.trust.regime", "gate reads held-out preference pairs; set "
                              "data.heldout_preference_path (pairs kept out of data.preference_path and out "
                              "of the reward model's training)")
        if t.signal in GATE_SIGNALS_ON_REWARD_MODELS and not cfg.reward.model_paths:
            raise ConfigError("algorithm.hpa.trust.signal", f"{t.signal!r} scores the held-out chosen "
                              "responses with the reward models; set reward.model_paths or signal: heldout_nll")
    if t.regime == "coverage":
        missing = [(not component_advantages(cfg), "per-component advantages (algorithm.advantage.estimator: grpo "
                    "with per_component true)"),
                   (not cfg.reward.model_paths, "reward models (reward.model_paths), whose embeddings it reads"),
                   (cfg.data.heldout_preference_path is None, "held-out preference pairs for its calibration "
                    "(data.heldout_preference_path)")]
        for absent, what in missing:
            if absent:
                raise ConfigError("algorithm.hpa.trust.regime", f"coverage weights the learned component per "
                                  f"row and needs {what}; set it, or regime: auto or off")


def _check_rewards_and_filters(cfg: Config) -> None:
    algo = cfg.algorithm
    check_diversity_source(cfg.reward.shaping, has_reward_model=bool(cfg.reward.model_paths))
    rescaled = cfg.reward.shaping.normalize or cfg.reward.shaping.clip is not None
    if algo.advantage.per_component is True and rescaled:
        raise ConfigError("algorithm.advantage.per_component", "the components are group-normalised "
                          "separately; turn off reward.shaping.normalize and reward.shaping.clip, or set "
                          "per_component: false")
    f = algo.rollout_filter
    if cfg.rollout.n < 2 and (f.name == "dapo_groups" or (f.name == "reward_above_mean_std" and f.scope == "group")):
        what, fix = ("drops the prompts whose responses all score the same", "raise rollout.n") \
            if f.name == "dapo_groups" else ("with scope 'group' takes the mean and std of each prompt's "
                                             "responses", "raise rollout.n or set algorithm.rollout_filter.scope=batch")
        raise ConfigError("algorithm.rollout_filter.name", f"{f.name!r} {what}, which needs rollout.n >= 2 "
                          f"responses per prompt (got rollout.n={cfg.rollout.n}); {fix}")


def _check_data_parallel(cfg: Config, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("--world-size", f"must be a positive number of processes, got {world_size!r}")
    world_size = trainer_world_size(cfg.rollout, world_size)  # the trainer ranks: the checks below count them
    dp = data_parallel_size(cfg.parallel, world_size)
    if cfg.rollout.placement == "disaggregated" and cfg.rollout.num_ranks > dp:
        raise ConfigError("rollout.num_ranks", f"{cfg.rollout.num_ranks} rollout ranks for {dp} trainer DP ranks: each "
                          f"rollout rank serves at least one DP rank (and takes every weight push); use at most {dp}")
    for key, value in (("trainer.global_batch_size", cfg.trainer.global_batch_size),
                       ("sft.global_batch_size", cfg.sft.global_batch_size),
                       ("trainer.preference_batch_size", cfg.trainer.preference_batch_size),
                       *((("trainer.replay_batch_size", cfg.trainer.replay_batch_size),)
                         if cfg.algorithm.replay.enabled else ())):
        if value % dp:
            raise ConfigError(key, f"{value} is not divisible by the data-parallel size {dp} (world size "
                              f"{world_size} / TP·PP·CP); use a multiple of {dp}")
    _check_micro_batches(cfg, dp)


def update_micro_batches(cfg: Config, dp: int) -> Dict[str, int]:
    """The micro-batches of one rank's policy update per stream that ``trainer.micro_batch_size`` cuts (the
    streams without a token budget: none of them with ``trainer.ppo_max_token_len_per_rank``), all PPO epochs."""
    t = cfg.trainer
    if t.ppo_max_token_len_per_rank is not None:
        return {}
    minis = t.global_batch_size // t.ppo_mini_batch_size if t.ppo_mini_batch_size else 1
    rows = t.global_batch_size * cfg.rollout.n // dp // minis
    out = {"rollout": minis * -(-rows // t.micro_batch_size),
           "pairs": -(-(t.preference_batch_size // dp) // t.micro_batch_size)}
    if cfg.algorithm.replay.enabled:
        out["replay"] = -(-(t.replay_batch_size // dp) // t.micro_batch_size)
    return {k: v * t.ppo_epochs for k, v in out.items()}


def _check_micro_batches(cfg: Config, dp: int) -> None:
    counts = update_micro_batches(cfg, dp)
    total = sum(counts.values())
    if total > MAX_UPDATE_MICRO_BATCHES:
        parts = ", ".join(f"{v} {k}" for k, v in counts.items())
        raise ConfigError("trainer.micro_batch_size", f"{cfg.trainer.micro_batch_size} cuts each step's policy "
                          f"update into {total} micro-batches a rank ({parts}; at most {MAX_UPDATE_MICRO_BATCHES}: "
                          f"each costs the host a fixed ~5k operations); set trainer.ppo_max_token_len_per_rank "
                          f"(every stream is then cut by tokens) or raise trainer.micro_batch_size")


def check_lora(cfg: Config) -> None:
    """What LoRA over one frozen base cannot combine with (docs/lora.md): a critic that does not start from the
    base (``model.critic_path``), tied embeddings or full recomputation with a critic, a reference other than
    the base, Transformer Engine's fused layers."""
    m = cfg.model
    if not m.lora.enabled:
        return
    if cfg.algorithm.advantage.estimator == "gae":  # the critic: its own adapters + value head on the base
        if m.critic_path:
            raise ConfigError("model.critic_path", "with LoRA the critic is its own adapters and a fresh value head "
                              "over the policy's base (model.policy_path); unset model.critic_path or set "
                              "model.lora.rank: 0")
        if not m.untie_embeddings_and_output_weights:
            raise ConfigError("model.untie_embeddings_and_output_weights", "a critic needs untied embeddings "
                              "(its value head is not the embedding); set it true")
        if m.recompute_granularity == "full":
            raise ConfigError("model.recompute_granularity", "full recomputation re-runs the critic's layers in "
                              "backward, outside the block that switches the critic's adapters on; with LoRA "
                              "and a critic use selective or null")
    for target, (width_in, width_out) in linears.widths(m).items():
        if target in m.lora.target_modules and m.lora.rank > min(width_in, width_out):
            raise ConfigError("model.lora.rank", f"{m.lora.rank} is above the width of {target} ({width_out} x "
                              f"{width_in}): its update B·A has rank {min(width_in, width_out)} at most, the rest is "
                              f"parameters and memory for nothing; give at most {min(width_in, width_out)}")
    if m.reference_path and m.reference_path != m.policy_path:
        raise ConfigError("model.reference_path", "with LoRA the reference is the frozen base (model.policy_path) "
                          "with the adapters off; unset model.reference_path or set model.lora.rank: 0")
    if m.transformer_impl == "transformer_engine":
        raise ConfigError("model.transformer_impl", "LoRA adapts megatron's local parallel linears; Transformer "
                          "Engine's fused layer-norm linears are not supported: use local (or auto on CPU)")


def component_advantages(cfg: Config) -> bool:
    """Whether per-component advantages are in effect: ``algorithm.advantage.per_component``, or by default
    with ``grpo`` whenever reward models give a learned reward (rules alone: the classic GRPO advantage) and
    the shaped reward is not renormalised or clipped as a whole."""
    explicit = cfg.algorithm.advantage.per_component
    if explicit is not None:
        return explicit
    shaping = cfg.reward.shaping
    return (cfg.algorithm.advantage.estimator == "grpo" and bool(cfg.reward.model_paths)
            and not shaping.normalize and shaping.clip is None)


def trust_gate_enabled(cfg: Config) -> bool:
    """Whether the trust gate runs: ``algorithm.hpa.trust.regime`` gate, or with ``auto`` whenever
    per-component advantages are in effect and held-out preference pairs are given (and reward models, for a
    signal that reads them)."""
    t = cfg.algorithm.hpa.trust
    if t.regime != "auto":
        return t.regime == "gate"
    return component_advantages(cfg) and cfg.data.heldout_preference_path is not None \
        and (t.signal not in GATE_SIGNALS_ON_REWARD_MODELS or bool(cfg.reward.model_paths))


def coverage_enabled(cfg: Config) -> bool:
    """Whether the coverage trust runs: ``algorithm.hpa.trust.regime`` coverage, or with ``auto`` whenever
    per-component advantages are in effect and reward models and held-out preference pairs are given."""
    regime = cfg.algorithm.hpa.trust.regime
    if regime != "auto":
        return regime == "coverage"
    return component_advantages(cfg) and bool(cfg.reward.model_paths) and cfg.data.heldout_preference_path is not None


def old_log_probs_from_update(cfg: Config) -> bool:
    """Whether a step's old log-probs come from the update's own forward (``trainer.old_log_probs_from_update``):
    the old policy is the policy the update's forward runs (one PPO epoch of one mini-batch, no dropout, one
    pipeline stage) and nothing reads the old log-probs or the old pooled hidden states before the update (no
    in-reward KL, no rollout correction (``algorithm.rollout_correction``), no coverage trust, no diversity on the
    policy's embeddings, no refilling rollout filter). The KL controller's ``actor/reward_kl`` and the
    rollout/training log-prob metrics are then computed after the update, from the same values. verl's FSDP actor
    (v0.6.0 to v0.7.0, ``dp_actor.update_policy``) takes the detached log-probs the same way but still runs its
    old-policy forward."""
    t, m, a = cfg.trainer, cfg.model, cfg.algorithm
    one_update = t.ppo_epochs == 1 and (t.ppo_mini_batch_size is None or t.ppo_mini_batch_size == t.global_batch_size)
    no_dropout = m.hidden_dropout == 0 and m.attention_dropout == 0 and (m.lora.rank == 0 or m.lora.dropout == 0)
    shaping, f = cfg.reward.shaping, a.rollout_filter
    refills = f.name == "dapo_groups" and f.max_refill_rounds > 0  # the log-prob metrics are the first round's
    read_before = (a.kl.use_kl_in_reward or a.rollout_correction.enabled or coverage_enabled(cfg)
                   or (shaping.beta > 0 and shaping.diversity_source == "policy") or refills)
    return (t.old_log_probs_from_update and one_update and no_dropout and not read_before
            and cfg.parallel.pipeline_model_parallel_size == 1)


def demonstrations_needed(cfg: Config) -> bool:
    """Whether the run reads ``data.sft_path``: for the SFT replay, or for the coverage trust's measure of the
    start's skill where no pair covers a prompt (``algorithm.hpa.trust.hold_min_skill``, with a boost)."""
    c = cfg.algorithm.hpa.trust
    return cfg.algorithm.replay.enabled or (cfg.data.sft_path is not None and coverage_enabled(cfg)
                                            and c.kl_boost > 0 and c.hold_min_skill is not None)


def heldout_pairs_needed(cfg: Config) -> bool:
    """Whether a run reads the held-out preference pairs: the trust gate or the coverage calibration."""
    return trust_gate_enabled(cfg) or coverage_enabled(cfg)


def to_dict(cfg) -> dict:
    """Plain data (tuples as lists) for YAML/JSON."""

    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(cfg))
