"""Waits of the trainer workers before they SIGKILL themselves (tests/integrations): a test
of a restore from a streamed base must not depend on how fast the background writer runs
on a loaded machine."""

from __future__ import annotations

import os
import sys
import time

from lowdiff_store.log import LogReader
from lowdiff_store.log.latest import latest_step
from tests.helpers.timing import scaled


def await_streamed_base(ckpt: str, step: int, timeout_s: float = 120.0) -> None:
    """Wait until ``step`` is durable in the log ``ckpt`` and a streamed base is complete
    at or before the durable step, so that a restore after a kill starts from a streamed
    base (a slice holds no durable step back: the base may complete after its step is
    durable). ``scaled(timeout_s)`` is a hang bound, not a duration: past it the process
    exits 3 (the test fails naming it) instead of going on to its kill."""
    end = time.monotonic() + scaled(timeout_s)
    durable = None
    while time.monotonic() < end:
        durable = latest_step(ckpt)
        if durable is not None and durable >= step:
            with LogReader(ckpt) as r:
                if any(c <= durable for c, _s in r.streamed):
                    return
        time.sleep(0.01)
    print(f"no streamed base complete with step {step} durable (durable: {durable})",
          file=sys.stderr, flush=True)
    os._exit(3)


__all__ = ["await_streamed_base"]
