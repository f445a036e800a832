"""The writer process behind a disk that stalls on demand, for
tests/torch/test_writer_process_kills.py: run as ``RingClient(..., command=COMMAND)`` with
``LOWDIFF_TEST_STALL_GATE`` naming a file. While that file exists, every segment sync
waits (the writer's first wait creates ``<gate>.hit``, so a test knows the writer is
stuck); removing the file lets the syncs go on. A wait never outlasts ``MAX_STALL_S``, so a
test that dies with the gate in place leaves no process behind for long.
``LOWDIFF_TEST_STALL_BASE_GATE`` does the same for the writing of bases (``LogWriter.
write_base``; first wait: ``<gate>.hit``). ``LOWDIFF_TEST_STALL_START_GATE`` holds the
process before it does anything (a writer process still importing). Torch-free, like the
writer process itself; the ordinary ``lowdiff_store.writer.process.main`` runs."""

from __future__ import annotations

import os
import sys
import time

from lowdiff_store.log.writer import LogWriter
from lowdiff_store.storage import AppendFile
from lowdiff_store.writer.process import main

ENV = "LOWDIFF_TEST_STALL_GATE"
BASE_ENV = "LOWDIFF_TEST_STALL_BASE_GATE"
START_ENV = "LOWDIFF_TEST_STALL_START_GATE"
COMMAND = (sys.executable, os.path.abspath(__file__))
MAX_STALL_S = 300.0


def wait_at(gate: str) -> None:
    """Wait while ``gate`` exists (at most MAX_STALL_S); the first wait makes
    ``<gate>.hit``."""
    if not os.path.exists(gate):
        return
    if not os.path.exists(gate + ".hit"):
        with open(gate + ".hit", "w") as f:
            f.write(str(os.getpid()))
    deadline = time.monotonic() + MAX_STALL_S
    while os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.005)


def install(gate: str) -> None:
    """Make every segment sync wait while ``gate`` exists."""
    sync = AppendFile._sync

    def stalled(self: AppendFile, fd: int) -> None:
        if self.path.endswith(".ldlog"):
            wait_at(gate)
        sync(self, fd)
    AppendFile._sync = stalled  # type: ignore[method-assign]


def install_base(gate: str) -> None:
    """Make the writing of every base wait while ``gate`` exists."""
    write_base = LogWriter.write_base

    def stalled(self: LogWriter, *args: object, **kwargs: object) -> object:
        wait_at(gate)
        return write_base(self, *args, **kwargs)  # type: ignore[arg-type]
    LogWriter.write_base = stalled  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    if os.environ.get(START_ENV):
        wait_at(os.environ[START_ENV])
    if os.environ.get(ENV):
        install(os.environ[ENV])
    if os.environ.get(BASE_ENV):
        install_base(os.environ[BASE_ENV])
    sys.exit(main(sys.argv[1:]))
