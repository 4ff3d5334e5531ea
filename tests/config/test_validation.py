"""Bad values per key class, found by walking the dataclasses (a new key is covered without an edit): every
float key refuses NaN and infinity unless its field documents infinity, every seed key its range, every
cross-section rule without a world size; each error names the key and where the value came from."""

import copy
import dataclasses
import functools
import math
import re
from pathlib import Path

import pytest

from hpa.ablate import AblateConfig, load_ablate_config
from hpa.config import ConfigError, load_config
from hpa.config.load import default_config_path
from hpa.config.schema import Config, validate
from hpa.config.values import leaf_fields

SEED_MAX = 2 ** 32 - 1


@functools.lru_cache(maxsize=1)
def _parsed():
    from hpa.config.load import _yaml_with_lines

    return _yaml_with_lines(default_config_path())


def _load(overrides):
    """``load_config(None, overrides)`` on one parse of the default YAML (parsing is most of its time)."""
    from hpa.config.load import _set_dotted, build, parse_overrides

    data, sources = copy.deepcopy(_parsed())
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
        sources[key] = "command line"
    return build(data, sources, origin=str(default_config_path()))


FLOAT_KEYS = [(k, f, t) for k, f, tp, t in leaf_fields(Config) if tp is float]
ABLATE_FLOAT_KEYS = [(k, f, t) for k, f, tp, t in leaf_fields(AblateConfig, "ablate.") if tp is float]
SEED_KEYS = [(k, t) for k, f, tp, t in leaf_fields(Config) if tp is int and re.fullmatch(r"seed|.*_seed|seeds", f.name)]


def test_the_walk_finds_the_keys_it_must():
    floats = {k for k, _, _ in FLOAT_KEYS}
    assert {"algorithm.hpa.trust.slack", "algorithm.hpa.trust.released_kl", "algorithm.hpa.trust.kl_boost",
            "algorithm.hpa.trust.margin", "algorithm.ppo.clip_ratio", "algorithm.ppo.value_clip",
            "algorithm.rollout_correction.rollout_is_threshold", "algorithm.ppo.loss_scale_factor",
            "algorithm.rollout_filter.k",
            "serve.kl_threshold", "serve.batch_wait_ms", "algorithm.hpa.w_ppo.boundaries"} <= floats
    assert {k for k, _, _ in ABLATE_FLOAT_KEYS} == {"ablate.collapse_margin", "ablate.stop_timeout_s"}
    assert {"trainer.seed", "rollout.seed", "data.seed"} <= {k for k, _ in SEED_KEYS}


def _override(key, text, is_tuple):
    return f"{key}=[{text}]" if is_tuple else f"{key}={text}"


@pytest.mark.parametrize("bad", [".nan", ".inf"])
@pytest.mark.parametrize("key,field,is_tuple", FLOAT_KEYS, ids=[k for k, _, _ in FLOAT_KEYS])
def test_every_float_key_refuses_nan_and_infinity(key, field, is_tuple, bad):
    if bad == ".inf" and field.metadata.get("infinity"):
        _load([_override(key, bad, is_tuple)])  # documented: accepted
        return
    with pytest.raises(ConfigError) as err:
        _load([_override(key, bad, is_tuple)])
    assert err.value.key == key and err.value.source == "command line", str(err.value)
    assert "finite" in err.value.message or "infinity" in err.value.message


@pytest.mark.parametrize("key,field,is_tuple", FLOAT_KEYS, ids=[k for k, _, _ in FLOAT_KEYS])
def test_a_config_made_in_code_is_walked_too(key, field, is_tuple):
    """``validate`` refuses NaN in any float key of a config built without the loader."""
    cfg = _load([])

    def replaced(obj, parts):
        value = math.nan if len(parts) == 1 else replaced(getattr(obj, parts[0]), parts[1:])
        if len(parts) == 1 and is_tuple:
            value = (math.nan,)
        return dataclasses.replace(obj, **{parts[0]: value})

    with pytest.raises(ConfigError, match=re.escape(key.split(".")[-1])):
        validate(replaced(cfg, key.split(".")))


