"""Config loading: YAML + overrides, documented errors, cross-section checks, resolved config."""

import textwrap

import pytest
import yaml

from hpa.config import ConfigError, load_config, write_resolved
from hpa.config.load import build
from hpa.config.schema import Config, validate

BASE = textwrap.dedent("""\
    model:
      num_layers: 4
      hidden_size: 64
      num_attention_heads: 8
      num_query_groups: 4
      vocab_size: 128
      max_sequence_length: 64
    data:
      tokenizer_kind: sentencepiece
      tokenizer_path: tok.model
      prompt_path: prompts.jsonl
      preference_path: prefs.jsonl
    reward:
      shaping:
        diversity_source: policy  # no reward model here
    trainer:
      total_steps: 10
      global_batch_size: 8
      micro_batch_size: 2
      preference_batch_size: 8
    """)


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE)
    return path


def test_loads_with_recipe_defaults(cfg_file):
    cfg = load_config(cfg_file)
    assert isinstance(cfg, Config)
    assert cfg.parallel.tensor_model_parallel_size == 1
    assert cfg.rollout.n == 4 and cfg.rollout.temperature == 0.7
    assert cfg.algorithm.hpa is not None
    assert cfg.logging.wandb.mode == "offline"
    assert cfg.checkpoint.resume == "auto"


def test_dotted_overrides_are_typed_and_applied_in_order(cfg_file):
    cfg = load_config(cfg_file, ["parallel.tensor_model_parallel_size=2", "trainer.total_steps=4",
                                 "optim.lr=3e-4", "trainer.total_steps=5", "logging.wandb.mode=disabled"])
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.trainer.total_steps == 5
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.logging.wandb.mode == "disabled"


def test_frozen(cfg_file):
    cfg = load_config(cfg_file)
    with pytest.raises(Exception):
        cfg.trainer.total_steps = 3  # noqa


