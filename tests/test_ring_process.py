"""The writer process through :class:`RingClient` (format_spec/ring.md): the log it writes
is the log ``AsyncLogWriter`` writes, it never imports torch, it gets two descriptors
whatever the tensor count, a full ring waits, and failures and kills on either side end
as the spec says."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, codecs
from lowdiff_store.errors import CommitError, ConfigError, LowdiffError, Reason, StorageError
from lowdiff_store.writer import AsyncLogWriter, TensorSpec
from lowdiff_store.writer.ring import RingTensor
from lowdiff_store.writer.ring_client import RingClient
from tests.helpers.ring_writer import COMMAND as FAULTY
from tests.helpers.ring_writer import ENV as FAULT
from tests.helpers.ring_writer import zombie_or_gone
from tests.helpers.timing import scaled


def _arrays(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((7, 300)).astype(np.float32),
            "h": rng.integers(0, 1 << 16, 50).astype(np.uint16),  # BF16 bits
            "n": np.arange(step, dtype=np.int64)}


def _sparse(step: int) -> codecs.Encoded:
    return codecs.encode("sparse", np.where(np.arange(1000) % 97 == step % 97, 1.5, 0.0)
                         .astype(np.float32), "F32")


def _ring_tensors(step: int) -> list[Any]:
    a = _arrays(step)
    enc = _sparse(step)
    return [("w", "F32", a["w"].shape, a["w"]), ("h", "BF16", a["h"].shape, a["h"]),
            RingTensor("n", "I64", a["n"].shape, (("I64", a["n"]),), zstd=3),
            RingTensor("s", "F32", (1000,), tuple((p.dtype, p.data) for p in enc.parts),
                       enc.codec, enc.params)]


def _specs(step: int) -> list[TensorSpec]:
    a = _arrays(step)
    return [TensorSpec("w", "F32", a["w"]), TensorSpec("h", "BF16", a["h"]),
            TensorSpec("n", "I64", a["n"], zstd=3),
            TensorSpec("s", "F32", encoded=_sparse(step), shape=(1000,))]


def _steps(reader: LogReader) -> list[int]:
    return [int(s) for s in reader.steps]


def _record(path: Path, step: int) -> bytes:
    with LogReader(path) as r:
        seg, off, length = r.record_location(step)
    with open(seg, "rb") as f:
        f.seek(off)
        return f.read(length)


def test_a_log_through_the_process_is_the_log_written_directly(tmp_path: Path) -> None:
    base = {"w": ("F32", np.ones((3, 4), np.float32)), "i": ("I32", np.arange(5, dtype=np.int32))}
    with AsyncLogWriter(tmp_path / "direct", batch=2, meta={"m": 1}) as w:
        for s in range(1, 7):
            w.append(s, _specs(s), kind="grad", side={"lr": s / 10}, extra={"e": s},
                     sync=s == 4)
            if s == 3:
                w.write_base(3, base, {"b": 3})
    with RingClient(tmp_path / "ring", batch=2, meta={"m": 1}, slots=4,
                    slot_size=4096) as c:
        for s in range(1, 7):
            c.put_step(s, "grad", _ring_tensors(s), side={"lr": s / 10}, extra={"e": s},
                       sync=s == 4)
            if s == 3:
                c.put_base(3, base, {"b": 3})
        assert c.flush() == 6
        assert c.stats()["pads"] > 0  # steps of ~11 KiB in 4 KiB slots: the ring wrapped
    with LogReader(tmp_path / "direct") as a, LogReader(tmp_path / "ring") as b:
        assert _steps(a) == _steps(b) == list(range(1, 7))
        assert a.meta == b.meta
        assert b.base_for(6) == 3
        for n in ("w", "i"):
            assert np.array_equal(a.base(3).tensor(n), b.base(3).tensor(n))
        for s in range(1, 7):
            assert np.array_equal(b.record(s).tensor("w"), _arrays(s)["w"])
    for s in range(1, 7):  # records are position independent: the same bytes
        assert _record(tmp_path / "direct", s) == _record(tmp_path / "ring", s)


def test_the_writer_process_never_imports_torch_and_starts_fast(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        ) -> None:
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # -X importtime, in the child
    with RingClient(tmp_path / "log") as c:
        c.put_step(1, "grad", [("w", "F32", (3,), np.ones(3, np.float32))])
    modules = {line.rsplit("|", 1)[1].strip() for line in capfd.readouterr().err.splitlines()
               if line.startswith("import time:") and line.count("|") == 2}
    assert "lowdiff_store.writer.async_writer" in modules  # the import list is the child's
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    monkeypatch.delenv("PYTHONPROFILEIMPORTTIME")
    with RingClient(tmp_path / "log") as c:
        start = c.stats()["start_s"]
    print(f"writer process start (spawn to log open): {start * 1000:.0f} ms")
    # a hang bound, not a duration (tests/helpers/timing.py): 4.7 s was seen on a 2-CPU VM
    # under load; the real figure is printed (docs/design.md)
    assert start < scaled(15.0)


def _fds(pid: int) -> list[str]:
    d = f"/proc/{pid}/fd"
    out = []
    for n in os.listdir(d):
        try:
            out.append(os.readlink(f"{d}/{n}"))
        except FileNotFoundError:
            pass
    return out


def test_the_writer_process_holds_one_ring_descriptor_whatever_the_tensor_count(
        tmp_path: Path) -> None:
    seen = []
    for i, count in enumerate((1, 2000)):
        with RingClient(tmp_path / f"log{i}", slot_size=1 << 20, slots=2) as c:
            c.put_step(1, "grad", [(f"t{j}", "F32", (2,), np.full(2, j, np.float32))
                                   for j in range(count)])
            c.flush()
            fds = _fds(c.pid)
            seen.append(len(fds))
            assert sum(t.startswith("/memfd:lowdiff-ring") for t in fds) == 1
            assert sum(t.startswith("socket:") for t in fds) == 1
        with LogReader(tmp_path / f"log{i}") as r:
            assert len(r.record(1).names) == count
    assert seen[0] == seen[1]


def test_a_full_ring_waits_for_a_slow_store_and_drops_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT, "slow_sync:0.02")
    with RingClient(tmp_path / "log", slots=2, slot_size=4096, command=FAULTY) as c:
        for s in range(1, 13):
            c.put_step(s, "grad", [("w", "I32", (900,), np.full(900, s, np.int32))])
        stats = c.stats()
        assert stats["ring_waits"] >= 5
        assert stats["ring_wait_s"] > 0.05
        assert c.flush() == 12
    with LogReader(tmp_path / "log") as r:
        assert _steps(r) == list(range(1, 13))
        for s in range(1, 13):
            assert np.array_equal(r.record(s).tensor("w"), np.full(900, s, np.int32))


def test_a_step_larger_than_the_ring_is_refused_and_the_client_goes_on(
        tmp_path: Path) -> None:
    with RingClient(tmp_path / "log", slots=2, slot_size=4096) as c:
        with pytest.raises(ConfigError) as ei:
            c.put_step(1, "grad", [("w", "U8", (9000,), np.zeros(9000, np.uint8))])
        assert ei.value.reason is Reason.LIMIT_EXCEEDED
        assert "open a larger ring" in str(ei.value)
        c.put_step(1, "grad", [("w", "U8", (7000,), np.zeros(7000, np.uint8))])
        with pytest.raises(ConfigError) as ei:
            c.put_step(1, "grad", [])
        assert ei.value.reason is Reason.STEP_OUT_OF_ORDER
        assert c.flush() == 1


def test_an_error_at_open_is_raised_by_the_constructor(tmp_path: Path) -> None:
    with AsyncLogWriter(tmp_path / "log") as w:
        w.append(5, [TensorSpec("w", "U8", np.zeros(3, np.uint8))], kind="grad").result(30)
        with pytest.raises(LowdiffError) as ei:
            RingClient(tmp_path / "log")
        assert ei.value.reason is Reason.LOCKED
    with RingClient(tmp_path / "log") as c:  # the log's steps are known before a put
        assert c.last_step == 5
        assert c.durable_step == 5
        with pytest.raises(ConfigError, match="does not follow step 5"):
            c.put_step(5, "grad", [])


def _wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while not zombie_or_gone(pid):
        assert time.monotonic() - t0 < timeout, f"process {pid} still running"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_the_writer_process_killed_midstream_is_raised_at_the_next_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT, "slow_sync:0.05")
    c = RingClient(tmp_path / "log", command=FAULTY)
    for s in range(1, 4):
        c.put_step(s, "grad", [("w", "I64", (2,), np.array([s, s]))])
    c.flush()
    for s in range(4, 9):
        c.put_step(s, "grad", [("w", "I64", (2,), np.array([s, s]))])
    os.kill(c.pid, signal.SIGKILL)
    _wait_gone(c.pid, 30)
    durable = c.durable_step
    assert durable is not None
    assert 3 <= durable < 8
    # (flush waits on the channel: the kernel closes a dead process's socket a moment after
    # it becomes a zombie, and a put sent into that moment is only lost, raised next call)
    with pytest.raises(CommitError, match=r"writer process died \(killed by signal 9 "
                                          r"\(SIGKILL\)\); durable step") as ei:
        c.flush()
    assert ei.value.reason is Reason.WRITER_FAILED
    with pytest.raises(CommitError, match="writer process died"):
        c.put_step(9, "grad", [("w", "I64", (2,), np.array([9, 9]))])
    c.close()  # already reported: closes quietly
    with LogReader(tmp_path / "log") as r:
        assert _steps(r)[:durable] == list(range(1, durable + 1))
        for s in range(1, durable + 1):
            assert list(r.record(s).tensor("w")) == [s, s]


_TRAINER = textwrap.dedent("""
    import sys
    import numpy as np
    from lowdiff_store.writer.ring_client import RingClient
    from tests.helpers.ring_writer import COMMAND
    c = RingClient(sys.argv[1], command=COMMAND)
    for s in range(1, 9):
        c.put_step(s, "grad", [("w", "I64", (2,), np.array([s, s]))])
    print(c.pid, c.durable_step, flush=True)
    sys.stdin.read()  # until killed