@pytest.mark.parametrize("bad", [".nan", ".inf"])
@pytest.mark.parametrize("key,field,is_tuple", ABLATE_FLOAT_KEYS, ids=[k for k, _, _ in ABLATE_FLOAT_KEYS])
def test_every_ablate_float_key_refuses_nan_and_infinity(key, field, is_tuple, bad):
    with pytest.raises(ConfigError) as err:
        load_ablate_config(None, [_override(key, bad, is_tuple)])
    assert err.value.key == key and err.value.source == "command line"


@pytest.mark.parametrize("key,is_tuple", SEED_KEYS + [("ablate.seeds", True)],
                         ids=[k for k, _ in SEED_KEYS] + ["ablate.seeds"])
def test_every_seed_key_is_in_numpys_range(key, is_tuple):
    load = functools.partial(load_ablate_config, None) if key.startswith("ablate.") else _load
    for good in (0, SEED_MAX):
        load([_override(key, good, is_tuple)])
    for bad in (-1, SEED_MAX + 1, 10 ** 30):
        with pytest.raises(ConfigError, match=r"out of range \[0, 4294967295\]") as err:
            load([_override(key, bad, is_tuple)])
        assert err.value.key == key and err.value.source == "command line"


# every cross-section rule of validate that needs no world size: (overrides, the key the error names)
HELDOUT = "data.heldout_preference_path=heldout.jsonl"
CROSS_SECTION = [
    (["parallel.tensor_model_parallel_size=3"], "model.num_attention_heads"),
    (["parallel.tensor_model_parallel_size=4"], "model.num_query_groups"),
    (["parallel.pipeline_model_parallel_size=3"], "model.num_layers"),
    (["trainer.ppo_mini_batch_size=5"], "trainer.ppo_mini_batch_size"),
    (["rollout.max_new_tokens=64"], "rollout.max_new_tokens"),
    (["guard.early_stop_on_hacking=true"], "guard.early_stop_on_hacking"),
    (["parallel.use_distributed_optimizer=true", "parallel.backend=gloo", "model.params_dtype=bfloat16"],
     "model.params_dtype"),
    (["algorithm.hpa.trust.regime=gate"], "algorithm.hpa.trust.regime"),
    (["algorithm.hpa.trust.regime=gate", HELDOUT], "algorithm.hpa.trust.regime"),
    (["algorithm.hpa.trust.regime=gate", HELDOUT, "algorithm.advantage.per_component=true"],
     "algorithm.hpa.trust.signal"),
    (["algorithm.hpa.trust.regime=coverage"], "algorithm.hpa.trust.regime"),
    (["algorithm.hpa.trust.regime=coverage", HELDOUT, "algorithm.advantage.per_component=true"],
     "algorithm.hpa.trust.regime"),
    (["reward.shaping.diversity_source=reward_model"], "reward.shaping.diversity_source"),
    (["algorithm.replay.coef=0.5", "data.sft_path=null"], "algorithm.replay.coef"),
    (["algorithm.advantage.per_component=true", "reward.shaping.normalize=true"], "algorithm.advantage.per_component"),
    (["algorithm.rollout_filter.name=dapo_groups", "rollout.n=1"], "algorithm.rollout_filter.name"),
    (["algorithm.rollout_filter.name=reward_above_mean_std", "algorithm.rollout_filter.scope=group", "rollout.n=1"],
     "algorithm.rollout_filter.name"),
]


@pytest.mark.parametrize("overrides,key", CROSS_SECTION, ids=[f"{k}-{i}" for i, (_, k) in enumerate(CROSS_SECTION)])
def test_every_cross_section_rule_runs_without_a_world_size(overrides, key, capsys):
    from hpa.cli import main

    with pytest.raises(ConfigError) as err:
        _load(overrides)
    assert err.value.key == key, str(err.value)
    assert err.value.source and (err.value.source == "command line" or "tiny_cpu.yaml" in err.value.source)
    assert main(["check-config", *overrides]) == 2  # check-config without --world-size refuses it too
    out = capsys.readouterr().err.strip()
    assert len(out.splitlines()) == 1 and key in out and "Traceback" not in out


