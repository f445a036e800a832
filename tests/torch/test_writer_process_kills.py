"""Red team of the writer process's boundary (``DiffCheckpointer(..., writer_process=True)``,
format_spec/ring.md sections 4-6; docs/failures.md, issue 49): kills on either side at
chosen moments, a full ring behind a stalled disk, a writer that cannot start, garbage in a
slot, two checkpointers in one process, ``os.fork()`` after open, one descriptor whatever
the tensor count. Each case asserts states and values: what restores is bitwise the state
of an uninterrupted run at that step.

Nothing here depends on how fast the machine is: a "stalled disk" is a writer process
(tests/torch/stalled_writer.py) whose syncs wait while a gate file exists, and the test
opens the gate once it has seen what it waits for (a count, a file, a line); every wait has
a generous deadline (tests/helpers/timing.py) that only bounds a hang.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _cases import assert_same, build, ckpt_kwargs, reference, run, snapshot, train_step
from stalled_writer import BASE_ENV as STALL_BASE_ENV
from stalled_writer import COMMAND as STALLED
from stalled_writer import ENV as STALL_ENV
from stalled_writer import START_ENV as STALL_START_ENV

from lowdiff_store import LogReader
from lowdiff_store.errors import (
    BadMagicError,
    CommitError,
    ConfigError,
    CorruptRecordError,
    FormatError,
    LowdiffError,
    Reason,
    StorageError,
)
from lowdiff_store.format.checksum import crc32c, mask
from lowdiff_store.torch import DiffCheckpointer, restore
from lowdiff_store.torch.capture import process_sink
from lowdiff_store.writer import ring as R
from lowdiff_store.writer import ring_client
from lowdiff_store.writer.ring import Op, RingBatch
from lowdiff_store.writer.ring_client import RingClient
from tests.helpers.ring_writer import zombie_or_gone
from tests.helpers.timing import scaled, wait_for

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "writer_process_worker.py")
STEPS = 12
_REFS: dict[str, dict[int, Any]] = {}


def _ref(case: str) -> dict[int, Any]:
    """Snapshots of an uninterrupted run of ``case`` at every step 1..STEPS (cached)."""
    if case not in _REFS:
        _REFS[case] = reference(case, STEPS, at=tuple(range(1, STEPS + 1)))[1]
    return _REFS[case]


def _ckpt(path: Any, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), "writer_process": True, **kw})


def _restored(path: Any, case: str) -> tuple[Any, Any]:
    o = build(case)
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler)
    return o, res


def _assert_restores(path: Any, case: str, low: int, high: int) -> int:
    """The log restores exactly to a step in [low, high], bitwise the reference's state
    there, with every record 1..that step in the log; returns the step."""
    o, res = _restored(path, case)
    assert low <= res.step <= high, (low, res.step, high)
    assert res.exact
    assert res.extra == {"batches": res.step}
    assert_same(snapshot(o), _ref(case)[res.step])
    with LogReader(path) as r:
        assert [int(s) for s in r.steps if int(s) <= res.step] == list(range(1, res.step + 1))
    return int(res.step)


def _ended(pid: int) -> bool:
    """Our child ``pid`` exited with every thread (a zombie leader with threads still
    exiting holds the descriptors, the channel included)."""
    if not zombie_or_gone(pid):
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:  # reaped meanwhile: ENOENT, or ESRCH on a directory already open
        return True


def _children() -> set[int]:
    """This process's live (not zombie) children."""
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), \
                open(f"/proc/self/task/{task}/children") as f:  # a thread may just end
            out.update(int(p) for p in f.read().split())
    return {p for p in out if not zombie_or_gone(p)}


def _fd_targets(pid: int | str) -> list[str]:
    d = f"/proc/{pid}/fd"
    out = []
    for n in os.listdir(d):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"{d}/{n}"))
    return out


@pytest.fixture
def stalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Checkpointers opened in this test run their writer behind a disk whose segment syncs
    wait while the returned gate file exists (it does not yet)."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(STALL_ENV, str(gate))
    monkeypatch.setattr(process_sink, "RingClient", functools.partial(RingClient,
                                                                      command=STALLED))
    try:
        yield gate
    finally:
        gate.unlink(missing_ok=True)


