"""A fork server for the tests that start a worker script many times: the worker's imports
(torch, torch.distributed, the library; torchtitan) cost most of a short run's time, so a
server process makes them once and forks a child for each run.

Each run is still a process of its own, as ``python WORKER ARGV`` would be: its own
environment (the request's), stdin ``/dev/null``, stdout and stderr into files, its
``sys.argv``, the RNGs seeded afresh, the interpreter's own exit (threads joined, atexit
handlers run; an exception's traceback and exit status 1), killed by a signal as any
process (the exit status is then minus the signal). What it does not get afresh is what
the server's imports did, which is why the server must be started with the environment
the runs read at import (``OMP_NUM_THREADS``, ``PYTHONPATH``, ...) and must not have run
anything of a job (no process group, no thread pool).

Server side: the worker script, once imported, calls :func:`serve` with the function that
runs one of its command lines (:func:`serve_worker` for a worker whose ``main()`` reads
``sys.argv``). Client side: :class:`ForkServer` (one run at a time per server),
:func:`run_ranks`, the forked counterpart of ``tests.helpers.dist.run_ranks`` (a server per
rank), and :class:`Launcher`, a test module's launches of one worker on ranks: forked by
the servers its module fixture holds, else processes of their own.

The protocol: one JSON line per request on the server's stdin (``{"argv", "env",
"stdout", "stderr"}``); two JSON lines back on its stdout, ``{"pid"}`` once the child runs
and ``{"status"}`` once it ended. EOF on stdin ends the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers.timing import scaled

if TYPE_CHECKING:  # (the server side imports nothing of the tests but this module)
    from tests.helpers.dist import RankExit

# ------------------------------------------------------------------------------ server


def serve(run: Callable[[list[str]], None]) -> None:
    """Answer requests until EOF on stdin: fork a child for each, which runs ``run(argv)``
    and exits as the interpreter does; one child at a time."""
    sys.stdout.flush()
    sys.stderr.flush()
    while line := sys.stdin.readline():
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the run: what follows is its process, as if it had started so
            _child(req)
            run(list(req["argv"]))
            sys.exit(0)  # the interpreter's own exit (threads joined, atexit), not a return
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


def serve_worker(main: Callable[[], object], *modules: str) -> None:
    """``WORKER --serve`` for a worker whose ``main()`` reads ``sys.argv``: ``modules`` and
    ``torch._dynamo`` imported (an optimizer's first ``add_param_group`` imports it: 1.8 s
    of each run's CPU otherwise), one torch thread, the imports' objects out of every
    cyclic collection's walk (``gc.freeze``), then a ``main()`` forked per run."""
    import gc
    import importlib

    for name in ("torch._dynamo", *modules):
        importlib.import_module(name)
    sys.modules["torch"].set_num_threads(1)
    gc.freeze()
    serve(lambda _argv: main())


def _child(req: dict[str, Any]) -> None:
    """A forked run's process made as a started one: its environment, no stdin, stdout and
    stderr into its files (one file for both when they are the same), ``sys.argv``, the
    RNGs seeded afresh (``random`` reseeds itself at a fork)."""
    def into(path: str, fds: tuple[int, ...], mode: int) -> None:
        fd = os.open(path, mode, 0o644)
        for target in fds:
            os.dup2(fd, target)
        os.close(fd)

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    into(os.devnull, (0,), os.O_RDONLY)
    if req["stderr"] == req["stdout"]:
        into(req["stdout"], (1, 2), flags)
    else:
        into(req["stdout"], (1,), flags)
        into(req["stderr"], (2,), flags)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [sys.argv[0], *req["argv"]]
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


# ------------------------------------------------------------------------------ client


class ForkServer:
    """A server process (``argv``: ``python WORKER ...`` that calls :func:`serve`), its
    stderr into ``log``; one run at a time."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=fh)
        self._buf = b""
        self.pid: int | None = None  # the run's

    def start(self, argv: Sequence[str], env: Mapping[str, str], stdout: Path,
              stderr: Path | None = None) -> None:
        """``argv`` (the worker's arguments) run by a child, its output into ``stdout``
        and ``stderr`` (default: the same file). Waits for the child to run (the server
        first makes its imports)."""
        assert self.proc.stdin is not None
        assert self.pid is None, "one run at a time"
        req = {"argv": list(argv), "env": dict(env), "stdout": str(stdout),
               "stderr": str(stderr or stdout)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        got = self._answer(scaled(600))
        assert got is not None, f"the fork server did not start the run {argv}"
        self.pid = got["pid"]

    def run(self, argv: Sequence[str], env: Mapping[str, str], files: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``argv`` run to its end, as ``subprocess.run`` with captured output would
        (``FILES.stdout`` and ``FILES.stderr`` hold it); a run past ``timeout`` seconds (a
        hang bound) is killed and fails the test with the end of its stderr."""
        out, err = Path(f"{files}.stdout"), Path(f"{files}.stderr")
        self.start(argv, env, out, err)
        status = self.poll(timeout)
        if status is None:
            self.kill()
            raise AssertionError(f"the run {list(argv)} did not end in {timeout:.0f} s:\n"
                                 f"{err.read_text()[-4000:]}")
        return subprocess.CompletedProcess(list(argv), status, out.read_text(),
                                           err.read_text())

    def poll(self, timeout: float = 0.0) -> int | None:
        """The run's exit status once it ended (waiting at most ``timeout``), else None."""
        got = self._answer(timeout)
        if got is None:
            return None
        self.pid = None
        status: int = got["status"]
        return status

    def kill(self) -> int:
        """SIGKILL the run; its exit status."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        status = self.poll(scaled(60))
        assert status is not None, "the fork server did not reap a killed run"
        return status

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        fd, end = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = max(0.0, end - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            assert chunk, f"the fork server ended:\n{self.log.read_text()[-4000:]}"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        """End the server (a run still going is killed first)."""
        if self.pid is not None:
            self.kill()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(scaled(60))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def run_ranks(servers: Sequence[ForkServer], argv: Callable[[int], Sequence[str]],
              world: int, *, env: Mapping[str, str], timeout: float = 120.0,
              killed: int | None = None, peers_grace: float = 60.0) -> list[RankExit]:
    """``tests.helpers.dist.run_ranks`` with each rank forked by ``servers[rank]``:
    ``argv(rank)`` are the worker's arguments. The same deadline (a hang bound, scaled)
    and the same grace for the peers of the rank ``killed``; the same exits."""
    from tests.helpers.dist import RankExit

    assert len(servers) >= world
    logs = [Path(tempfile.mkstemp(prefix=f"rank{r}-", suffix=".log")[1]) for r in range(world)]
    status: dict[int, int] = {}
    timed_out: set[int] = set()
    try:
        for r in range(world):
            servers[r].start(argv(r), env, logs[r])
        deadline = time.monotonic() + scaled(timeout) + 30
        while len(status) < world:
            for r in range(world):
                if r not in status and (s := servers[r].poll()) is not None:
                    status[r] = s
            now = time.monotonic()
            if killed is not None and killed in status:
                deadline = min(deadline, now + scaled(peers_grace))
                killed = None
            if now > deadline:
                for r in range(world):
                    if r not in status:
                        status[r] = servers[r].kill()
                        timed_out.add(r)
            time.sleep(0.02)
        return [RankExit(r, status[r], logs[r].read_text(errors="replace"), r in timed_out)
                for r in range(world)]
    finally:
        for r in range(world):
            if r not in status and servers[r].pid is not None:
                servers[r].kill()
            logs[r].unlink(missing_ok=True)


class Launcher:
    """A test module's launches of ``WORKER`` on ranks (environment ``env()``): forked by
    ``WORKER --serve`` servers, one per rank, started as launches need them, while
    :meth:`held` holds them (the module's autouse fixture), else processes of their own (a
    launch from a module that does not hold them)."""

    def __init__(self, worker: Path, env: Callable[[], dict[str, str]]) -> None:
        self.worker, self.env = worker, env
        self._held: list[tuple[Path, list[ForkServer]]] = []

    @contextlib.contextmanager
    def held(self, root: Path) -> Iterator[None]:
        """Launches inside go through fork servers (their logs in ``root``); ended after."""
        servers: list[ForkServer] = []
        self._held.append((root, servers))
        try:
            yield
        finally:
            self._held.remove((root, servers))
            for server in servers:
                server.close()

    def run_ranks(self, argv: Callable[[int], Sequence[str]], world: int,
                  **kw: Any) -> list[RankExit]:
        """``run_ranks`` (this module's or ``tests.helpers.dist``'s) of ``WORKER
        argv(rank)`` on ``world`` ranks; ``kw``: their options but ``env``."""
        if not self._held:
            from tests.helpers import dist

            return dist.run_ranks(lambda r: [sys.executable, str(self.worker), *argv(r)],
                                  world, env=self.env(), **kw)
        root, servers = self._held[-1]
        while len(servers) < world:
            servers.append(ForkServer([sys.executable, str(self.worker), "--serve"],
                                      self.env(), root / f"server-{len(servers)}.log"))
        return run_ranks(servers, argv, world, env=self.env(), **kw)
