"""The console on a terminal: the progress bar and the log lines on a pseudo-terminal, captured raw."""

import os
import pty
import re
import subprocess
import sys
import textwrap

import pytest

from hpa.distributed.console import due

CHILD = textwrap.dedent("""
    import logging, sys
    from hpa.config.schema import LoggingConfig, WandbConfig
    from hpa.distributed.console import configure_logging
    from hpa.trainer.metrics import MetricsWriter

    configure_logging("INFO")
    w = MetricsWriter(sys.argv[1], LoggingConfig(wandb=WandbConfig(mode="disabled"), log_interval=2), is_main=True,
                      total_steps=6)
    for step in range(1, 7):
        w.write(step, {"reward/raw_mean": step / 10, "kl/token": 0.01})
        logging.getLogger("hpa.test").info("marker %d", step)
    w.close()
""")


def _run_on_a_terminal(tmp_path) -> str:
    """The child's stdout and stderr as a terminal shows them (a 120-column pseudo-terminal), raw."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=slave, stdout=slave, stderr=slave,
                            env=env, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminals as on Linux")
def test_log_lines_print_through_the_bar_not_into_it(tmp_path):
    raw = _run_on_a_terminal(tmp_path)
    assert "train:" in raw and "6/6" in raw  # the bar was drawn
    shown = []  # each terminal line as it finally reads: the text after its last carriage return
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown.append(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).split("\r")[-1])
    logs = [line for line in shown if " INFO " in line]
    # every log record is a whole line of its own, from its timestamp on: no bar text before it, none after
    assert logs and all(re.fullmatch(r"\d{4}-\d\d-\d\d [\d:,]+ hpa(\.test)? INFO (marker \d|step \d .*)", line)
                        for line in logs), logs
    assert [line.split()[-1] for line in logs if "marker" in line] == [str(i) for i in range(1, 7)]
    assert [line.split()[5] for line in logs if " INFO step " in line] == ["2", "4", "6"]


def test_console_lines_come_every_interval_and_at_the_last_step():
    assert [s for s in range(1, 8) if due(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 4) if due(s, 1, 3)] == [1, 2, 3]
