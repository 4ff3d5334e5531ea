"""Metrics sinks: ``metrics.jsonl`` (one JSON object per step, with ``step``), console lines, a
progress bar, wandb and TensorBoard.

Only the main rank writes. wandb and TensorBoard are imported lazily; wandb runs ``offline`` by
default, and its API key is never read or printed by hpa (wandb takes it from its own login or
``WANDB_API_KEY``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional

from hpa.config.schema import LoggingConfig
from hpa.distributed import comm
from hpa.distributed.console import due as console_due
from hpa.distributed.console import progress_bar

logger = logging.getLogger("hpa")

WANDB_STEP = "trainer/step"


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


class MetricsWriter:
    """Writes one record per step to every enabled sink.

    Args:
        run_dir: the run directory; ``metrics.jsonl`` goes there.
        logging_cfg: the ``logging`` section.
        is_main: only the main rank writes.
        run_config: the resolved config as plain data, for wandb's run config.
        resume_step: append to an existing ``metrics.jsonl`` (after dropping records at or after
            ``resume_step``, so a resumed run has one record per step).
        total_steps: the run's length, for the progress bar (no bar without it) and the last console line.
        phase: the bar's name (``train``, ``sft``).
    """

    def __init__(self, run_dir: os.PathLike, logging_cfg: LoggingConfig, *, is_main: bool,
                 run_config: Optional[Mapping] = None, resume_step: Optional[int] = None,
                 total_steps: Optional[int] = None, phase: str = "train"):
        self.is_main = is_main
        self.cfg = logging_cfg
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        self._tensorboard = None
        self._bar = None
        self.total_steps = total_steps or 0
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self.truncate(resume_step)
        elif self.path.exists():
            self.path.unlink()
        if logging_cfg.wandb.mode != "disabled":
            self._wandb = self._init_wandb(run_dir, run_config)
        if logging_cfg.tensorboard:
            self._tensorboard = self._init_tensorboard(Path(run_dir) / "tensorboard")
        if logging_cfg.progress_bar:
            self._bar = progress_bar(phase, self.total_steps, initial=max((resume_step or 1) - 1, 0))

    @staticmethod
    def _init_tensorboard(log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.warning("logging.tensorboard=true needs the tensorboard package (pip install tensorboard); "
                           "TensorBoard logging is off")
            return None
        return SummaryWriter(log_dir=str(log_dir))

    def _init_wandb(self, run_dir, run_config):
        try:
            import wandb
        except ImportError:
            logger.warning("wandb is not installed; logging.wandb.mode=%s ignored", self.cfg.wandb.mode)
            return None
        w = self.cfg.wandb
        # wandb's own banner and run summary (some twenty lines per run) only at logging.level DEBUG
        quiet = self.cfg.level != "DEBUG"
        run = wandb.init(project=w.project, entity=w.entity, name=w.name, mode=w.mode,
                         dir=str(run_dir), config=dict(run_config or {}), resume="allow",
                         settings=wandb.Settings(quiet=quiet, show_info=not quiet))
        logger.info("wandb (%s): %s", w.mode, run.dir if w.mode == "offline" else run.url)
        # wandb's own step must only grow, but a rollback or a resume writes earlier steps again:
        # plot against hpa's step, a metric of its own
        run.define_metric(WANDB_STEP)
        run.define_metric("*", step_metric=WANDB_STEP)
        return run

    def truncate(self, from_step: int) -> None:
        """Drop the records of ``from_step`` and later (a resumed or rolled-back run writes them again)."""
        if not self.is_main or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) < from_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.is_main:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({WANDB_STEP: step, **{k: v for k, v in record.items() if k != "step"}})
        if self._tensorboard is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tensorboard.add_scalar(k, v, global_step=step)
            self._tensorboard.flush()
        if self._bar is not None:
            self._bar.update(max(step - self._bar.n, 0))
            self._bar.set_postfix({k: _fmt(record[k]) for k in _BAR_KEYS if k in record}, refresh=True)
        if self.cfg.console and console_due(step, self.cfg.log_interval, self.total_steps):
            shown = {k: record[k] for k in sorted(record) if k in _CONSOLE_KEYS}
            logger.info("step %d %s", step, " ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_CONSOLE_KEYS = ("sft/nll", "actor/pg_loss", "dpo/loss", "kl/token", "kl/semantic", "reward/shaped_mean",
                 "eval/score", "actor/grad_norm", "timing_s/step")


_BAR_KEYS = ("reward/raw_mean", "kl/token", "dpo/reward_acc", "eval/score", "sft/nll", "rm/loss")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_metrics(run_dir: os.PathLike):
    """The records of ``<run_dir>/metrics.jsonl`` as a list of dicts."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------
# per-step figures of the HPA loop that are not losses


