"""The writer process with a fault in its segment files, for tests/test_ring_process.py: run
as ``RingClient(..., command=COMMAND)``; ``LOWDIFF_TEST_RING_FAULT`` picks the fault:

- ``slow_sync:S``: every segment sync sleeps S seconds first (a slow disk);
- ``enospc:N``: the N-th segment write and every later one raise ENOSPC (a full disk).

The fault is put on ``AppendFile`` (the class every local segment is), then the ordinary
``lowdiff_store.writer.process.main`` runs."""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Sequence

from lowdiff_store.storage import AppendFile
from lowdiff_store.writer.process import main

ENV = "LOWDIFF_TEST_RING_FAULT"
COMMAND = (sys.executable, os.path.abspath(__file__))


def zombie_or_gone(pid: int) -> bool:
    """The process ``pid`` has exited (a zombie not yet reaped counts as gone). Reaped
    between ``open`` and ``read``, the read fails with ESRCH (ProcessLookupError), not
    ENOENT: any OSError means gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _install(fault: str) -> None:
    kind, _, arg = fault.partition(":")
    writev, sync = AppendFile._writev, AppendFile._sync
    if kind == "slow_sync":
        def slow_sync(self: AppendFile, fd: int) -> None:
            if self.path.endswith(".ldlog"):
                time.sleep(float(arg))
            sync(self, fd)
        AppendFile._sync = slow_sync  # type: ignore[method-assign]
    elif kind == "enospc":
        count = [0]

        def full(self: AppendFile, fd: int, chunks: Sequence[object]) -> int:
            if self.path.endswith(".ldlog"):
                count[0] += 1
                if count[0] >= int(arg):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return writev(self, fd, chunks)  # type: ignore[arg-type]
        AppendFile._writev = full  # type: ignore[method-assign,assignment]
    else:
        raise SystemExit(f"unknown {ENV}={fault!r}")


if __name__ == "__main__":
    if os.environ.get(ENV):
        _install(os.environ[ENV])
    sys.exit(main(sys.argv[1:]))
