"""Ctrl-C for real: run ``python -m lowdiff_store ARGV`` and send SIGINT while it works.

Once the process has mapped a file whose path contains ``needle`` (it is inside the
command, reading the log), it is frozen (SIGSTOP), sent SIGINT, and let go (SIGCONT): the
interrupt lands wherever the work was, without a race against a fast command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _mapped(pid: int, needle: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return needle in f.read()
    except OSError:
        return False


def interrupt_when(argv: list[str], needle: str, timeout: float = 120.0,
                   cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI, interrupt it once ``needle`` is mapped; the finished process."""
    env = dict(os.environ)
    env.pop("LOWDIFF_DEBUG", None)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "lowdiff_store", *argv], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not _mapped(proc.pid, needle) and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the command never opened the log")
        time.sleep(0.001)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
