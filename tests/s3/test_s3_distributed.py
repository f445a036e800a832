"""Several ranks (processes standing for nodes) write one sharded log to one bucket: two
DDP ranks over gloo train with DiffCheckpointer on ``s3://``, crash without closing, then
restore from the bucket and continue, bit for bit against an uninterrupted run (the
scenario of tests/torch/test_distributed.py, with the checkpoint in S3)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "dist_worker.py"

pytestmark = [pytest.mark.slow,  # ~1 min: four torch processes
              pytest.mark.skipif(not torch.distributed.is_available()
                                 or not torch.distributed.is_gloo_available(),
                                 reason="torch.distributed with gloo is needed")]


def _launch(phase: str, url: str, out: Path, *args: str, timeout: float = 180.0) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), "--phase", phase, "--rank", str(r), "--world", "2",
         "--port", str(port), "--dir", url, "--out", str(out), "--timeout", str(timeout),
         *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)]
    deadline = time.monotonic() + timeout + 30
    for r, p in enumerate(procs):
        try:
            o, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
        assert p.returncode == 0, f"rank {r}: {o.decode(errors='replace')[-4000:]}"


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
