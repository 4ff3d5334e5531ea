"""LoRA adapters loaded the wrong way are refused by name, and forward-only passes run without dropout
(one in-process gloo rank, a tiny model made here):

* forward-only passes (old policy, reference) run without dropout: with ``model.lora.dropout`` and megatron's own
  dropout on, the old policy's log-probs equal the native sampler's and the reference's equal the base's;
* the base's fingerprint in ``lora.json``: adapters over another base are refused (``model.lora.adapter_path``,
  resume, ``convert --base-dir``), an old ``lora.json`` without it is a warning;
* every adapter of a file lands and every target gets one (adapter checkpoints and PEFT imports);
* resuming with another rank or alpha is refused naming the key, by ``hpa train`` before any model is built
  (the checkpoint ``checkpoint.resume`` picks, its ``lora.json`` read at start-up), and by the load itself.
"""

import dataclasses
import json
import logging

import pytest
import torch

VOCAB = 64


def model_config(**lora):
    from hpa.config.schema import LoRAConfig, ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16,
                       lora=LoRAConfig(**{"rank": 4, "alpha": 8.0, **lora}))


def lora_model(groups, base_dir, cfg=None):
    from hpa.config.schema import ParallelConfig
    from hpa.models.lora_io import build_lora_model

    return build_lora_model(cfg or model_config(), ParallelConfig(), groups, str(base_dir))


def randomize_b(model, seed=1):
    from hpa.models.lora import adapters

    torch.manual_seed(seed)
    with torch.no_grad():  # B = 0 would make any adapter mix-up invisible
        for _, a in adapters(model):
            a.B.normal_(0, 0.2)


@pytest.fixture(scope="module")
def bases(groups, tmp_path_factory):
    """Two random bases of the same shape, and adapters trained (random B) over the first."""
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.lora_io import save_adapters
    from hpa.models.weights import save_model_weights

    root = tmp_path_factory.mktemp("lora_checks")
    for seed, name in ((0, "base_a"), (1, "base_b")):
        torch.manual_seed(seed)
        save_model_weights(build_policy(model_config(), ParallelConfig(), groups), root / name, groups)
    model = lora_model(groups, root / "base_a")
    randomize_b(model)
    save_adapters(model, root / "adapters", groups)
    return root


def config_file(path, cfg, base_dir):
    """A run's YAML (the embedded default's) with this model section over ``base_dir``."""
    import yaml

    from hpa.config.load import default_config_path

    data = yaml.safe_load(default_config_path().read_text())
    data["model"] = {**json.loads(json.dumps(dataclasses.asdict(cfg))), "policy_path": str(base_dir)}
    data["data"].update(max_prompt_length=16, max_response_length=8)  # within the tiny model's 32 positions
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# dropout: forward-only passes run in eval mode


