"""Rank 0 SIGKILLed after its layout published ``SHARDS`` and before it opened its own log
(issue 48, item 4), in the DDP (``replicated``), ZeRO and FSDP2 layouts.

``RankLayout`` (lowdiff_store/torch/distributed/checkpointer.py) publishes ``SHARDS`` on
rank 0 while it is made, before the layout's agreement; every rank opens its log after that
agreement. Rank 0 killed where its checkpointer opens its log (``fsdp_worker.py --end
shards``, ``open`` here) leaves ``SHARDS`` and the logs the other ranks opened meanwhile,
each holding its step-0 base, and no ``rank-00000``; killed as soon as ``SHARDS`` is
written (``--end shards-written``, ``written``), it leaves ``SHARDS`` alone. Either way no
step is durable on every rank, so ``latest_step`` is None and a script starts the job
afresh (``restore(..., missing_ok=True)`` returns None). The whole job relaunched on the
same path must open, train bitwise the uninterrupted run, and restore exactly. DDP at
``open`` runs by default; ZeRO and FSDP2 reach the same window through the same layout,
and ``written`` was never refused; those are ``@pytest.mark.slow``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lowdiff_store import cli, latest_step
from lowdiff_store.log import LogReader
from lowdiff_store.log.shards import read_shards_manifest
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port
from tests.helpers.timing import scaled

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_fsdp import LAUNCHER, fsdp_worker_servers  # noqa: E402, F401 (autouse fixture)

pytestmark = NEEDS_GLOO

ARGS = ("--steps", "8", "--stop", "6", "--every", "4")
#: the worker's layout -> the layout ``SHARDS`` names
KIND = {"ddp": "replicated", "zero": "zero", "fsdp": "fsdp"}


def _launch(d: Path, phase: str, *args: str, killed: int | None = None) -> list[Any]:
    """``fsdp_worker.py`` on 2 ranks, forked by ``test_fsdp``'s fork servers (this
    module holds them too: ``fsdp_worker_servers``); the ranks' exits."""
    port = free_port()
    (d / "out").mkdir(parents=True, exist_ok=True)
    return LAUNCHER.run_ranks(lambda r: [
        "--phase", phase, "--rank", str(r), "--world", "2", "--port", str(port), "--dir",
        str(d / "ck"), "--out", str(d / "out"), "--timeout", str(scaled(100)), *ARGS,
        *args], 2, timeout=150, killed=killed, peers_grace=20)


def _json(d: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted((d / "out").glob(pattern))]


@pytest.mark.parametrize(("layout", "where"), [
    ("ddp", "open"),
    pytest.param("zero", "open", marks=pytest.mark.slow),
    pytest.param("fsdp", "open", marks=pytest.mark.slow),
    pytest.param("ddp", "written", marks=pytest.mark.slow),
])
def test_rank0_killed_after_shards_then_the_job_reopens(
        tmp_path: Path, layout: str, where: str, capsys: pytest.CaptureFixture[str]
        ) -> None:
    ck = tmp_path / "ck"
    end = "shards" if where == "open" else "shards-written"
    exits = _launch(tmp_path, "train", "--layout", layout, "--end", end, killed=0)
    check_exits(exits, killed=0, peers="fail")
    assert exits[1].returncode != 0, str(exits[1])   # never got past an agreement
    # the window: SHARDS published; at open, rank 1's log opened with its step-0 base
    body = read_shards_manifest(ck)
    assert (body["world_size"], body["layout"]) == (2, KIND[layout])
    if where == "written":
        assert sorted(p.name for p in ck.iterdir()) == ["SHARDS"]
    else:
        assert sorted(p.name for p in ck.iterdir()) == ["SHARDS", "rank-00001"]
        with LogReader(ck / "rank-00001") as r:
            assert (r.last_step, list(r.bases)) == (0, [0])
    # nothing durable on every rank: a script restoring with missing_ok starts afresh
    assert latest_step(str(ck)) is None
    rc = cli.main(["verify", str(ck)])
    out, err = capsys.readouterr()   # the missing log is named
    assert (rc, out.count("\n")) == (cli.EXIT_CORRUPT, 1), (rc, out, err)
    assert "SHARDS:-: bad_metadata: " in out, out
    assert "rank-00000 holds no log" in out, out
    # the whole job relaunched on the same path: a new job, trained bitwise the reference
    check_exits(_launch(tmp_path, "train", "--layout", layout, "--end", "close"))
    train = _json(tmp_path, f"train-{layout}-*.json")
    assert len(train) == 2
    for t in train:
        assert t["perturbed"] == [], t["perturbed"]
    assert sorted(p.name for p in ck.iterdir()) == ["SHARDS", "rank-00000", "rank-00001"]
    assert latest_step(str(ck)) == 6
    assert cli.main(["verify", str(ck)]) == 0, capsys.readouterr()
    capsys.readouterr()
    # restored exactly at step 6, then trained on to the end bitwise the reference
    check_exits(_launch(tmp_path, "resume", "--layout", layout, "--restore", f":{layout}",
                        "--continue"))
    res = _json(tmp_path, "result-*.json")
    assert len(res) == 2
    for r in res:
        got = r[f":{layout}"]
        assert got["step"] == 6
        assert got["restored_bad"] == [], got["restored_bad"]
        assert got["exact"], got["notes"]
        assert r["final_bad"] == [], r["final_bad"]