# ------------------------------------------------------------------ 1. the writer killed

@pytest.mark.parametrize("next_call", ["step", "flush", "close"])
def test_writer_sigkilled_mid_run_is_raised_and_the_durable_steps_restore(
        tmp_path: Path, next_call: str) -> None:
    case, path = "sgd_bn", tmp_path / "log"
    o = build(case)
    ckpt = _ckpt(path, case, o)
    run(case, o, 0, 6, ckpt)
    assert ckpt.flush() == 6
    run(case, o, 6, 8, ckpt)  # steps in flight at the kill
    durable = ckpt.durable_step
    pid = ckpt._out.sink.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _ended(pid), "the killed writer process ended")
    with pytest.raises(CommitError) as ei:
        if next_call == "step":  # (its channel is closed: the next put raises; a few
            for t in range(9, 14):  # steps in case a hand-over waits for a later step)
                train_step(case, o, t, ckpt)
        else:
            getattr(ckpt, next_call)()
    msg = str(ei.value)
    assert "writer process died" in msg
    assert "SIGKILL" in msg
    assert ei.value.reason is Reason.WRITER_FAILED
    with contextlib.suppress(CommitError):  # (reported: may be raised once more)
        ckpt.close()
    ckpt.close()  # idempotent, quiet
    train_step(case, o, 12, ckpt)  # the hooks are gone: training goes on unlogged
    assert 6 <= durable <= 8
    _assert_restores(path, case, durable, 8)


# ------------------------------------------------------------------ 2. the trainer killed

