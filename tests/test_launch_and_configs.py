"""The shipped GPU configs pass their cross-checks at their intended world sizes; the launch scripts
parse, pass config and overrides through unchanged, and forward preemption signals (run with fake
``torchrun`` / ``srun`` / ``scontrol`` / ``nvidia-smi`` executables on PATH; nothing is launched)."""

import dataclasses
import os
import pathlib
import signal
import stat
import subprocess
import time

import pytest

from hpa.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
SLURM_SBATCH = ROOT / "launch" / "slurm.sbatch"
SLURM_DISAGGREGATED = ROOT / "launch" / "slurm_disaggregated.sbatch"

# config -> world size it is meant for
CONFIGS = {"llama2_7b.yaml": 8, "llama2_70b.yaml": 64}


def fake(bin_dir: pathlib.Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "torchrun", 'printf "%s\\n" "$@"\n')
    fake(bin_dir, "nvidia-smi", 'echo "GPU 0: fake"; echo "GPU 1: fake"; echo "GPU 2: fake"\n')
    fake(bin_dir, "scontrol", 'if [[ "$1" == show ]]; then printf "gpu017\\ngpu018\\n"; '
                              'else echo "scontrol $*" >> "$FAKE_LOG"; fi\n')
    return bin_dir


def env_with(bin_dir, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", **extra)
    return env


@pytest.mark.parametrize("name,world_size", CONFIGS.items())
def test_config_cross_checks_at_intended_world_size(name, world_size):
    cfg = load_config(ROOT / "configs" / name, world_size=world_size)
    assert cfg.model.params_dtype == "bfloat16"
    # the recipe's 0.85 assumes rollout GPUs of their own; colocated, the share is what hpa plan leaves
    assert cfg.rollout.engine == "vllm" and cfg.rollout.colocate and 0 < cfg.rollout.gpu_memory_utilization < 0.85
    assert cfg.rollout.n == 4 and cfg.rollout.temperature == 0.7
    assert cfg.optim.lr == 1e-6 and cfg.optim.clip_grad == 1.0
    assert cfg.algorithm.ppo.clip_ratio == 0.2 and cfg.algorithm.ppo.clip_ratio_c == 3.0
    assert cfg.algorithm.dpo.beta == 0.1 and cfg.algorithm.kl.target_kl == 0.015
    assert cfg.parallel.use_distributed_optimizer
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    assert world_size % (tp * pp) == 0
    assert cfg.rollout.max_new_tokens + cfg.data.max_prompt_length <= cfg.model.max_sequence_length


def test_llama2_shapes():
    m7 = load_config(ROOT / "configs" / "llama2_7b.yaml").model
    assert (m7.num_layers, m7.hidden_size, m7.num_attention_heads, m7.kv_heads, m7.ffn_hidden_size,
            m7.vocab_size, m7.max_sequence_length) == (32, 4096, 32, 32, 11008, 32000, 4096)
    cfg70 = load_config(ROOT / "configs" / "llama2_70b.yaml")
    m70 = cfg70.model
    assert (m70.num_layers, m70.hidden_size, m70.num_attention_heads, m70.kv_heads, m70.ffn_hidden_size,
            m70.vocab_size) == (80, 8192, 64, 8, 28672, 32000)
    assert (cfg70.parallel.tensor_model_parallel_size, cfg70.parallel.pipeline_model_parallel_size) == (8, 8)
    assert m70.recompute_granularity == "full"
    assert load_config(ROOT / "configs" / "llama2_7b.yaml").rollout.vllm_tensor_parallel_size == 2


def test_70b_layout_is_refused_on_one_node():
    with pytest.raises(ConfigError, match="not divisible by TP"):
        load_config(ROOT / "configs" / "llama2_70b.yaml", world_size=8)


@pytest.mark.parametrize("name", [*CONFIGS, "llama2_70b_lora.yaml"])
def test_placeholder_paths_are_documented(name):
    text = (ROOT / "configs" / name).read_text()
    cfg = load_config(ROOT / "configs" / name)
    for key in ("tokenizer_path", "prompt_path", "preference_path"):
        assert getattr(cfg.data, key).startswith("/path/to/"), key
    assert cfg.model.policy_path.startswith("/path/to/")
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert "/path/to/" in header and "Replace the placeholder paths" in header


def test_recompute_granularity_is_validated():
    with pytest.raises(ConfigError, match="recompute_granularity"):
        load_config(ROOT / "configs" / "llama2_7b.yaml", ["model.recompute_granularity=everything"])


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH, SLURM_DISAGGREGATED], ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_torchrun_passes_config_nproc_and_overrides(fake_bin):
    overrides = ["trainer.total_steps=3", "logging.wandb.name=my run", "optim.lr=2e-6"]
    out = subprocess.run(["bash", str(TORCHRUN_SH), "configs/llama2_7b.yaml", "8", *overrides], cwd=ROOT,
                         env=env_with(fake_bin), capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["--standalone", "--nproc_per_node", "8", "--max-restarts", "3", "-m", "hpa.cli",
                                "train", "--config", "configs/llama2_7b.yaml", *overrides]


def test_torchrun_defaults_to_the_visible_gpus(fake_bin):
    out = subprocess.run(["bash", str(TORCHRUN_SH), "configs/tiny_cpu.yaml", "trainer.total_steps=2"], cwd=ROOT,
                         env=env_with(fake_bin, HPA_COMMAND="sft", HPA_MAX_RESTARTS="0"), capture_output=True,
                         text=True, check=True).stdout
    assert out.splitlines() == ["--standalone", "--nproc_per_node", "3", "--max-restarts", "0", "-m", "hpa.cli",
                                "sft", "--config", "configs/tiny_cpu.yaml", "trainer.total_steps=2"]


def test_torchrun_refuses_a_missing_config(fake_bin):
    proc = subprocess.run(["bash", str(TORCHRUN_SH), "configs/nope.yaml"], cwd=ROOT, env=env_with(fake_bin),
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no such config file" in proc.stderr


def test_sbatch_header_and_signal_trap():
    text = SLURM_SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text
    assert "trap 'forward USR1' USR1" in text and "trap 'forward TERM' TERM" in text
    assert "--kill-on-bad-exit" in text and "--rdzv_backend c10d" in text
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1" in text
    assert "8 nodes x 8 GPUs" in text


def slurm_env(fake_bin, log, **extra):
    return env_with(fake_bin, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[017-018]", SLURM_JOB_NUM_NODES="2",
                    SLURM_GPUS_ON_NODE="4", FAKE_LOG=str(log), **extra)


def test_sbatch_starts_one_torchrun_per_node_with_overrides(fake_bin, tmp_path):
    log = tmp_path / "srun.log"
    fake(fake_bin, "srun", 'printf "%s\\n" "$@" > "$FAKE_LOG"\n'
                           'echo "shared store off: $TORCH_DISABLE_SHARE_RDZV_TCP_STORE" >> "$FAKE_LOG"\n')
    subprocess.run(["bash", str(SLURM_SBATCH), "configs/llama2_70b.yaml", "trainer.total_steps=5",
                    "trainer.run_dir=/scratch/a b"], cwd=ROOT, env=slurm_env(fake_bin, log, HPA_MAX_RESTARTS="2"),
                   capture_output=True, text=True, check=True)
    *args, shared = log.read_text().splitlines()
    assert shared == "shared store off: 1"  # each rendezvous round of a restart gets a fresh store
    assert args[:5] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "torchrun"]
    torchrun = args[5:]
    joined = " ".join(torchrun)
    assert "--nnodes 2 --nproc_per_node 4 --rdzv_id 4242 --rdzv_backend c10d" in joined
    assert f"--rdzv_endpoint gpu017:{20000 + 4242 % 20000}" in joined
    assert "--max-restarts 2" in joined
    assert "SIGUSR1" in joined
    assert torchrun[-7:] == ["-m", "hpa.cli", "train", "--config", "configs/llama2_70b.yaml",
                             "trainer.total_steps=5", "trainer.run_dir=/scratch/a b"]


def test_disaggregated_sbatch_gives_the_last_nodes_gpus_to_the_rollout_ranks(fake_bin, tmp_path):
    log = tmp_path / "srun.log"
    fake(fake_bin, "srun", 'printf "%s\\n" "$@" > "$FAKE_LOG"\n')
    proc = subprocess.run(["bash", str(SLURM_DISAGGREGATED), "configs/llama2_7b.yaml", "trainer.total_steps=5"],
                          cwd=ROOT, env=slurm_env(fake_bin, log), capture_output=True, text=True, check=True)
    assert "1 trainer node(s), 1 rollout node(s) x 4 GPUs" in proc.stdout
    args = log.read_text().splitlines()
    assert args[:5] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "torchrun"]
    assert "--nnodes 2 --nproc_per_node 4" in " ".join(args)
    # 2 nodes x 4 GPUs: the 4 GPUs of one node sample; the user's overrides come after (and win)
    assert args[-8:] == ["-m", "hpa.cli", "train", "--config", "configs/llama2_7b.yaml",
                         "rollout.placement=disaggregated", "rollout.num_ranks=4", "trainer.total_steps=5"]
    for nodes in ("0", "2", "x"):
        bad = subprocess.run(["bash", str(SLURM_DISAGGREGATED), "configs/llama2_7b.yaml"], cwd=ROOT,
                             env=slurm_env(fake_bin, log, HPA_ROLLOUT_NODES=nodes), capture_output=True, text=True)
        assert bad.returncode == 2 and "HPA_ROLLOUT_NODES" in bad.stderr, (nodes, bad.stderr)


