"""``hpa``: the command line.

Every command is one row of ``COMMANDS``: its help line and the function that runs it
(``"module:function"``, imported only when the command runs; it takes the command's own arguments and
returns the exit code, and parses them with its own parser, so ``hpa COMMAND --help`` is that parser's).
Most commands take ``--config FILE`` plus ``section.key=value`` overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
import warnings
from typing import List, Optional

import hpa
from hpa.config import ConfigError, UserError, load_config
from hpa.config.presets import PRESETS, with_preset
from hpa.config.schema import to_dict
from hpa.config.startup import config_warnings


EXIT_ALL_SKIPPED = 65  # EX_DATAERR: hpa train ran to its end without applying one update


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    run: str  # "module:function", function(argv: List[str]) -> int


COMMANDS = {
    "train": Command("run HPA training (PPO + DPO + hierarchical KL every step)", "hpa.cli:train"),
    "sft": Command("supervised fine-tuning of the initial policy", "hpa.cli:sft"),
    "train-rm": Command("train a Bradley-Terry reward model ensemble", "hpa.reward.train_rm:main"),
    "generate": Command("generate from a checkpoint, with a KL guard", "hpa.generate:main"),
    "serve": Command("serve a checkpoint over an OpenAI-compatible HTTP API, with the KL guard", "hpa.serve:main"),
    "report": Command("plots and a summary of a run directory's metrics (hpa report RUN_DIR)",
                      "hpa.trainer.report:main"),
    "plan": Command("estimate memory per GPU for a config and layout", "hpa.plan:main"),
    "convert": Command("convert Hugging Face <-> Megatron checkpoints", "hpa.models.convert:run_convert"),
    "check-config": Command("validate a config with overrides and print the resolved YAML/JSON", "hpa.cli:check_config"),
    "doctor": Command("installed torch, CUDA, NCCL, Transformer Engine, vLLM, megatron-core: compatible? the fix",
                      "hpa.doctor:main"),
    "ablate": Command("train named variants of one config over several seeds and compare them (an ablation file)",
                      "hpa.cli:ablate"),
}


def config_parser(name: str) -> argparse.ArgumentParser:
    """The parser of a command that takes ``--config FILE`` and dotted overrides."""
    parser = argparse.ArgumentParser(prog=f"hpa {name}", description=COMMANDS[name].help)
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    if name in ("train", "check-config"):
        parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                            help="named overrides applied before yours (recipe: the HPA recipe as published, "
                                 "without the anchor, per-component advantages, trust gate and balance)")
    return parser


def check_config(argv: List[str]) -> int:
    parser = config_parser("check-config")
    parser.add_argument("--world-size", type=_positive_int, default=None,
                        help="also run the data-parallel checks for this many processes (every other check "
                             "runs without it)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, with_preset(args.preset, args.overrides), world_size=args.world_size)
    for key, message in config_warnings(cfg):
        print(f"hpa check-config: warning: config key '{key}': {message}", file=sys.stderr)
    print(json.dumps(to_dict(cfg), indent=2))
    return 0


def _positive_int(text: str) -> int:
    """argparse type of a count of processes: a decimal integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _load(args, command: str):
    """The config of a launched command, checked at this launch's world size, with its paths."""
    from hpa.distributed.init import read_launch_env  # defers torch (hpa.distributed imports it) to a launch

    overrides = with_preset(getattr(args, "preset", None), args.overrides)
    return load_config(args.config, overrides, world_size=read_launch_env().world_size, command=command)


