"""Write the ablation file of a re-drawn demo task: a task nobody tuned on, made by
``DEMO_SEED=N DEMO_FAMILY=F DEMO_TRAIN=0 bash launch/demo.sh DIR`` (data, tokenizer, SFT policy, reward
ensemble; no HPA run), ablated like the shipped task of its family.

The file takes the family's shipped ablation (``configs/ablate_demo.yaml``, ``ablate_hackable.yaml``,
``ablate_split.yaml``, ``ablate_freetext.yaml``): its reward settings, its number of steps, its seeds and ``max_parallel``; every
data path, the SFT policy and the reward ensemble point into ``DIR``, and the variants are the ones asked
for. Usage::

    python -m experiments.tools.redraw_ablation --family hackable --task-dir runs/redraw/hackable_s3 \\
        --variants hpa dpo-rpo --custom 'hpa-coverage: algorithm.hpa.trust.regime=coverage' \\
        --out runs/redraw/hackable_s3/ablate.yaml
    OMP_NUM_THREADS=1 hpa ablate --config runs/redraw/hackable_s3/ablate.yaml

The results go to ``<task-dir>/ablation`` unless ``--out-dir`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAMILY_FILES = {"standard": "ablate_demo.yaml", "hackable": "ablate_hackable.yaml", "split": "ablate_split.yaml",
                "freetext": "ablate_freetext.yaml"}
# the task's own files (launch/demo.sh's layout under its OUT_DIR)
TASK_PATHS = {
    "data.tokenizer_path": "data/tok.model", "data.prompt_path": "data/prompts.jsonl",
    "data.preference_path": "data/preferences.jsonl", "data.eval_prompt_path": "data/eval_prompts.jsonl",
    "data.sft_path": "data/sft.jsonl", "data.adversarial_prompt_path": "data/adversarial_prompts.jsonl",
    "data.heldout_preference_path": "data/heldout_preferences.jsonl", "model.policy_path": "sft",
}
KEPT = ("reward.num_heads", "reward.rules", "reward.rule_weight", "trainer.total_steps", "logging.wandb.mode")


def parse_custom(spec: str) -> Dict[str, object]:
    """``"name: key=value key=value"`` -> ``{name, overrides}``; an error names the bad spec."""
    name, sep, rest = spec.partition(":")
    overrides = rest.split()
    if not sep or not name.strip() or not overrides or not all("=" in o for o in overrides):
        raise ValueError(f"--custom {spec!r}: expected 'name: section.key=value [section.key=value ...]'")
    return {"name": name.strip(), "overrides": overrides}


def decimal_seed(text: str) -> int:
    """argparse type of a seed: decimal digits without leading zeros, in [0, 2^32 - 1]."""
    if not re.fullmatch(r"0|[1-9][0-9]{0,9}", text) or int(text) > 2 ** 32 - 1:
        raise argparse.ArgumentTypeError(f"a seed is a decimal integer from 0 to {2 ** 32 - 1} without leading "
                                         f"zeros, got {text!r}")
    return int(text)


def check_ablation(doc: Dict) -> None:
    """Refuse what ``hpa ablate`` would refuse (unknown variants, repeated or out-of-range seeds, bad custom
    names), before the file is written: raises ConfigError naming the ``ablate.*`` key."""
    from hpa.ablate import AblateConfig
    from hpa.config.load import _build_dataclass

    _build_dataclass(AblateConfig, doc["ablate"], "ablate.", {})


def redraw_ablation(family: str, task_dir: str, variants: Sequence[str], custom: Sequence[str] = (),
                    out_dir: Optional[str] = None, seeds: Optional[Sequence[int]] = None) -> Dict:
    """The ablation file (a dict, ``{"ablate": {...}}``) of the task in ``task_dir``."""
    if family not in FAMILY_FILES:
        raise ValueError(f"--family must be one of {sorted(FAMILY_FILES)}, got {family!r}")
    task = Path(task_dir)
    missing = [p for p in ("data/tok.model", "data/prompts.jsonl", "sft", "rm/reward_model") if not (task / p).exists()]
    if missing:
        raise FileNotFoundError(f"{task_dir} is not a prepared demo task (missing {', '.join(missing)}): run "
                                f"DEMO_SEED=N DEMO_FAMILY={family} DEMO_TRAIN=0 bash launch/demo.sh {task_dir} first")
    shipped = yaml.safe_load((CONFIGS / FAMILY_FILES[family]).read_text())["ablate"]
    kept = [o for o in shipped["overrides"] if o.split("=", 1)[0] in KEPT]
    overrides: List[str] = [f"{key}={task / rel}" for key, rel in TASK_PATHS.items()]
    overrides += [f"reward.model_paths=[{task / 'rm' / 'reward_model'}]", *kept]
    return {"ablate": {
        "config": str(CONFIGS / shipped["config"]), "overrides": overrides, "variants": list(variants),
        "custom": [parse_custom(c) for c in custom], "seeds": list(seeds or shipped["seeds"]),
        "out_dir": out_dir or str(task / "ablation"), "max_parallel": shipped.get("max_parallel", 1)}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status 0, or 2 with one line on stderr saying what is wrong."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(FAMILY_FILES))
    parser.add_argument("--task-dir", required=True, help="launch/demo.sh's OUT_DIR of the re-drawn task")
    parser.add_argument("--variants", nargs="*", default=["hpa", "dpo-rpo"], help="built-in variant names")
    parser.add_argument("--custom", action="append", default=[], help="'name: key=value ...' (repeatable)")
    parser.add_argument("--seeds", type=decimal_seed, nargs="*", default=None, help="default: the shipped file's")
    parser.add_argument("--out-dir", default=None, help="the ablation's out_dir (default <task-dir>/ablation)")
    parser.add_argument("--out", required=True, help="where to write the ablation file")
    args = parser.parse_args(argv)
    try:
        doc = redraw_ablation(args.family, args.task_dir, args.variants, args.custom, args.out_dir, args.seeds)
        check_ablation(doc)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(f"# written by python -m experiments.tools.redraw_ablation --family {args.family} "
                    f"--task-dir {args.task_dir}\n")
            yaml.safe_dump(doc, f, sort_keys=False, width=120)
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError; a missing task or an unwritable --out
        print(f"redraw_ablation: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: OMP_NUM_THREADS=1 hpa ablate --config {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
