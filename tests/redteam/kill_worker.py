"""A process the kill tests SIGKILL at the K-th file-system operation (issue 35 item 5).

``python kill_worker.py K MODE ARGS...`` counts every call of ``os.open``, ``os.write``,
``os.pwrite``, ``os.fsync``, ``os.rename``, ``os.replace``, ``os.mkdir``, ``os.unlink``,
``os.ftruncate`` and ``open`` (from any thread) and kills itself with SIGKILL at call
``K`` (0: never; it then prints ``events N`` at the end, so a test can draw K in
``1..N``). A moment is an event count, not a time: the same K kills at the same place on a
busy machine and a quiet one. Modes:

- ``export LOG OUT FORMAT``: ``export_state`` of the newest state (optimizer included
  where the format holds it);
- ``import LOG CK STEPS``: ``DiffCheckpointer(LOG, initial_base=CK)`` (after a crash, as a
  user re-runs the script: ``restore`` first when ``latest_step(LOG)`` is not None), then
  train to STEPS;
- ``train LOG STEPS``: a checkpointer with a base every 2 steps (staged beside the next
  step), resuming from LOG when ``latest_step`` says there is a step; after every step
  prints ``durable S``.

With ``LOWDIFF_TEST_WRITER_PROCESS=1`` the checkpointers of ``import`` and ``train`` write
through a writer process (``writer_process=True``); the kill still counts this process's
operations. ``LOWDIFF_TEST_KILL_WRITER_AT=K`` (with it) counts the *writer process's*
operations instead and kills it at the K-th (0: never; at its end it prints ``writer
events N``): this file is then also the writer command (``python kill_worker.py writer
ARGS...`` runs ``lowdiff_store.writer.process`` with the counting installed, torch-free).
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import threading
from typing import Any

_count = 0
_lock = threading.Lock()
_kill_at = 0


def _hook(mod: Any, name: str) -> None:
    real = getattr(mod, name)

    def counted(*a: Any, **k: Any) -> Any:
        global _count
        with _lock:
            _count += 1
            now = _count
        if now == _kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)

    setattr(mod, name, counted)


def _install() -> None:
    for name in ("open", "write", "pwrite", "fsync", "rename", "replace", "mkdir", "unlink",
                 "ftruncate"):
        if hasattr(os, name):
            _hook(os, name)
    _hook(builtins, "open")


#: the environment variables of the process path (module docstring)
PROCESS_ENV = "LOWDIFF_TEST_WRITER_PROCESS"
KILL_WRITER_ENV = "LOWDIFF_TEST_KILL_WRITER_AT"


def _writer(argv: list[str]) -> None:
    """The writer process, counting its file-system operations (``KILL_WRITER_ENV``)."""
    global _kill_at
    from lowdiff_store.writer.process import main as writer_main

    _kill_at = int(os.environ.get(KILL_WRITER_ENV, "0"))
    _install()
    try:
        rc = writer_main(argv)
    finally:
        if _kill_at == 0:
            print(f"writer events {_count}", flush=True)
    sys.exit(rc)


def _writer_options() -> dict[str, Any]:
    """``DiffCheckpointer`` options for ``PROCESS_ENV`` (and the counting writer command
    for ``KILL_WRITER_ENV``)."""
    if os.environ.get(PROCESS_ENV) != "1":
        return {}
    if KILL_WRITER_ENV in os.environ:
        import functools

        from lowdiff_store.torch.capture import process_sink
        from lowdiff_store.writer.ring_client import RingClient

        process_sink.RingClient = functools.partial(  # type: ignore[misc]
            RingClient, command=(sys.executable, os.path.abspath(__file__), "writer"))
    return {"writer_process": True}


def _model(seed: int) -> Any:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    from tests.redteam.common import build

    return build(seed)


def _has_log(path: str) -> bool:
    """What the README tells a script to ask: anything durable to resume from?"""
    from lowdiff_store import latest_step

    return latest_step(path) is not None


def main(argv: list[str]) -> None:
    """Run one mode (see the module)."""
    global _kill_at
    if argv[0] == "writer":
        _writer(argv[1:])
    _kill_at = int(argv[0])
    mode, args = argv[1], argv[2:]
    import torch

    torch.set_num_threads(1)
    from lowdiff_store.torch import DiffCheckpointer, export_state, replay_state, restore
    from tests.redteam.common import train

    if mode == "export":
        log, out, fmt = args
        state, opt_state = replay_state(log, with_optimizer=fmt != "hf")
        _install()
        export_state(state, out, format=fmt, optimizer_state=opt_state)
    elif mode == "import":
        log, ck, steps = args
        m, opt = _model(5)
        kw = _writer_options()
        _install()
        if _has_log(log):
            start = restore(log, m, opt).step
            ckpt = DiffCheckpointer(log, m, opt, snapshot_every=100, **kw)
        else:
            ckpt = DiffCheckpointer(log, m, opt, snapshot_every=100, initial_base=ck, **kw)
            start = 0
        train(m, opt, 3 + start, 3 + int(steps))
        ckpt.close()
    elif mode == "train":
        log, steps = args
        m, opt = _model(1)
        kw = _writer_options()
        _install()
        start = restore(log, m, opt).step if _has_log(log) else 0
        with DiffCheckpointer(log, m, opt, snapshot_every=2, **kw) as ckpt:
            for t in range(start, int(steps)):
                train(m, opt, t, t + 1)
                if kw and t == 3:  # (the run is shorter than a writer process's start)
                    ckpt.flush()
                print(f"durable {ckpt.durable_step}", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(f"events {_count}", flush=True)


def serve() -> None:
    """``kill_worker.py --serve``: a fork server (``tests/helpers/fork_server.py``) that
    makes every mode's imports once, then forks a :func:`main` per run. Every run of a
    server starts from the same state, so an unkilled run's count of operations (after
    :func:`_install`) is the count of a killed run's, as between fresh processes."""
    from tests.helpers.fork_server import serve_worker

    serve_worker(lambda: main(sys.argv[1:]), "torch.distributed.checkpoint",
                 "lowdiff_store.torch", "lowdiff_store.torch.capture.process_sink",
                 "tests.redteam.common")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        serve()
    else:
        main(sys.argv[1:])
