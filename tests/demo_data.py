"""Test data on disk: the demo task (``make_demo_task``, seed 0) and its SentencePiece tokenizer under ``root/data``."""

import subprocess
import sys


def make_task(root, num_prompts, num_eval_prompts, **task):
    """Demo task files (``task``: make_demo_task options) and a 96-token tokenizer under ``root/data``; returns root."""
    from data_tools.make_demo_task import make_demo_task

    make_demo_task(str(root / "data"), num_prompts, seed=0, num_eval_prompts=num_eval_prompts, **task)
    subprocess.run([sys.executable, "-m", "data_tools.train_tokenizer", "--input", str(root / "data" / "corpus.txt"),
                    "--model-prefix", str(root / "data" / "tok"), "--vocab-size", "96"], check=True,
                   capture_output=True)
    return root


def write_prompt_file(root, count):
    """``root/prompts.jsonl``: the first ``count`` training prompts (the input of ``hpa generate``)."""
    lines = (root / "data" / "prompts.jsonl").read_text().splitlines()[:count]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
