#!/usr/bin/env python3
"""Object storage (``s3://`` logs) against a local S3-compatible server (moto_server on
127.0.0.1, started by this script), every comparison within one run, on the same server.

0. ``--clients``: the client libraries on the same server (why boto3): 4 KiB PUT / GET
   latency, 64 MiB upload (multipart, 8 MiB parts, 4 in flight) and GET, for boto3, obstore
   and s3fs (each where installed), and whether each sends a create-only multipart upload.

1. Base upload and restore throughput of one state of ``--state-mib`` MiB (float32 tensors
   of 4 MiB): lowdiff-store's base (``LogWriter.write_base``: multipart upload, parts in
   flight; restore: ``LogReader.base(...).tensor``: parallel ranged GETs) vs DCP's fsspec
   writer/reader (``torch.distributed.checkpoint`` ``FsspecWriter``/``FsspecReader`` over
   s3fs) on the same server, and both on local disk (``FileSystemWriter``).
2. Requests per step at per-step logging: DiffCheckpointer on a small LM (top-1% gradients,
   one diff per step, default segment size), counting every request the client sends:
   default (the active segment uploaded every ``upload_interval_s``, 10 s, and at
   flush/seal/close) and with a write-ahead directory (``--upload-interval``).
   2b (``--upload-bytes``): segment bytes uploaded per byte of segment through several
   seals (a AsyncLogWriter, 4 MiB segments, default settings).
3. Step-time ratio: the same training with an ``s3://`` log vs a local one (interleaved
   rounds; mean step time, stalls included).

Run:   python bench/bench_s3.py [--state-mib 256] [--steps 60] [--rounds 2] [--json]
Smoke: python -m pytest bench/bench_s3.py  (tiny sizes; asserts it runs)

moto keeps objects in memory in one Python process: absolute figures are the server's
(and this 2-vCPU VM's), not S3's; the ratios between clients on the same server are the
point.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _lm import LM, batch_for, train_step

from lowdiff_store import LogReader, LogWriter
from lowdiff_store.storage import s3 as s3mod
from lowdiff_store.storage.s3.client import Client as S3Client
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor

SIZES = {"small": (2048, 32, 128, 2, 4, 4), "tiny": (128, 8, 32, 1, 2, 2)}


@contextmanager
def moto_server() -> Iterator[str]:
    """moto_server on 127.0.0.1 (a free port); the AWS variables point at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                            "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    try:
        import boto3

        c = boto3.client("s3")
        for _ in range(300):
            try:
                c.list_buckets()
                break
            except Exception:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_bucket() -> str:
    import boto3

    name = f"bench-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