def test_disaggregated_sbatch_example_fits_what_its_comment_says():
    """The header's example (2 nodes x 8 GPUs of 80 GB, 8 rollout ranks) passes the cross-checks and fits, with
    the plan's numbers the comment quotes."""
    import re

    from hpa.plan import plan

    header = SLURM_DISAGGREGATED.read_text()
    example = re.search(r"launch/slurm_disaggregated.sbatch configs/llama2_7b.yaml (.*?)trainer.run_dir",
                        header, re.S).group(1)
    overrides = [o for o in example.replace("\\", " ").split() if "=" in o]
    assert "rollout.engine=megatron" in overrides and "model.lora.rank=16" in overrides
    cfg = load_config(ROOT / "configs" / "llama2_7b.yaml",
                      [*overrides, "rollout.placement=disaggregated", "rollout.num_ranks=8"], world_size=16)
    result = plan(cfg, world_size=16, gpu_memory_gb=80)
    assert result["fits"] and result["layout"]["data_parallel_size"] == 8
    assert f"{result['total_gb']:.2f} GB per trainer rank" in header
    assert f"{result['rollout_ranks']['total_gb']:.2f} GB per rollout rank" in header


def test_sbatch_forwards_usr1_to_the_step_and_requeues(fake_bin, tmp_path):
    log = tmp_path / "srun.log"
    fake(fake_bin, "srun", 'trap \'echo "srun got USR1" >> "$FAKE_LOG"; exit 0\' USR1\n'
                           'echo started >> "$FAKE_LOG"\n'
                           'for i in $(seq 300); do sleep 0.1; done\nexit 3\n')
    proc = subprocess.Popen(["bash", str(SLURM_SBATCH), "configs/llama2_70b.yaml"], cwd=ROOT,
                            env=slurm_env(fake_bin, log, HPA_REQUEUE="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20
        while not (log.exists() and "started" in log.read_text()):
            assert time.time() < deadline, "the fake srun never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = log.read_text().splitlines()
    assert "srun got USR1" in lines and "scontrol requeue 4242" in lines
    assert "received SIGUSR1" in err


def test_gpu_check_config_is_qwen2_0_5b_shaped_for_one_gpu():
    """``configs/qwen2_0.5b_gpu_check.yaml`` (bench/gpu_check.sh): Qwen2-0.5B's 494,032,768 parameters,
    one GPU, bf16, the local layer spec and the native engine (neither TE nor vLLM on the check machine)."""
    from hpa.plan import count_parameters

    cfg = load_config(ROOT / "configs" / "qwen2_0.5b_gpu_check.yaml", world_size=1)
    assert count_parameters(cfg.model) == 494_032_768
    assert (cfg.model.params_dtype, cfg.model.transformer_impl, cfg.rollout.engine) == ("bfloat16", "local", "megatron")
    assert cfg.parallel.backend == "nccl" and cfg.algorithm.advantage.estimator == "grpo"
    # what the check exercises: packed rows (varlen attention) and graph decode (gpu_check.py fails without)
    assert cfg.trainer.sequence_packing and cfg.rollout.cuda_graphs


def test_gpu_perf_config_is_the_check_model_at_a_step_worth_measuring():
    """``configs/qwen2_0.5b_gpu_perf.yaml`` (bench/gpu_perf.sh): the GPU check's model and paths, at 64 prompts x 4
    responses (256 rows) of up to 256 new tokens, 64 pairs, token budgets, the balance measured at step 1 only
    (no timed step of bench/gpu_perf.py's 3-5 is a measured one), and a plan that fits one 80 GB GPU."""
    from hpa.plan import plan

    check = load_config(ROOT / "configs" / "qwen2_0.5b_gpu_check.yaml", world_size=1)
    cfg = load_config(ROOT / "configs" / "qwen2_0.5b_gpu_perf.yaml", world_size=1)
    assert cfg.model == check.model and cfg.parallel == check.parallel
    assert (cfg.rollout.engine, cfg.rollout.cuda_graphs, cfg.trainer.sequence_packing) == ("megatron", True, True)
    assert cfg.trainer.global_batch_size * cfg.rollout.n == 256 and cfg.rollout.max_new_tokens == 256
    assert cfg.trainer.preference_batch_size == 64 and cfg.algorithm.hpa.balance.measure_steps == 1
    assert cfg.trainer.peak_tflops_per_device is None  # the device's own peak
    # the update's budget: 24k tokens (32k does not fit 80 GB by the plan), the forward-only passes' 32k
    assert (cfg.trainer.ppo_max_token_len_per_rank, cfg.trainer.log_prob_max_token_len_per_rank) == (24576, 32768)
    assert plan(cfg, world_size=1, gpu_memory_gb=80)["fits"]
    wider = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, ppo_max_token_len_per_rank=32768))
    assert not plan(wider, world_size=1, gpu_memory_gb=80)["fits"]