def test_a_cross_section_error_names_the_line_of_its_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(Path(default_config_path()).read_text().replace("  n: 4", "  n: 1").replace(
        "algorithm:\n", "algorithm:\n  rollout_filter:\n    name: dapo_groups\n"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    line = path.read_text().splitlines().index("    name: dapo_groups") + 1
    assert err.value.source == f"{path}:{line}"


def test_world_size_checks_need_a_world_size_and_refuse_zero(capsys):
    from hpa.cli import main

    load_config(None, ["trainer.global_batch_size=9"])  # fine for one process
    with pytest.raises(ConfigError, match="data-parallel size 2") as err:
        load_config(None, ["trainer.global_batch_size=9"], world_size=2)
    assert err.value.source == "command line"
    # the replayed SFT examples are split over the DP ranks only when the replay is on
    load_config(None, ["trainer.replay_batch_size=3"], world_size=2)
    with pytest.raises(ConfigError, match="data-parallel size 2") as err:
        load_config(None, ["trainer.replay_batch_size=3", "data.sft_path=sft.jsonl"], world_size=2)
    assert err.value.key == "trainer.replay_batch_size"
    with pytest.raises(ConfigError, match="world-size"):
        load_config(None, world_size=0)
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as exit_:
            main(["check-config", "--world-size", bad])
        assert exit_.value.code == 2
        err_text = capsys.readouterr().err
        assert "--world-size" in err_text and "Traceback" not in err_text


@pytest.mark.parametrize("override,key", [
    ("serve.api_key=", "serve.api_key"),            # an unset shell variable: never "no key"
    ("serve.model_name=", "serve.model_name"),
    ("data.eval_prompt_path=", "data.eval_prompt_path"),
    ("optim.lr=", "optim.lr"),
    ("trainer.run_dir=", "trainer.run_dir"),          # a required string: the empty string, refused by its check
    ('serve.api_key=" secret"', "serve.api_key"),   # stray whitespace can never match a client's key
    ('serve.api_key="secret "', "serve.api_key"),
])
def test_empty_overrides_and_stray_whitespace_are_errors(override, key):
    with pytest.raises(ConfigError) as err:
        _load([override])
    assert err.value.key == key and err.value.source == "command line", str(err.value)


def test_an_explicit_null_is_still_null():
    assert _load(["serve.api_key=null", "serve.model_name=null"]).serve.api_key is None


def test_a_secret_with_whitespace_in_yaml_names_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(Path(default_config_path()).read_text() + "serve:\n  api_key: ' k'\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.source == f"{path}:{len(path.read_text().splitlines())}"


def test_the_api_key_environment_variable_is_checked():
    from hpa.config.startup import serve_api_key

    serve = _load([]).serve
    for bad in ("", " k", "k\n"):
        with pytest.raises(ConfigError, match="X_KEY"):
            serve_api_key(serve, {"X_KEY": bad}, "X_KEY")
    assert serve_api_key(serve, {"X_KEY": "k"}, "X_KEY") == "k"
    assert serve_api_key(serve, {}, "X_KEY") is None


def test_a_key_that_documents_infinity_accepts_plus_infinity_and_the_reference_says_what_it_means():
    from hpa.config.load import _build_dataclass
    from hpa.config.reference import _checks, entries

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Limits:
        """Test limits.

        Attributes:
            timeout_s: how long to wait.
            margin: a margin.
        """

        timeout_s: float = dataclasses.field(default=1.0, metadata={"infinity": "wait forever"})
        margin: float = 0.5

    assert _build_dataclass(Limits, {"timeout_s": math.inf}, "x.", {}).timeout_s == math.inf
    for bad in ({"timeout_s": -math.inf}, {"timeout_s": math.nan}, {"margin": math.inf}):
        with pytest.raises(ConfigError, match=f"x.{next(iter(bad))}"):
            _build_dataclass(Limits, bad, "x.", {})
    rows = list(entries(Limits, "x."))
    assert rows[0].infinity == "wait forever" and rows[1].infinity == ""
    assert "`x.timeout_s`: wait forever" in " ".join(_checks(rows))
    assert "no key accepts infinity" in " ".join(_checks(list(entries())))  # none in the schema today


def test_a_negative_guard_threshold_is_refused():
    """A mean k1 KL can be slightly negative per response, but a threshold below 0 regenerates (almost) every
    response; it was accepted silently."""
    with pytest.raises(ConfigError, match="serve.kl_threshold"):
        load_config(None, ["serve.kl_threshold=-0.5"])
    assert load_config(None, ["serve.kl_threshold=0"]).serve.kl_threshold == 0


def test_the_replay_follows_the_demonstrations_by_default(tmp_path):
    """``algorithm.replay.coef`` left unset (None): 0.5 when ``data.sft_path`` is given, else 0 (off); a set
    value wins either way, and the recipe preset (the peers' objectives in ``hpa ablate``) turns it off. The
    loaded config holds the number, and so does the resolved file a run writes (it reloads to the same)."""
    from hpa.config.load import write_resolved
    from hpa.config.presets import with_preset

    demo = tmp_path / "sft.jsonl"
    demo.write_text('{"prompt": "a", "response": "b"}\n')
    assert load_config(None, []).algorithm.replay.coef == 0.0 and not load_config(None, []).algorithm.replay.enabled
    given = load_config(None, [f"data.sft_path={demo}"])
    assert given.algorithm.replay.coef == 0.5 and given.algorithm.replay.enabled
    assert load_config(None, [f"data.sft_path={demo}", "algorithm.replay.coef=0"]).algorithm.replay.coef == 0.0
    assert load_config(None, [f"data.sft_path={demo}", "algorithm.replay.coef=0.2"]).algorithm.replay.coef == 0.2
    assert load_config(None, with_preset("recipe", [f"data.sft_path={demo}"])).algorithm.replay.coef == 0.0
    resolved = write_resolved(given, tmp_path / "run")
    assert load_config(resolved, []).algorithm.replay.coef == 0.5
    assert load_config(resolved, ["data.sft_path=null", "algorithm.replay.coef=null"]).algorithm.replay.coef == 0.0


def test_the_start_skill_hold_checks_its_share_and_reads_the_demonstrations(tmp_path):
    """``algorithm.hpa.trust.hold_min_skill`` is a share in [0, 1] (NaN refused), null turns it off; a
    training run given ``data.sft_path`` reads it (the replay and the skill), so a missing file is an error
    naming the key before anything is built."""
    for bad in ("1.5", "-0.1", ".nan"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"algorithm.hpa.trust.hold_min_skill={bad}"])
        assert err.value.key == "algorithm.hpa.trust.hold_min_skill"
    assert load_config(None, ["algorithm.hpa.trust.hold_min_skill=null"]).algorithm.hpa.trust.hold_min_skill is None
    for key in ("released_kl", "released_pairs"):  # trust.released_*: a weight >= 0, finite
        for bad in ("-0.25", ".nan", ".inf"):
            with pytest.raises(ConfigError) as err:
                load_config(None, [f"algorithm.hpa.trust.{key}={bad}"])
            assert err.value.key == f"algorithm.hpa.trust.{key}"
    data = []
    for key in ("tokenizer_path", "prompt_path", "preference_path", "eval_prompt_path"):  # the other files are there
        (tmp_path / key).write_text("{}\n")
        data.append(f"data.{key}={tmp_path / key}")
    load_config(None, data, command="train")
    with pytest.raises(ConfigError) as err:
        load_config(None, [*data, f"data.sft_path={tmp_path / 'missing.jsonl'}"], command="train")
    assert err.value.key == "data.sft_path"