def train(argv: List[str]) -> int:
    args = config_parser("train").parse_args(argv)
    cfg = _load(args, "train")  # before megatron's import: a bad config is told in a moment
    # defers torch and megatron to the command's run (hpa --help, a bad config: in a moment)
    from hpa.distributed import launched
    from hpa.distributed.watchdog import EXIT_COLLECTIVE_FAILURE, CollectiveFailure
    from hpa.trainer.checkpoint import EXIT_SAVE_FAILED
    from hpa.trainer.loop import HPATrainer
    from hpa.trainer.rollout_server import serve_rollouts

    with launched(cfg, disaggregate=True) as (cfg, groups):
        if groups.placement is not None and groups.placement.role == "rollout":
            serve_rollouts(cfg, groups)  # until the trainer ranks stop
            return 0
        try:
            trainer = HPATrainer(cfg, groups)
        except CollectiveFailure as exc:  # at start-up: the message names the phase and the ranks waited for
            logging.getLogger("hpa").error("%s", exc)
            return EXIT_COLLECTIVE_FAILURE
        trainer.train()
    if trainer.exit_reason == "collective_failure":  # logged with the phase and the ranks waited for
        return EXIT_COLLECTIVE_FAILURE
    if trainer.exit_reason == "save_failed":
        print(f"hpa train: stopped at step {trainer.state.step}: its checkpoint could not be saved "
              f"(checkpoint.on_save_failure=stop); the previous checkpoint and 'latest' are intact, "
              f"free space or fix the disk and run the same command again to resume", file=sys.stderr)
        return EXIT_SAVE_FAILED
    if trainer.exit_reason == "all_skipped":
        print(f"hpa train: every optimizer step of the run's {trainer.state.step} steps was skipped (a non-finite or "
              f"spiking gradient norm, guard/skipped_steps={trainer.guard.skipped_steps}): nothing was learned; "
              f"lower optim.lr or model.lora.alpha, or check the loss scale (metrics.jsonl: actor/grad_norm)",
              file=sys.stderr)
        return EXIT_ALL_SKIPPED
    if trainer.exit_reason in ("signal", "max_steps_per_run"):
        saved = "after saving a checkpoint" if trainer.state.last_save_ok else \
            "but its checkpoint could not be saved (the previous one is kept)"
        print(f"hpa train: stopped at step {trainer.state.step} ({trainer.exit_reason}) {saved}; "
              f"run the same command again to resume", file=sys.stderr)
    return 0


def sft(argv: List[str]) -> int:
    args = config_parser("sft").parse_args(argv)
    cfg = _load(args, "sft")
    # defers torch and megatron, as train
    from hpa.distributed import launched
    from hpa.trainer.sft import run_sft

    with launched(cfg) as (cfg, groups):
        run_sft(cfg, groups)
    return 0


def ablate(argv: List[str]) -> int:
    args = config_parser("ablate").parse_args(argv)
    import signal

    # defers the command's module to its run, as COMMANDS does for every command
    from hpa.ablate import AblationStopped, load_ablate_config, run_ablation

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_ablate_config(args.config, args.overrides)
    try:
        counts, report = run_ablation(cfg, command=" ".join(["hpa", "ablate", *argv]))
    except AblationStopped as stopped:
        print(f"hpa ablate: stopped by {signal.Signals(stopped.signum).name}; every run it started has ended:")
        for run, state in stopped.states:
            print(f"  {run.variant} seed {run.seed}: {state}")
        print("run the same command again to continue where it stopped")
        return 128 + stopped.signum
    print(f"hpa ablate: {counts['ran']} runs ran ({counts['failed']} failed, {counts['stopped']} stopped early and "
          f"resumable), {counts['skipped']} were done before; summary in {report}")
    return 1 if counts["failed"] else 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the commands (each parses its own arguments)."""
    parser = argparse.ArgumentParser(
        prog="hpa", description="Hybrid Preference Alignment on megatron-core.",
        epilog="Example: hpa train --config configs/tiny_cpu.yaml trainer.total_steps=4 "
               "parallel.tensor_model_parallel_size=2. Run hpa COMMAND --help for a command's arguments.")
    parser.add_argument("--version", action="version", version=f"hpa {hpa.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, description=command.help, add_help=False)
    return parser


# megatron says at import, per module and process, that Apex / Transformer Engine are missing and what it
# falls back to: the expected case on CPU; on a GPU, the launch says it once (distributed.init.launched)
MEGATRON_FALLBACK_WARNING = r"(Transformer Engine and Apex are|Apex is) not installed"
MEGATRON_FALLBACK_LOGGER = "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"


def _not_a_fallback_notice(record: logging.LogRecord) -> bool:
    return "without Transformer Engine" not in record.getMessage()


def quiet_megatron_fallbacks() -> None:
    """Silence megatron's Apex / Transformer Engine fallback notices, and nothing else."""
    warnings.filterwarnings("ignore", message=MEGATRON_FALLBACK_WARNING, category=UserWarning, module="megatron")
    fallback_logger = logging.getLogger(MEGATRON_FALLBACK_LOGGER)
    if _not_a_fallback_notice not in fallback_logger.filters:
        fallback_logger.addFilter(_not_a_fallback_notice)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_megatron_fallbacks()
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv[:1])  # --help, --version, or an error that lists the commands (exit 2)
        return 2
    name = argv[0]
    module, function = COMMANDS[name].run.split(":")
    run = getattr(importlib.import_module(module), function)
    try:
        return run(argv[1:])
    except UserError as exc:  # ConfigError and every other mistake a user can fix
        print(f"hpa {name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