""")


def test_a_killed_trainer_leaves_no_writer_and_what_it_handed_over_is_durable(
        tmp_path: Path) -> None:
    env = dict(os.environ, **{FAULT: "slow_sync:0.1"})
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(tmp_path / "log")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=env, cwd=root)
    try:
        assert trainer.stdout is not None
        pid_s, durable_s = trainer.stdout.readline().split()
        trainer.kill()
        trainer.wait(30)
        took = _wait_gone(int(pid_s), 30)
    finally:
        trainer.kill()
        trainer.wait(30)
        assert trainer.stdin is not None
        assert trainer.stdout is not None
        trainer.stdin.close()
        trainer.stdout.close()
    assert durable_s == "None" or int(durable_s) < 8  # the kill came before durability
    print(f"writer exited {took:.2f} s after the trainer's SIGKILL")
    with LogReader(tmp_path / "log") as r:
        assert _steps(r) == list(range(1, 9))
        assert [list(r.record(s).tensor("w")) for s in range(1, 9)] == [[s, s] for s in
                                                                         range(1, 9)]


def test_a_full_disk_in_the_writer_is_raised_at_the_next_call_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT, "enospc:4")  # the segment header, steps 1-2, then full
    c = RingClient(tmp_path / "log", command=FAULTY)
    for s in (1, 2):
        c.put_step(s, "grad", [("w", "I64", (2,), np.array([s, s]))])
    assert c.flush() == 2
    c.put_step(3, "grad", [("w", "I64", (2,), np.array([3, 3]))])
    with pytest.raises(CommitError) as ei:
        c.flush()
    e = ei.value
    assert e.reason is Reason.WRITER_FAILED
    assert "the writer failed at step 3" in str(e)
    assert e.path == str(tmp_path / "log")
    assert isinstance(e.__cause__, StorageError)
    assert e.__cause__.errno == errno.ENOSPC
    assert e.__cause__.reason is Reason.IO_ERROR
    with pytest.raises(CommitError, match="step 3"):
        c.put_step(4, "grad", [])
    c.close()  # reported: quiet
    assert c.durable_step == 2
    with LogReader(tmp_path / "log") as r:
        assert _steps(r) == [1, 2]


def test_close_raises_an_unreported_failure_once(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT, "enospc:2")
    c = RingClient(tmp_path / "log", command=FAULTY)
    c.put_step(1, "grad", [("w", "I64", (2,), np.array([1, 1]))])
    with pytest.raises(CommitError, match="step 1"):
        c.close()
    c.close()
    with pytest.raises(LowdiffError, match="closed"):
        c.flush()


def test_sigterm_makes_the_writer_finish_what_it_was_handed_then_say_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's end or a preemption (SIGTERM to the writer process, the trainer alive): the
    steps handed over become durable before it exits, and the producer's next call says
    why it is gone."""
    monkeypatch.setenv(FAULT, "slow_sync:0.05")  # (each group's sync: 50 ms)
    c = RingClient(tmp_path / "log", slots=64, slot_size=8192, command=FAULTY, batch=1)
    c.put_base(0, {"w": ("F32", np.zeros(4, np.float32))})
    for s in range(1, 9):
        c.put_step(s, "grad", [("w", "I32", (900,), np.full(900, s, np.int32))])
    assert (c.durable_step or 0) < 8  # (handed over, not all durable yet)
    os.kill(c.pid, signal.SIGTERM)
    assert c._proc.wait(60) == 1  # (it published why: exit status 1)
    with pytest.raises(CommitError) as ei:
        c.put_step(9, "grad", [("w", "I32", (900,), np.full(900, 9, np.int32))])
    assert "received SIGTERM" in str(ei.value)
    assert "durable step 8" in str(ei.value)
    c.close()  # (raised once)
    with LogReader(tmp_path / "log") as r:
        assert _steps(r) == list(range(1, 9))