# every training config shipped in configs/ -> a world size it is meant for
TRAIN_CONFIGS = {**CONFIGS, "llama2_70b_lora.yaml": 8, "tiny_cpu.yaml": 1, "qwen2_0.5b_gpu_check.yaml": 1,
                 "qwen2_0.5b_gpu_perf.yaml": 1}


def test_every_training_config_is_listed():
    shipped = {p.name for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("ablate_")}
    assert shipped == set(TRAIN_CONFIGS)


@pytest.mark.parametrize("name,world_size", TRAIN_CONFIGS.items())
def test_every_training_config_passes_the_cross_checks(name, world_size):
    """Red on the first GPU run: ``qwen2_0.5b_gpu_check.yaml`` asked for diversity from reward-model
    embeddings without a reward model, which only the reward's construction noticed, after the models
    were built."""
    load_config(ROOT / "configs" / name, world_size=world_size)


def test_diversity_from_reward_model_embeddings_needs_a_reward_model():
    with pytest.raises(ConfigError, match="reward.shaping.diversity_source"):
        load_config(None, ["reward.model_paths=[]", "reward.rules=[exact_match]", "reward.shaping.beta=0.2",
                           "reward.shaping.diversity_source=reward_model"], world_size=1)
    load_config(None, ["reward.model_paths=[]", "reward.rules=[exact_match]", "reward.shaping.beta=0",
                       "reward.shaping.diversity_source=reward_model"], world_size=1)


@pytest.mark.parametrize("seed", ["08", "010", "-1", "abc", "4294966062", "99999999999999999999"])
def test_demo_sh_refuses_a_seed_that_is_not_a_bounded_decimal(seed, tmp_path):
    """Before any step runs: bash reads 010 as octal, 08 not at all, and a huge value wraps around."""
    env = {**os.environ, "DEMO_SEED": seed}
    proc = subprocess.run(["bash", "launch/demo.sh", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 2 and "DEMO_SEED must be a decimal integer" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_demo_sh_names_the_freetext_family_among_the_valid_ones(tmp_path):
    """An unknown DEMO_FAMILY is refused before any step runs, the message listing every family."""
    env = {**os.environ, "DEMO_FAMILY": "prose"}
    proc = subprocess.run(["bash", "launch/demo.sh", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 2, proc.stderr
    assert "DEMO_FAMILY must be standard, hackable, split or freetext, got 'prose'" in proc.stderr
    assert not (tmp_path / "out").exists()
