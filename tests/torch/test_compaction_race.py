"""Readers beside a compaction: a replay or restore that read a manifest, then met a base
a compaction deleted after publishing a newer manifest, runs again on the newer manifest
(as verify does) instead of failing with ``missing_file`` on a healthy log.

The race is made deterministic: the compaction runs inside the first ``LogReader.base``
call, after the reader opened the older manifest and before it opens the base file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cases import assert_same, build, ckpt_kwargs, run, snapshot

from lowdiff_store import LogReader, cli
from lowdiff_store.compaction import compact
from lowdiff_store.errors import LowdiffError, Reason
from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log.manifest import load_manifest
from lowdiff_store.torch import DiffCheckpointer, materialize_base, replay_state, restore

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


def make_log(path: Path, steps: int) -> None:
    o = build("adamw")
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                          **ckpt_kwargs("adamw")) as ckpt:
        run("adamw", o, 0, steps, ckpt)


@pytest.fixture
def compact_on_first_base(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ``LogReader.base``: its first call compacts the log (keeping one base) before
    opening the base the caller's manifest named. Yields the generations published."""
    real = LogReader.base
    done: list[int] = []

    def base(self: LogReader, step: int) -> Any:
        if not done:
            done.append(self.manifest.generation)
            compact(self.path, keep_bases=1, materializer=materialize_base)
            done.append(load_manifest(self.path).generation)
        return real(self, step)

    monkeypatch.setattr(LogReader, "base", base)
    return done


def test_restore_beside_compaction_retries_on_newer_manifest(
        tmp_path: Path, compact_on_first_base: list[int]) -> None:
    p = tmp_path / "log"
    make_log(p, 28)  # bases 0, 10, 20; the durable step 28 is no base
    want = build("adamw")
    restore(p, want.model, want.optimizer, scheduler=want.scheduler)  # before the race
    compact_on_first_base.clear()
    o = build("adamw")
    res = restore(p, o.model, o.optimizer, scheduler=o.scheduler)
    old, new = compact_on_first_base
    assert new > old
    assert not (p / BASE_NAME.format(20)).exists()  # the base the old manifest named
    assert load_manifest(p).bases == [28]
    assert (res.step, res.base_step) == (28, 28)
    assert res.exact
    assert_same(snapshot(o), snapshot(want))


def test_replay_state_beside_compaction_retries_on_newer_manifest(
        tmp_path: Path, compact_on_first_base: list[int]) -> None:
    p = tmp_path / "log"
    make_log(p, 28)
    compact_on_first_base.append(-1)  # no race for the reference
    want, _ = replay_state(p, 28)
    compact_on_first_base.clear()
    got, _ = replay_state(p, 28)
    assert len(compact_on_first_base) == 2
    assert load_manifest(p).bases == [28]
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype
        assert got[k].numpy().tobytes() == want[k].numpy().tobytes(), k


def test_cli_replay_beside_compaction(tmp_path: Path, compact_on_first_base: list[int],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    make_log(p, 28)
    out = tmp_path / "state.safetensors"
    assert cli.main(["replay", str(p), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 28
    assert len(compact_on_first_base) == 2
    assert out.stat().st_size > 0


def test_a_base_missing_from_the_newest_manifest_still_fails(tmp_path: Path) -> None:
    """No compaction moved the manifest: a missing base is a real problem, reported once."""
    p = tmp_path / "log"
    make_log(p, 28)
    (p / BASE_NAME.format(20)).unlink()
    o = build("adamw")
    with pytest.raises(LowdiffError) as ei:
        restore(p, o.model, o.optimizer, scheduler=o.scheduler)
    assert ei.value.reason is Reason.MISSING_FILE
    assert "base named by the manifest is missing" in str(ei.value)
