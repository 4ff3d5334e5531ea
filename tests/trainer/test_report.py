"""``hpa report``: PNGs and summary.md from a synthetic metrics.jsonl; skipped panels; bad input."""

import json

import pytest

from hpa.trainer.report import PANELS, main, run_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _full_records(num_steps=12):
    out = []
    for step in range(1, num_steps + 1):
        r = {"step": step, "reward/raw_mean": 0.1 * step, "reward/shaped_mean": 0.05 * step,
             "kl/token": 0.01 * step, "kl/semantic": 0.002 * step, "actor/entropy": 2.0 - 0.1 * step,
             "actor/grad_norm": 1.0 / step, "actor/pg_clipfrac": 0.1, "actor/pg_clipfrac_lower": 0.01,
             "critic/vf_clipfrac": 0.2, "response_length/mean": 10.0 + step, "dpo/reward_acc": 0.5 + 0.03 * step,
             "hpa/w_ppo": 1.0, "hpa/w_dpo": 1.0 - step / num_steps, "hpa/w_kl": 0.1,
             "hpa/lambda_token": 1.0, "hpa/lambda_semantic": 0.5, "gate/gate": 1.0 / (1.0 + 0.1 * step),
             "gate/lambda": 0.1 * step, "hpa/balance_factor": 1.7}
        if step % 4 == 0:
            r["eval/score"] = 0.1 * step  # 0.4, 0.8, 1.2
        out.append(r)
    out[5]["kl/token"] = "nan"  # MetricsWriter writes non-finite values as strings
    out[6]["actor/grad_norm"] = "inf"
    return out


def test_full_metrics_give_every_png_and_the_numbers(tmp_path):
    _write(tmp_path, _full_records())
    summary = run_report(tmp_path)
    assert summary == tmp_path / "report" / "summary.md"
    for panel in PANELS:
        png = tmp_path / "report" / f"{panel.name}.png"
        assert png.is_file(), panel.name
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size > 1000
    text = summary.read_text()
    assert "steps logged: 12 (step 1 to 12)" in text
    assert "eval score: 0.4 at step 4 (before) -> 1.2 at step 12 (after)" in text
    # reward first / last / best
    assert "| `reward/raw_mean` | 0.1 (1) | 1.2 (12) | 1.2 (12, max) | 0 |" in text
    # KL: the nan at step 6 is left out and counted; best is the minimum
    assert "| `kl/token` | 0.01 (1) | 0.12 (12) | 0.01 (1, min) | 1 |" in text
    assert "`actor/grad_norm` (1)" in text and "`kl/token` (1)" in text
    assert "Skipped panels" not in text
    for panel in PANELS:
        assert f"({panel.name}.png)" in text


def test_missing_keys_are_skipped_and_reported(tmp_path):
    records = [{"step": s, "reward/raw_mean": float(s), "kl/token": 0.1, "timing/step_s": 1.0}
               for s in range(3)]
    _write(tmp_path, records)
    text = run_report(tmp_path).read_text()
    written = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert written == ["kl.png", "reward.png"]
    assert "## Skipped panels" in text
    for name in ("entropy", "grad_norm", "clip_fractions", "response_length", "dpo_accuracy", "weights",
                 "eval_score"):
        assert f"- {name}: " in text
    assert "`reward.png` lacks `reward/shaped_mean`" in text
    assert "`kl.png` lacks `kl/semantic`" in text
    assert "eval score: not logged" in text


def test_weights_plot_shows_the_trust_gate_and_the_balance():
    """The two weights that move in a default run: the learned reward's gate and the pair term's factor."""
    weights, = [p for p in PANELS if p.name == "weights"]
    keys = [k for k, _ in weights.keys]
    assert "gate/gate" in keys and "hpa/balance_factor" in keys
    assert {"hpa/w_ppo", "hpa/w_dpo", "hpa/w_kl", "hpa/lambda_token", "hpa/lambda_semantic"} <= set(keys)


def _without(records, prefixes):
    return [{k: v for k, v in r.items() if not k.startswith(prefixes)} for r in records]