class RequestCounter:
    """Counts the requests lowdiff-store's S3 client sends, by HTTP method, and the body
    bytes sent to segment keys (``*.ldlog`` and its pieces) under ``"log_bytes"``."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        client = S3Client.get(s3mod.S3Options.from_env())
        client.s3.meta.events.register("before-send.s3", self._on_send)

    def _on_send(self, request: Any, **_kw: Any) -> None:
        self.counts[request.method] += 1
        if request.method == "PUT" and ".ldlog" in request.url.split("?")[0]:
            body = request.body
            if hasattr(body, "seek") and hasattr(body, "tell"):
                pos = body.tell()
                body.seek(0, os.SEEK_END)
                n = body.tell()
                body.seek(pos)
            else:
                n = len(body or b"")
            self.counts["log_bytes"] += n

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts)


# ---------------------------------------------------------------------------- 0. clients


def bench_clients(mib: int = 64, n_small: int = 30) -> dict[str, Any]:
    """Median latency of small requests and throughput of a large object per client."""
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    bucket = new_bucket()
    big, small = os.urandom(mib << 20), os.urandom(4096)
    out: dict[str, Any] = {"big_bytes": len(big)}

    def timed(f: Any, n: int) -> float:
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            f(i)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    c = boto3.client("s3")
    cfg = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20,
                         max_concurrency=4)
    out["boto3"] = {
        "put_4k_ms": 1e3 * timed(lambda i: c.put_object(Bucket=bucket, Key=f"b/s{i}",
                                                         Body=small, IfNoneMatch="*"), n_small),
        "get_4k_ms": 1e3 * timed(lambda i: c.get_object(Bucket=bucket, Key=f"b/s{i}")[
            "Body"].read(), n_small),
        "upload_MBps": len(big) / timed(lambda i: c.upload_fileobj(
            io.BytesIO(big), bucket, f"b/big{i}", Config=cfg), 2) / 1e6,
        "get_MBps": len(big) / timed(lambda i: c.get_object(Bucket=bucket, Key="b/big0")[
            "Body"].read(), 2) / 1e6,
        "create_only_multipart": True}
    try:
        import obstore
        from obstore.store import S3Store as ObStore

        st = ObStore(bucket, endpoint=endpoint, allow_http=True, region="us-east-1",
                     access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                     secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])
        out["obstore"] = {
            "put_4k_ms": 1e3 * timed(lambda i: obstore.put(st, f"o/s{i}", small,
                                                           mode="create"), n_small),
            "get_4k_ms": 1e3 * timed(lambda i: obstore.get(st, f"o/s{i}").bytes(), n_small),
            "upload_MBps": len(big) / timed(lambda i: obstore.put(
                st, f"o/big{i}", big, chunk_size=8 << 20, max_concurrency=4), 2) / 1e6,
            "get_MBps": len(big) / timed(lambda i: obstore.get(st, "o/big0").bytes(), 2) / 1e6,
            # put(mode="create") is a single in-memory PUT: no create-only multipart upload
            "create_only_multipart": False}
    except ImportError:
        out["obstore"] = None
    try:
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        out["s3fs"] = {
            "put_4k_ms": 1e3 * timed(lambda i: fs.pipe(f"{bucket}/f/s{i}", small), n_small),
            "get_4k_ms": 1e3 * timed(lambda i: fs.cat(f"{bucket}/f/s{i}"), n_small),
            "upload_MBps": len(big) / timed(lambda i: fs.pipe(f"{bucket}/f/big{i}", big),
                                            2) / 1e6,
            "get_MBps": len(big) / timed(lambda i: fs.cat(f"{bucket}/f/big0"), 2) / 1e6,
            # pipe(mode="create") sends If-None-Match on CompleteMultipartUpload too
            "create_only_multipart": True}
    except ImportError:
        out["s3fs"] = None
    return out


# ---------------------------------------------------------------------------- 1. bases


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, mib // 4)
    return {f"layer{i}.weight": torch.randn(1 << 20, generator=g) for i in range(n)}


def _lowdiff_base(location: str, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    arrays = {k: ("F32", v.numpy()) for k, v in state.items()}
    with LogWriter(location) as w:
        t0 = time.perf_counter()
        w.write_base(0, arrays)
        up = time.perf_counter() - t0
    return up, _lowdiff_restore(location, state)


def _lowdiff_restore(location: str, state: dict[str, torch.Tensor]) -> float:
    """Seconds to read every tensor of base 0 in order (what ``restore`` does)."""
    t0 = time.perf_counter()
    with LogReader(location) as r:
        b = r.base(0)
        for k, v in state.items():
            a = b.tensor(k)
            assert a.nbytes == v.numel() * 4
    return time.perf_counter() - t0


def _no_readahead(location: str, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The same restore with the read-ahead off (one ranged GET per part of each tensor, as
    before read-ahead existed); no upload."""
    os.environ["LOWDIFF_S3_READAHEAD_BYTES"] = "0"
    try:
        return float("nan"), _lowdiff_restore(location, state)
    finally:
        del os.environ["LOWDIFF_S3_READAHEAD_BYTES"]


def _dcp(location: str, state: dict[str, torch.Tensor], fsspec: bool) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    if fsspec:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        writer: Any = FsspecWriter(location, thread_count=4)
        reader: Any = FsspecReader(location)
    else:
        writer = dcp.FileSystemWriter(location, thread_count=4)
        reader = dcp.FileSystemReader(location)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    up = time.perf_counter() - t0
    out = {k: torch.empty_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(out, storage_reader=reader)
    down = time.perf_counter() - t0
    assert all(torch.equal(out[k], v) for k, v in state.items())
    return up, down


def bench_bases(mib: int, reps: int, workdir: str) -> dict[str, Any]:
    state = _state(mib)
    nbytes = sum(v.numel() * 4 for v in state.values())
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in (
        "lowdiff_s3", "lowdiff_s3_no_readahead", "dcp_fsspec_s3", "lowdiff_local",
        "dcp_local")}
    for i in range(reps):
        bucket = new_bucket()
        runs["lowdiff_s3"].append(_lowdiff_base(f"s3://{bucket}/ld{i}", state))
        runs["lowdiff_s3_no_readahead"].append(_no_readahead(f"s3://{bucket}/ld{i}", state))
        runs["dcp_fsspec_s3"].append(_dcp(f"s3://{bucket}/dcp{i}", state, True))
        d = os.path.join(workdir, f"r{i}")
        runs["lowdiff_local"].append(_lowdiff_base(os.path.join(d, "ld"), state))
        runs["dcp_local"].append(_dcp(os.path.join(d, "dcp"), state, False))
        shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {"state_bytes": nbytes, "reps": reps}
    for k, v in runs.items():
        up = statistics.median(u for u, _ in v)
        down = statistics.median(d for _, d in v)
        out[k] = {"upload_MBps": nbytes / up / 1e6, "restore_MBps": nbytes / down / 1e6,
                  "upload_s": up, "restore_s": down}
    return out


