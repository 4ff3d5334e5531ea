"""Every entry point given a bad argument prints one line naming what is wrong, never a traceback; ``hpa
ablate`` refuses a bad file, variant, seed or metric before any run starts; start-up path checks and
warnings name the key."""

import json
import subprocess
import sys

import pytest

from hpa import ablate
from hpa.cli import main
from hpa.config import ConfigError, load_config
from hpa.config.startup import check_paths, config_warnings


@pytest.fixture
def data(tmp_path):
    """Files where the training config reads them (their content is never read by these checks)."""
    names = ("tok.model", "prompts.jsonl", "prefs.jsonl", "eval.jsonl", "heldout.jsonl", "sft.jsonl")
    for name in names:
        (tmp_path / name).write_text(f'{{"name": "{name}"}}\n')
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "metadata.json").write_text("{}")
    (tmp_path / "rm" / "hpa_reward_model.json").write_text('{"num_heads": 3}')
    return [f"data.tokenizer_path={tmp_path / 'tok.model'}", f"data.prompt_path={tmp_path / 'prompts.jsonl'}",
            f"data.preference_path={tmp_path / 'prefs.jsonl'}", f"data.eval_prompt_path={tmp_path / 'eval.jsonl'}",
            f"data.sft_path={tmp_path / 'sft.jsonl'}"]


def _one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_check_config_bad_arguments(tmp_path, capsys):
    for argv, needles in [(["--config", str(tmp_path / "missing.yaml")], ("no such config file",)),
                          (["--config", str(tmp_path)], ("is a directory",)),
                          (["optim.lr=.nan"], ("optim.lr", "command line", "finite")),
                          (["trainer.seed=-1"], ("trainer.seed", "command line", "4294967295")),
                          (["algorithm.hpa.trust.regime=gate"], ("algorithm.hpa.trust.regime", "command line")),
                          (["algorithm.hpa.gate.kp=3"], ("algorithm.hpa.gate.kp", "GATE_KP", "command line"))]:
        _one_line_error(capsys, main(["check-config", *argv]), *needles)


@pytest.mark.parametrize("argv,needles", [
    (["rollout.max_staleness=-1"], ("rollout.max_staleness", ">= 0")),
    (["--world-size", "2", "rollout.placement=disaggregated", "rollout.num_ranks=2"],
     ("rollout.num_ranks", "leave no trainer rank")),
    (["--world-size", "3", "rollout.placement=disaggregated", "rollout.num_ranks=1",
      "parallel.tensor_model_parallel_size=2"], ("rollout.placement", "tensor and pipeline parallel size 1")),
    (["rollout.placement=disaggregated", "rollout.num_ranks=1", "rollout.engine=vllm",
      "rollout.vllm_tensor_parallel_size=2"], ("rollout.vllm_tensor_parallel_size", "TP 1")),
])
def test_check_config_refuses_a_launch_that_cannot_be_split(argv, needles, capsys):
    _one_line_error(capsys, main(["check-config", *argv]), *needles)


