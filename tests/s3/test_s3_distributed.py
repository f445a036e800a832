"""Several ranks (processes standing for nodes) write one sharded log to one bucket: two
DDP ranks over gloo train with DiffCheckpointer on ``s3://``, crash without closing, then
restore from the bucket and continue, bit for bit against an uninterrupted run (the
scenario of tests/torch/test_distributed.py, with the checkpoint in S3)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.helpers.dist import check_exits, free_port, run_ranks  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "dist_worker.py"

pytestmark = [pytest.mark.slow,  # ~1 min: four torch processes
              pytest.mark.skipif(not torch.distributed.is_available()
                                 or not torch.distributed.is_gloo_available(),
                                 reason="torch.distributed with gloo is needed")]


def _launch(phase: str, url: str, out: Path, *args: str, timeout: float = 180.0) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out.mkdir(parents=True, exist_ok=True)
    check_exits(run_ranks(lambda r: [
        sys.executable, str(WORKER), "--phase", phase, "--rank", str(r), "--world", "2",
        "--port", str(port), "--dir", url, "--out", str(out), "--timeout",
        str(scaled(timeout)), *args], 2, env=env, timeout=timeout))


def test_two_ranks_one_bucket_crash_restore_continue(s3_url: str, tmp_path: Path) -> None:
    args = ("--hook", "allreduce", "--end", "crash", "--every", "5", "--flush-at", "11")
    _launch("train", s3_url, tmp_path / "out", *args)
    _launch("resume", s3_url, tmp_path / "out", *args)
    res = [json.loads(f.read_text()) for f in sorted((tmp_path / "out").glob("result-*.json"))]
    assert len(res) == 2
    for r in res:
        assert r["restored_bad"] == [], "restored state differs from the reference"
        assert r["final_bad"] == [], "continued run differs from the uninterrupted one"
        assert r["step"] == 11
    from lowdiff_store.storage.s3 import S3Store

    names = S3Store(s3_url).list()
    assert "SHARDS" in names
    assert any(n.startswith("rank-00000/MANIFEST.") for n in names)
    assert any(n.startswith("rank-00001/MANIFEST.") for n in names)
