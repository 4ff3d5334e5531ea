"""The ``hpa`` command line."""

import json
import subprocess
import sys

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
