"""The ``hpa serve`` command: load the checkpoints (converting HF directories), start the HTTP thread, run
the scheduler on the main thread, stop on SIGTERM within ``serve.drain_timeout_s``."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import ipaddress
import os
import signal
import sys
import threading
import time
from typing import List, Optional

import uvicorn

from hpa import distributed
from hpa.config import ConfigError, load_config
from hpa.config.startup import serve_api_key
from hpa.distributed.init import read_launch_env
from hpa.engine.batching import Batching
from hpa.inference import KLGuard, load_policy
from hpa.models.convert import import_hf_checkpoint

from .app import build_app
from .errors import logger
from .metrics import Metrics
from .scheduler import Scheduler
from .serving import ServeState

API_KEY_ENV = "HPA_SERVE_API_KEY"
# after a second signal stops the engine, how long uvicorn still waits for the cut requests' 503s to go out;
# a request task still running then is cancelled, and uvicorn answers it with a bare 500
CUT_ANSWER_GRACE_S = 5.0


def _import_hf(cfg, groups, workdir: str):
    """An HF directory as ``model.policy_path`` or ``model.reference_path`` goes through the converter
    (``hpa convert hf-to-megatron``) into ``workdir``; the model section becomes the one derived from the
    policy's config.json."""
    from pathlib import Path

    m, paths, derived = cfg.model, {}, None
    for key in ("policy_path", "reference_path"):
        path = getattr(m, key)
        if not path or not (Path(path) / "config.json").is_file() or (Path(path) / "metadata.json").is_file():
            continue
        out = Path(workdir) / key
        logger.info("hpa serve: converting the HF checkpoint %s (model.%s) into %s", path, key, out)
        model = import_hf_checkpoint(path, out, cfg.parallel, groups, params_dtype=m.params_dtype,
                                     transformer_impl=m.transformer_impl)
        derived = derived if key == "reference_path" and derived is not None else model
        paths[key] = str(out)
    if not paths:
        return cfg
    model = dataclasses.replace(derived, **{"policy_path": m.policy_path, "reference_path": m.reference_path,
                                            "critic_path": m.critic_path, **paths})
    return dataclasses.replace(cfg, model=model)


def load_into(state: ServeState, cfg, groups) -> None:
    """Load the checkpoints and the engine (main thread), then open the doors."""
    import tempfile

    state.workdir = tempfile.TemporaryDirectory(prefix="hpa-serve-")  # converted HF checkpoints, if any
    cfg = _import_hf(cfg, groups, state.workdir.name)
    s = cfg.serve
    engine_kwargs = {"llm_kwargs": {"enable_prefix_caching": True}} if cfg.rollout.engine == "vllm" else None
    loaded = load_policy(cfg, groups, command="hpa serve", load_reference=s.guard, engine_kwargs=engine_kwargs)
    tok = loaded.tokenizer
    guard = KLGuard(loaded.engine, loaded.policy, loaded.reference, groups,
                    batching=Batching(micro_batch_size=cfg.trainer.micro_batch_size, pad_id=tok.pad_id),
                    vocab_size=tok.vocab_size,
                    kl_threshold=s.kl_threshold, guard_temperature=s.guard_temperature,
                    max_retries=s.guard_max_retries, score=s.guard)
    state.scheduler.attach(guard, tok)
    state.tokenizer = tok
    state.context_length = cfg.model.max_sequence_length
    state.default_max_tokens = cfg.rollout.max_new_tokens
    # no token is longer than the longest piece (+1: a word's leading space): a longer text cannot fit
    state.max_prompt_chars = state.context_length * (1 + max(len(tok.decode([i])) for i in range(tok.vocab_size)))
    state.ready.set()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpa serve", description="serve a checkpoint over an OpenAI-compatible HTTP "
                                                              "API, with the KL guard")
    p.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides (serve.port=8000)")
    return p


def _api_key(s) -> Optional[str]:
    key = serve_api_key(s, os.environ, API_KEY_ENV)
    if key is None and not _loopback(s.host):
        print(f"hpa serve: WARNING: listening on {s.host} beyond this machine without an API key; anyone who "
              f"reaches the port can use the model: set serve.api_key or {API_KEY_ENV}", file=sys.stderr, flush=True)
    return key


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it reaches beyond
        return False


def _on_signals(server, scheduler, drain_timeout_s: float) -> None:
    """SIGTERM/SIGINT: stop accepting, drain until the deadline (then the engine stops and the cut requests
    get 503); a second signal stops the engine at once the same way, and uvicorn stops waiting for the
    requests ``CUT_ANSWER_GRACE_S`` later (not at once: it would cancel the cut requests before their 503s
    went out); a third exits at once."""
    received = 0

    def force_exit():
        server.force_exit = True

    def stop(signum, frame):
        nonlocal received
        received += 1
        if received == 1:
            server.should_exit = True
            scheduler.stop_at(time.monotonic() + drain_timeout_s)
        elif received == 2:
            scheduler.stop_at(time.monotonic())
            timer = threading.Timer(CUT_ANSWER_GRACE_S, force_exit)
            timer.daemon = True
            timer.start()
        else:
            force_exit()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv: Optional[List[str]] = None) -> int:
    """``hpa serve --config X [overrides]``: one process (no torchrun); exits 0 after SIGTERM has drained."""

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(args.config, args.overrides, command="serve")
    if read_launch_env().world_size != 1:
        raise ConfigError("parallel.tensor_model_parallel_size",
                          "hpa serve runs as one process: start it without torchrun or srun, with "
                          "parallel.tensor_model_parallel_size=1 and parallel.pipeline_model_parallel_size=1")
    s = cfg.serve
    name = s.model_name or os.path.basename(os.path.normpath(cfg.model.policy_path or "hpa")) or "hpa"
    metrics = Metrics()
    state = ServeState(cfg=cfg, scheduler=Scheduler(s, metrics, seed=cfg.rollout.seed), metrics=metrics,
                       model_name=name)
    # uvicorn waits a little past the drain deadline: the cut requests' 503s go out
    server = uvicorn.Server(uvicorn.Config(build_app(state, api_key=_api_key(s)), host=s.host, port=s.port,
                                           log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=s.drain_timeout_s + CUT_ANSWER_GRACE_S))
    http = threading.Thread(target=server.run, name="hpa-serve-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.01)
    if not http.is_alive():
        print(f"hpa serve: could not listen on {s.host}:{s.port} (serve.host, serve.port)", file=sys.stderr)
        return 1
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"hpa serve: listening on http://{s.host}:{port} (model {name!r}; loading)", flush=True)
    _on_signals(server, state.scheduler, s.drain_timeout_s)
    try:
        with distributed.launched(cfg) as (cfg, groups):
            load_into(state, cfg, groups)
            print(f"hpa serve: ready (model {name!r})", flush=True)
            while http.is_alive():
                state.scheduler.step(timeout=0.1)
    except (ValueError, FileNotFoundError) as exc:  # a missing or mismatched checkpoint: the message says which
        print(str(exc) if str(exc).startswith("hpa serve") else f"hpa serve: {exc}", file=sys.stderr)
        return 2
    finally:
        server.should_exit = True
        http.join(timeout=s.drain_timeout_s + 10)
    print("hpa serve: stopped", flush=True)
    gc.freeze()  # the interpreter's last collection of the models' objects took seconds past the drain
    return 0
