"""The report of logs the torch checkpointer writes, made here at small size the way
``examples/demo.py`` makes them (a small model, AdamW, a warm-up/cosine schedule, dense and
top-1% gradients), and of a run whose tuner (``snapshot_every="auto"``, ``batch="auto"``)
changed its intervals: the page shows the run's bases, codecs, tensors, measured costs and
the tuner's decisions."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from lowdiff_store import LogReader  # noqa: E402
from lowdiff_store.report import report_log  # noqa: E402
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor  # noqa: E402
from tests.test_report import cells, pngs  # noqa: E402

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

STEPS, EVERY = 24, 8


def objects(topk: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    comp = TopKCompressor(ratio=0.01, error_feedback=False) if topk else None
    return model, opt, sched, comp


def train(path: Path, topk: bool, steps: int = STEPS, **kw: object) -> DiffCheckpointer:
    model, opt, sched, comp = objects(topk)
    # exact_bases: the page's base steps are asserted, even on a loaded machine
    options = {"snapshot_every": EVERY, "batch": 1, "exact_bases": True, **kw}
    ckpt = DiffCheckpointer(path, model, opt, scheduler=sched, compressor=comp, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 64, (8, 4), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), x[:, 0])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
    ckpt.close()
    return ckpt


@pytest.mark.parametrize("topk", [False, True], ids=["dense", "topk"])
def test_demo_style_log(tmp_path: Path, topk: bool) -> None:
    log = tmp_path / "ckpt"
    train(log, topk)
    out = tmp_path / "page.html"
    rep = report_log(log, out)
    page = out.read_text()
    c = cells(page)
    with LogReader(log) as r:
        assert rep.health == "ok"
        assert rep.durable_step == r.durable_step == STEPS
        bases = list(r.bases)
        records = len(r)
    assert bases == [0, 8, 16, 24]
    assert rep.logs[0].records == records == STEPS
    for v in ("torch.optim.adamw.AdamW", "torch.optim.lr_scheduler.LambdaLR", str(EVERY)):
        assert v in c, v
    codecs = rep.logs[0].by_codec
    if topk:
        assert "sparse" in codecs
        assert any(x.startswith("topk(") for x in c)
    else:
        assert "sparse" not in codecs
        assert "none" in c  # compressor
    # bytes by tensor: the gradient of the largest parameter leads the table
    sec = page[page.index("<h3>By tensor"):]
    first = re.search(r"<tr><td>(.*?)</td>", sec)
    assert first is not None
    assert first.group(1) in {"@grad/3.weight", "@grad/0.weight", "@grad/2.weight",
                              "@rng/cpu"}
    # the recovery table: the tooth's top in each interval is 7 diffs after its base
    rows = [tuple(c[i:i + 4]) for i, v in enumerate(c) if v == "log" and i + 4 <= len(c)]
    tops = [(s, b, n) for _l, s, b, n in rows if b.isdigit() and n.isdigit() and s.isdigit()]
    assert ("7", "0", "7") in tops
    assert ("23", "16", "7") in tops
    assert ("24", "24", "0") in tops
    # measured costs the checkpointer recorded, and the restore time they give
    assert "replay_cost" in c
    assert "Time = base load" in page
    assert rep.logs[0].measurements["replay_cost"] > 0
    assert len(pngs(page)) == 3


FAST_TUNER = {"min_observations": 20, "evaluate_every": 20, "min_steps_between_changes": 100,
              "min_improvement": 0.0, "restart_cost": 0.0}


def test_tuner_decisions_on_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fdatasync

    def slow(fd: int) -> None:  # a write+fsync the step cannot afford: B=1 starves
        time.sleep(0.015)  # (4 ms did not outweigh a step slowed by a loaded machine)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    log = tmp_path / "auto"
    ckpt = train(log, False, steps=60, snapshot_every="auto", batch="auto", mtbf=5.0,
                 tuner=FAST_TUNER)
    decisions = ckpt.tuning_decisions
    assert decisions
    rep = report_log(log, tmp_path / "auto.html")
    page = (tmp_path / "auto.html").read_text()
    assert rep.health == "ok", rep.all_problems()  # each decision parses (verify's check)
    got = [d.step for d in rep.logs[0].decisions]
    assert got == [d["step"] for d in decisions]
    c = cells(page)
    for d in decisions:
        assert f"{d['previous_batch']} → {d['batch']}" in c
        assert d["reason"] in c
    assert "No decision recorded" not in page


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is needed")
def test_real_local_update_checkpoint(tmp_path: Path) -> None:
    """A checkpoint of post-local SGD on 2 gloo ranks (tests/torch/local_worker.py: AdamW
    inside PostLocalSGDOptimizer, periodic averaging): every rank's row, its
    synchronization events, the job's durable step."""
    from tests.torch.test_local_update import launch

    common = ("--steps", "10", "--snapshot-every", "4")
    launch("ref", tmp_path, "periodic", *common)
    launch("run", tmp_path, "periodic", *common)
    root = tmp_path / "ck"
    rep = report_log(root, tmp_path / "local.html")
    page = (tmp_path / "local.html").read_text()
    assert rep.layout == "local"
    assert rep.world_size == 2
    assert rep.health == "ok", rep.all_problems()
    assert rep.durable_step == 10
    syncs = [f.syncs for f in rep.logs]
    assert syncs[0] == syncs[1]
    assert syncs[0]  # periodic averaging synchronized at least once in 10 steps
    c = cells(page)
    assert "torch.optim.adamw.AdamW" in c or any("PostLocalSGD" in x for x in c)
    rows = page[page.index('id="ranks"'):page.index('id="metadata"')]
    for rank, f in enumerate(rep.logs):
        with LogReader(root / f"rank-{rank:05d}") as r:
            assert f.durable_step == r.durable_step == 10
        assert f">{len(f.syncs)}</td></tr>" in rows
