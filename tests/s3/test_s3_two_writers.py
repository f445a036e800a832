"""Two writers from two machines (issue 26 item 4), on the session's server (SeaweedFS):
two processes, each with its own credentials (two identities of the server), its own
write-ahead directory and its own node name (``LOWDIFF_NODE_NAME``, standing for two hosts),
open the same prefix. Exactly one gets it; the other gets one line. After the holder is
SIGKILLed its lease (here 6 s) runs out on the clock, and the other takes the log over and
goes on from the last step the first one made durable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

from lowdiff_store import LogReader
from tests.s3.servers import IDENTITIES, S3Server

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 6.0


def _node(url: str, server: S3Server, identity: str, home: Path) -> subprocess.Popen[str]:
    (home / "wal").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": identity,
           "AWS_SECRET_ACCESS_KEY": IDENTITIES.get(identity, server.secret_key),
           "LOWDIFF_S3_WAL_DIR": str(home / "wal"), "LOWDIFF_NODE_NAME": home.name,
           "LOWDIFF_S3_LOCK_TTL_S": str(TTL_S), "LOWDIFF_S3_UPLOAD_INTERVAL_S": "0.2"}
    return subprocess.Popen([sys.executable, "-m", "tests.s3.writer_node", url],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _first_line(p: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.startswith(("GOT", "ERR")):
            return line.strip()
        if not line and p.poll() is not None:
            break
    raise AssertionError(f"no answer from the node (rc {p.poll()})")


def _durable_after(p: subprocess.Popen[str], n: int) -> int:
    """Read the node's lines until it reported ``n`` durable steps; the last one."""
    assert p.stdout is not None
    got = -1
    for _ in range(n):
        line = p.stdout.readline()
        assert line.startswith("DURABLE"), line
        got = int(line.split()[1])
    return got


def test_two_nodes_one_prefix_one_gets_it_then_takes_over_after_a_sigkill(
        s3_env: S3Server, s3_url: str, tmp_path: Path) -> None:
    nodes = {"lowdiff-test": tmp_path / "node-a", "lowdiff-node2": tmp_path / "node-b"}
    started = {ident: _node(s3_url, s3_env, ident, home) for ident, home in nodes.items()}
    procs = list(started.values())
    try:
        lines = {id(p): _first_line(p) for p in procs}
        got = [p for p in procs if lines[id(p)].startswith("GOT")]
        lost = [p for p in procs if lines[id(p)].startswith("ERR")]
        assert len(got) == 1, lines
        assert len(lost) == 1, lines
        holder, other = got[0], lost[0]
        # the node that lost comes back (another node name: the lease must run out)
        ident = next(i for i, p in started.items() if p is other)
        msg = lines[id(other)]
        assert msg.startswith("ERR locked "), msg
        assert "another writer holds this log (LOCK is taken)" in msg
        assert other.wait(30) == 1
        last = _durable_after(holder, 5)
        holder.kill()  # SIGKILL: the lease is not released
        holder.wait()
        # the lease as the holder last refreshed it: live until its time + ttl (the
        # holder's refreshes come every ttl / 3, unless a loaded machine starved them)
        bucket, prefix = s3_url[len("s3://"):].split("/", 1)
        lease = msgpack.unpackb(s3_env.client().get_object(
            Bucket=bucket, Key=f"{prefix}/LOCK")["Body"].read())
        expires = float(lease["time"]) + float(lease["ttl"])
        # at once: the lease is still live (another node's pid is not checked here)
        again = _node(s3_url, s3_env, ident, nodes[ident])
        procs.append(again)
        line = _first_line(again)
        if time.time() < expires:  # answered, so it looked, while the lease was live
            assert line.startswith("ERR locked"), line
        if line.startswith("ERR locked"):  # a late answer may still be one: the node looked
            again.wait(30)  # when it started, on a busy machine seconds before it answered
            time.sleep(max(0.0, expires - time.time()) + 0.5)  # (the lease ran out)
            again = _node(s3_url, s3_env, ident, nodes[ident])
            procs.append(again)
            line = _first_line(again)
        assert line.startswith("GOT"), line
        assert int(line.split()[1]) >= last  # every step node a made durable is there
        after = _durable_after(again, 3)
        again.kill()
        again.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
    with LogReader(s3_url) as r:
        steps = [rec.step for rec in r.iter_records()]
        assert steps[: after + 1] == list(range(after + 1))
        for s in (0, last, after):
            np.testing.assert_array_equal(r.record(s).tensor("g"), np.full(64, s, "<f4"))
