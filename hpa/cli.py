"""``hpa``: the command line. Each subcommand takes ``--config FILE`` plus ``section.key=value`` overrides."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Dict, List, Optional

from hpa.config import ConfigError, load_config
from hpa.config.schema import to_dict

_COMMANDS: Dict[str, Callable[[argparse.Namespace], int]] = {}

_HELP = {
    "train": "run HPA training (PPO + DPO + hierarchical KL every step)",
    "sft": "supervised fine-tuning of the initial policy",
    "train-rm": "train a Bradley-Terry reward model ensemble",
    "generate": "generate from a checkpoint, with a KL guard",
    "report": "plots and a summary of a run directory's metrics (hpa report RUN_DIR)",
    "plan": "estimate memory per GPU for a config and layout",
    "convert": "convert Hugging Face <-> Megatron checkpoints",
    "check-config": "validate a config with overrides and print the resolved YAML/JSON",
    "doctor": "installed torch, CUDA, NCCL, Transformer Engine, vLLM, megatron-core: compatible? the fix",
}

# subcommands whose issues are still open; listed so the interface is stable, refused clearly
_NOT_YET: set = set()


def command(name: str):
    def wrap(fn):
        _COMMANDS[name] = fn
        return fn

    return wrap


@command("check-config")
def _check_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    print(json.dumps(to_dict(cfg), indent=2))
    return 0


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _distributed(cfg):
    from hpa.config.schema import validate
    from hpa.distributed import initialize, read_launch_env

    launch = read_launch_env()
    validate(cfg, launch.world_size)
    groups = initialize(cfg.parallel, seed=cfg.trainer.seed, launch=launch)
    return groups


@command("train")
def _train(args: argparse.Namespace) -> int:
    _setup_logging()
    cfg = load_config(args.config, args.overrides)
    groups = _distributed(cfg)
    from hpa.distributed import destroy
    from hpa.trainer.loop import HPATrainer

    try:
        trainer = HPATrainer(cfg, groups)
        trainer.train()
    finally:
        destroy()
    if trainer.exit_reason in ("signal", "max_steps_per_run"):
        print(f"hpa train: stopped at step {trainer.step} ({trainer.exit_reason}) after saving a checkpoint; "
              f"run the same command again to resume", file=sys.stderr)
    return 0


@command("sft")
def _sft(args: argparse.Namespace) -> int:
    _setup_logging()
    cfg = load_config(args.config, args.overrides)
    groups = _distributed(cfg)
    from hpa.distributed import destroy
    from hpa.trainer.sft import run_sft

    try:
        run_sft(cfg, groups)
    finally:
        destroy()
    return 0


@command("train-rm")
def _train_rm(args: argparse.Namespace) -> int:
    from hpa.reward.train_rm import main as train_rm_main

    return train_rm_main(["--config", args.config, *args.overrides] if args.config else list(args.overrides))


def _not_yet(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"hpa {name}: not available in this build yet (see the README's status table)",
              file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpa", description="Hybrid Preference Alignment on megatron-core.",
        epilog="Example: hpa train --config configs/tiny_cpu.yaml trainer.total_steps=4 "
               "parallel.tensor_model_parallel_size=2")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in _HELP.items():
        p = sub.add_parser(name, help=text, description=text)
        if name in ("convert", "report", "generate", "plan", "doctor"):  # handled before parsing, by their own parsers
            continue
        p.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
        p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
        if name == "check-config":
            p.add_argument("--world-size", type=int, default=None,
                           help="also run the layout checks for this many processes")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:  # its own parser (hf-to-megatron | megatron-to-hf)
        from hpa.models.convert import run_convert

        return run_convert(argv[1:])
    if argv[:1] == ["generate"]:  # --prompts/--output/--kl-threshold besides --config and overrides
        from hpa.trainer.generate import main as generate_main

        return generate_main(argv[1:])
    if argv[:1] == ["plan"]:  # --world-size/--gpu-memory-gb/--json besides --config and overrides
        from hpa.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["doctor"]:  # no config: it reads the installed packages
        from hpa.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["report"]:  # hpa report RUN_DIR
        from hpa.trainer.report import main as report_main

        return report_main(argv[1:])
    args = build_parser().parse_args(argv)
    run = _COMMANDS.get(args.command) or _not_yet(args.command)
    try:
        return run(args)
    except ConfigError as exc:
        print(f"hpa {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
