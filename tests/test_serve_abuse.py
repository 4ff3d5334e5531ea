"""``hpa serve`` under abuse: the real server on localhost, with an API key and small limits,
talked to with the ``openai`` client and raw HTTP. Each case is bounded in count and time; the server
must stay up and answer every error in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
The last tests send SIGTERM: the exit is bounded by ``serve.drain_timeout_s``, and a second signal stops
at once.
"""

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from demo_data import make_task, write_prompt_file
from test_serve import Server, _env, _overrides, in_process, save_worker

pytestmark = pytest.mark.e2e

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

KEY = "test-key-123"
MAX_ROWS = 64
MAX_BATCH = 8
MAX_BODY = 65536
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("abuse"), 64, 4)
    write_prompt_file(root, 2)
    in_process(save_worker, root)
    return root


def _start(demo, *extra):
    s = Server(demo, _overrides(demo, "serve.model_name=tiny", f"serve.max_rows_per_request={MAX_ROWS}",
                                f"serve.max_batch_size={MAX_BATCH}", f"serve.max_body_bytes={MAX_BODY}", *extra),
               env=dict(_env(), HPA_SERVE_API_KEY=KEY))
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return s


@pytest.fixture(scope="module")
def server(demo):
    s = _start(demo, "serve.drain_timeout_s=1")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def _post(server, content, path="/v1/completions", headers=AUTH, method="POST"):
    if not isinstance(content, (bytes, str)):
        content = json.dumps(content)
    return httpx.request(method, server.url + path, content=content, timeout=60,
                         headers={"content-type": "application/json", **headers})


def _error(r, status):
    """The OpenAI error object of ``r``, which must have ``status``."""
    assert r.status_code == status, r.text[:300]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]


def test_api_key(server):
    ok = {"model": "tiny", "prompt": "add 1 2 =", "max_tokens": 2}
    assert _error(_post(server, ok, headers={}), 401)["code"] == "invalid_api_key"
    assert _error(_post(server, ok, headers={"authorization": "Bearer wrong"}), 401)["code"] == "invalid_api_key"
    assert _post(server, ok).status_code == 200
    assert server.client.completions.create(model="tiny", prompt="add 1 2 =", max_tokens=2).choices
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(server.url + "/metrics").status_code == 200
    for path in ("/openapi.json", "/docs"):  # no docs pages, no schema
        _error(httpx.get(server.url + path), 404)