class _Child:
    """A training process (writer_process_worker.py) whose stdout lines are read with a
    deadline."""

    def __init__(self, mode: str, case: str, path: Path, gate: Path) -> None:
        env = dict(os.environ, **{STALL_ENV: str(gate)})
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, WORKER, mode, case, str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def expect(self, word: str) -> list[str]:
        """The next line, which must start with ``word``; its other words."""
        try:
            line = self.lines.get(timeout=scaled(120))
        except queue.Empty:
            raise AssertionError(f"no {word} line from the training process") from None
        got = line.split()
        assert got[:1] == [word], (word, line, self.proc.poll())
        return got[1:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(scaled(60))
        assert self.proc.returncode == -signal.SIGKILL

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(scaled(60))
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@contextlib.contextmanager
def _trainer(mode: str, case: str, path: Path, gate: Path) -> Iterator[tuple[_Child, int]]:
    """A training process of ``mode`` (the reference states made first), past its flush at
    step 6: yields it and its writer process's pid. At the end the stall gate is open, the
    child gone and the writer process killed if it still runs."""
    _ref(case)
    child = _Child(mode, case, path, gate)
    writer = -1
    try:
        writer = int(child.expect("WRITER")[0])
        assert int(child.expect("DURABLE")[0]) == 6
        yield child, writer
    finally:
        gate.unlink(missing_ok=True)
        child.close()
        if writer > 0 and not zombie_or_gone(writer):
            os.kill(writer, signal.SIGKILL)


def _kill_then_free_the_disk(child: _Child, writer: int, gate: Path) -> None:
    """SIGKILL the trainer; its writer process still serves (its disk stalls) until the
    gate opens, then exits."""
    child.kill()
    assert not zombie_or_gone(writer)  # (still serving: its disk stalls)
    gate.unlink()
    wait_for(lambda: zombie_or_gone(writer), "the orphaned writer process exited")


@pytest.mark.parametrize(("mode", "case"), [("between", "topk"), ("base", "sgd_bn"),
                                           ("close", "sgd_bn")])
def test_trainer_sigkilled_leaves_no_writer_and_everything_handed_over_restores(
        tmp_path: Path, mode: str, case: str) -> None:
    """The trainer is killed with steps handed over that the stalled disk has not made
    durable (between steps; with base 8 in flight; inside ``close()``); the writer process
    makes them durable once the disk goes on, then exits."""
    path, gate = tmp_path / "log", tmp_path / "gate"
    with _trainer(mode, case, path, gate) as (child, writer):
        if mode == "close":
            (last,) = map(int, child.expect("CLOSING"))
            assert last >= 8
            # the writer is stuck in a sync: the trainer is inside close()
            wait_for(lambda: Path(f"{gate}.hit").exists(), "the writer stalled")
            low, high = last, 9
        else:
            last, durable, *bases = map(int, child.expect("HANDED"))
            assert durable == 6 < last  # handed over, not durable: the disk stalls
            assert last == (7 if mode == "between" else 8)
            assert (8 in bases) is (mode == "base")
            low = high = last  # every step put before the kill becomes durable
        _kill_then_free_the_disk(child, writer, gate)
    step = _assert_restores(path, case, low, high)
    if mode != "close":
        with LogReader(path) as r:
            assert set(bases) <= {int(b) for b in r.bases}  # every base put is there
    _o, res = _restored(path, case)
    assert res.base_step == max(b for b in (0, 4, 8) if b <= step)


def test_trainer_sigkilled_with_a_record_not_yet_in_the_ring(tmp_path: Path) -> None:
    """Where the promise of a trainer kill ends: a record is handed over when ``append``
    returns, but it reaches the writer process only once the step thread has copied it
    into the ring. Killed with step 7 in the ring (not durable: the disk stalls) and
    step 8 handed over but held before its copy, the writer process makes step 7 durable;
    step 8 dies with the trainer (it never was durable), and the restore is step 7,
    exact, with no step 8 in the log."""
    path, gate, case = tmp_path / "log", tmp_path / "gate", "topk"
    with _trainer("queued", case, path, gate) as (child, writer):
        ring, last, durable = map(int, child.expect("QUEUED"))
        assert (ring, last, durable) == (7, 8, 6)
        _kill_then_free_the_disk(child, writer, gate)
    assert _assert_restores(path, case, 7, 7) == 7
    with LogReader(path) as r:
        assert r.last_step == 7


def test_a_restore_waits_for_the_orphaned_writer_to_finish_the_log(tmp_path: Path) -> None:
    """Restarting right after the trainer's death: the writer process still holds steps it
    was handed (its disk stalls); ``restore`` waits for it (never a step short of what
    becomes durable), and so do ``latest_step`` (what a restart script asks first: it said
    6, the durable step of the moment, while the restore then loaded 7) and a
    checkpointer opening the log (never a taken LOCK)."""
    from lowdiff_store import latest_step
    from lowdiff_store.storage.orphans import orphaned_writer

    path, gate, case = tmp_path / "log", tmp_path / "gate", "topk"
    with _trainer("between", case, path, gate) as (child, writer):
        last, durable, *_bases = map(int, child.expect("HANDED"))
        assert durable == 6 < last == 7
        assert orphaned_writer(str(path)) is None  # its trainer lives: not an orphan
        child.kill()
        wait_for(lambda: orphaned_writer(str(path)) == writer, "the writer seen orphaned")
        got: list[Any] = []
        latest: list[Any] = []
        t = threading.Thread(target=lambda: got.append(_restored(path, case)[1]))
        t2 = threading.Thread(target=lambda: latest.append(latest_step(path)))
        t.start()
        t2.start()
        t.join(0.5)
        t2.join(0.1)
        assert t.is_alive()  # (neither can end: the orphan's disk is stalled)
        assert t2.is_alive()
        assert not got
        assert not latest
        gate.unlink()
        t.join(120)
        t2.join(120)
        assert not t.is_alive()
        assert got[0].step == last  # everything handed over, made durable first
        assert latest == [last]
        assert orphaned_writer(str(path)) is None
        o = build(case)
        restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler)
        with _ckpt(path, case, o) as ck:  # (the LOCK is free: opens at once)
            for t_ in (last + 1, last + 2):
                train_step(case, o, t_, ck)
        _assert_restores(path, case, last + 2, last + 2)