def length_metrics(response_lengths, max_new_tokens: int, dp_group) -> Dict[str, float]:
    """Response lengths over the global batch (mean weighted by responses, max as max, and the
    fraction cut at ``max_new_tokens``)."""
    import torch

    lengths = response_lengths.double()
    total = comm.all_reduce_sum(torch.stack([lengths.sum(), torch.tensor(float(len(lengths))),
                                             (lengths >= max_new_tokens).double().sum()]), dp_group)
    longest = comm.all_reduce_max(lengths.max().reshape(1), dp_group)
    return {"response_length/mean": (total[0] / total[1]).item(), "response_length/max": longest.item(),
            "response_length/clip_ratio": (total[2] / total[1]).item()}


GB = 1e9  # the unit of ``hpa plan``, so a run's peak and the plan compare directly


def peak_memory_gb(device=None) -> float:
    """Peak memory torch allocated on ``device`` when it is a CUDA device, else this process's peak
    resident set; in GB (1e9 bytes, ``hpa plan``'s unit)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # KiB (Linux)


@contextlib.contextmanager
def device_timer(device, add: Callable[[float], None], clock: Callable[[], float] = time.perf_counter):
    """Time a block of work on ``device``: ``add(seconds)`` at its end. On CUDA the block's kernels run
    after the Python that launched them returns, so the device is synchronised at both ends (else a
    CUDA phase counts only its launch time)."""
    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = clock()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(device)
        add(clock() - start)


# dense bf16 tensor-core peak TFLOP/s of one device, by the name CUDA reports (NVIDIA's datasheets give the
# figures with sparsity: these are half); first match wins, ``None``: not known, declare
# ``trainer.peak_tflops_per_device``. An H100 NVL or a MIG slice is not an SXM part, so neither falls through.
DEVICE_PEAK_TFLOPS = ((r"\bMIG\b", None), (r"\bH100\b.*\bPCIe\b", 756.0), (r"\bH200\b.*\bNVL\b", 835.0),
                      (r"\bH100\b.*\bNVL\b", None), (r"\bH[12]00\b", 989.0))


def device_peak_tflops(device_name: Optional[str]) -> Optional[float]:
    """The table's peak for a CUDA device name (``torch.cuda.get_device_name``), or ``None`` when unknown:
    H100 SXM and H200 SXM 989, H200 NVL 835, H100 PCIe 756."""
    for pattern, peak in DEVICE_PEAK_TFLOPS if device_name else ():
        if re.search(pattern, device_name, re.IGNORECASE):
            return peak
    return None


def peak_tflops(declared: Optional[float], device_name: Optional[str]) -> Optional[float]:
    """The peak MFU is measured against: ``trainer.peak_tflops_per_device`` where declared (a card the table
    does not know, a capped clock), else the device name's (``device_peak_tflops``); ``None``: MFU is NaN."""
    return declared if declared else device_peak_tflops(device_name)


def device_name(device) -> Optional[str]:
    """``torch.cuda.get_device_name`` of a CUDA device; ``None`` elsewhere."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def mfu(num_params: int, tokens_per_second: float, model_parallel_size: int, peak_tflops: Optional[float]) -> float:
    """Model FLOPs utilisation: 6·N·tokens per second per device over the declared peak; NaN when the
    peak is unknown (e.g. CPU), not a made-up figure."""
    if not peak_tflops:
        return float("nan")
    return 6.0 * num_params * tokens_per_second / model_parallel_size / (peak_tflops * 1e12)


def update_perf(num_params: int, *, tokens: float, padded_tokens: float, update_seconds: float,
                step_seconds: float, model_parallel_size: int, peak_tflops: Optional[float]) -> Dict[str, float]:
    """The ``perf/`` figures of a step.

    MFU is the policy update's (forward and backward, 6·N per token) over the update's own time: the
    rollout, the reference and reward forwards and the critic run at other rates and are not in it.
    ``perf/mfu`` counts the real (non-pad) tokens, ``perf/mfu_padded`` every position the update
    computed (padding included), so their ratio is the padding's cost; ``perf/pad_share`` is the share of
    the update's positions that were pads (0 with ``trainer.sequence_packing``).

    Args:
        tokens, padded_tokens: this rank's trained tokens of the step, without and with padding.
        update_seconds, step_seconds: the update's and the whole step's time.
    """
    update = max(update_seconds, 1e-12)
    return {"perf/throughput": tokens / max(step_seconds, 1e-12),
            "perf/update_throughput": tokens / update,
            "perf/mfu": mfu(num_params, tokens / update, model_parallel_size, peak_tflops),
            "perf/mfu_padded": mfu(num_params, padded_tokens / update, model_parallel_size, peak_tflops),
            "perf/pad_share": 1.0 - tokens / padded_tokens if padded_tokens > 0 else 0.0}
