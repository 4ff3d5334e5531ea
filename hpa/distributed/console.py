"""The console of every entry point: log records through the progress bar, one bar per phase (on a terminal
only), and megatron's start-up chatter below the level a user sees unless asked for.

A log line printed while a tqdm bar is drawn would land in the middle of the bar's line; each record is
written with ``tqdm.write`` instead, which clears the bar, prints the line and draws the bar again below it.
Off a terminal there is no bar (its carriage-return redraws would fill a log file), and the per-step lines
come every ``logging.log_interval`` steps.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Optional

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# megatron-core logs its DDP buckets (every parameter's name) and its FSDP probe at INFO on every start
CHATTY_LOGGERS = ("megatron",)
# deprecations inside torch's and megatron's distributed checkpointing, two lines each per checkpoint load,
# that nothing in hpa can act on
QUIET_WARNING_MODULES = r"(torch\.distributed\.checkpoint|megatron\.core)(\.|$)"


class BarSafeHandler(logging.StreamHandler):
    """A stream handler that writes each record through ``tqdm.write`` (no interleaving with a bar)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's contract: a broken stream never raises into the caller
            self.handleError(record)


def configure_logging(level: str = "INFO") -> None:
    """The root logger at ``level`` through a ``BarSafeHandler`` on stderr (unless the process configured
    its own handlers first, as ``logging.basicConfig`` does); unless ``level`` is DEBUG, megatron's loggers at
    WARNING and the deprecation warnings of torch's and megatron's checkpointing off."""
    root = logging.getLogger()
    if not root.handlers:
        handler = BarSafeHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(level)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)
    if level != "DEBUG":
        warnings.filterwarnings("ignore", category=FutureWarning, module=QUIET_WARNING_MODULES)


def progress_bar(phase: str, total: int, initial: int = 0, file=None) -> Optional[object]:
    """A tqdm bar for one phase (``sft``, ``train-rm``, ``train``) on ``file`` (stderr), None off a terminal."""
    file = file if file is not None else sys.stderr
    if not total or not file.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=phase, unit="step", dynamic_ncols=True, file=file)


def due(step: int, interval: int, total: int) -> bool:
    """Whether step ``step`` (1-based) of ``total`` gets a console line: every ``interval`` steps and the last."""
    return step == total or (interval > 0 and step % interval == 0)
