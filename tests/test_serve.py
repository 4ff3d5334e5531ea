"""``hpa serve`` (hpa.serve): the real server on a free localhost port, talked to with the official
``openai`` client (and raw HTTP where a client would refuse to send the request).

One server per module, in the test device mode (a host tensor fed to the models fails): the demo task's
tokenizer, a random policy (seed 0) and a different random
reference (seed 1), CPU. The guard's threshold is set low (``serve.kl_threshold=0.0``) and regenerates
greedily (``serve.guard_temperature=0.0``), so about half of the sampled responses are regenerated and a
regenerated response is known exactly: the greedy one. The last test sends SIGTERM.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from demo_data import make_task, write_prompt_file
from multirank import run_ranks

pytestmark = pytest.mark.e2e

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

NUM_PROMPTS = 6
MAX_TOKENS = 6
CONTEXT = 64  # tiny_cpu.yaml's model.max_sequence_length


def save_worker(groups, root):
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    cfg = load_config(None, _overrides(root))
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        save_model_weights(build_policy(cfg.model, cfg.parallel, groups), str(root / name), groups)


def _overrides(root, *extra):
    d = root / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            f"rollout.max_new_tokens={MAX_TOKENS}", "trainer.micro_batch_size=8",
            f"model.policy_path={root / 'policy'}", f"model.reference_path={root / 'reference'}", *extra]


def _env(device_mode=False):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if device_mode:  # the test device mode (hpa/distributed/device_mode.py): a host tensor fed to a model fails
        env["HPA_TEST_MODEL_DEVICE"] = "lazy"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    return env


def in_process(fn, *args):
    """``fn(groups, *args)`` on a single-rank gloo group in this process (no worker to spawn: it saves the
    import of megatron in a fresh process), or in one spawned rank where this process already has a group."""
    import torch.distributed as dist

    from hpa.config.schema import ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize

    if dist.is_initialized():
        return run_ranks(fn, args=args)[0]
    groups = initialize(ParallelConfig(backend="gloo"), launch=LaunchEnv(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single"))
    try:
        return fn(groups, *args)
    finally:
        destroy()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("serve"), 64, 4)
    write_prompt_file(root, NUM_PROMPTS)
    in_process(save_worker, root)
    return root


class Server:
    """``hpa serve`` in a subprocess; what it printed and what it answered while loading."""

    def __init__(self, root, overrides, *, env=None, timeout=120):
        self.log = open(root / "serve.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "hpa.cli", "serve", "serve.port=0", *overrides],
                                     env=env or _env(), stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines = []
        self.port = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while self.port is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.while_loading = {}
        while True:  # the port answers before the model is loaded
            assert self.proc.poll() is None and time.monotonic() < deadline + timeout, self.output()
            r = httpx.get(self.url + "/health", timeout=60)  # the loading import holds the GIL for a while
            if r.status_code == 503 and not self.while_loading:
                c = httpx.post(self.url + "/v1/completions", json={"model": "tiny", "prompt": "add 1 2 ="},
                               timeout=60)
                self.while_loading = {"health": (r.status_code, r.json()), "completion": (c.status_code, c.json())}
            if r.status_code == 200:
                break
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return "".join(self.lines) + self.log.read()[-4000:]

    def metric(self, name):
        text = httpx.get(self.url + "/metrics").text
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                  or line.startswith(name + "{")]
        return sum(values)


@pytest.fixture(scope="module")
def generated(demo):
    """``hpa generate`` on the prompts with the server's guard settings, greedy: started before the server,
    so that both load at once (two cores), and waited for by the test that compares them."""
    proc = subprocess.Popen([sys.executable, "-m", "hpa.generate", "--prompts", str(demo / "prompts.jsonl"),
                             "--output", str(demo / "generated.jsonl"), "--kl-threshold", "0.0",
                             "--guard-temperature", "0.0", *_overrides(demo, "rollout.temperature=0")],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=open(demo / "generate.log", "w"))
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(demo, generated):
    s = Server(demo, _overrides(demo, "serve.kl_threshold=0.0", "serve.guard_temperature=0.0", "serve.model_name=tiny",
                                "serve.batch_wait_ms=20"), env=_env(device_mode=True))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


@pytest.fixture(scope="module")
def prompts(demo):
    return [json.loads(line)["prompt"] for line in (demo / "prompts.jsonl").read_text().splitlines()]


def _greedy(server, prompt):
    r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0]


def test_503_while_loading_then_models_and_health(server):
    status, body = server.while_loading["health"]
    assert status == 503 and body == {"status": "loading"}
    status, body = server.while_loading["completion"]
    assert status == 503 and body["error"]["code"] == "loading" and body["error"]["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client.models.list().data] == ["tiny"]


def test_completion_usage_and_guard_fields(server, prompts):
    r = server.client.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == "tiny" and len(r.choices) == 1
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    hpa = choice.model_extra["hpa"]
    assert isinstance(hpa["kl"], float) and isinstance(hpa["regenerated"], bool)
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    two = server.client.completions.create(model="tiny", prompt=prompts[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == choice.text
    text = choice.text.strip()
    assert len(text) >= 3
    cut = server.client.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                                           stop=["\u2603", text[1:3]])
    assert cut.choices[0].text == choice.text[:choice.text.index(text[1:3])]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens <= r.usage.completion_tokens


def test_greedy_output_equals_hpa_generate(server, generated, demo, prompts):
    """The same prompts through ``hpa generate`` (same guard settings) and through the server, greedy:
    the same texts, finish reasons, KLs and regenerations."""
    assert generated.wait(timeout=300) == 0, (demo / "generate.log").read_text()[-4000:]
    out = demo / "generated.jsonl"
    expected = [json.loads(line) for line in out.read_text().splitlines()]
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: batched differently from hpa generate
        served = list(pool.map(lambda p: _greedy(server, p), prompts))
    assert [c.text for c in served] == [e["response"] for e in expected]
    assert [c.finish_reason for c in served] == [e["finish_reason"] for e in expected]
    assert [c.model_extra["hpa"]["regenerated"] for c in served] == [e["regenerated"] for e in expected]
    for c, e in zip(served, expected):
        assert c.model_extra["hpa"]["kl"] == pytest.approx(e["kl"], abs=1e-5)


def test_chat_completion(server):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "add 3 5 ="}],
                                              max_tokens=4, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 4 and "kl" in choice.model_extra["hpa"]
    # the tokenizer has no chat template: the documented plain one ("user: ...\nassistant:")
    plain = server.client.completions.create(model="tiny", prompt="user: add 3 5 =\nassistant:", max_tokens=4,
                                             temperature=0)
    assert choice.message.content == plain.choices[0].text
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streaming_completion_and_chat(server, prompts):
    whole = _greedy(server, prompts[1])
    chunks = list(server.client.completions.create(model="tiny", prompt=prompts[1], max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].finish_reason == whole.finish_reason
    assert finals[0].model_extra["hpa"] == whole.model_extra["hpa"]
    assert chunks[-1].usage.completion_tokens == len([c for c in chunks if c.choices and c.choices[0].text])
    chat = list(server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "copy a b ="}],
                                                      max_tokens=4, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length") and "hpa" in chat[-1].choices[0].model_extra
    text = "".join(c.choices[0].delta.content or "" for c in chat)
    plain = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "copy a b ="}],
                                                  max_tokens=4, temperature=0)
    assert text == plain.choices[0].message.content


def test_n_logprobs_and_seed(server, prompts):
    r = server.client.completions.create(model="tiny", prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=1.0,
                                         n=3, logprobs=2, seed=7)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    for c in r.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
        for value, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert value <= 0 and len(top) <= 2 and value <= max(top.values()) + 1e-5
    again = server.client.completions.create(model="tiny", prompt=prompts[2], max_tokens=MAX_TOKENS,
                                             temperature=1.0, n=3, logprobs=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # the seed reproduces the request
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "add 1 1 ="}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5) for t in content)  # greedy


def test_guard_regenerates_above_the_threshold(server, prompts):
    before = server.metric("hpa_guard_regenerations_total")
    rows = []
    for p in prompts[:3]:
        r = server.client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=1.0, n=4,
                                             seed=11)
        rows += [(p, c) for c in r.choices]
    counted = server.metric("hpa_guard_regenerations_total") - before
    regenerated = [(p, c) for p, c in rows if c.model_extra["hpa"]["regenerated"]]
    kept = [(p, c) for p, c in rows if not c.model_extra["hpa"]["regenerated"]]
    assert regenerated and kept  # threshold 0: the responses the reference likes less are sampled again
    assert all(c.model_extra["hpa"]["kl"] <= 0.0 for _, c in kept)
    for p, c in regenerated:  # guard_temperature 0: the regeneration is the greedy response, with its KL
        greedy = _greedy(server, p)
        assert c.text == greedy.text
        assert c.model_extra["hpa"]["kl"] == pytest.approx(greedy.model_extra["hpa"]["kl"], abs=1e-5)
    assert counted == len(regenerated)


def _post(server, body, path="/v1/completions"):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def test_bad_inputs_get_openai_errors_while_a_good_request_succeeds(server, prompts):
    ok = {"model": "tiny", "prompt": prompts[0], "max_tokens": MAX_TOKENS, "n": 4, "temperature": 1.0}
    bad = [
        (b'{"model": "tiny", "prompt": ', 400, None),  # malformed JSON
        ({"model": "tiny", "prompt": "add 1 2 =", "temperature": "hot"}, 400, "temperature"),  # wrong type
        ({"model": "tiny", "prompt": "add 1 2 =", "n": "2"}, 400, "n"),
        ({"model": "tiny", "prompt": [5] * (CONTEXT + 1)}, 400, "prompt"),  # longer than the context
        ({"model": "tiny", "prompt": [5] * (CONTEXT - 2), "max_tokens": 8}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "add 1 2 =", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "add 1 2 =", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "nope", "prompt": "add 1 2 ="}, 404, "model"),
        ({"model": "tiny", "prompt": "add 1 2 =", "best_of": 3}, 400, "best_of"),
        ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ]
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(_post, server, ok) for _ in range(3)]
        answers = list(pool.map(lambda b: _post(server, b[0], "/v1/chat/completions" if b[2] == "messages"
                                                 else "/v1/completions"), bad))
        goods = [g.result() for g in good]
    for (body, status, param), r in zip(bad, answers):
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert param in (error["param"] or "") or param in error["message"], (body, error)
    assert all(g.status_code == 200 and len(g.json()["choices"]) == 4 for g in goods)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="tiny", prompt="add 1 2 =", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="add 1 2 =")


def test_concurrent_requests_are_batched(server, prompts):
    rows_before, calls_before = server.metric("hpa_batch_rows_sum"), server.metric("hpa_batch_rows_count")
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda i: server.client.completions.create(
            model="tiny", prompt=prompts[i % len(prompts)], max_tokens=MAX_TOKENS, temperature=0.7), range(16)))
    assert all(len(r.choices) == 1 for r in done)
    rows = server.metric("hpa_batch_rows_sum") - rows_before
    calls = server.metric("hpa_batch_rows_count") - calls_before
    assert rows == 16 and calls < 16  # several requests shared engine calls


def test_client_disconnect_mid_stream_frees_its_slot(server, prompts):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": prompts[0], "max_tokens": MAX_TOKENS, "n": 8,
                            "temperature": 1.0, "stream": True}) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 30
    while server.metric("hpa_requests_in_flight") != 0:
        assert time.monotonic() < deadline, "the disconnected stream still holds its slot"
        time.sleep(0.05)
    assert _greedy(server, prompts[0]).finish_reason in ("stop", "length")


def test_metrics_in_prometheus_text(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("hpa_requests_total", "hpa_prompt_tokens_total", "hpa_completion_tokens_total",
                 "hpa_request_latency_seconds_bucket", "hpa_guard_regenerations_total", "hpa_response_kl_bucket",
                 "hpa_requests_in_flight", "hpa_batch_rows_bucket"):
        assert name in text, name
    assert server.metric('hpa_requests_total{endpoint="/v1/completions",status="200"}') > 0
    assert 'status="400"' in text and 'status="404"' in text


def hf_worker(groups, root):
    """A tiny transformers Llama as ``model.policy_path``: converted at start-up, the model section derived."""
    import torch
    import transformers

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights
    from hpa.serve import _import_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf_policy")
    cfg = load_config(None, _overrides(root, f"model.policy_path={root / 'hf_policy'}"))
    out = _import_hf(cfg, groups, str(root / "hf_work"))
    m = out.model
    policy = build_policy(m, out.parallel, groups)
    load_model_weights(policy, m.policy_path, groups)
    return {"policy_path": m.policy_path, "reference_path": m.reference_path, "hidden_size": m.hidden_size,
            "num_layers": m.num_layers, "num_query_groups": m.num_query_groups}


def test_an_hf_directory_goes_through_the_converter(demo):
    got = in_process(hf_worker, demo)
    assert got == {"policy_path": str(demo / "hf_work" / "policy_path"), "reference_path": str(demo / "reference"),
                   "hidden_size": 32, "num_layers": 2, "num_query_groups": 2}


def test_sigterm_drains_in_flight_requests_then_exits_0(server, prompts):
    """Last: SIGTERM while a request is in flight (a long one: 32 random-policy responses of up to 48 tokens,
    half of them regenerated); it still gets its answer, then the process exits 0."""
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 48, "n": 32, "temperature": 1.0, "logprobs": 5}
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_post, server, body)
        deadline = time.monotonic() + 60
        while server.metric("hpa_requests_in_flight") < 1:
            assert time.monotonic() < deadline and not slow.done()
            time.sleep(0.005)
        server.proc.send_signal(signal.SIGTERM)
        r = slow.result()
    assert r.status_code == 200 and len(r.json()["choices"]) == 32
    assert server.proc.wait(timeout=60) == 0, server.output()
    assert "stopped" in server.output()


def top_logprobs_worker(groups):
    """``response_top_log_probs`` (2 rows per forward, each cut to its longest row) against one forward of
    the whole batch and the full ``[b, s, v]`` softmax, gathered at the response positions."""
    import torch

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.engine.batching import Batching
    from hpa.engine.forward import response_top_log_probs
    from hpa.models import build_policy
    from hpa.rollout.base import RolloutBatch

    vocab, b, p, r, k = 40, 5, 6, 5, 3
    torch.manual_seed(0)
    policy = build_policy(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                      ffn_hidden_size=48, vocab_size=vocab, max_sequence_length=32,
                                      make_vocab_size_divisible_by=16), ParallelConfig(), groups).eval()
    g = torch.Generator().manual_seed(1)
    prompt_mask = (torch.arange(p)[None, :] >= (p - torch.tensor([6, 2, 4, 3, 5]))[:, None]).long()
    response_mask = (torch.arange(r)[None, :] < torch.tensor([5, 1, 3, 2, 4])[:, None]).float()
    batch = RolloutBatch(prompt_ids=torch.randint(1, vocab, (b, p), generator=g) * prompt_mask,
                         prompt_mask=prompt_mask,
                         response_ids=(torch.randint(1, vocab, (b, r), generator=g) * response_mask).long(),
                         response_mask=response_mask, log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b,
                         group_ids=torch.arange(b))
    got = response_top_log_probs(policy, batch, groups, batching=Batching(micro_batch_size=2, pad_id=0),
                                 vocab_size=vocab, k=k)
    ts = batch.sequences
    with torch.no_grad():
        logp = torch.log_softmax(policy(ts.input_ids, ts.position_ids, None)[..., :vocab].float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    want = {"log_probs": ts.to_response(logp.gather(2, ts.labels.unsqueeze(2))[..., 0]),
            "top_values": ts.to_response(values), "top_ids": ts.to_response(ids)}
    mask = response_mask.bool()
    return {key: (got[key][mask] - want[key][mask]).abs().max().item() for key in want}


def test_logprobs_at_the_response_positions_equal_the_full_softmax():
    errors = in_process(top_logprobs_worker)
    assert errors["top_ids"] == 0 and errors["log_probs"] < 1e-5 and errors["top_values"] < 1e-5, errors