def test_unknown_key_in_yaml_names_key_file_line_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.replace("  total_steps: 10\n", "  total_steps: 10\n  totl_steps: 3\n"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    line = BASE.replace("  total_steps: 10\n", "  total_steps: 10\n  totl_steps: 3\n").splitlines().index(
        "  totl_steps: 3") + 1
    assert f"{path}:{line}" in msg
    assert "trainer.totl_steps" in msg and "unknown key" in msg
    assert "trainer.total_steps" in msg  # the closest valid key


def test_unknown_override_names_closest(cfg_file):
    with pytest.raises(ConfigError) as err:
        load_config(cfg_file, ["parallel.tensor_parallel_size=2"])
    msg = str(err.value)
    assert "command line" in msg and "parallel.tensor_parallel_size" in msg
    assert "parallel.tensor_model_parallel_size" in msg


def test_unknown_section(cfg_file):
    with pytest.raises(ConfigError, match="closest valid keys: .*trainer"):
        load_config(cfg_file, ["trainr.total_steps=3"])


@pytest.mark.parametrize("override,expected", [
    ("trainer.total_steps=abc", "trainer.total_steps.*must be of type int, got str"),
    ("trainer.total_steps=1.5", "trainer.total_steps.*must be of type int, got float"),
    ("parallel.sequence_parallel=3", "parallel.sequence_parallel.*must be of type bool"),
    ("model.num_layers=null", "model.num_layers.*must be a int, not null"),
    ("rollout=5", "rollout.*must be a section"),
])
def test_wrong_types(cfg_file, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(cfg_file, [override])


def test_bad_override_syntax(cfg_file):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(cfg_file, ["trainer.total_steps"])


def test_missing_required_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE.replace("  num_layers: 4\n", ""))
    with pytest.raises(ConfigError, match="model.num_layers.*required"):
        load_config(path)


def test_value_checks_name_the_full_key(cfg_file):
    with pytest.raises(ConfigError, match="rollout.top_p"):
        load_config(cfg_file, ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match="parallel.backend.*valid: auto, nccl, gloo"):
        load_config(cfg_file, ["parallel.backend=mpi"])


@pytest.mark.parametrize("overrides,world,key", [
    (["parallel.tensor_model_parallel_size=3"], 3, "model.num_attention_heads"),
    (["parallel.tensor_model_parallel_size=8", "model.num_query_groups=4"], 8, "model.num_query_groups"),
    (["parallel.pipeline_model_parallel_size=3"], 3, "model.num_layers"),
    (["parallel.tensor_model_parallel_size=2"], 3, "parallel.tensor_model_parallel_size"),
    (["trainer.global_batch_size=7"], 2, "trainer.global_batch_size"),
    (["guard.early_stop_on_hacking=true"], 1, "guard.early_stop_on_hacking"),
    (["guard.early_stop_on_hacking=true", "data.adversarial_prompt_path=adv.jsonl", "trainer.eval_interval=0"], 1,
     "guard.early_stop_on_hacking"),
    # the trust gate scales the learned component: it needs per-component advantages and held-out pairs
    (["algorithm.hpa.trust.regime=gate", "data.heldout_preference_path=h.jsonl"], 1, "algorithm.hpa.trust.regime"),
    (["algorithm.hpa.trust.regime=gate", "algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true"],
     1, "algorithm.hpa.trust.regime"),
    # the default signal scores the held-out chosen responses with the reward models
    (["algorithm.hpa.trust.regime=gate", "algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true",
      "data.heldout_preference_path=h.jsonl"], 1, "algorithm.hpa.trust.signal"),
    (["algorithm.hpa.trust.signal=gold"], 1, "algorithm.hpa.trust.signal"),
    (["algorithm.hpa.trust.regime=both"], 1, "algorithm.hpa.trust.regime"),
    # the coverage trust weights the learned component from the reward models' embeddings, calibrated on held-out
    # pairs: it needs all three
    (["algorithm.hpa.trust.regime=coverage", "reward.model_paths=[rm]", "data.heldout_preference_path=h.jsonl"], 1,
     "algorithm.hpa.trust.regime"),
    (["algorithm.hpa.trust.regime=coverage", "algorithm.advantage.estimator=grpo",
      "algorithm.advantage.per_component=true", "data.heldout_preference_path=h.jsonl"], 1,
     "algorithm.hpa.trust.regime"),
    (["algorithm.hpa.trust.regime=coverage", "algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]"], 1,
     "algorithm.hpa.trust.regime"),
    (["algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true", "reward.shaping.normalize=true"],
     1, "algorithm.advantage.per_component"),
])
def test_cross_checks(cfg_file, overrides, world, key):
    with pytest.raises(ConfigError) as err:
        load_config(cfg_file, overrides, world_size=world)
    assert err.value.key == key


def test_trust_options_name_their_keys(cfg_file):
    with pytest.raises(ConfigError, match="algorithm.advantage.per_component.*estimator: grpo"):
        load_config(cfg_file, ["algorithm.advantage.estimator=gae", "algorithm.advantage.per_component=true"])
    with pytest.raises(ConfigError, match="algorithm.dpo.rpo_alpha"):
        load_config(cfg_file, ["algorithm.dpo.rpo_alpha=-1"])
    with pytest.raises(ConfigError, match="algorithm.hpa.balance.measure_steps"):
        load_config(cfg_file, ["algorithm.hpa.balance.measure_steps=0"])
    for bad in ("margin=0.9", "kl_boost=-1", "slack=-0.1", "released_pairs=0"):
        with pytest.raises(ConfigError, match=f"algorithm.hpa.trust.{bad.split('=')[0]}"):
            load_config(cfg_file, [f"algorithm.hpa.trust.{bad}"])


def test_the_trust_keys_that_moved_name_their_replacement(tmp_path):
    """``algorithm.hpa.gate.*`` and ``algorithm.hpa.coverage.*`` became ``algorithm.hpa.trust``: a key that moved
    names its new key, one that became a constant names the constant, with the file and line."""
    cases = {"algorithm.hpa.gate.enabled": "algorithm.hpa.trust.regime",
             "algorithm.hpa.coverage.enabled": "algorithm.hpa.trust.regime",
             "algorithm.hpa.gate.slack": "algorithm.hpa.trust.slack",
             "algorithm.hpa.gate.signal": "algorithm.hpa.trust.signal",
             "algorithm.hpa.coverage.released_kl": "algorithm.hpa.trust.released_kl",
             "algorithm.hpa.coverage.hold_min_skill": "algorithm.hpa.trust.hold_min_skill",
             "algorithm.hpa.gate.kp": "GATE_KP of hpa.algorithms.gate",
             "algorithm.hpa.gate.baseline_prompts": "GATE_BASELINE_PROMPTS of hpa.algorithms.gate",
             "algorithm.hpa.coverage.k": "COVERAGE_K of hpa.algorithms.coverage",
             "algorithm.hpa.coverage.kl_boost_target": "KL_BOOST_TARGET of hpa.algorithms.coverage"}
    for key, where in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{key}=1"])
        assert err.value.key == key and where in err.value.message, (key, str(err.value))
    path = tmp_path / "old.yaml"
    path.write_text(BASE + "algorithm:\n  hpa:\n    coverage:\n      margin: 3.0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [])
    assert err.value.key == "algorithm.hpa.coverage.margin" and "algorithm.hpa.trust.margin" in str(err.value)
    assert f"old.yaml:{len(BASE.splitlines()) + 4}" in str(err.value)


@pytest.mark.parametrize("extra,gate,coverage", [
    ([], False, False),  # no learned reward, no held-out pairs
    (["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]"], False, False),
    (["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]", "data.heldout_preference_path=h.jsonl"],
     True, True),
    (["algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true",
      "data.heldout_preference_path=h.jsonl", "algorithm.hpa.trust.signal=heldout_nll"], True, False),
    (["algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true",
      "data.heldout_preference_path=h.jsonl"], False, False),  # start_rollouts reads reward models
    (["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]", "data.heldout_preference_path=h.jsonl",
      "algorithm.advantage.per_component=false"], False, False),
])
def test_the_auto_regime_turns_on_what_enabled_null_did(cfg_file, extra, gate, coverage):
    """``regime: auto`` runs each controller where the old ``enabled: null`` did (its inputs given); ``off``
    runs neither, ``gate`` and ``coverage`` that one alone."""
    from hpa.config.schema import coverage_enabled, trust_gate_enabled

    cfg = load_config(cfg_file, extra)
    assert (trust_gate_enabled(cfg), coverage_enabled(cfg)) == (gate, coverage)
    off = load_config(cfg_file, [*extra, "algorithm.hpa.trust.regime=off"])
    assert not trust_gate_enabled(off) and not coverage_enabled(off)
    if gate and coverage:
        only_gate = load_config(cfg_file, [*extra, "algorithm.hpa.trust.regime=gate"])
        assert trust_gate_enabled(only_gate) and not coverage_enabled(only_gate)
        only_coverage = load_config(cfg_file, [*extra, "algorithm.hpa.trust.regime=coverage"])
        assert coverage_enabled(only_coverage) and not trust_gate_enabled(only_coverage)


def test_trust_defaults_of_2026_11_27(cfg_file):
    """The coverage trust is on by default wherever it can run (per-component advantages, reward models,
    held-out pairs) and off elsewhere without an error; the gate's default signal is start_rollouts."""
    from hpa.config.schema import coverage_enabled, heldout_pairs_needed

    plain = load_config(cfg_file, [])
    assert plain.algorithm.hpa.trust.regime == "auto" and not coverage_enabled(plain)
    assert plain.algorithm.hpa.trust.signal == "start_rollouts"
    full = load_config(cfg_file, ["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]",
                                  "data.heldout_preference_path=h.jsonl"])
    assert coverage_enabled(full) and heldout_pairs_needed(full)
    off = load_config(cfg_file, ["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]",
                                 "data.heldout_preference_path=h.jsonl", "algorithm.hpa.trust.regime=gate"])
    assert not coverage_enabled(off)
    no_heldout = load_config(cfg_file, ["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]"])
    assert not coverage_enabled(no_heldout)  # the default does not ask for what the run lacks


def test_cross_checks_pass_for_valid_layout(cfg_file):
    cfg = load_config(cfg_file, ["parallel.tensor_model_parallel_size=2",
                                 "parallel.pipeline_model_parallel_size=2"], world_size=8)
    validate(cfg, 8)  # dp = 2; 8 % (2 * 2) == 0


def test_resolved_config_round_trips(cfg_file, tmp_path):
    cfg = load_config(cfg_file, ["trainer.total_steps=7"])
    out = write_resolved(cfg, tmp_path / "run")
    assert out == tmp_path / "run" / "config.yaml"
    again = load_config(out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["trainer"]["total_steps"] == 7


def test_relative_data_paths_resolve_against_config_dir(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("")
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    cfg = load_config(path)
    assert cfg.data.prompt_path == str((tmp_path / "prompts.jsonl").resolve())
    assert cfg.data.preference_path == "prefs.jsonl"  # not there: left relative to the working dir


def test_embedded_default_loads():
    cfg = load_config(None, world_size=1)
    assert cfg.trainer.run_dir == "runs/demo"
    assert cfg.model.params_dtype == "float32"


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  num_layers: [1, 2\ntrainer: {}\n")
    with pytest.raises(ConfigError, match=f"{path}:\\d+.*cannot parse YAML"):
        load_config(path)


def test_build_from_plain_data():
    data = yaml.safe_load(BASE)
    cfg = build(data, world_size=2)
    assert cfg.trainer.micro_batch_size == 2


def test_trust_parts_default_on_where_they_apply(cfg_file):
    """The defaults: the anchor and the balance always; per-component advantages with grpo and a learned
    reward; the gate where per-component advantages run and held-out pairs are given."""
    from hpa.config.schema import component_advantages, trust_gate_enabled

    grpo_rm = ["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]"]
    cfg = load_config(cfg_file, grpo_rm + ["data.heldout_preference_path=h.jsonl"])
    assert cfg.algorithm.dpo.rpo_alpha == 1.0 and cfg.algorithm.hpa.balance.enabled
    assert component_advantages(cfg) and trust_gate_enabled(cfg)
    assert not trust_gate_enabled(load_config(cfg_file, grpo_rm))  # no held-out pairs: no gate
    # rules alone (nothing learned to gate), another estimator, or a renormalised reward: the classic advantage
    for overrides in (["algorithm.advantage.estimator=grpo"], ["algorithm.advantage.estimator=gae",
                                                               "reward.model_paths=[rm]"],
                      grpo_rm + ["reward.shaping.normalize=true"]):
        cfg = load_config(cfg_file, overrides + ["data.heldout_preference_path=h.jsonl"])
        assert not component_advantages(cfg) and not trust_gate_enabled(cfg), overrides


def test_the_recipe_preset_turns_every_trust_part_off(cfg_file):
    from hpa.config.presets import with_preset
    from hpa.config.schema import component_advantages, coverage_enabled, trust_gate_enabled

    overrides = ["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]", "data.heldout_preference_path=h.jsonl"]
    cfg = load_config(cfg_file, with_preset("recipe", overrides))
    assert cfg.algorithm.dpo.rpo_alpha is None and not cfg.algorithm.hpa.balance.enabled
    assert not component_advantages(cfg) and not trust_gate_enabled(cfg)
    # the coverage trust and its hold on the far rows (on by default since 2026-11-27) follow the
    # per-component advantages: off here too, where the defaults have them on
    assert not coverage_enabled(cfg) and coverage_enabled(load_config(cfg_file, overrides))
    assert (cfg.algorithm.hpa.w_ppo.value, cfg.algorithm.hpa.w_dpo.value) == (0.4, 0.4)
    # the user's overrides come after the preset's
    assert load_config(cfg_file, with_preset("recipe", ["algorithm.dpo.rpo_alpha=0.5"])).algorithm.dpo.rpo_alpha == 0.5
    with pytest.raises(ConfigError, match="--preset.*valid: recipe"):
        with_preset("recipie", [])