def test_metrics_of_parts_a_run_does_not_have_are_not_reported_missing(tmp_path):
    """A group-advantage run has no critic, a run may have no trust gate or balance: their panels do not say
    they lack those metrics; a run that has the part but not the metric still hears of it."""
    _write(tmp_path / "grpo", _without(_full_records(), ("critic/", "gate/", "hpa/balance_factor")))
    text = run_report(tmp_path / "grpo").read_text()
    assert "lacks" not in text
    _write(tmp_path / "gae", [{**r, "critic/vf_loss": 0.5, "gate/lambda": 0.0}
                              for r in _without(_full_records(), ("critic/", "gate/gate"))])
    text = run_report(tmp_path / "gae").read_text()
    assert "`clip_fractions.png` lacks `critic/vf_clipfrac`" in text
    assert "`weights.png` lacks `gate/gate`" in text


def test_all_non_finite_series_and_unsorted_duplicate_steps(tmp_path):
    records = [{"step": 2, "eval/score": "nan"}, {"step": 1, "eval/score": "inf"},
               {"step": 2, "eval/score": "-inf", "kl/token": 0.5}]
    _write(tmp_path, records)
    text = run_report(tmp_path).read_text()
    assert "steps logged: 2 (step 1 to 2)" in text
    assert "| `eval/score` | – | – | – | 2 |" in text  # step 2 logged twice: the last record counts
    assert (tmp_path / "report" / "eval_score.png").read_bytes()[:8] == PNG_MAGIC


def test_missing_file_names_the_path(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
        run_report(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert str(tmp_path / "metrics.jsonl") in capsys.readouterr().err


def test_empty_file_names_the_path(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"metrics file .*metrics\.jsonl is empty"):
        run_report(tmp_path)


@pytest.mark.parametrize("line, message", [("{not json", "not valid JSON"),
                                            ('{"loss": 1.0}', "integer 'step'"),
                                            ("[1, 2]", "integer 'step'")])
def test_bad_line_names_file_and_line(tmp_path, line, message):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "kl/token": 0.1}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"metrics\.jsonl:2: .*{message}"):
        run_report(tmp_path)


def test_main_prints_the_summary(tmp_path, capsys):
    _write(tmp_path, _full_records(8))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "steps logged: 8" in out and str(tmp_path / "report" / "summary.md") in out


def test_figures_without_a_peak_read_n_a_on_cpu_not_non_finite(tmp_path):
    """A CPU run logs perf/mfu as NaN every step (no peak FLOP/s is known): the summary says "n/a on CPU" for it
    and has no non-finite row; a figure that is NaN only sometimes is still counted."""
    records = [{"step": s, "perf/mfu": "nan", "perf/mfu_padded": "nan", "kl/token": 0.1 * s,
                "perf/throughput": 10.0} for s in range(1, 4)]
    _write(tmp_path, records)
    text = run_report(tmp_path).read_text()
    assert "n/a on CPU" in text and "`perf/mfu`, `perf/mfu_padded`" in text
    assert "non-finite values" not in text
    records[1]["kl/token"] = "nan"
    records[2]["perf/mfu"] = 0.3  # a peak was known: a NaN is a real non-finite value again
    _write(tmp_path, records)
    text = run_report(tmp_path).read_text()
    assert "non-finite values (left out of plots and of first/last/best): `kl/token` (1), `perf/mfu` (2)" in text
    assert "n/a on CPU" in text and "`perf/mfu_padded`" in text.split("n/a on CPU")[1].splitlines()[0]


def test_the_summary_names_the_trust_regime_the_start_chose(tmp_path):
    """A run whose coverage trust measured the start's skill (``coverage/start_skill``) says in its summary
    whether the far rows were held (``coverage/kl_boost`` > 0) or released; a run without the measure says
    nothing about it."""
    for boost, words in ((0.0, "released"), (100.0, "held (KL boost 100)")):
        run = tmp_path / f"b{boost:g}"
        _write(run, [{"step": s, "eval/score": 0.5, "coverage/start_skill": 0.445, "coverage/kl_boost": boost}
                     for s in (1, 2)])
        text = run_report(run).read_text()
        assert f"- trust regime: the start's skill where no pair covers 0.445; the far rows {words}" in text
    _write(tmp_path / "plain", [{"step": 1, "eval/score": 0.5}])
    assert "trust regime" not in run_report(tmp_path / "plain").read_text()