def test_a_restore_of_several_ranks_waits_for_any_ranks_orphaned_writer(tmp_path: Path
                                                                        ) -> None:
    """A checkpoint of several ranks (``PATH/rank-0000r``, one log each): the wait before a
    restore covers every rank's log, not only ``PATH`` (before, a restart restored at once
    and read a rank whose log was still growing, or not yet published: ``not_a_log``)."""
    from lowdiff_store.storage.orphans import orphaned_writer, wait_for_orphaned_writer

    root, gate, case = tmp_path / "ck", tmp_path / "gate", "topk"
    path = root / "rank-00001"
    root.mkdir()
    with _trainer("between", case, path, gate) as (child, writer):
        last, durable, *_bases = map(int, child.expect("HANDED"))
        assert durable == 6 < last == 7  # (killed earlier, nothing would hold the writer)
        child.kill()
        wait_for(lambda: orphaned_writer(str(path)) == writer, "the writer seen orphaned")
        assert orphaned_writer(str(root)) is None  # (the root holds no LOCK of its own)
        waited: list[float] = []
        t = threading.Thread(target=lambda: waited.append(wait_for_orphaned_writer(
            str(root))))
        t.start()
        t.join(0.5)
        assert t.is_alive()  # (the orphan's disk is stalled: it cannot be done)
        gate.unlink()
        t.join(120)
        assert not t.is_alive()
        assert waited[0] >= 0.5
        assert orphaned_writer(str(path)) is None


# ------------------------------------------------------------------ 3. a full ring

def test_a_full_ring_behind_a_stalled_disk_waits_and_loses_no_step(
        tmp_path: Path, stalled: Path) -> None:
    case, path = "sgd_bn", tmp_path / "log"
    o = build(case)
    ckpt = _ckpt(path, case, o, ring_bytes=1 << 20)  # two slots of 1 MiB
    client = ckpt._out.sink._c
    assert client._ring.slot_count == 2
    ckpt.flush()  # (base 0 settled)
    stalled.touch()
    seen: list[float] = []

    def open_gate() -> None:  # once the trainer waits for the ring (or after a deadline)
        try:
            wait_for(lambda: client.stats()["ring_waits"] > 0, "a ring wait", timeout=120)
            seen.append(client.stats()["ring_waits"])
        finally:
            stalled.unlink(missing_ok=True)

    opener = threading.Thread(target=open_gate, daemon=True)
    opener.start()
    run(case, o, 0, STEPS, ckpt)
    assert ckpt.flush() == STEPS
    opener.join(scaled(60))
    stats = ckpt.stats()
    ckpt.close()
    assert seen
    assert seen[0] >= 1
    assert stats["writer_ring_waits"] >= seen[0]
    assert stats["writer_ring_puts"] == STEPS
    with LogReader(path) as r:
        assert [int(s) for s in r.steps] == list(range(1, STEPS + 1))
    _assert_restores(path, case, STEPS, STEPS)


# ------------------------------------------------------------------ 4. no writer

def test_a_ring_too_large_is_refused_at_construction_leaving_nothing(tmp_path: Path) -> None:
    case, path = "sgd_bn", tmp_path / "log"
    before = _children()
    o = build(case)
    with pytest.raises((ConfigError, StorageError)) as ei:
        _ckpt(path, case, o, ring_bytes=1 << 50)
    assert "ring" in str(ei.value)
    assert _children() == before
    # nothing is left attached or locked: training goes on, and the log opens afterwards
    train_step(case, o, 1)
    o = build(case)
    with _ckpt(path, case, o) as ckpt:
        run(case, o, 0, 3, ckpt)
    _assert_restores(path, case, 3, 3)


def test_a_ring_too_large_names_the_size_asked_for(tmp_path: Path) -> None:
    o = build("sgd_bn")
    with pytest.raises((ConfigError, StorageError)) as ei:
        _ckpt(tmp_path / "log", "sgd_bn", o, ring_bytes=1 << 50)
    assert str(1 << 50) in str(ei.value) or "ring_bytes" in str(ei.value)


