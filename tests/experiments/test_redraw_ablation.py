"""experiments.tools.redraw_ablation: the ablation file of a re-drawn demo task, as hpa ablate reads it."""

import pytest
import yaml

from experiments.tools.redraw_ablation import main, redraw_ablation
from hpa.ablate import load_ablate_config, plan_runs


@pytest.fixture
def task(tmp_path):
    t = tmp_path / "hackable_s3"
    for rel in ("data/tok.model", "data/prompts.jsonl"):
        (t / rel).parent.mkdir(parents=True, exist_ok=True)
        (t / rel).write_text("")
    (t / "sft").mkdir()
    (t / "rm" / "reward_model").mkdir(parents=True)
    return t


@pytest.mark.parametrize("family, steps, reward", [("hackable", 150, "reward.rules=[]"),
                                                   ("split", 300, "reward.rule_weight=4.0"),
                                                   ("standard", 300, "reward.rule_weight=4.0"),
                                                   ("freetext", 300, "reward.rules=[token_f1]")])
def test_every_path_points_into_the_task_and_the_family_settings_are_kept(task, tmp_path, family, steps, reward):
    out = tmp_path / "ablate.yaml"
    main(["--family", family, "--task-dir", str(task), "--variants", "hpa", "dpo-rpo",
          "--custom", "hpa-coverage: algorithm.hpa.trust.regime=coverage", "--out", str(out)])
    cfg = load_ablate_config(str(out))
    overrides = dict(o.split("=", 1) for o in cfg.overrides)
    for key in ("data.tokenizer_path", "data.prompt_path", "data.preference_path", "data.eval_prompt_path",
                "data.adversarial_prompt_path", "data.heldout_preference_path", "model.policy_path"):
        assert overrides[key].startswith(str(task)), key
    assert overrides["reward.model_paths"] == f"[{task / 'rm' / 'reward_model'}]"
    assert overrides["trainer.total_steps"] == str(steps) and reward in cfg.overrides
    assert not any("runs/demo" in o for o in cfg.overrides)  # nothing left of the shipped task
    runs = plan_runs(cfg)
    assert sorted({r.variant for r in runs}) == ["dpo-rpo", "hpa", "hpa-coverage"] and len(runs) == 15
    assert all(str(r.run_dir).startswith(str(task / "ablation")) for r in runs)


def test_bad_input_is_refused_with_what_to_do(task, tmp_path):
    with pytest.raises(FileNotFoundError, match="DEMO_TRAIN=0 bash launch/demo.sh"):
        redraw_ablation("hackable", str(tmp_path / "nothing"), ["hpa"])
    with pytest.raises(ValueError, match="--custom 'oops'"):
        redraw_ablation("hackable", str(task), ["hpa"], custom=["oops"])
    with pytest.raises(ValueError, match="--family"):
        redraw_ablation("gold", str(task), ["hpa"])
    doc = redraw_ablation("split", str(task), ["hpa"], seeds=[7], out_dir=str(tmp_path / "x"))
    assert doc["ablate"]["seeds"] == [7] and doc["ablate"]["out_dir"] == str(tmp_path / "x")
    yaml.safe_dump(doc)


@pytest.mark.parametrize("argv,needle", [
    (["--variants", "hpa", "hpa-nope"], "ablate.variants"),                 # hpa ablate would refuse it later
    (["--seeds", "1", "1"], "ablate.seeds"),                                # repeated
    (["--custom", "bad spec"], "--custom 'bad spec'"),
    (["--custom", "x: a.b=1", "--custom", "x: a.b=2"], "ablate.custom"),    # a name twice
    (["--out", "/proc/no/such/dir/ablate.yaml"], "/proc/no"),               # cannot be written
    (["--task-dir", "/nonexistent/task"], "not a prepared demo task"),
])
def test_main_refuses_with_one_line_and_writes_nothing(task, tmp_path, capsys, argv, needle):
    out = tmp_path / "ablate.yaml"
    base = {"--task-dir": str(task), "--out": str(out)}
    for flag in ("--task-dir", "--out"):
        if flag not in argv:
            argv = [*argv, flag, base[flag]]
    assert main(["--family", "hackable", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("seed", ["08", "010", "-1", "4294967296", "99999999999999999999", "1e3"])
def test_seeds_are_decimal_and_bounded(task, tmp_path, capsys, seed):
    with pytest.raises(SystemExit) as exit_:
        main(["--family", "hackable", "--task-dir", str(task), "--seeds", seed, "--out", str(tmp_path / "a.yaml")])
    assert exit_.value.code == 2 and "decimal integer" in capsys.readouterr().err


def test_the_largest_seed_is_accepted(task, tmp_path):
    assert main(["--family", "hackable", "--task-dir", str(task), "--seeds", "0", "4294967295",
                 "--out", str(tmp_path / "a.yaml")]) == 0
    assert load_ablate_config(str(tmp_path / "a.yaml")).seeds == (0, 4294967295)
