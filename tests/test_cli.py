"""The ``hpa`` command line."""

import json
import subprocess
import sys

import pytest

from hpa.cli import main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "hpa.cli", "--help"], capture_output=True, text=True, check=True)
    for name in ("train", "sft", "train-rm", "generate", "report", "plan", "convert", "check-config", "ablate",
                 "doctor", "serve"):
        assert name in out.stdout


def test_check_config_prints_resolved_values(capsys):
    assert main(["check-config", "trainer.total_steps=4", "parallel.tensor_model_parallel_size=2",
                 "--world-size", "2"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["trainer"]["total_steps"] == 4
    assert cfg["parallel"]["tensor_model_parallel_size"] == 2


def test_config_error_is_reported_not_raised(capsys):
    assert main(["check-config", "trainer.total_stepz=4"]) == 2
    err = capsys.readouterr().err
    assert "trainer.total_stepz" in err and "trainer.total_steps" in err


def test_every_command_is_a_row_of_the_table_and_resolves():
    import importlib

    from hpa.cli import COMMANDS

    assert set(COMMANDS) >= {"train", "sft", "train-rm", "generate", "report", "plan", "convert", "check-config"}
    for name, command in COMMANDS.items():
        module, function = command.run.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_unknown_command_lists_the_commands(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["trian", "trainer.total_steps=4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'trian'" in err and "train" in err


def test_a_command_parses_its_own_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--world-size" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["check-config", "--help"])
    assert "--world-size" in capsys.readouterr().out


@pytest.mark.e2e
def test_megatron_fallback_warnings_are_not_printed_on_cpu(tmp_path):
    """On CPU, megatron's "Apex / Transformer Engine not installed, falling back to ..." (several per process,
    at import) is the expected case: ``hpa train`` prints none of it. The run stops at its tokenizer, a file
    that exists (so the start-up path checks pass) but is not a tokenizer, after megatron was imported and
    initialised; that stop is one line, not a traceback."""
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    (tmp_path / "bad.model").write_text("not a sentencepiece model")
    data = []
    for key in ("prompt_path", "preference_path", "eval_prompt_path", "sft_path"):
        (tmp_path / f"{key}.jsonl").write_text("{}\n")
        data.append(f"data.{key}={tmp_path / f'{key}.jsonl'}")
    proc = subprocess.run([sys.executable, "-m", "hpa.cli", "train", f"trainer.run_dir={tmp_path / 'run'}",
                           f"data.tokenizer_path={tmp_path / 'bad.model'}", *data, "logging.wandb.mode=disabled"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert "initialised tp1_pp1_dp1 on cpu" in proc.stderr and "bad.model" in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if "Apex" in line or "Transformer Engine" in line]
    assert not noise, noise


def test_the_fallback_filter_silences_only_megatrons_fallback_warnings():
    import warnings

    from hpa.cli import quiet_megatron_fallbacks

    def shown(message, module):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_megatron_fallbacks()
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
        return bool(caught)

    assert not shown("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                     "megatron.core.optimizer")
    assert not shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
    assert shown("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
                 "megatron.core.transformer.transformer_config")
    assert shown("Apex is not installed. Falling back to Torch Norm", "someone_else")


def test_a_gpu_run_without_transformer_engine_hears_once_what_runs_in_its_place(monkeypatch):
    import torch

    from hpa.distributed import init

    assert init.megatron_fallback_note(torch.device("cpu")) is None  # the expected case: nothing
    monkeypatch.setattr(init, "_importable", lambda module: False)
    note = init.megatron_fallback_note(torch.device("cuda", 0))
    assert "Transformer Engine and Apex are not installed" in note and "torch" in note and "hpa doctor" in note
    monkeypatch.setattr(init, "_importable", lambda module: module.startswith("apex"))
    assert "Transformer Engine is not installed" in init.megatron_fallback_note(torch.device("cuda", 0))
    monkeypatch.setattr(init, "_importable", lambda module: True)
    assert init.megatron_fallback_note(torch.device("cuda", 0)) is None