def test_a_ring_the_memory_cannot_hold_is_a_storage_error_at_construction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def short(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(R.os, "posix_fallocate", short)
    gc.collect()  # (an earlier test's garbage may still hold files: closed before counting)
    before, fds = _children(), len(_fd_targets("self"))
    o = build("sgd_bn")
    with pytest.raises(StorageError) as ei:
        _ckpt(tmp_path / "log", "sgd_bn", o, ring_bytes=3 << 20)
    assert "cannot allocate a writer ring of" in str(ei.value)
    assert str(4096 + 3 * (1 << 20)) in str(ei.value)
    assert ei.value.errno == errno.ENOMEM
    assert _children() == before
    assert len(_fd_targets("self")) == fds
    train_step("sgd_bn", o, 1)  # no hook left behind


def test_a_writer_command_that_exits_is_raised_with_its_exit_code(tmp_path: Path) -> None:
    gc.collect()  # (an earlier test's garbage may still hold files: closed before counting)
    before, fds = _children(), sorted(_fd_targets("self"))
    with pytest.raises(CommitError, match=r"writer process died \(exit code 3\)") as ei:
        RingClient(tmp_path / "log", command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    assert ei.value.reason is Reason.WRITER_FAILED
    assert _children() == before
    del ei
    gc.collect()  # (the next test holds the descriptors to the moment of the raise)
    assert sorted(_fd_targets("self")) == fds  # the ring and the channel are closed


class _ExitedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """A Popen that returns once the process has exited: the producer's first PUBLISH then
    meets a closed channel (what a loaded machine does now and then)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait(scaled(60))


def test_a_writer_that_exits_before_the_first_publish_leaves_no_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_client.subprocess, "Popen", _ExitedPopen)
    gc.collect()  # (an earlier test's garbage may still hold files: closed before counting)
    fds = sorted(_fd_targets("self"))
    gc.disable()  # the descriptors must be closed by the raise, not by a later collection
    try:
        with pytest.raises(CommitError, match=r"writer process died \(exit code 3\)"):
            RingClient(tmp_path / "log",
                       command=(sys.executable, "-c", "import sys; sys.exit(3)"))
        left = sorted(set(_fd_targets("self")) - set(fds))
    finally:
        gc.enable()
        with warnings.catch_warnings():  # (what this test asserts, not a second failure)
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
    assert left == [], left


# ------------------------------------------------------------------ 5. garbage in a slot

SLOT = 4096


def _small(step: int) -> list[Any]:
    return [("w", "I64", (2,), np.array([step, -step], dtype=np.int64))]


def _at(c: RingClient, seq: int) -> int:
    return c._ring.slot_offset(seq)


def _recrc(c: RingClient, at: int) -> None:
    buf = c._ring.buf
    table_len = int.from_bytes(buf[at + 32:at + 36], "little")
    body = bytes(buf[at + 8:at + 64]) + bytes(buf[at + 64:at + 64 + table_len])
    buf[at + 4:at + 8] = mask(crc32c(body)).to_bytes(4, "little")


@pytest.mark.parametrize(("field", "cls", "reason", "rel"), [
    ("magic", BadMagicError, Reason.BAD_MAGIC, 0),
    ("table", CorruptRecordError, Reason.CHECKSUM_MISMATCH, 4),
    ("payload_len", FormatError, Reason.OUT_OF_BOUNDS, 40),
])
def test_a_garbled_slot_is_raised_naming_slot_and_offset_and_earlier_steps_stay(
        tmp_path: Path, field: str, cls: type, reason: Reason, rel: int) -> None:
    path = tmp_path / "log"
    c = RingClient(path, slots=8, slot_size=SLOT)
    for s in (1, 2, 3):  # handed over, not flushed: the writer closes the log with them
        c.put_step(s, "grad", _small(s))
    seq = c._head
    c._write(R.layout_diff(4, "grad", [R.RingTensor.raw(*_small(4)[0])]), what="step 4")
    at = _at(c, seq)
    buf = c._ring.buf
    if field == "magic":
        buf[at:at + 4] = b"XXXX"
    elif field == "table":
        buf[at + 66] ^= 0xFF
    else:
        buf[at + 40:at + 48] = (1 << 40).to_bytes(8, "little")
        _recrc(c, at)
    c._send(Op.PUBLISH, c._head)
    with pytest.raises(FormatError) as ei:
        c.flush()
    e = ei.value
    assert type(e) is cls
    assert e.reason is reason
    assert e.offset == at + rel
    assert f"ring slot {seq % 8}" in str(e)
    c.close()  # reported: quiet
    assert c._proc.returncode == 1
    with LogReader(path) as r:
        assert [int(s) for s in r.steps] == [1, 2, 3]
        for s in (1, 2, 3):
            assert list(r.record(s).tensor("w")) == [s, -s]


def _batch(shape: int, numel: int) -> RingBatch:
    return RingBatch(buffers=[("F32", np.arange(10, dtype=np.float32))],
                     recipes=[(0, "g", "F32", [shape], None, "bits", [[0, 0, numel]],
                               ["F32"])])


def test_a_recipe_past_its_buffer_is_raised_naming_the_recipe_and_earlier_steps_stay(
        tmp_path: Path) -> None:
    path = tmp_path / "log"
    c = RingClient(path, slots=8, slot_size=SLOT)
    c.put_step(1, "grad", _small(1))
    c.put_step(2, "grad", _small(2), batch=_batch(10, 10))  # a good recipe
    seq = c._head
    c.put_step(3, "grad", _small(3), batch=_batch(20, 20))  # 20 elements of a buffer of 10
    with pytest.raises(FormatError) as ei:
        c.flush()
    e = ei.value
    assert e.reason is Reason.OUT_OF_BOUNDS
    assert "recipe 0 ('g')" in str(e)
    assert "past buffer 0 of 10" in str(e)
    assert f"ring slot {seq % 8}" in str(e)
    assert e.offset == _at(c, seq) + 64  # the table
    c.close()
    assert c._proc.returncode == 1
    with LogReader(path) as r:
        assert [int(s) for s in r.steps] == [1, 2]
        assert np.array_equal(r.record(2).tensor("g"), np.arange(10, dtype=np.float32))
        assert list(r.record(2).tensor("w")) == [2, -2]


# ------------------------------------------------------------------ 6. two checkpointers

def test_two_checkpointers_with_writer_processes_interleaved_both_restore(
        tmp_path: Path) -> None:
    cases = ("adamw", "topk")  # a transformer; top-k messages encoded by recipes
    for case in cases:
        _ref(case)
    runs = []
    for case in cases:  # each run keeps its own global RNG stream (dropout), as if alone
        o = build(case)
        ckpt = _ckpt(tmp_path / case, case, o)
        runs.append([case, o, ckpt, torch.get_rng_state()])
    pids = [r[2]._out.sink.pid for r in runs]
    assert pids[0] != pids[1]
    saved = torch.get_rng_state()
    try:
        for t in range(1, STEPS + 1):
            for r in runs:
                case, o, ckpt, rng = r
                torch.set_rng_state(rng)
                train_step(case, o, t, ckpt)
                if t == 5:
                    assert ckpt.flush() == 5
                r[3] = torch.get_rng_state()
        for pid in pids:  # each writer holds its own channel only
            assert sum(t.startswith("socket:") for t in _fd_targets(pid)) == 1
        for case, _o, ckpt, rng in runs:
            torch.set_rng_state(rng)
            ckpt.close()
    finally:
        torch.set_rng_state(saved)
        for r in runs:
            r[2].close()
    for case in cases:
        _assert_restores(tmp_path / case, case, STEPS, STEPS)


@pytest.mark.parametrize("second", ["process", "thread"])
def test_a_second_checkpointer_on_a_new_log_is_refused_before_the_first_writer_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str) -> None:
    """A new log is not waited for (its writer process imports while the first steps
    queue), yet it is the first checkpointer's from its construction: a second one on the
    same path, made while the first's writer process has not started (held before it does
    anything), is refused there, ``locked``, with either writer; the first goes on and
    restores bitwise. Before, the LOCK was the writer process's to take: the second was
    not refused, and whichever writer took the LOCK first won, the first checkpointer's
    next call raising ``locked`` as often as not."""
    case, path = "sgd_bn", tmp_path / "log"
    gate = tmp_path / "start-gate"
    gate.touch()
    monkeypatch.setenv(STALL_START_ENV, str(gate))
    monkeypatch.setattr(process_sink, "RingClient", functools.partial(RingClient,
                                                                      command=STALLED))
    o = build(case)
    ckpt = _ckpt(path, case, o)
    try:
        o2 = build(case)
        with pytest.raises(LowdiffError) as ei:
            _ckpt(path, case, o2, writer_process=second == "process")
        assert ei.value.reason is Reason.LOCKED
        assert str(ei.value) == f"{path}/LOCK: locked: another writer holds this log " \
                                "(LOCK is taken)"
        assert ckpt._out.sink._c._ring.get(R.Word.STATE) == R.State.STARTING  # still held
        gate.unlink()
        run(case, o, 0, STEPS, ckpt)
        assert ckpt.flush() == STEPS
    finally:
        gate.unlink(missing_ok=True)
        ckpt.close()
    _assert_restores(path, case, STEPS, STEPS)


# ------------------------------------------------------------------ 7. fork after open

def test_a_fork_that_exits_at_once_does_not_end_the_parents_writer(tmp_path: Path) -> None:
    case, path = "sgd_bn", tmp_path / "log"
    o = build(case)
    ckpt = _ckpt(path, case, o)
    run(case, o, 0, 5, ckpt)
    writer = ckpt._out.sink.pid
    pid = os.fork()
    if pid == 0:  # the child: nothing of the checkpointer is touched
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    run(case, o, 5, STEPS, ckpt)
    assert ckpt.flush() == STEPS
    assert not zombie_or_gone(writer)
    ckpt.close()
    assert zombie_or_gone(writer)
    _assert_restores(path, case, STEPS, STEPS)


def test_a_fork_during_a_base_copy_closes_at_once_and_the_parent_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowdiff_store.writer.ring_client import RingClient

    real, entered, gate = RingClient.put_base, threading.Event(), threading.Event()

    def put_base(self: Any, step: int, *a: Any, **kw: Any) -> None:
        if step == 5:  # the base of step 5 stays in its copy while the process forks
            entered.set()
            gate.wait(scaled(60))
        real(self, step, *a, **kw)
    monkeypatch.setattr(RingClient, "put_base", put_base)
    case, path = "sgd_bn", tmp_path / "log"
    _ref(case)
    o = build(case)
    ckpt = _ckpt(path, case, o, snapshot_every=5)
    run(case, o, 0, 6, ckpt)
    assert entered.wait(scaled(60))
    pid = os.fork()
    if pid == 0:  # the child closes its copy of the sink: no copy thread to wait for. (Not
        try:      # the whole checkpointer: a lock another thread held at the fork, a
            ckpt._out.sink.close()  # helper's or logging's, is never released in a child)
        finally:
            os._exit(0)
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > scaled(30):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's close() waited for its parent's base copy")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
    gate.set()
    run(case, o, 6, STEPS, ckpt)
    assert ckpt.flush() == STEPS
    ckpt.close()
    with LogReader(path) as r:
        assert 5 in r.bases
    _assert_restores(path, case, STEPS, STEPS)


@pytest.mark.slow
def test_a_fork_that_exits_the_ordinary_way_does_not_end_the_parents_writer(
        tmp_path: Path) -> None:
    case, path, gate = "sgd_bn", tmp_path / "log", tmp_path / "gate"
    _ref(case)
    child = _Child("fork_exit", case, path, gate)
    try:
        child.expect("WRITER")
        assert int(child.expect("DURABLE")[0]) == 6
        line = child.lines.get(timeout=scaled(120))
        assert child.proc.wait(scaled(60)) == 0
    finally:
        child.close()
    assert line.split() == ["FLUSHED", str(STEPS)], line
    _assert_restores(path, case, STEPS, STEPS)


# ------------------------------------------------------------------ 8. one descriptor

class _Chain(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = torch.tanh(m(x))
        return x


def test_the_writer_holds_as_many_descriptors_for_4_as_for_64_parameters(
        tmp_path: Path) -> None:
    counts = []
    for layers in (2, 32):
        torch.manual_seed(0)
        model = _Chain(layers)
        assert len(list(model.parameters())) == 2 * layers
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with DiffCheckpointer(tmp_path / f"log{layers}", model, opt, snapshot_every=100,
                              writer_process=True) as ckpt:
            for t in range(3):
                g = torch.Generator().manual_seed(t)
                opt.zero_grad()
                model(torch.randn(4, 3, generator=g)).square().mean().backward()
                opt.step()
            assert ckpt.flush() == 3
            fds = _fd_targets(ckpt._out.sink.pid)
        counts.append(len(fds))
        assert sum(t.startswith("socket:") for t in fds) == 1
        assert sum("lowdiff-ring" in t for t in fds) <= 1
        with LogReader(tmp_path / f"log{layers}") as r:
            assert len(r.record(3).names) >= 2 * layers
    assert counts[0] == counts[1], counts


# ------------------------------------------------------------------ base 0 and the writer

def test_base_0_written_late_by_the_writer_process_is_not_taken_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        ) -> None:
    gate = tmp_path / "base-gate"
    gate.touch()
    monkeypatch.setenv(STALL_BASE_ENV, str(gate))
    monkeypatch.setattr(process_sink, "RingClient", functools.partial(RingClient,
                                                                      command=STALLED))
    case, path = "sgd_bn", tmp_path / "log"
    o = build(case)
    try:
        ckpt = _ckpt(path, case, o)
        client = ckpt._out.sink._c
        flushes = client._token

        def open_gate() -> None:  # once the trainer asks for a flush (settling base 0)
            try:
                wait_for(lambda: client._token > flushes, "a flush", timeout=120)
            finally:
                gate.unlink(missing_ok=True)

        opener = threading.Thread(target=open_gate, daemon=True)
        opener.start()
        run(case, o, 0, STEPS, ckpt)
        ckpt.close()
        opener.join(scaled(60))
    finally:
        gate.unlink(missing_ok=True)
    _assert_restores(path, case, STEPS, STEPS)
    with LogReader(path) as r:
        bases = [int(b) for b in r.bases]
    assert "was not written" not in caplog.text
    assert bases == [0, 10]


# ------------------------------------------------------------------ 9. records without a base

@pytest.mark.parametrize("writer", ["thread", "process"])
def test_records_without_a_base_are_started_over_by_the_same_script(
        tmp_path: Path, writer: str) -> None:
    """A run killed after records reached the log but before its first base was published
    (found by the writer-process kill campaign, ``tests/redteam/test_kill.py``: the writer
    process killed at its 19th file-system operation; a base goes through the ring whole
    and the writer's base thread publishes it after the first records are synced). Nothing
    of it was durable and ``latest_step`` says so, so the script, run again, starts afresh:
    the checkpointer starts the log over (it refused, ``no_base``: "remove it or use
    another directory"), and the log restores bitwise."""
    from lowdiff_store import latest_step
    from lowdiff_store.log.manifest import update_manifest

    case, path = "sgd_bn", tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, writer_process=False, snapshot_every=100) as ck:
        run(case, o, 0, 3, ck)
    update_manifest(path, lambda m: m.bases.clear())  # base 0 never published
    (path / "base-0000000000000000.safetensors").unlink()
    with LogReader(path) as r:
        assert (r.last_step, list(r.bases)) == (3, [])
    assert latest_step(path) is None
    o = build(case)
    with _ckpt(path, case, o, writer_process=writer == "process") as ck:
        run(case, o, 0, 5, ck)
    with LogReader(path) as r:
        assert (list(r.steps), list(r.bases)) == ([1, 2, 3, 4, 5], [0])
    _assert_restores(path, case, 5, 5)
