"""``hpa serve`` with ``rollout.engine: vllm`` on vLLM's CPU build (the CI tier, ``pytest -m vllm``): one
completion and one stream through the official ``openai`` client, the guard's fields on both.

``rollout.engine=vllm`` is the only engine key given: vLLM's tensor parallelism follows the policy's.
vLLM's CPU attention needs a head dimension it has kernels for: hidden 128 with 4 heads (32).
"""

import os

import pytest

from demo_data import make_task
from multirank import run_ranks
from test_serve import Server
from vllm_tier import MODEL, vllm_marks

pytestmark = vllm_marks()


def save_worker(groups, root):
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    cfg = load_config(None, MODEL)
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        save_model_weights(build_policy(cfg.model, cfg.parallel, groups), str(root / name), groups)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("serve_vllm"), 64, 4)
    run_ranks(save_worker, args=(root,))
    d = root / "data"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    s = Server(root, [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
                      f"data.preference_path={d / 'preferences.jsonl'}",
                      f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}", "rollout.engine=vllm", *MODEL,
                      "rollout.max_new_tokens=6", f"model.policy_path={root / 'policy'}",
                      f"model.reference_path={root / 'reference'}", "serve.model_name=tiny",
                      "serve.guard_temperature=0.0"], env=env, timeout=600)  # greedy regenerations: reproducible
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def test_vllm_completion_and_stream(server):
    r = server.client.completions.create(model="tiny", prompt="add 3 5 =", max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and 0 < r.usage.completion_tokens <= 6
    assert isinstance(choice.model_extra["hpa"]["kl"], float)
    chunks = list(server.client.completions.create(model="tiny", prompt="add 3 5 =", max_tokens=6, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices[0].model_extra["hpa"] == choice.model_extra["hpa"]