def test_old_policy_and_reference_log_probs_run_without_dropout(groups, bases):
    from hpa.config.schema import ParallelConfig, RolloutConfig
    from hpa.engine import forward
    from hpa.engine.batching import Batching
    from hpa.models import build_policy
    from hpa.models.lora import BaseView
    from hpa.models.weights import load_model_weights
    from hpa.rollout import SamplingParams, TokenizerInfo, build_rollout_engine

    cfg = dataclasses.replace(model_config(dropout=0.1), hidden_dropout=0.1)
    model = lora_model(groups, bases / "base_a", cfg)
    randomize_b(model)
    engine = build_rollout_engine(RolloutConfig(), model, groups, TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=0), model_cfg=cfg)
    prompts = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4)).tolist()
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=3))
    model.train()  # the trainer's mode after sampling
    kw = dict(batching=Batching(micro_batch_size=2, pad_id=0), vocab_size=VOCAB, temperature=1.0)
    ts = batch.training_sequences()
    old = forward.sequence_log_probs(model, ts, batch.response_mask, groups, **kw)["log_probs"]
    mask = batch.response_mask.bool()
    torch.testing.assert_close(old[mask], batch.log_probs[mask].float(), atol=1e-5, rtol=0)
    assert model.training and all(m.training for m in model.modules())  # its mode back after

    plain = build_policy(cfg, ParallelConfig(), groups)
    load_model_weights(plain, bases / "base_a", groups)
    base = forward.sequence_log_probs(plain.eval(), ts, batch.response_mask, groups, **kw)["log_probs"]
    reference = forward.sequence_log_probs(BaseView(model), ts, batch.response_mask, groups, **kw)["log_probs"]
    torch.testing.assert_close(reference[mask], base[mask], atol=1e-5, rtol=0)
    assert (old[mask] - base[mask]).abs().max() > 1e-3  # the adapters matter

    # the critic's values for GAE: its view holds the base outside its module tree, and its mode too
    from hpa.models.builders import value_head
    from hpa.models.lora import CriticView, adapters

    critic = CriticView(model, cfg.lora, groups, head=value_head(cfg, groups), seed=5).train()
    with torch.no_grad():
        for a in critic.adapters.values():
            a.B.normal_(0, 0.2)
    values = [forward.sequence_values(critic, ts, groups, batching=kw["batching"]) for _ in range(2)]
    assert torch.equal(values[0], values[1])  # no dropout mask drawn
    assert model.training and all(a.dropout.training for _, a in adapters(model))


# ---------------------------------------------------------------------------------------------------------------
# the base's fingerprint


def test_adapters_over_another_base_are_refused_by_name(groups, bases):
    from hpa.models.lora import LoRAError
    from hpa.models.lora_io import load_adapters

    marker = json.loads((bases / "adapters" / "lora.json").read_text())
    assert marker["base"]["config"]["hidden_size"] == 32 and marker["base"]["num_elements"] > 0
    load_adapters(lora_model(groups, bases / "base_a"), bases / "adapters", groups)  # its own base
    with pytest.raises(LoRAError, match=r"^model.policy_path: the base has other weights .*checksum"):
        load_adapters(lora_model(groups, bases / "base_b"), bases / "adapters", groups)


def test_the_fingerprint_is_the_same_for_fp32_and_bf16_and_another_base_differs(groups, bases):
    from hpa.models.lora import base_fingerprint

    a32 = base_fingerprint(lora_model(groups, bases / "base_a"), groups)
    bf16 = lora_model(groups, bases / "base_a")
    for p in bf16.parameters():  # the base held in bf16 (CPU models are built in fp32)
        p.data = p.data.to(torch.bfloat16)
    a16 = base_fingerprint(bf16, groups)
    b32 = base_fingerprint(lora_model(groups, bases / "base_b"), groups)
    assert a32 == a16 and a32["checksum"] != b32["checksum"] and a32["config"] == b32["config"]


def test_an_old_marker_without_fingerprint_is_a_warning(groups, bases, tmp_path, caplog):
    import shutil

    from hpa.models.lora_io import load_adapters

    old = tmp_path / "old"
    shutil.copytree(bases / "adapters", old)
    marker = json.loads((old / "lora.json").read_text())
    del marker["base"]
    (old / "lora.json").write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING):
        load_adapters(lora_model(groups, bases / "base_b"), old, groups)
    assert "records no fingerprint of the base" in caplog.text


def test_convert_over_another_base_dir_is_refused_naming_it(groups, bases, tmp_path):
    from hpa.models.convert import run_convert
    from hpa.models.lora import LoRAError

    config = config_file(tmp_path / "config.yaml", model_config(), bases / "base_a")
    with pytest.raises(LoRAError, match="^--base-dir: the base has other weights"):
        run_convert(["megatron-to-hf", "--megatron-dir", str(bases / "adapters"), "--out", str(tmp_path / "hf"),
                     "--config", config, "--base-dir", str(bases / "base_b")], groups=groups)


def _trainable(groups, base_dir, cfg):
    from hpa.config.schema import OptimConfig, ParallelConfig
    from hpa.engine.optimizer import build_optimizer, wrap_ddp

    ddp = wrap_ddp(lora_model(groups, base_dir, cfg), ParallelConfig(), groups)
    return ddp, build_optimizer(ddp, OptimConfig(lr=1e-2), ParallelConfig(), groups)