# ---------------------------------------------------------------------------- 2b. bytes


def bench_upload_bytes(counter: RequestCounter, records: int = 200,
                       record_kib: int = 64, segment_mib: int = 4) -> dict[str, Any]:
    """Bytes uploaded to segment objects per byte of segment: a AsyncLogWriter at batch 1
    writing ``records`` records of ``record_kib`` KiB through several seals (segments of
    ``segment_mib`` MiB), default settings, then closed. Uses only APIs that the code
    before this change had too, so the same function measures both."""
    import numpy as np

    from lowdiff_store.writer import AsyncLogWriter, TensorSpec

    url = f"s3://{new_bucket()}/bytes"
    before = counter.snapshot()
    w = AsyncLogWriter(url, batch=1, segment_bytes=segment_mib << 20)
    rng = np.random.default_rng(0)
    for s in range(records):
        w.append(s, [TensorSpec("g", "F32", rng.standard_normal(record_kib * 256,
                                                                dtype=np.float32))],
                 kind="grad")
    w.close()
    c = counter.snapshot() - before
    store = s3mod.S3Store(url)
    stored = sum(store.size(n) for n in store.list() if n.endswith(".ldlog"))
    return {"segment_bytes": stored, "uploaded_log_bytes": c["log_bytes"],
            "uploaded_per_stored": c["log_bytes"] / stored, "puts": c["PUT"],
            "records": records}


# ---------------------------------------------------------------------------- 2-3. training