@pytest.mark.parametrize("command", ["train", "sft", "train-rm", "generate", "serve"])
def test_a_missing_path_names_its_key_at_start_up(command, data, tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    extra = ["--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "o.jsonl")] \
        if command == "generate" else []
    key = {"train": "data.preference_path", "sft": "data.sft_path", "train-rm": "data.preference_path",
           "generate": "model.policy_path", "serve": "model.policy_path"}[command]
    code = main([command, *extra, *data, f"{key}={missing}"])
    _one_line_error(capsys, code, key, "command line", "does not exist")


def test_reward_models_and_directories_name_their_key(data, tmp_path):
    cfg = load_config(None, [*data, f"reward.model_paths=[{tmp_path / 'rm'}, {tmp_path / 'gone'}]"])
    with pytest.raises(ConfigError, match=r"reward\.model_paths\[1\].*does not exist"):
        check_paths(cfg, "train")
    cfg = load_config(None, [*data, f"reward.model_paths=[{tmp_path / 'tok.model'}]"])
    with pytest.raises(ConfigError, match=r"reward\.model_paths\[0\].*is a file"):
        check_paths(cfg, "train")
    cfg = load_config(None, [*data, f"data.prompt_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"data\.prompt_path.*is a directory"):
        check_paths(cfg, "train")
    with pytest.raises(ConfigError, match="data.sft_path.*not set"):
        check_paths(load_config(None, [*data, "data.sft_path=null"]), "sft")
    # train reads the SFT examples to replay them (algorithm.replay, on by default when they are given) and to
    # measure the start's skill where no pair covers (coverage.hold_min_skill); with neither it does not
    gone = f"data.sft_path={tmp_path / 'gone.jsonl'}"
    check_paths(load_config(None, [*data, gone, "algorithm.replay.coef=0"]), "train")
    with pytest.raises(ConfigError, match=r"data\.sft_path.*does not exist"):
        check_paths(load_config(None, [*data, gone]), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"reward\.model_paths\[0\].*not a reward model checkpoint"):
        check_paths(load_config(None, [*data, f"reward.model_paths=[{tmp_path / 'empty'}]"]), "train")
    with pytest.raises(ConfigError, match=r"reward\.num_heads.*has 3 heads"):
        check_paths(load_config(None, [*data, f"reward.model_paths=[{tmp_path / 'rm'}]"]), "train")
    check_paths(load_config(None, [*data, f"reward.model_paths=[{tmp_path / 'rm'}]", "reward.num_heads=3"]), "train")


def test_report_bad_run_dir(tmp_path, capsys):
    _one_line_error(capsys, main(["report", str(tmp_path / "none")]), "hpa report")


def test_generate_names_a_missing_prompts_file(data, tmp_path, capsys):
    code = main(["generate", "--prompts", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o"), *data])
    _one_line_error(capsys, code, "--prompts", "is not a file")


def test_the_cli_in_a_process_of_its_own_prints_no_traceback(tmp_path):
    for argv in (["check-config", "--world-size", "0"], ["check-config", "serve.port=.nan"],
                 ["ablate", "--config", str(tmp_path / "missing.yaml")], ["ablate", "--config", str(tmp_path)]):
        proc = subprocess.run([sys.executable, "-m", "hpa.cli", *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]  # argparse's usage lines come before its error
        assert last.startswith("hpa ") and ("--world-size" in last or "serve.port" in last or "ablation" in last)


# -------------------------------------------------------------------------------------------- ablate


@pytest.fixture
def no_runs(monkeypatch):
    """Fails the test if any run would start."""
    def execute(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(ablate, "execute", execute)


def _ablation(tmp_path, data, **section):
    spec = {"overrides": data, "variants": ["hpa"], "seeds": [1, 2], "out_dir": str(tmp_path / "out"), **section}
    path = tmp_path / "ablate.yaml"
    path.write_text(json.dumps({"ablate": spec}))
    return str(path)


@pytest.mark.parametrize("section,overrides,needles", [
    ({"custom": [{"name": "cov", "overrides": ["algorithm.hpa.trust.regime=coverage"]}]}, [],
     ("the overrides of variant 'cov'", "algorithm.hpa.trust.regime")),
    ({"variants": ["hpa", "hpa-components"]}, [], ("variant 'hpa-components'", "algorithm.hpa.trust.regime")),
    ({}, ["ablate.seeds=[1, -1]"], ("ablate.seeds", "4294967295")),
    ({"seeds": [1, 4294967296]}, [], ("ablate.seeds", "ablate.yaml:")),
    ({}, ["ablate.metric=eval/scroe"], ("ablate.metric", "eval/score")),
    ({}, ["ablate.stop_timeout_s=.nan"], ("ablate.stop_timeout_s", "finite")),
    ({"custom": [{"name": "nan", "overrides": ["algorithm.ppo.clip_ratio=.nan"]}]}, [],
     ("variant 'nan'", "algorithm.ppo.clip_ratio")),
    ({"custom": [{"name": "nodata", "overrides": ["data.prompt_path=/nonexistent/p.jsonl"]}]}, [],
     ("variant 'nodata'", "data.prompt_path", "does not exist")),
    ({"config": "missing.yaml"}, [], ("ablate.config", "does not exist")),
])
def test_ablate_refuses_before_any_run_starts(section, overrides, needles, tmp_path, data, no_runs, capsys):
    code = main(["ablate", "--config", _ablation(tmp_path, data, **section), *overrides])
    assert code == 2
    _one_line_error(capsys, code, *needles)
    assert not (tmp_path / "out").exists()


def test_ablate_with_good_variants_gets_to_its_runs(tmp_path, data, no_runs, capsys):
    with pytest.raises(AssertionError, match="a run started"):
        main(["ablate", "--config", _ablation(tmp_path, data, variants=["hpa", "ppo", "dpo"])])
    assert "warning" not in capsys.readouterr().err
    # a metric no run logs (evaluation off) is valid, e.g. to smoke-test the runs, but said
    (tmp_path / "ablate.yaml").unlink()
    with pytest.raises(AssertionError, match="a run started"):
        main(["ablate", "--config", _ablation(tmp_path, [*data, "data.eval_prompt_path=null"])])
    err = capsys.readouterr().err
    assert "warning: config key 'ablate.metric'" in err and "variant(s) hpa never run" in err


def test_ablate_metric_names():
    for good in ("eval/score", "eval/kl", "eval/score/arithmetic", "eval/trust/copy"):
        ablate.check_metric(good)
    for bad in ("eval/scroe", "score", "eval/", "eval/kl/x", "train/score"):
        with pytest.raises(ConfigError, match="metric"):
            ablate.check_metric(bad)


# -------------------------------------------------------------------------------------------- warnings


def test_warnings_name_the_key_of_a_pathological_value(data, tmp_path):
    base = load_config(None, data)
    assert config_warnings(base) == []
    row = 24 + 16  # data.max_prompt_length + rollout.max_new_tokens of tiny_cpu.yaml, below max_sequence_length 64
    keys = lambda cfg: [k for k, _ in config_warnings(cfg)]  # noqa: E731
    assert keys(load_config(None, [*data, f"trainer.ppo_max_token_len_per_rank={row - 1}"])) == \
        ["trainer.ppo_max_token_len_per_rank"]
    assert keys(load_config(None, [*data, f"trainer.ppo_max_token_len_per_rank={row}"])) == []
    assert keys(load_config(None, [*data, f"trainer.log_prob_max_token_len_per_rank={row - 1}"])) == \
        ["trainer.log_prob_max_token_len_per_rank"]
    assert keys(load_config(None, [*data, "trainer.total_steps=5", "algorithm.hpa.balance.measure_steps=6"])) == \
        ["algorithm.hpa.balance.measure_steps"]
    assert keys(load_config(None, [*data, "trainer.total_steps=5", "algorithm.hpa.balance.measure_steps=5"])) == []
    assert keys(load_config(None, [*data, "trainer.total_steps=5", "algorithm.hpa.balance.measure_steps=6",
                                   "algorithm.hpa.balance.enabled=false"])) == []
    same = [f"data.heldout_preference_path={tmp_path / 'prefs.jsonl'}"]
    assert keys(load_config(None, [*data, *same])) == ["data.heldout_preference_path"]
    (tmp_path / "copy.jsonl").write_text((tmp_path / "prefs.jsonl").read_text())
    assert keys(load_config(None, [*data, f"data.heldout_preference_path={tmp_path / 'copy.jsonl'}"])) == \
        ["data.heldout_preference_path"]
    assert keys(load_config(None, [*data, f"data.heldout_preference_path={tmp_path / 'heldout.jsonl'}"])) == []


def test_start_up_prints_the_warnings_with_their_source(data, capsys):
    load_config(None, [*data, "trainer.ppo_max_token_len_per_rank=8"], command="train")
    err = capsys.readouterr().err
    assert "warning: command line: config key 'trainer.ppo_max_token_len_per_rank'" in err


@pytest.mark.parametrize("argv,needle", [(["--world-size", "0", "--gpu-memory-gb", "80"], "--world-size"),
                                         (["--world-size", "1", "--gpu-memory-gb", "nan"], "--gpu-memory-gb"),
                                         (["--world-size", "1", "--gpu-memory-gb", "80", "optim.lr=.inf"], "optim.lr")])
def test_plan_bad_arguments(argv, needle, capsys):
    _one_line_error(capsys, main(["plan", *argv]), needle)


def test_convert_bad_directories(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    none, out = str(tmp_path / "none"), str(tmp_path / "o")
    for argv, needle in [(["hf-to-megatron", "--hf-dir", none, "--out", out], "--hf-dir"),
                         (["hf-to-megatron", "--hf-dir", str(tmp_path), "--out", str(tmp_path / "full")], "--out"),
                         (["megatron-to-hf", "--megatron-dir", none, "--out", out], "--megatron-dir")]:
        _one_line_error(capsys, main(["convert", *argv]), needle, "command line")


def test_convert_peft_import_without_a_base_is_one_line(tmp_path, capsys):
    """An adapter-import mistake (here: no base to import onto) is one line, like every other user error."""
    (tmp_path / "notpeft").mkdir()
    (tmp_path / "notpeft" / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    (tmp_path / "notpeft" / "adapter_model.safetensors").write_bytes(b"")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, vocab_size: 128, "
                   "max_sequence_length: 64, lora: {rank: 4}}\ntrainer: {total_steps: 1}\n"
                   "algorithm: {advantage: {estimator: grpo}}\nreward: {shaping: {diversity_source: policy}}\n"
                   "data: {tokenizer_path: t, tokenizer_kind: sentencepiece, prompt_path: p, preference_path: q}\n")
    _one_line_error(capsys, main(["convert", "peft-to-megatron", "--peft-dir", str(tmp_path / "notpeft"),
                                  "--config", str(cfg), "--out", str(tmp_path / "o"), "--backend", "gloo"]),
                    "model.policy_path")


def test_a_launcher_variable_that_is_not_a_number_is_one_line(monkeypatch, capsys):
    from hpa.config import UserError
    from hpa.distributed.init import read_launch_env

    with pytest.raises(UserError, match="WORLD_SIZE"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "eight"})
    with pytest.raises(UserError, match="MASTER_PORT"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "x"})


# -------------------------------------------------------------------------------------------- LoRA adapters


def _adapters(tmp_path, name, record):
    path = tmp_path / name
    path.mkdir()
    if record is not None:
        (path / "lora.json").write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("command", ["serve", "generate", "train"])
def test_lora_adapters_are_checked_before_any_model_loads(command, data, tmp_path, capsys, monkeypatch):
    """A missing, unmarked or mismatched ``model.lora.adapter_path``, and ``generate``/``serve`` with LoRA on and
    no adapters, are one line naming the key from the config's start-up checks: no process group, no base load
    (``launched`` fails the test if reached)."""
    import hpa.distributed

    def launched(*args, **kwargs):
        raise AssertionError("a model was about to load")

    monkeypatch.setattr(hpa.distributed, "launched", launched)
    (tmp_path / "base").mkdir()
    extra = ["--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "o.jsonl")] \
        if command == "generate" else []
    lora = [*data, f"model.policy_path={tmp_path / 'base'}", "model.lora.rank=4", "model.lora.alpha=8",
            "algorithm.advantage.estimator=grpo", "serve.port=0"]
    step = _adapters(tmp_path, "step_1", None)
    (step / "manifest.json").write_text("{}")
    _adapters(step, "policy", {"adapters_only": True, "rank": 8, "scaling": 2.0, "num_adapters": 8})
    ok = {"adapters_only": True, "rank": 4, "scaling": 2.0, "num_adapters": 8}
    targets = _adapters(tmp_path, "qkv", {**ok, "target_modules": ["linear_qkv"]})
    shape = _adapters(tmp_path, "wide", {**ok, "base": {"config": {"num_layers": 2, "hidden_size": 128}}})
    cases = [(_adapters(tmp_path, "plain", None), "not a LoRA adapter checkpoint (no lora.json)"),
             (tmp_path / "gone", "does not exist"),
             (step, "model.lora.rank: 4, but the adapters of"),
             (targets, "model.lora.target_modules: ['linear_fc1', 'linear_fc2', 'linear_proj', 'linear_qkv'], but"),
             (shape, "model.hidden_size: 64, but the adapters of")]
    if command != "train":
        cases.append((None, "is not set"))
    for path, needle in cases:
        adapter = [] if path is None else [f"model.lora.adapter_path={path}"]
        _one_line_error(capsys, main([command, *extra, *lora, *adapter]), "model.lora.adapter_path", needle)
    # the record of a run checkpoint (its policy/) with the right rank and scaling passes to the model load
    with pytest.raises(AssertionError, match="about to load"):
        main([command, *extra, *lora, "model.lora.rank=8", "model.lora.alpha=16", f"model.lora.adapter_path={step}"])


def test_a_resume_path_that_is_no_checkpoint_names_the_key(data, tmp_path, capsys, monkeypatch):
    """``checkpoint.resume`` that is not a complete run checkpoint: one line before any process group starts."""
    import hpa.distributed

    monkeypatch.setattr(hpa.distributed, "launched", lambda *a, **k: pytest.fail("the run was about to start"))
    (tmp_path / "step_1").mkdir()
    for path, needle in ((tmp_path / "gone", "no manifest.json"), (tmp_path / "step_1", "not a complete run")):
        _one_line_error(capsys, main(["train", *data, f"checkpoint.resume={path}"]), "checkpoint.resume", needle)


# -------------------------------------------------------------------------------------------- values that do nothing


@pytest.mark.parametrize("overrides,needles", [
    (["model.lora.rank=65", "algorithm.advantage.estimator=grpo"], ("model.lora.rank", "65", "at most 64")),
    (["algorithm.hpa.trust.released_pairs=0"], ("algorithm.hpa.trust.released_pairs", "out of range (0.0")),
])
def test_values_that_do_nothing_are_refused(overrides, needles, capsys):
    """A LoRA rank above a targeted layer's width (tiny: 64 wide) adds parameters and nothing else, and ``hpa plan``
    would call it a fit; no pairs where the coverage hold is released drops the
    pair stream there. Each is one line naming the key, from ``hpa plan`` as from every command."""
    _one_line_error(capsys, main(["plan", "--world-size", "1", "--gpu-memory-gb", "80", *overrides]), *needles)
    load_config(None, ["model.lora.rank=64", "algorithm.advantage.estimator=grpo"])  # the width itself is fine


def test_plan_names_the_reward_config_flag(tmp_path, capsys):
    argv = ["plan", "--world-size", "1", "--gpu-memory-gb", "80", "--reward-config"]
    err = _one_line_error(capsys, main([*argv, str(tmp_path / "missing.yaml")]), "--reward-config", "missing.yaml")
    assert "'--config'" not in err
    _one_line_error(capsys, main([*argv, str(tmp_path)]), "--reward-config", "is a directory")


def test_a_malformed_record_is_a_user_error(tmp_path):
    """Every data file's malformed record (``data.sft_path`` and ``data.heldout_preference_path`` included) is a
    ``UserError``, which the command line prints as one line (tests/trainer/test_failed_runs_e2e.py runs it)."""
    from hpa.config import UserError
    from hpa.data.preferences import PreferenceDataset, SFTDataset

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n')
    for dataset in (SFTDataset, PreferenceDataset):
        with pytest.raises(UserError, match=r"bad\.jsonl:1: key '(response|chosen)': is missing"):
            dataset.load(str(tmp_path / "bad.jsonl"), None, max_prompt_length=8, max_response_length=8)
