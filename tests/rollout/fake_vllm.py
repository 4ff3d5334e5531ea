"""A stand-in for the ``vllm`` package that records what the vLLM engine asks of it (no vLLM needed).

``install(on_cpu=False)`` points ``hpa.rollout.vllm_engine`` at it (call it in the process that builds
the engine, e.g. inside a ``run_ranks`` worker). ``FakeLLM.instances`` holds every LLM built since.
Its ``generate`` answers each request with ``[3 + i % 5, 4, 5, ...]`` up to ``max_tokens``, ending early
with the first stop id when there is one (finish reason ``stop``), and log-prob ``-0.5 · (j + 1)`` for
token j; the ids stay below any vocabulary of more than 8 tokens.
"""

import json
import os
import types


class FakeLLM:
    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.sampling, self.weights = kwargs, [], [], {}
        with open(os.path.join(kwargs["model"], "config.json")) as f:
            self.hf_config = json.load(f)
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, kwargs=None, args=()):
        assert method == "reload_weights", method
        names = []
        for name, tensor in kwargs["weights_iterator"]:
            self.weights[name] = tensor.detach().clone()
            names.append(name)
        self.calls.append(("reload_weights", tuple(names)))
        self.synced = {k: v.clone() for k, v in self.weights.items()}
        self.history = getattr(self, "history", []) + [self.synced]

    def generate(self, requests, sampling, use_tqdm=False):
        from types import SimpleNamespace

        self.calls.append(("generate", len(requests)))
        outs = []
        for i, (req, sp) in enumerate(zip(requests, sampling)):
            self.sampling.append(sp)
            ids = [3 + i % 5] + list(range(4, 4 + sp["max_tokens"] - 1))
            ids = ids[:sp["max_tokens"]]
            reason = "length"
            if sp["stop_token_ids"] and len(ids) > 2:
                ids = ids[:2] + [sp["stop_token_ids"][0]]
                reason = "stop"
            logprobs = [{t: SimpleNamespace(logprob=-0.5 * (j + 1))} for j, t in enumerate(ids)]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs,
                                                                 finish_reason=reason)]))
        return outs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def module():
    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: kw
    return fake


def install(on_cpu: bool = False, monkeypatch=None) -> None:
    """Point ``hpa.rollout.vllm_engine`` at the fake (through ``monkeypatch`` when given, so it is undone)."""
    from hpa.rollout import vllm_engine

    FakeLLM.instances = []
    patches = {"_import_vllm": module, "_vllm_on_cpu": lambda: on_cpu,
               "_engine_arg_names": lambda: {"logprobs_mode", "disable_custom_all_reduce"}}
    for name, value in patches.items():
        if monkeypatch is not None:
            monkeypatch.setattr(vllm_engine, name, value)
        else:
            setattr(vllm_engine, name, value)


def rollouts(calls):
    """The calls around each ``generate``: ``[(calls since the one after the previous generate, the call
    after this one)]``."""
    out, since, skip = [], [], False
    for i, call in enumerate(calls):
        if call[0] == "generate":
            out.append((since, calls[i + 1] if i + 1 < len(calls) else None))
            since, skip = [], True
        elif skip:
            skip = False
        else:
            since.append(call)
    return out
