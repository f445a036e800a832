"""A training process with ``writer_process=True``, for
tests/torch/test_writer_process_kills.py, which kills it at a chosen moment:

    python writer_process_worker.py MODE CASE PATH     (LOWDIFF_TEST_STALL_GATE=FILE)

The writer process runs behind ``stalled_writer`` (its segment syncs wait while FILE
exists). Lines on stdout: ``WRITER pid``, ``DURABLE d`` (after a flush at step 6), then

- ``between``: the disk stalls, steps 7..8 run (step 7 is handed over at step 8's
  optimizer step); once every step handed over is in the ring (``settle``), ``HANDED
  last durable bases...`` (the newest step in the ring, the durable step, the bases put),
  then it waits on stdin;
- ``queued``: as ``between`` with steps 7..9, but the copy of step 8 into the ring never
  starts (held on the sink's step thread); once step 7 is in the ring, ``QUEUED ring last
  durable`` (the newest step in the ring, the newest handed over, the durable step), then
  it waits;
- ``base`` (a base every 4 steps): the disk stalls, steps 7..9 run (step 8 and its base
  are handed over at step 9's optimizer step); ``HANDED ...`` as above, then it waits;
- ``close``: steps 7..9 run, the disk stalls, ``CLOSING last``, then ``close()`` (which
  waits on the stalled writer) and ``CLOSED``;
- ``fork_exit``: a child is forked and exits at once the ordinary way (``sys.exit``: its
  interpreter runs its exit handlers); then steps 7..12, ``FLUSHED d`` or ``ERROR ...``,
  ``close()``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _cases import build, ckpt_kwargs, train_step  # noqa: E402
from stalled_writer import COMMAND, ENV  # noqa: E402

from lowdiff_store.torch import DiffCheckpointer  # noqa: E402
from lowdiff_store.torch.capture import process_sink  # noqa: E402
from lowdiff_store.writer.ring_client import RingClient  # noqa: E402


def say(*words: object) -> None:
    print(*words, flush=True)


class HeldClient(RingClient):
    """A ring client whose copy of step :attr:`HELD` never starts (``queued``)."""

    HELD = 8

    def put_step(self, step: int, *args: Any, **kw: Any) -> None:
        if step == self.HELD:
            threading.Event().wait()  # (until the process is killed)
        super().put_step(step, *args, **kw)


def main() -> None:
    mode, case, path = sys.argv[1:4]
    gate = os.environ[ENV]
    torch.set_num_threads(1)
    client = HeldClient if mode == "queued" else RingClient
    process_sink.RingClient = functools.partial(client, command=COMMAND)  # type: ignore[misc]
    o = build(case)
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                            scaler=o.scaler, compressor=o.compressor,
                            extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), "snapshot_every": 4,
                               "writer_process": True})
    sink = ckpt._out.sink
    say("WRITER", sink.pid)
    for t in range(1, 7):
        train_step(case, o, t, ckpt)
    say("DURABLE", ckpt.flush())

    def handed() -> None:
        sink.settle()
        assert sink.ring_step == sink.last_step
        say("HANDED", sink.ring_step, ckpt.durable_step, *sink._put)

    if mode in ("between", "base"):
        open(gate, "w").close()
        for t in range(7, 9 if mode == "between" else 10):
            train_step(case, o, t, ckpt)
        handed()
        sys.stdin.read()  # until killed
    elif mode == "queued":
        open(gate, "w").close()
        for t in range(7, 10):
            train_step(case, o, t, ckpt)
        deadline = time.monotonic() + 120
        while sink.ring_step < HeldClient.HELD - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        say("QUEUED", sink.ring_step, sink.last_step, ckpt.durable_step)
        sys.stdin.read()
    elif mode == "close":
        for t in range(7, 10):
            train_step(case, o, t, ckpt)
        open(gate, "w").close()
        say("CLOSING", sink.last_step)
        ckpt.close()
        say("CLOSED")
        sys.stdin.read()
    elif mode == "fork_exit":
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # an ordinary interpreter exit: atexit handlers, finalizers
        os.waitpid(pid, 0)
        try:
            for t in range(7, 13):
                train_step(case, o, t, ckpt)
            say("FLUSHED", ckpt.flush())
        except Exception as e:
            say("ERROR", type(e).__name__, str(e).replace("\n", " "))
        try:
            ckpt.close()
        except Exception as e:
            say("CLOSE_ERROR", type(e).__name__)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
