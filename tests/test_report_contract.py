"""The report's own contract (issue 42, item 4): a record's tuner decision that does not
follow its schema is one problem (file, offset, ``bad_metadata``) on a page that is still
written, and ``verify`` reports the same problem; the work grows linearly with the number
of problems (counted in Python calls, not timed)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lowdiff_store import LogReader
from lowdiff_store.cli import main
from lowdiff_store.report import report_log
from lowdiff_store.verify import verify_log
from tests.helpers.problems import GOOD, damaged_log, write_log


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


HOSTILE: dict[str, Any] = {
    "step a string": {**GOOD, "step": "2"},
    "step a list": {**GOOD, "step": [2]},
    "step a float": {**GOOD, "step": 2.0},
    "step negative": {**GOOD, "step": -1},
    "step a bool": {**GOOD, "step": True},
    "no step": _without("step"),
    "no batch": _without("batch"),
    "snapshot_every a string": {**GOOD, "snapshot_every": "9"},
    "previous_batch zero": {**GOOD, "previous_batch": 0},
    "predicted waste a string": {**GOOD, "predicted_waste_before": "low"},
    "reason a number": {**GOOD, "reason": 5},
    "measurements a list": {**GOOD, "measurements": [1.0]},
    "not a map": "raise batch",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_decision_is_one_problem_and_the_page_is_written(tmp_path: Path, name: str
                                                                 ) -> None:
    log = tmp_path / "log"
    write_log(log, 4, lambda t: HOSTILE[name] if t == 2 else None)
    with LogReader(log) as r:
        seg, off, _n = r.record_location(2)
    where = (seg, off, "bad_metadata")
    # verify: the same problem (its CRC is valid: only the schema is wrong)
    vrep = verify_log(str(log))
    assert [(p.path, p.offset, p.reason.value) for p in vrep.problems] == [where]
    assert "tuning" in vrep.problems[0].detail
    for check in ("never", "always"):  # the report's own read, and with verify's findings
        out = tmp_path / f"{check}.html"
        rep = report_log(log, out, full_check=check, plots=False)  # type: ignore[arg-type]
        page = out.read_text()
        assert page.rstrip().endswith("</html>")
        assert rep.health == "corrupt"
        assert [(p["path"], p["offset"], p["reason"]) for p in rep.all_problems()] == [where]
        assert "bad_metadata" in page
        assert "tuning" in page
        assert rep.logs[0].decisions == []  # nothing shown of a decision that did not parse
        assert rep.logs[0].records == 4  # the rest is read
        assert rep.durable_step == 4


def test_cli_report_and_verify_agree_on_a_hostile_decision(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log"
    write_log(log, 3, lambda t: HOSTILE["step a list"] if t == 2 else None)
    assert main(["verify", str(log)]) == 3
    verify_lines = capsys.readouterr().out.splitlines()
    assert main(["report", str(log), "-o", str(tmp_path / "p.html")]) == 3
    report_lines = capsys.readouterr().out.splitlines()
    assert len(verify_lines) == 1
    assert report_lines == verify_lines
    assert ": bad_metadata: " in verify_lines[0]


def test_good_decision_is_read_into_its_fields(tmp_path: Path) -> None:
    log = tmp_path / "log"
    write_log(log, 4, lambda t: {**GOOD, "step": t} if t in (2, 3) else None)
    rep = report_log(log, tmp_path / "p.html", plots=False)
    assert rep.health == "ok", rep.all_problems()
    d = rep.logs[0].decisions
    assert [(x.step, x.previous_snapshot_every, x.snapshot_every, x.previous_batch, x.batch)
            for x in d] == [(2, 8, 9, 1, 2), (3, 8, 9, 1, 2)]
    assert d[0].predicted_waste_before == 0.02
    assert d[0].predicted_waste_after is None
    assert d[0].reason == "model: fewer bases"
    assert "8 → 9" in (tmp_path / "p.html").read_text()


# ---------------------------------------------------------------- linear work


def python_calls(fn: Callable[[], object]) -> int:
    """How many Python and C functions ``fn`` calls (each resumption of a generator
    counts): a deterministic measure of work, whatever the CPU and its load."""
    n = 0

    def count(_frame: object, event: str, _arg: object) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    old = sys.getprofile()
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return n


@pytest.mark.parametrize("damage", ["decision", "checksum"])
def test_report_work_grows_linearly_with_the_problems(tmp_path: Path, damage: str) -> None:
    """Twice the problems, about twice the work: the duplicate checks are keyed lookups,
    not a comparison with every problem found so far (which made a 7,997-problem log take
    17.8 s against verify's 0.8 s)."""
    calls = []
    for n in (1000, 2000):
        log = tmp_path / f"log{n}"
        damaged_log(log, n, damage)
        reps = []
        calls.append(python_calls(lambda log=log: reps.append(  # type: ignore[misc]
            report_log(log, tmp_path / "p.html", full_check="always", plots=False))))
        assert len(reps[0].all_problems()) >= n
    assert calls[1] < 2.4 * calls[0], calls