def _train(size: str, location: str, steps: int, counter: RequestCounter | None
           ) -> dict[str, Any]:
    vocab, ctx, dim, layers, heads, batch = SIZES[size]
    torch.manual_seed(0)
    model = LM(vocab, ctx, dim, layers, heads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comp = TopKCompressor(ratio=0.01, error_feedback=False)
    ckpt = DiffCheckpointer(location, model, opt, compressor=comp, snapshot_every=10**9)
    train_step(model, opt, batch_for(0, vocab, batch, ctx))  # warm-up (and base 0)
    ckpt.flush()
    before = counter.snapshot() if counter is not None else Counter()
    times = []
    t_start = time.perf_counter()
    for t in range(1, steps + 1):
        x = batch_for(t, vocab, batch, ctx)
        t0 = time.perf_counter()
        train_step(model, opt, x)
        times.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_start
    in_loop = counter.snapshot() - before if counter is not None else Counter()
    ckpt.flush()
    wall = time.perf_counter() - t_start
    ckpt.close()
    out: dict[str, Any] = {"mean_step_ms": 1e3 * sum(times) / len(times),
                           "median_step_ms": 1e3 * statistics.median(times), "wall_s": wall}
    if counter is not None:
        c = counter.snapshot() - before
        c.pop("log_bytes", None)
        out["requests"] = dict(c)
        out["puts_per_step"] = c["PUT"] / steps
        out["requests_per_step"] = sum(c.values()) / steps
        out["puts_per_s"] = c["PUT"] / wall
        # the steady state: requests while training, before the final flush and close
        out["loop_puts"] = float(in_loop["PUT"] + in_loop["POST"])
        out["loop_puts_per_s"] = out["loop_puts"] / loop_s
    return out


def bench_training(size: str, steps: int, rounds: int, interval: float, workdir: str
                   ) -> dict[str, Any]:
    counter = RequestCounter()
    res: dict[str, list[dict[str, Any]]] = {"local": [], "s3": [], "s3_wal": []}
    for r in range(rounds):
        bucket = new_bucket()
        res["local"].append(_train(size, os.path.join(workdir, f"t{r}"), steps, None))
        res["s3"].append(_train(size, f"s3://{bucket}/run", steps, counter))
        os.environ["LOWDIFF_S3_WAL_DIR"] = os.path.join(workdir, f"wal{r}")
        os.environ["LOWDIFF_S3_UPLOAD_INTERVAL_S"] = str(interval)
        try:
            res["s3_wal"].append(_train(size, f"s3://{bucket}/wal", steps, counter))
        finally:
            os.environ.pop("LOWDIFF_S3_WAL_DIR")
            os.environ.pop("LOWDIFF_S3_UPLOAD_INTERVAL_S")
    out: dict[str, Any] = {"steps": steps, "rounds": rounds, "upload_interval_s": interval}
    for k, v in res.items():
        out[k] = {m: statistics.median(x[m] for x in v) for m in v[0]
                  if isinstance(v[0][m], float)}
        if "requests" in v[-1]:
            out[k]["requests_last_round"] = v[-1]["requests"]
    base = out["local"]["mean_step_ms"]
    out["step_ratio_s3_vs_local"] = out["s3"]["mean_step_ms"] / base
    out["step_ratio_s3_wal_vs_local"] = out["s3_wal"]["mean_step_ms"] / base
    return out


def run_all(state_mib: int, reps: int, size: str, steps: int, rounds: int, interval: float,
            workdir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    with moto_server() as endpoint:
        out = {"endpoint": endpoint, "cpus": os.cpu_count(),
               "bases": bench_bases(state_mib, reps, workdir),
               "training": bench_training(size, steps, rounds, interval, workdir),
               "upload_bytes": bench_upload_bytes(RequestCounter())}
    return out


@pytest.mark.slow  # ~40 s: a server, DCP and two training runs
def test_bench_s3_smoke(tmp_path: Any) -> None:
    """Smoke: every part runs on tiny sizes and counts requests."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    out = run_all(4, 1, "tiny", 4, 1, 3600.0, str(tmp_path))
    assert out["bases"]["lowdiff_s3"]["upload_MBps"] > 0
    assert out["training"]["s3"]["requests_per_step"] > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--upload-interval", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--clients", action="store_true",
                    help="only part 0: the client libraries compared")
    ap.add_argument("--upload-bytes", action="store_true",
                    help="only part 2b: segment bytes uploaded per byte logged")
    args = ap.parse_args()
    if args.upload_bytes:
        with moto_server():
            print(json.dumps(bench_upload_bytes(RequestCounter()), indent=1))
        return 0
    if args.clients:
        with moto_server():
            res = bench_clients()
        if args.json:
            print(json.dumps(res, indent=1))
            return 0
        print(f"clients, {res['big_bytes'] >> 20} MiB object (median)")
        print(f"  {'client':<8} {'PUT 4k ms':>10} {'GET 4k ms':>10} {'upload MB/s':>12} "
              f"{'GET MB/s':>9} {'create-only multipart':>22}")
        for k in ("boto3", "obstore", "s3fs"):
            r = res[k]
            if r is not None:
                print(f"  {k:<8} {r['put_4k_ms']:>10.1f} {r['get_4k_ms']:>10.1f} "
                      f"{r['upload_MBps']:>12.0f} {r['get_MBps']:>9.0f} "
                      f"{'yes' if r['create_only_multipart'] else 'no':>22}")
        return 0
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run_all(args.state_mib, args.reps, args.size, args.steps, args.rounds,
                      args.upload_interval, d)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    b = out["bases"]
    print(f"bases: {b['state_bytes'] / 2**20:.0f} MiB state, median of {b['reps']}")
    print(f"  {'writer':<23} {'upload MB/s':>12} {'restore MB/s':>13}")
    for k in ("lowdiff_s3", "lowdiff_s3_no_readahead", "dcp_fsspec_s3", "lowdiff_local",
              "dcp_local"):
        print(f"  {k:<23} {b[k]['upload_MBps']:>12.0f} {b[k]['restore_MBps']:>13.0f}")
    dcp_restore = b["dcp_fsspec_s3"]["restore_MBps"]
    print(f"  restore s3 / DCP fsspec: {b['lowdiff_s3']['restore_MBps'] / dcp_restore:.2f} "
          f"(no read-ahead: {b['lowdiff_s3_no_readahead']['restore_MBps'] / dcp_restore:.2f})")
    tr = out["training"]
    print(f"training ({args.size} LM, top-1% diffs every step, {tr['steps']} steps x "
          f"{tr['rounds']} rounds)")
    for k in ("local", "s3", "s3_wal"):
        r = tr[k]
        extra = (f"  PUT/step {r['puts_per_step']:.2f}  requests/step "
                 f"{r['requests_per_step']:.2f}  PUT/s {r['puts_per_s']:.2f}  while "
                 f"training: {r['loop_puts']:.0f} PUT ({r['loop_puts_per_s']:.2f}/s)"
                 if "puts_per_step" in r else "")
        print(f"  {k:<7} mean step {r['mean_step_ms']:.1f} ms{extra}")
    print(f"  step ratio s3/local {tr['step_ratio_s3_vs_local']:.3f}, "
          f"s3+wal/local {tr['step_ratio_s3_wal_vs_local']:.3f}")
    u = out["upload_bytes"]
    print(f"segment bytes uploaded per segment byte: {u['uploaded_per_stored']:.3f} "
          f"({u['uploaded_log_bytes']} / {u['segment_bytes']}; {u['puts']} PUTs for "
          f"{u['records']} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
