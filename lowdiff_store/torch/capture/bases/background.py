"""Background bases (LowDiff+ "incremental merging"): a worker process makes the bases.

With ``DiffCheckpointer(..., base_mode="background")`` the training process never copies
the full state after step 0. At each base step t it only notes the request; once step t is
durable it sends t to a worker process, which replays the logged diffs onto the newest base
at or before t on the CPU (:func:`~lowdiff_store.torch.materialize_base`: the same replay as
:func:`replay_state`, digests checked) and publishes the base with one manifest swap
(:func:`lowdiff_store.compaction.publish_base`). The base is byte for byte the one the
checkpointer would have written in the foreground (the tests check it).

The worker is a separate interpreter (``python -m lowdiff_store.torch.capture.bases.worker``),
not a ``multiprocessing`` child: it does not re-import the training script, shares no CUDA
context, and uses one CPU thread. It reads only what is durable, talks to the training
process through two pipes (one JSON object per line), dies with it (Linux
``PR_SET_PDEATHSIG``, and a parent-pid check before each publish), and never takes part in
a collective. When it falls behind, it skips to the newest requested base (the diffs are
durable either way), once more than :data:`~.worker.MAX_BACKLOG` wait.
When it fails (replay diverged, I/O error, killed), the checkpointer
logs a warning and takes its next bases in the foreground.

Requirements (checked when the checkpointer is created): in grad mode the replay must give
the training bits on the CPU, so the parameters must be on the CPU and the optimizer one of
:data:`ALLOWED_OPTIMIZERS`; an error-feedback compressor needs ``ef_state="step"`` (with
``"base"`` its residuals are not in the log). Delta mode works on any device.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from ....errors import ConfigError, Reason

_log = logging.getLogger(__name__)


def check_background(mode: str, optimizer_class: str, devices: Sequence[str],
                     error_feedback: bool, ef_state: str) -> None:
    """Raise ``ConfigError`` when background bases cannot be identical to foreground ones."""
    if mode == "grad":
        from ...core.schema import ALLOWED_OPTIMIZERS, allowed_optimizer

        bad = sorted({d for d in devices if d != "cpu"})
        if bad:
            raise ConfigError(
                f"base_mode='background' replays on the CPU, which does not give the bits of "
                f"a {bad[0]} run in mode='grad': use mode='delta' or base_mode='foreground'",
                reason=Reason.NOT_ALLOWED)
        if allowed_optimizer(optimizer_class) is None:
            raise ConfigError(
                f"base_mode='background' rebuilds the optimizer in a worker process; "
                f"{optimizer_class} is not one of {', '.join(ALLOWED_OPTIMIZERS)}",
                reason=Reason.NOT_ALLOWED)
    if error_feedback and ef_state != "step":
        raise ConfigError("base_mode='background' needs the error-feedback residuals in the "
                          "log: pass ef_state='step'", reason=Reason.NOT_ALLOWED)


def _pythonpath() -> str:
    """PYTHONPATH that lets the worker import this very package."""
    import lowdiff_store

    root = os.path.dirname(os.path.dirname(os.path.abspath(lowdiff_store.__file__)))
    old = os.environ.get("PYTHONPATH")
    return root if not old else root + os.pathsep + old


class BackgroundBases:
    """The training side of the worker: requests, durability gating, results.

    Args:
        path: the log directory.
        verify: check the recorded digests while replaying (default True).
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = path
        env = dict(os.environ)
        env["PYTHONPATH"] = _pythonpath()
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "lowdiff_store.torch.capture.bases.worker", path,
               str(os.getpid()), "1" if verify else "0"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      close_fds=True, env=env)
        assert self._proc.stdout is not None
        assert self._proc.stdin is not None
        self._out_fd = self._proc.stdout.fileno()
        os.set_blocking(self._out_fd, False)
        self._buf = b""
        self._wanted: deque[int] = deque()   # requested, not yet durable
        self._sent: set[int] = set()          # sent, no answer yet
        self.failed: str | None = None
        self.ready = False  # the worker has started (imports done)
        self._stopping = False
        self._counts = {"requested": 0, "sent": 0, "done": 0, "skipped": 0, "errors": 0,
                        "worker_s": 0.0, "bytes": 0}
        self._finalizer = weakref.finalize(self, _kill, self._proc)

    @property
    def active(self) -> bool:
        """The worker is usable (not failed, not stopped)."""
        return self.failed is None and not self._stopping

    @property
    def pending(self) -> int:
        """Bases requested and not yet made (or skipped)."""
        return len(self._wanted) + len(self._sent)

    def request(self, step: int) -> None:
        """A base is due at ``step``: it is sent to the worker once ``step`` is durable."""
        self._wanted.append(step)
        self._counts["requested"] += 1

    def poll(self, durable: int | None) -> list[dict[str, Any]]:
        """Send the requests that ``durable`` covers; return the worker's new results
        (``{"done": step, "load_s", "replay_s", "replayed", "write_s", "bytes"}``).
        Never blocks."""
        if self.failed is not None:
            return []
        while self._wanted and durable is not None and self._wanted[0] <= durable:
            step = self._wanted.popleft()
            if not self._send({"base": step}):
                return []
            self._sent.add(step)
            self._counts["sent"] += 1
        return self._read(block=False)

    def close(self, durable: int | None, timeout: float | None = None) -> list[dict[str, Any]]:
        """Send what ``durable`` covers, wait until the worker has made (or skipped) every
        base sent, stop it. Returns the results that arrived meanwhile."""
        out = self.poll(durable)
        self._wanted.clear()
        if self.failed is None:
            self._send({"stop": True})
        self._stopping = True
        end = None if timeout is None else time.monotonic() + timeout
        while self.failed is None and self._sent:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                self.failed = f"worker still busy after {timeout} s"
                break
            out += self._read(block=True, timeout=left)
        self.abort()
        return out

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the worker has started (it imports torch: a second or two), or it
        failed, or ``timeout``; returns :attr:`ready`. Never needed for correctness: requests
        wait in the pipe."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.ready and self.failed is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._read(block=True, timeout=left)
        return self.ready

    def abort(self) -> None:
        """Stop the worker now (a base it was publishing may be left unpublished; the next
        writer open or compaction removes it). Idempotent."""
        self._stopping = True
        self._finalizer()

    def stats(self) -> dict[str, float]:
        """Counters: bases ``requested``, ``sent`` to the worker, ``done``, ``skipped``
        (the worker jumped to a newer one), ``errors``; ``worker_s`` (its seconds),
        ``bytes`` written, ``pending``, ``failed`` (0/1)."""
        out = dict(self._counts)
        out["pending"] = self.pending
        out["failed"] = float(self.failed is not None)
        return out

    # ------------------------------------------------------------------ plumbing

    def _send(self, obj: dict[str, Any]) -> bool:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps(obj) + "\n").encode())
            stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            self._fail("the background base worker exited")
            return False

    def _fail(self, why: str) -> None:
        if self.failed is None:
            code = self._proc.poll()
            self.failed = why + (f" (exit code {code})" if code is not None else "")
            _log.warning("lowdiff-store background bases for %s: %s; the next bases are "
                         "taken in the foreground", self.path, self.failed)
        self._sent.clear()
        self._wanted.clear()

    def _read(self, *, block: bool, timeout: float | None = None) -> list[dict[str, Any]]:
        """Results available now; with ``block``, wait (up to ``timeout``) for at least one
        message, or the worker's exit."""
        out: list[dict[str, Any]] = []
        end = None if timeout is None else time.monotonic() + timeout
        seen = 0
        while True:
            try:
                chunk: bytes | None = os.read(self._out_fd, 1 << 16)
            except BlockingIOError:
                chunk = None
            except (OSError, ValueError):
                chunk = b""
            if chunk:
                self._buf += chunk
                seen += self._handle_lines(out)
                continue
            if chunk == b"":  # the worker exited
                self._handle_lines(out)
                if self._sent or not self._stopping:
                    self._fail("the background base worker exited")
                return out
            if not block or seen or self.failed is not None:
                return out
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return out
            select.select([self._out_fd], [], [], left)

    def _handle_lines(self, out: list[dict[str, Any]]) -> int:
        """Act on the complete lines received; returns how many."""
        n = 0
        while b"\n" in self._buf:
            n += 1
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "ready" in msg:
                self.ready = True
            elif "done" in msg:
                self._sent.discard(msg["done"])
                self._counts["done"] += 1
                self._counts["worker_s"] += float(msg.get("seconds", 0.0))
                self._counts["bytes"] += int(msg.get("bytes", 0))
                out.append(msg)
            elif "skipped" in msg:
                self._sent.discard(msg["skipped"])
                self._counts["skipped"] += 1
            elif "error" in msg:
                self._counts["errors"] += 1
                self._fail(f"base at step {msg['error']} failed: {msg.get('detail')}")
        return n


def _kill(proc: subprocess.Popen[bytes]) -> None:
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    if proc.poll() is None:
        try:
            proc.wait(timeout=2)  # a stopped worker exits at once; a busy one is killed
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = ["BackgroundBases", "check_background"]
