"""Ctrl-C for real: run ``python -m lowdiff_store ARGV`` and send SIGINT while it works.

The command runs under a small wrapper that holds it, the first time it maps a file whose
path contains ``needle`` (it is inside the command, reading the log), in a sleep inside that
``mmap`` call, and says so on a private pipe; only then is SIGINT sent. The hold ends with
the SIGINT, on whichever thread it is (a mapping made by a worker thread that the main
thread waits for while it unwinds once held the exit for minutes under load). The interrupt thus
always lands inside the work, however loaded the machine: an earlier version polled
``/proc/PID/maps`` and stopped the process when it saw the mapping, and on a busy machine
the command could run to its end (and its exit) between the poll and the signal.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

#: run as ``python -c _WRAPPER FD NEEDLE ARGV...``: the CLI with ``mmap.mmap`` held once
_WRAPPER = r"""
import mmap, os, runpy, signal, sys, threading, time
fd, needle = int(sys.argv[1]), sys.argv[2]
del sys.argv[1:3]
sys.argv[0] = "lowdiff_store"
held = []
interrupted = threading.Event()


def on_sigint(signum, frame):  # Python's default (KeyboardInterrupt), remembered
    interrupted.set()
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, on_sigint)


class Held(mmap.mmap):
    def __new__(cls, fileno, *a, **kw):
        m = super().__new__(cls, fileno, *a, **kw)
        if not held and needle in os.readlink(f"/proc/self/fd/{fileno}"):
            held.append(m)
            os.write(fd, b"started\n")
            os.close(fd)
            end = time.monotonic() + 300
            # the test's SIGINT ends this sleep: on the main thread by its KeyboardInterrupt,
            # on a worker thread (the replay's prefetch, which the main thread then waits
            # for while it unwinds) by the flag
            while time.monotonic() < end and not interrupted.is_set():
                time.sleep(0.01)
        return m


mmap.mmap = Held
runpy.run_module("lowdiff_store", run_name="__main__", alter_sys=True)
"""


def interrupt_when(argv: list[str], needle: str, timeout: float = 120.0,
                   cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI, interrupt it while it maps the first file whose path has ``needle``;
    the finished process. ``AssertionError`` when it never maps one."""
    env = dict(os.environ)
    env.pop("LOWDIFF_DEBUG", None)
    env["OMP_NUM_THREADS"] = "1"
    rfd, wfd = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, str(wfd), needle, *argv],
                                env=env, cwd=cwd, pass_fds=(wfd,), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        os.close(wfd)
        wfd = -1
        deadline = time.monotonic() + timeout
        started = b""
        while not started and time.monotonic() < deadline:
            ready, _w, _x = select.select([rfd], [], [], 0.1)
            if ready:
                started = os.read(rfd, 64)
                if not started:  # the pipe closed: the command ended without mapping one
                    break
        if started:
            os.kill(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # (never left running into the next test)
            out, err = proc.communicate()
            raise AssertionError(f"the command did not end {timeout:.0f} s after SIGINT "
                                 f"(started: {bool(started)}): {err[-2000:]}") from None
        if not started:
            raise AssertionError(f"the command never mapped a {needle!r} file "
                                 f"(exit {proc.returncode}): {err[-2000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
