"""Every command that runs a model, in one process, on the demo task (used by ``test_device_placement``).

``python tests/device_runs.py ROOT OUT_JSON [COMMAND ...]`` saves a seeded random policy, then runs ``hpa sft``
(one step), ``hpa generate`` from the saved policy, ``hpa train-rm`` (one step), ``hpa train`` with GAE (the
critic, and the reward model just trained next to the rule reward), the same with sequence packing, and with
group advantages (each one step, with evaluation), and writes for each command either its results or the error that stopped it. With
``HPA_TEST_MODEL_DEVICE=lazy`` the models live on the test device (``hpa/distributed/device_mode.py``).
"""

import json
import sys
import traceback
from pathlib import Path


def _data(root: Path):
    d = root / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            "logging.wandb.mode=disabled", "trainer.total_steps=1", "trainer.global_batch_size=4",
            "trainer.preference_batch_size=4", "trainer.micro_batch_size=2", "rollout.n=2",
            "rollout.max_new_tokens=4", "rollout.temperature=1.0"]


def _metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _numbers(record):
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not k.startswith(("timing_s/", "perf/"))}


def _save_initial_policy(path: Path) -> None:
    """A seeded random policy, saved without the test mode (the commands below load it)."""
    import os

    import torch

    from hpa.config import load_config
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.distributed.init import TEST_MODEL_DEVICE_ENV
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    mode = os.environ.pop(TEST_MODEL_DEVICE_ENV, None)
    try:
        cfg = load_config(None, [])
        groups = initialize(cfg.parallel, launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                                           master_port=0, launcher="single"))
        torch.manual_seed(0)
        save_model_weights(build_policy(cfg.model, cfg.parallel, groups), path, groups)
        destroy()
    finally:
        if mode is not None:
            os.environ[TEST_MODEL_DEVICE_ENV] = mode


def run_all(root: Path, out: Path, only=()) -> None:
    from hpa import cli
    from hpa.generate import main as generate
    from hpa.reward.train_rm import main as train_rm

    results = {}

    def attempt(name, fn):
        try:
            results[name] = {"ok": True, "result": fn()}
        except BaseException as exc:  # noqa: BLE001  (a failed command is a result here)
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-3000:]}

    data = _data(root)
    sft_dir = root / "sft_run"
    init = root / "init"
    _save_initial_policy(init)

    def sft():
        assert cli.main(["sft", *data, f"data.sft_path={root / 'data' / 'sft.jsonl'}", "sft.global_batch_size=4", "sft.total_steps=1",
                         f"trainer.run_dir={sft_dir}"]) == 0
        return [_numbers(r) for r in _metrics(sft_dir / "sft_logs")]

    def gen():
        output = root / "generated.jsonl"
        assert generate(["--prompts", str(root / "data" / "eval_prompts.jsonl"), "--output", str(output),
                         *data, f"model.policy_path={init}"]) == 0
        return [{k: r[k] for k in ("response", "kl")} for r in map(json.loads, output.read_text().splitlines())]

    def train(estimator, *extra):
        run_dir = root / f"train_{estimator}{'_packed' if extra else ''}"
        rm_args = [f"reward.model_paths=[{root / 'rm_run' / 'reward_model'}]"] if estimator == "gae" else []
        assert cli.main(["train", *data, f"trainer.run_dir={run_dir}", f"algorithm.advantage.estimator={estimator}",
                         f"model.policy_path={init}", "trainer.eval_interval=1", *rm_args, *extra]) == 0
        return [_numbers(r) for r in _metrics(run_dir)]

    def rm():
        run_dir = root / "rm_run"
        assert train_rm([*data, f"trainer.run_dir={run_dir}", "trainer.eval_interval=1"]) == 0
        return [_numbers(json.loads(line)) for line in (run_dir / "rm_metrics.jsonl").read_text().splitlines()]

    for name, fn in (("sft", sft), ("generate", gen), ("train_rm", rm), ("train_gae", lambda: train("gae")),
                     ("train_grpo", lambda: train("grpo")),
                     ("train_packed", lambda: train("gae", "trainer.sequence_packing=true"))):
        if not only or name in only:
            attempt(name, fn)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    run_all(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