@pytest.fixture(scope="module")
def run_checkpoint(groups, bases, tmp_path_factory):
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager

    import lora_workers

    manager = CheckpointManager(CheckpointConfig(), tmp_path_factory.mktemp("lora_resume"), groups)
    ddp, opt = _trainable(groups, bases / "base_a", model_config())
    lora_workers.train_steps(ddp, opt, groups, 1)  # Adam's state exists
    path = manager.save(1, {"policy": (ddp, opt)}, {"step": 1, "layout": groups.layout})
    return manager, path


@pytest.mark.parametrize("base,cfg,match", [
    ("base_b", model_config(), r"^model.policy_path: the base has other weights"),
    ("base_a", model_config(alpha=16.0), r"^model.lora.alpha: .* trained at 2.0"),
    ("base_a", model_config(rslora=True), r"^model.lora.alpha: .*rslora"),
    ("base_a", model_config(rank=8, alpha=16.0), r"^model.lora.rank: 8, but .* rank 4"),
    ("base_a", model_config(target_modules=("linear_qkv",)), r"^model.lora.target_modules: \['linear_qkv'\]"),
], ids=["other_base", "other_alpha", "rslora", "other_rank", "other_targets"])
def test_resume_with_another_base_or_lora_settings_is_refused_by_key(groups, bases, run_checkpoint, base, cfg, match):
    from hpa.models.lora import LoRAError

    manager, path = run_checkpoint
    with pytest.raises(LoRAError, match=match):
        manager.load(path, {"policy": _trainable(groups, bases / base, cfg)})


def test_resume_over_its_own_base_and_settings_loads(groups, bases, run_checkpoint):
    manager, path = run_checkpoint
    manager.load(path, {"policy": _trainable(groups, bases / "base_a", model_config())})


@pytest.fixture
def no_model(monkeypatch):
    """``hpa train`` fails the test if it gets as far as building a model: its process group comes first."""
    import hpa.distributed

    def launched(*args, **kwargs):
        raise AssertionError("a model was about to be built")

    monkeypatch.setattr(hpa.distributed, "launched", launched)


