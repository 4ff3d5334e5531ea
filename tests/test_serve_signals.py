"""``hpa serve``'s signal handler, in process: the first SIGTERM drains, the second stops the engine at once
but leaves the cut requests time to get their 503 before uvicorn cancels what is left (a cancelled request
task is a bare 500 from uvicorn), a third exits at once."""

import signal
import time
import types

import pytest

from hpa.serve import cli
from hpa.serve.scheduler import Scheduler


@pytest.fixture
def handler(monkeypatch):
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(cli, "CUT_ANSWER_GRACE_S", 0.3)
    server, scheduler = types.SimpleNamespace(should_exit=False, force_exit=False), Scheduler(None, None)
    cli._on_signals(server, scheduler, drain_timeout_s=600.0)
    yield server, scheduler, signal.getsignal(signal.SIGTERM)
    for s, h in saved.items():
        signal.signal(s, h)


def test_the_first_signal_drains_until_the_deadline(handler):
    server, scheduler, stop = handler
    before = time.monotonic()
    stop(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    assert before + 600 <= scheduler.deadline <= time.monotonic() + 600


def test_a_second_signal_stops_the_engine_and_leaves_the_cut_answers_time(handler):
    server, scheduler, stop = handler
    stop(signal.SIGTERM, None)
    stop(signal.SIGINT, None)
    assert scheduler.deadline <= time.monotonic()  # the engine stops at its next decode step
    assert not server.force_exit  # uvicorn would cancel the request tasks: 500s instead of the 503s
    time.sleep(0.6)
    assert server.force_exit  # bounded: a client that does not read its answer does not hold the exit


def test_a_third_signal_exits_at_once(handler):
    server, scheduler, stop = handler
    for _ in range(3):
        stop(signal.SIGTERM, None)
    assert server.force_exit
