"""The background base worker process (``python -m lowdiff_store.torch.capture.bases.worker
PATH PPID VERIFY``): see :mod:`.background`. Requests come on stdin and results go to stdout,
one JSON object per line."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from ....errors import LowdiffError, Reason

#: Requests waiting beyond this many: the worker skips to the newest (it cannot keep up, and
#: every diff is durable anyway); up to it, every requested base is made, in order.
MAX_BACKLOG = 4


def _die_with_parent(ppid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != ppid:
        os._exit(0)


class _Lines:
    """Line reader over a file descriptor, blocking or not."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def get(self, block: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while not self.eof:
            r, _w, _x = select.select([self.fd], [], [], None if block and not out else 0)
            if not r:
                break
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                out.append(json.loads(line))
            if out:
                block = False
        return out


def _build(path: str, step: int, verify: bool) -> tuple[Any, Any, bytes, dict[str, float]]:
    from ....log import LogReader
    from ...replay.materialize import materialize_base

    t0 = time.perf_counter()
    marks: dict[str, float] = {}

    def progress(done: int, total: int) -> None:
        if done == 0:
            marks["loaded"] = time.perf_counter()
        marks["replayed"] = float(total)

    last: LowdiffError | None = None
    for attempt in range(3):  # a compaction may delete a segment between open and read
        try:
            with LogReader(path) as r:
                tensors, meta = materialize_base(r, step, progress=progress, verify=verify)
                t1 = time.perf_counter()
                loaded = marks.get("loaded", t1)
                return tensors, meta, r.log_id, {"load_s": loaded - t0,
                                                 "replay_s": t1 - loaded,
                                                 "replayed": marks.get("replayed", 0.0)}
        except LowdiffError as e:
            if e.reason == Reason.REPLAY_DIVERGED:
                raise
            last = e
            time.sleep(0.05 * (attempt + 1))
    assert last is not None
    raise last


def _warm_up() -> None:
    """Import what the first replay would import lazily (torch.optim pulls in dynamo on its
    first optimizer, over a second), so the first base is not late."""
    import torch

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(1)
    opt.step()


def main(argv: Sequence[str]) -> int:
    """Entry point of the worker process: ``PATH PARENT_PID VERIFY``."""
    path, ppid, verify = argv[0], int(argv[1]), argv[2] == "1"
    _die_with_parent(ppid)
    proto: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by libraries goes to stderr, not into the protocol

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    import torch

    torch.set_num_threads(1)
    from ....compaction import publish_base

    _warm_up()
    send({"ready": os.getpid()})

    lines = _Lines(sys.stdin.fileno())
    pending: list[int] = []
    stop = False
    while True:
        for msg in lines.get(block=not pending and not stop):
            if "base" in msg:
                pending.append(int(msg["base"]))
            elif msg.get("stop"):
                stop = True
        if lines.eof and not stop:
            return 0  # the training process went away without stopping us
        if not pending:
            if stop or lines.eof:
                return 0
            continue
        pending.sort()
        if len(pending) > MAX_BACKLOG:
            for s in pending[:-1]:
                send({"skipped": s})
            pending = pending[-1:]
        step = pending.pop(0)
        t0 = time.perf_counter()
        try:
            tensors, meta, log_id, times = _build(path, step, verify)
            if os.getppid() != ppid:
                return 0
            t1 = time.perf_counter()
            size = publish_base(path, step, tensors, meta, log_id)
            del tensors
        except Exception as e:
            send({"error": step, "detail": f"{type(e).__name__}: {e}"})
            return 1
        t2 = time.perf_counter()
        send({"done": step, "bytes": size, "write_s": t2 - t1, "seconds": t2 - t0, **times})


__all__ = ["MAX_BACKLOG", "main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