def _train_argv(tmp_path, run_checkpoint, bases, cfg, *overrides):
    """``hpa train`` over the run that wrote ``run_checkpoint`` (its run_dir), with ``cfg``'s model section."""
    for name in ("tok.model", "prompts.jsonl", "prefs.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("{}\n")  # read only after the start-up checks
    _, path = run_checkpoint
    return ["train", "--config", config_file(tmp_path / "config.yaml", cfg, bases / "base_a"),
            f"trainer.run_dir={path.parent.parent}", f"data.tokenizer_path={tmp_path / 'tok.model'}",
            f"data.prompt_path={tmp_path / 'prompts.jsonl'}", f"data.preference_path={tmp_path / 'prefs.jsonl'}",
            f"data.eval_prompt_path={tmp_path / 'eval.jsonl'}", *overrides]


@pytest.mark.parametrize("cfg,overrides,needles", [
    (model_config(alpha=16.0), [], ("config key 'model.lora.alpha'", "trained at 2.0", "checkpoint.resume=auto")),
    (model_config(rslora=True), [], ("config key 'model.lora.alpha'", "rslora", "trained at 2.0")),
    (model_config(rank=8, alpha=16.0), [], ("config key 'model.lora.rank'", "8, but", "rank 4")),
    (model_config(target_modules=("linear_qkv",)), [],
     ("config key 'model.lora.target_modules'", "['linear_qkv'], but", "linear_fc1")),
    (model_config(rank=0), [], ("config key 'model.lora.rank'", "holds LoRA adapters", "rank: 4")),
    (dataclasses.replace(model_config(), num_layers=3), [], ("config key 'model.num_layers'", "3, but", "num_layers 2")),
    (model_config(alpha=16.0), ["checkpoint.resume=PATH"], ("config key 'model.lora.alpha'", "checkpoint.resume=")),
], ids=["other_alpha", "rslora", "other_rank", "other_targets", "lora_off", "other_shape", "resume_path"])
def test_hpa_train_refuses_a_resume_with_other_lora_settings_before_any_model_is_built(
        tmp_path, bases, run_checkpoint, no_model, capsys, cfg, overrides, needles):
    from hpa.cli import main

    overrides = [o.replace("PATH", str(run_checkpoint[1])) for o in overrides]
    code = main(_train_argv(tmp_path, run_checkpoint, bases, cfg, *overrides))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_hpa_train_resuming_with_its_own_settings_gets_to_the_model(tmp_path, bases, run_checkpoint, no_model):
    from hpa.cli import main

    with pytest.raises(AssertionError, match="about to be built"):
        main(_train_argv(tmp_path, run_checkpoint, bases, model_config()))
    with pytest.raises(AssertionError, match="about to be built"):  # a new run: nothing is resumed
        main(_train_argv(tmp_path, run_checkpoint, bases, model_config(alpha=16.0), "checkpoint.resume=never"))


# ---------------------------------------------------------------------------------------------------------------
# every adapter lands, every target gets one


def test_adapters_on_other_targets_are_refused_listing_them(groups, bases, tmp_path):
    import shutil

    from hpa.models.lora import LoRAError
    from hpa.models.lora_io import AdapterImportError, load_adapters

    qkv = model_config(target_modules=("linear_qkv",))
    with pytest.raises(LoRAError, match=r"^model.lora.target_modules: \['linear_qkv'\], but .* holds adapters on "
                                        r"\['linear_fc1', 'linear_fc2', 'linear_proj', 'linear_qkv'\]"):
        load_adapters(lora_model(groups, bases / "base_a", qkv), bases / "adapters", groups)
    old = tmp_path / "old"  # a lora.json that records no targets: the stored keys decide
    shutil.copytree(bases / "adapters", old)
    marker = json.loads((old / "lora.json").read_text())
    del marker["target_modules"]
    (old / "lora.json").write_text(json.dumps(marker))
    with pytest.raises(AdapterImportError, match=r"adapters in the file without a target \[.*linear_fc1_lora.A"):
        load_adapters(lora_model(groups, bases / "base_a", qkv), old, groups)


def test_a_peft_adapter_with_modules_outside_the_targets_is_refused(groups, bases, tmp_path):
    from hpa.config.schema import ParallelConfig
    from hpa.models.lora_io import AdapterImportError, export_peft_adapter, import_peft_checkpoint

    model = lora_model(groups, bases / "base_a")
    randomize_b(model)
    cfg = model_config()
    export_peft_adapter(model, cfg, cfg.lora, groups, tmp_path / "peft")
    config = config_file(tmp_path / "qkv.yaml", model_config(target_modules=("linear_qkv",)), bases / "base_a")
    with pytest.raises(AdapterImportError, match=r"leaves out .*o_proj.*add \['linear_fc1', 'linear_fc2', "
                                                 r"'linear_proj'\] to model.lora.target_modules"):
        import_peft_checkpoint(str(tmp_path / "peft"), config, str(tmp_path / "out"), ParallelConfig(), groups)
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_hpa_convert_over_another_base_exits_2_with_one_line(bases, tmp_path):
    """Through the command: exit 2, one line naming the flag, no traceback."""
    import os
    import subprocess
    import sys

    config = config_file(tmp_path / "config.yaml", model_config(), bases / "base_a")
    proc = subprocess.run([sys.executable, "-m", "hpa.cli", "convert", "megatron-to-hf", "--megatron-dir",
                           str(bases / "adapters"), "--out", str(tmp_path / "hf"), "--config", config, "--base-dir",
                           str(bases / "base_b"), "--backend", "gloo"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hpa convert:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and "--base-dir: the base has other weights" in lines[0], proc.stderr[-3000:]
