"""A second writer (issue 35 item 5): another checkpointer, in this process or another one,
on a log a checkpointer is writing; two exports racing for one directory. The second is
refused in one line (``locked``, ``already_exists``) and the first goes on: every step it
made durable restores bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from lowdiff_store import LogWriter, LowdiffError, Reason
from lowdiff_store.torch import DiffCheckpointer, export_state, replay_state, restore

from .common import ROOT, build, one_line, same_bits, train

#: the first checkpointer's writer and the second's: in the training process, or a writer
#: process (with one, the log is the first's from its construction on although a new log
#: does not wait for its writer process to start: format_spec/ring.md, section 1)
WRITERS = [(False, False), (True, True), (True, False), (False, True)]


@pytest.mark.parametrize(("first", "second"), WRITERS)
def test_second_checkpointer_in_this_process(tmp_path: Path, first: bool, second: bool
                                             ) -> None:
    m, opt = build(0)
    log = tmp_path / "log"
    with DiffCheckpointer(log, m, opt, snapshot_every=3, writer_process=first) as ck:
        train(m, opt, 0, 3)
        m2, opt2 = build(0)
        with pytest.raises(LowdiffError) as ei:
            DiffCheckpointer(log, m2, opt2, snapshot_every=3, writer_process=second)
        assert ei.value.reason in (Reason.LOCKED, Reason.HISTORY_CONFLICT)
        one_line(ei.value, str(log))
        with pytest.raises(LowdiffError) as ei:
            LogWriter(log)
        assert ei.value.reason is Reason.LOCKED
        train(m, opt, 3, 6)  # the first goes on
        assert ck.flush() == 6
    m3, opt3 = build(4)
    assert restore(log, m3, opt3).step == 6
    same_bits(m3.state_dict(), m.state_dict())


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_second_checkpointer_in_another_process(tmp_path: Path, writer: str) -> None:
    """The user's second job on the same path, after restoring (what the README says to
    do): refused ``locked`` while the first holds the log, one line on stderr. Both jobs'
    checkpointers with the same writer."""
    m, opt = build(0)
    log = tmp_path / "log"
    process = writer == "process"
    with DiffCheckpointer(log, m, opt, snapshot_every=3, writer_process=process) as ck:
        train(m, opt, 0, 4)
        ck.flush()
        code = textwrap.dedent(f"""
            import sys
            from tests.redteam.common import build
            from lowdiff_store import LowdiffError
            from lowdiff_store.torch import DiffCheckpointer, restore
            m, opt = build(0)
            try:
                restore({str(log)!r}, m, opt)
                DiffCheckpointer({str(log)!r}, m, opt, snapshot_every=3,
                                 writer_process={process!r})
            except LowdiffError as e:
                print(e.reason.value, file=sys.stderr)
                print(e, file=sys.stderr)
                sys.exit(1)
            sys.exit(0)
        """)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert p.returncode == 1, p.stderr
        reason, line = p.stderr.strip().splitlines()[-2:]
        assert reason == Reason.LOCKED.value
        one_line(line, str(log))
        train(m, opt, 4, 7)
        assert ck.flush() == 7
    m3, opt3 = build(4)
    assert restore(log, m3, opt3).step == 7
    same_bits(m3.state_dict(), m.state_dict())


def test_two_exports_race_for_one_directory(tmp_path: Path) -> None:
    """Both write their own temp directory; one rename wins, the other is refused
    (``already_exists`` or ``io_error`` naming the directory); what is there is complete."""
    m, opt = build(0)
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=3):
        train(m, opt, 0, 4)
    state = replay_state(tmp_path / "log")[0]
    out = tmp_path / "out" / "d"
    out.parent.mkdir()
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def export(i: int) -> None:
        barrier.wait()
        try:
            results[i] = export_state(state, out, format="dcp")
        except LowdiffError as e:
            results[i] = e

    threads = [threading.Thread(target=export, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    errors = [r for r in results if isinstance(r, LowdiffError)]
    assert len(errors) == 1, results  # exactly one publishes
    for e in errors:
        assert e.reason in (Reason.ALREADY_EXISTS, Reason.IO_ERROR)
        one_line(e, str(out))
    assert os.listdir(out.parent) == ["d"]  # no temp directory left
    from .test_kill import _dcp_state

    got = _dcp_state(out)
    same_bits({n: got[n] for n in state}, state)
