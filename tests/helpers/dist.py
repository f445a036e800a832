"""What the multi-process torch tests share: the gloo skip marker, a free port for a
rendezvous on 127.0.0.1, and one launcher for the ranks of a job (``run_ranks``).

The launcher waits for every rank under one deadline (a hang bound, scaled by
``LOWDIFF_TEST_TIME_SCALE``, see ``timing.py``), never for a duration: on a busy machine a
job only takes longer. At the deadline every rank still running is killed and reported as
timed out, so a hung job fails with its ranks' output instead of passing as "killed".
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch

from tests.helpers.timing import scaled

#: skip a module whose ranks need torch.distributed with the gloo backend
NEEDS_GLOO = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankExit:
    """How one rank ended: its exit status (negative: killed by that signal), its
    combined stdout and stderr, and whether the launcher killed it at the deadline."""

    rank: int
    returncode: int
    output: str
    timed_out: bool = False

    def __str__(self) -> str:
        how = f"exited {self.returncode}"
        if self.returncode < 0:
            how += f" ({signal.Signals(-self.returncode).name})"
        if self.timed_out:
            how += ", killed by the launcher at the deadline"
        return f"rank {self.rank} {how}:\n{self.output[-4000:]}"


def run_ranks(argv: Callable[[int], Sequence[str]], world: int, *,
              env: Mapping[str, str], timeout: float = 120.0, killed: int | None = None,
              peers_grace: float = 60.0) -> list[RankExit]:
    """Start ``argv(rank)`` for every rank and wait for all of them. ``timeout`` bounds the
    whole job (scaled); ``killed``: a rank expected to SIGKILL itself, after whose end its
    peers get ``peers_grace`` (scaled) to fail out of their collectives before they are
    killed. Output goes to temporary files (no pipe can fill and block a rank)."""
    logs = [tempfile.TemporaryFile() for _ in range(world)]
    procs = [subprocess.Popen(list(argv(r)), env=dict(env), stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(world)]
    deadline = time.monotonic() + scaled(timeout) + 30
    timed_out: set[int] = set()
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if killed is not None and procs[killed].poll() is not None:
                deadline = min(deadline, now + scaled(peers_grace))
                killed = None
            if now > deadline:
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        timed_out.add(r)
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    exits = []
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        exits.append(RankExit(r, p.returncode, log.read().decode(errors="replace"),
                              r in timed_out))
        log.close()
    return exits


def check_exits(exits: Sequence[RankExit], *, killed: int | None = None,
                peers: str = "ok") -> None:
    """Every rank exited 0, except ``killed`` (SIGKILL, never a timeout). ``peers="fail"``:
    the other ranks may fail out of a collective with the dead peer, or hang in it until
    the launcher kills them, but never abort (SIGABRT is a teardown bug, not a way to
    stop)."""
    for e in exits:
        if e.rank == killed:
            assert not e.timed_out, str(e)
            assert e.returncode == -signal.SIGKILL, str(e)
        elif peers == "ok":
            assert not e.timed_out, str(e)
            assert e.returncode == 0, str(e)
        else:
            assert e.returncode != -signal.SIGABRT, str(e)
