"""A writer process whose trainer died finishes its log before anything reads it again.

When the training process dies (SIGKILL included), its writer process handles every step
already handed over, makes it durable and exits (``format_spec/ring.md``, section 5): for
a moment the log still grows. A restart that restored the log in that moment would stop
short of steps that become durable a moment later (and its checkpointer would then find
the log ahead of the restored objects), and one that opened it would find its ``LOCK``
taken. So :func:`wait_for_orphaned_writer` waits, before a restore, an open or a
``latest_step``, until no writer process whose trainer is gone holds the log's ``LOCK``
(for a checkpoint of several ranks, the ``LOCK`` of any rank's log: a restart restores
every rank's log at once, and would otherwise read a rank whose log is still growing, or
not yet published).

How it knows, on Linux: ``/proc/locks`` names the process that took the ``flock`` of the
log's ``LOCK`` file (by device and inode). For a local log that is the trainer:
``RingClient`` takes the lock and hands its descriptor to the writer process, and a
``flock`` lasts while any process holds a descriptor of it, so a lock whose taker is gone
is held by the writer process it started: the process whose command line carries the
arguments ``RingClient`` starts one with (``--ring-fd``, ``--channel-fd``, ``--parent-pid``)
with ``--parent-pid`` the taker. A writer process that took the lock itself is an orphan if
the ``--parent-pid`` it was started with is gone (or is no longer its parent). A writer
whose trainer is alive (another job writing the log) is not waited for: opening the log
then fails as before (``locked``). Elsewhere (no ``/proc/locks``) and for object-store
logs nothing is waited for. (A trainer's pid reused by a new process within the moment
the orphan needs would hide it: the open then meets the lock, ``locked``.)
"""

from __future__ import annotations

import os
import time
from typing import Final

from ..format.constants import LOCK_NAME, RANK_DIR

#: the longest wait for an orphaned writer process (it has only to sync what it holds)
ORPHAN_WAIT_S: Final = 120.0
#: the arguments every writer process is started with (``RingClient``)
_ARGS = (b"--ring-fd", b"--channel-fd", b"--parent-pid")


def orphaned_writer(path: str) -> int | None:
    """The pid of a writer process holding the ``LOCK`` of the log at ``path`` whose trainer
    is gone, or None (no such process, another holder, not a local log, not Linux)."""
    if "://" in path:
        return None
    try:
        st = os.stat(os.path.join(path, LOCK_NAME))
        with open("/proc/locks", "rb") as f:
            locks = f.read().decode("ascii", "replace")
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in locks.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            pid = int(parts[4]) if parts[4].isdigit() else -1
            if pid <= 0:
                return None
            if _is_orphaned_writer(pid):
                return pid
            return _writer_started_by(pid) if _gone(pid) else None
    return None


def _gone(pid: int) -> bool:
    """The process ``pid`` has exited (no longer listed, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")


def _writer_started_by(parent: int) -> int | None:
    """The writer process started with ``--parent-pid parent`` (a trainer now gone that
    handed it the log's lock), or None."""
    want = str(parent).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        argv = _cmdline(int(entry))
        if all(a in argv for a in _ARGS) and \
                argv[argv.index(b"--parent-pid") + 1:][:1] == [want]:
            return int(entry)
    return None


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _is_orphaned_writer(pid: int) -> bool:
    argv = _cmdline(pid)
    if not all(a in argv for a in _ARGS):  # (python -m lowdiff_store.writer.process ...)
        return False
    try:
        parent = int(argv[argv.index(b"--parent-pid") + 1])
    except (ValueError, IndexError):
        return False
    return not os.path.exists(f"/proc/{parent}") or _ppid(pid) != parent


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _logs_at(path: str) -> list[str]:
    """``path``, and the rank directories in it where it is a checkpoint of several ranks
    (``PATH/rank-0000r``: each a log with a writer process of its own)."""
    try:
        names = os.listdir(path)
    except OSError:
        return [path]
    prefix = RANK_DIR.split("{", 1)[0]
    return [path, *(os.path.join(path, n) for n in sorted(names) if n.startswith(prefix))]


def wait_for_orphaned_writer(path: str, timeout: float = ORPHAN_WAIT_S) -> float:
    """Wait until no orphaned writer process holds the log at ``path``, nor, where
    ``path`` holds one log per rank, the log of any rank (at most ``timeout`` seconds;
    then the caller goes on and meets the lock as it is); returns the seconds waited."""
    t0 = time.monotonic()
    logs = _logs_at(path)  # (an object store's URL lists nothing: orphaned_writer says None)
    while any(orphaned_writer(p) is not None for p in logs) and \
            time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    return time.monotonic() - t0


__all__ = ["ORPHAN_WAIT_S", "orphaned_writer", "wait_for_orphaned_writer"]
