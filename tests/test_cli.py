"""The ``hpa`` command line."""

import json
import subprocess
import sys

from hpa.cli import main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "hpa.cli", "--help"], capture_output=True, text=True, check=True)
    for name in ("train", "sft", "train-rm", "generate", "report", "plan", "convert", "check-config", "doctor"):
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
