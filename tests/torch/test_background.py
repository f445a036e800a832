"""Background bases (``base_mode="background"``): a worker process replays the durable diffs
onto the last base and writes the bases; the training process never copies the state after
step 0. The bases are byte for byte the foreground ones; restore is exact; a failed worker
falls back to foreground bases; the worker dies with the training process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _cases import CASES, assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store import ConfigError, LogReader
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore
from lowdiff_store.torch.capture.bases.background import check_background
from lowdiff_store.verify import verify_log
from tests.helpers.ring_writer import zombie_or_gone
from tests.helpers.timing import scaled

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def train(path: Path, case: str, steps: int, mode: str, **kw: Any) -> dict[str, float]:
    o = build(case)
    opts = {**ckpt_kwargs(case), "snapshot_every": 5, **kw}
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            base_mode=mode, **opts)
    run(case, o, 0, steps, ckpt)
    ckpt.close()
    return ckpt.stats()


def body(path: str) -> tuple[Any, Any, bytes]:
    """A base file without what names its log (log id, header CRC)."""
    with open(path, "rb") as fh:
        data = fh.read()
    n = int.from_bytes(data[:8], "little")
    h = json.loads(data[8:8 + n])
    md = h.pop("__metadata__")
    md.pop("log_id")
    md.pop("header_crc32c")
    return h, md, data[8 + n:]


def compare(case: str, tmp_path: Path, steps: int = 23) -> dict[str, float]:
    fg, bg = tmp_path / f"{case}-fg", tmp_path / f"{case}-bg"
    train(fg, case, steps, "foreground")
    st = train(bg, case, steps, "background")
    assert st["writer_bases"] == 1  # the training process wrote step 0 only
    assert st["background_done"] == steps // 5
    assert st["background_failed"] == 0
    with LogReader(fg) as a, LogReader(bg) as b:
        assert b.bases == list(range(0, steps + 1, 5))
        # exact_bases (ckpt_kwargs): a foreground base whose staging memory is still being
        # made on a loaded machine waits for it, so both logs base on the same steps
        assert a.bases == b.bases
        for s in a.bases:
            assert body(a.base_path(s)) == body(b.base_path(s)), f"base {s}"
    assert verify_log(str(bg)).ok
    return st


@pytest.mark.parametrize("case", ["adamw", "delta"])
def test_background_bases_are_the_foreground_ones(case: str, tmp_path: Path) -> None:
    compare(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c not in ("adamw", "delta")])
def test_background_bases_every_case(case: str, tmp_path: Path) -> None:
    compare(case, tmp_path)


def test_restore_and_continue_from_background_bases(tmp_path: Path) -> None:
    p = tmp_path / "log"
    train(p, "adam_amp_fp16", 23, "background")
    _ref, snaps = reference("adam_amp_fp16", 30, at=(20, 23))
    o = build("adam_amp_fp16")
    res = restore(p, o.model, o.optimizer, scaler=o.scaler, step=20)
    assert res.base_step == 20
    assert res.replayed == 0
    assert_same(snapshot(o), snaps[20])
    o = build("adam_amp_fp16")
    restore(p, o.model, o.optimizer, scaler=o.scaler)
    assert_same(snapshot(o), snaps[23])
    with DiffCheckpointer(p, o.model, o.optimizer, scaler=o.scaler,
                          **{**ckpt_kwargs("adam_amp_fp16"), "snapshot_every": 5}) as ckpt:
        run("adam_amp_fp16", o, 23, 30, ckpt)
    assert_same(snapshot(o), snaps[30])
    with LogReader(p) as r:
        assert r.bases == [0, 5, 10, 15, 20, 25, 30]


def test_failed_worker_falls_back_to_foreground(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "log"
    o = build("sgd_bn")
    with DiffCheckpointer(p, o.model, o.optimizer, scheduler=o.scheduler, snapshot_every=5,
                          base_mode="background", exact_bases=True) as ckpt:  # (15, 20)
        run("sgd_bn", o, 0, 10, ckpt)
        ckpt.flush()
        assert ckpt._bg is not None
        ckpt._bg._proc.kill()  # the worker dies (OOM killer, a bug...)
        ckpt._bg._proc.wait()
        with caplog.at_level(logging.WARNING):
            run("sgd_bn", o, 10, 21, ckpt)
        st = ckpt.stats()
    assert st["background_failed"] == 1
    assert any("taken in the foreground" in r.getMessage() for r in caplog.records)
    with LogReader(p) as r:
        assert {15, 20} <= set(r.bases)  # taken by the training process after the failure
    _ref, snaps = reference("sgd_bn", 21)
    o2 = build("sgd_bn")
    restore(p, o2.model, o2.optimizer, scheduler=o2.scheduler)
    assert_same(snapshot(o2), snaps[21])


def test_requirements_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mode='delta'"):
        check_background("grad", "torch.optim.sgd.SGD", ["cuda"], False, "base")
    check_background("delta", "torch.optim.sgd.SGD", ["cuda"], False, "base")
    o = build("sgd_bn")
    with pytest.raises(ConfigError, match="ef_state='step'"):
        DiffCheckpointer(tmp_path / "a", o.model, o.optimizer, base_mode="background",
                         compressor=TopKCompressor(0.1, error_feedback=True))

    class MySGD(type(o.optimizer)):  # type: ignore[misc]
        pass

    o.optimizer.__class__ = MySGD
    with pytest.raises(ConfigError, match="not one of"):
        DiffCheckpointer(tmp_path / "b", o.model, o.optimizer, base_mode="background")
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()


def _trainer_main(path: str) -> None:
    """A training process with background bases that runs until killed."""
    import torch

    torch.set_num_threads(1)
    o = build("adamw")
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, snapshot_every=5,
                            base_mode="background")
    assert ckpt._bg is not None
    print(ckpt._bg._proc.pid, flush=True)
    t, told = 0, False
    while True:
        t += 1
        run("adamw", o, t - 1, t, ckpt)
        if not told and ckpt.stats()["background_done"] >= 1:
            print("based", flush=True)  # the worker is up and has published a base
            told = True
        time.sleep(0.01)


def test_worker_dies_with_the_training_process(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with subprocess.Popen([sys.executable, str(HERE / "test_background.py"),
                           str(tmp_path / "log")], stdout=subprocess.PIPE, text=True,
                          env=env) as proc:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "based"
        time.sleep(0.1)  # a few more steps: the worker is busy with the next bases
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + scaled(60)   # a hang bound: it notices within a poll
    while time.monotonic() < deadline:
        if zombie_or_gone(worker):  # (a zombie until whoever adopted it reaps it)
            break
        time.sleep(0.05)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the background worker outlived the training process")
    rep = verify_log(str(tmp_path / "log"))
    assert rep.ok
    with LogReader(tmp_path / "log") as r:
        assert len(r.bases) >= 2


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _trainer_main(sys.argv[1])