def test_n_and_rows_are_capped(server):
    started = time.monotonic()
    for n in (129, 10 ** 9):
        assert _error(_post(server, {"model": "tiny", "prompt": "add 1 2 =", "n": n}), 400)["param"] == "n"
    error = _error(_post(server, {"model": "tiny", "prompt": ["add 1 2 =", "copy a b ="], "n": MAX_ROWS // 2 + 1}),
                   400)
    assert "serve.max_rows_per_request" in error["message"]
    assert time.monotonic() - started < 10


def test_a_large_request_runs_in_engine_batches_that_others_interleave_with(server):
    calls, rows = server.metric("hpa_batch_rows_count"), server.metric("hpa_batch_rows_sum")
    big = {"model": "tiny", "prompt": "add 1 2 =", "n": MAX_ROWS, "max_tokens": 40, "temperature": 1.0}
    small = {"model": "tiny", "prompt": "copy a b =", "max_tokens": 2, "temperature": 0.5}
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(_post, server, big)
        deadline = time.monotonic() + 60
        while server.metric("hpa_batch_rows_count") == calls:  # the first slice has started
            assert time.monotonic() < deadline and not slow.done()
            time.sleep(0.005)
        quick = _post(server, small)
        small_done_first = not slow.done()
        r = slow.result()
    assert quick.status_code == 200 and r.status_code == 200 and len(r.json()["choices"]) == MAX_ROWS
    assert small_done_first  # it ran between two of the big request's engine batches
    assert server.metric("hpa_batch_rows_sum") - rows == MAX_ROWS + 1
    assert server.metric("hpa_batch_rows_count") - calls >= MAX_ROWS // MAX_BATCH + 1


def test_body_limit_and_prompts_longer_than_the_context(server):
    huge = json.dumps({"model": "tiny", "prompt": "x" * MAX_BODY})
    assert _error(_post(server, huge), 413)["code"] == "request_too_large"

    def chunks():  # no content-length: counted as it arrives
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    _error(r, 413)
    long = "add 1 2 = " * 5000  # fits the body, not the context: refused by its length before tokenizing
    error = _error(_post(server, {"model": "tiny", "prompt": long}), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    error = _error(_post(server, {"model": "tiny", "messages": [{"role": "user", "content": long}]},
                         "/v1/chat/completions"), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_every_error_is_an_openai_error_and_counted(server):
    before = server.metric("hpa_requests_total")
    cases = [
        ('{"model": "tiny", "prompt": "\\ud800"}', "/v1/completions", "POST", 400),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', "/v1/chat/completions",
         "POST", 400),
        (json.dumps({"model": "tiny", "prompt": "add 1 2 =", "seed": 2 ** 64}), "/v1/completions", "POST", 400),
        (json.dumps({"model": "tiny", "prompt": "add 1 2 =", "seed": -1}), "/v1/completions", "POST", 400),
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', "/v1/completions", "POST", 400),  # invalid UTF-8
        ("[" * 30000 + "]" * 30000, "/v1/completions", "POST", 400),  # deeply nested
        ("{}", "/v1/nothing", "POST", 404),
        ("", "/nothing", "GET", 404),
        ("", "/v1/completions", "GET", 405),
        ("", "/health", "DELETE", 405),
    ]
    for body, path, method, status in cases:
        _error(_post(server, body, path, method=method), status)
    assert server.metric("hpa_requests_total") - before == len(cases)
    assert httpx.get(server.url + "/health").status_code == 200


def test_error_bodies_do_not_echo_input_whole(server):
    r = _post(server, {"model": "m" * 60000, "prompt": "add 1 2 ="})
    assert _error(r, 404)["param"] == "model" and len(r.content) < 1000
    r = _post(server, {"model": "tiny", "prompt": "add 1 2 =", "best_of": "b" * 60000})
    assert _error(r, 400)["param"] == "best_of" and len(r.content) < 1000


def test_config_keys_are_checked():
    from hpa.config import ConfigError, load_config

    for override, key in (("serve.max_rows_per_request=0", "max_rows_per_request"),
                          ("serve.max_body_bytes=10", "max_body_bytes"), ("serve.api_key=' '", "api_key")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])


def _in_flight(pool, server, body, count=4):
    """``count`` requests of ``body`` sent from ``pool``, returned once the server counts them all in flight."""
    futures = [pool.submit(_post, server, body) for _ in range(count)]
    deadline = time.monotonic() + 60
    while server.metric("hpa_requests_in_flight") < count:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return futures


def test_sigterm_bounds_the_exit_by_the_drain_timeout(server):
    """``serve.drain_timeout_s=1`` with more work queued than a second holds: the engine stops between
    decode steps, the cut requests get 503 in the OpenAI shape, the process exits 0 soon after."""
    big = {"model": "tiny", "prompt": "add 1 2 =", "n": MAX_ROWS, "max_tokens": 40, "temperature": 1.0,
           "logprobs": 5}
    with ThreadPoolExecutor(4) as pool:
        slow = _in_flight(pool, server, big)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        answers = [f.result() for f in slow]
    assert server.proc.wait(timeout=30) == 0, server.output()
    elapsed = time.monotonic() - signalled
    assert elapsed < 1 + 6, elapsed  # the drain timeout, the cut answers, the exit
    cut = [r for r in answers if r.status_code != 200]
    assert cut and all(_error(r, 503)["code"] == "shutting_down" for r in cut)


def test_a_second_signal_stops_at_once(demo):
    s = _start(demo, "serve.drain_timeout_s=600")
    try:
        big = {"model": "tiny", "prompt": "add 1 2 =", "n": MAX_ROWS, "max_tokens": 40, "temperature": 1.0}
        with ThreadPoolExecutor(4) as pool:
            slow = _in_flight(pool, s, big)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            s.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            answers = [f.result() for f in slow]
        assert s.proc.wait(timeout=60) == 0, s.output()
        elapsed, codes = time.monotonic() - signalled, [r.status_code for r in answers]
        assert elapsed < 20 and 503 in codes, (elapsed, codes)  # not the 600 s drain
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_a_warning_when_bound_beyond_loopback_without_a_key(capsys, monkeypatch):
    from hpa.config.schema import ServeConfig
    from hpa.serve.cli import API_KEY_ENV, _api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _api_key(ServeConfig(host="127.0.0.1")) is None and _api_key(ServeConfig(host="::1")) is None
    assert capsys.readouterr().err == ""
    assert _api_key(ServeConfig(host="0.0.0.0")) is None
    assert "without an API key" in capsys.readouterr().err
    assert _api_key(ServeConfig(host="0.0.0.0", api_key="k")) == "k"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _api_key(ServeConfig(host="0.0.0.0")) == "from-env" and capsys.readouterr().err == ""
