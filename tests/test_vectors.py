"""Conformance: our readers against the golden vectors in format_spec/vectors."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import pytest

from lowdiff_store import codecs
from lowdiff_store.errors import LowdiffError
from lowdiff_store.format.constants import FORMAT_MAJOR
from lowdiff_store.format.framing import unpack_manifest
from lowdiff_store.log.base import BaseFile
from lowdiff_store.log.index import load_index
from lowdiff_store.log.manifest import Manifest
from lowdiff_store.log.reader import LogReader, Record
from lowdiff_store.log.reference import ReferenceBase, as_base
from lowdiff_store.log.segment import read_record_meta, read_segment_header, scan_segment
from lowdiff_store.log.shards import read_shards_manifest
from lowdiff_store.log.streamed import StreamedBase
from lowdiff_store.storage import BytesSource, LocalStore
from lowdiff_store.verify import verify_log

VECTORS = os.path.join(os.path.dirname(__file__), "..", "format_spec", "vectors")
with open(os.path.join(VECTORS, "expected.json")) as _fh:
    EXPECTED: dict[str, Any] = json.load(_fh)


def test_corpus_is_present() -> None:
    assert len(EXPECTED) >= 19
    for name in EXPECTED:
        assert os.path.exists(os.path.join(VECTORS, name)), name
    assert FORMAT_MAJOR == 1


def _read(name: str) -> bytes:
    with open(os.path.join(VECTORS, name), "rb") as fh:
        return fh.read()


def _segment(data: bytes, name: str) -> tuple[list[dict[str, Any]], int]:
    src = BytesSource(data, name)
    hdr = read_segment_header(src)
    res = scan_segment(src, hdr.header_len, active=True)
    out = []
    for ref in res.records:
        rh, meta, payload = read_record_meta(src, ref)
        rec = Record(rh.step, meta, payload, name, ref.offset, rh.length)
        tensors = []
        for e in rec.entries:
            arr = rec.tensor(e.name)
            tensors.append({"name": e.name, "dtype": e.dtype, "shape": list(e.shape),
                            "codec": e.codec, "values": arr.reshape(-1).tolist()})
        out.append({"step": rh.step, "side": meta.get("side", {}), "tensors": tensors})
    return out, res.torn_tail_bytes


def _shards_dir(root: Any, data: bytes, world: int) -> None:
    (root / "SHARDS").write_bytes(data)
    for r in range(world):
        (root / f"rank-{r:05d}").mkdir()


def _log_dir(name: str, tmp_path: Any) -> str:
    """A copy of the log directory vector ``name`` (a reader may leave files in a log)."""
    dest = os.path.join(str(tmp_path), "log")
    shutil.copytree(os.path.join(VECTORS, name), dest)
    return dest


def _streamed_log(name: str, exp: dict[str, Any], tmp_path: Any) -> None:
    """A log directory with a streamed base (spec section 7.2): its bases, where a
    restore of each step starts and what it replays, and the streamed base's tensors
    with the step of the slice holding each."""
    path = _log_dir(name, tmp_path)
    with LogReader(path) as r:
        assert r.bases == exp["bases"]
        assert [[c, list(sl)] for c, sl in r.streamed] == exp["streamed"]
        assert r.durable_step == exp["durable_step"]
        for step, want in exp["restore"].items():
            plan, diffs = r.chain_from(int(step))
            assert (plan.complete, list(plan.slices) if plan.streamed else [], diffs) == \
                (want["base"], want["slices"], want["diffs"]), step
        with StreamedBase(r, r.start_for(int(max(exp["restore"], key=int)))) as sb:
            assert {n: sb.step_of(n) for n in sb.names} == exp["slice_of"]
            assert {n: sb.tensor(n).reshape(-1).tolist() for n in sb.names} == exp["tensors"]
    rep = verify_log(path)  # verify reads it whole and finds nothing wrong
    assert (rep.ok, rep.bases, rep.streamed) == (True, len(exp["bases"]), len(exp["streamed"]))


def _open_streamed(name: str, exp: dict[str, Any], tmp_path: Any) -> None:
    """Open the streamed base a restore of ``exp["step"]`` starts from, every tensor read;
    ``verify`` must report the same reason."""
    path = _log_dir(name, tmp_path)
    rep = verify_log(path)
    assert [p.reason.value for p in rep.problems] == [exp["reason"]], rep.problems
    with LogReader(path) as r, StreamedBase(r, r.start_for(exp["step"])) as sb:
        for n in sb.names:
            sb.tensor(n)


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.startswith("valid/")
                                         and EXPECTED[n]["kind"] != "external"))
def test_valid_vector(name: str, tmp_path: Any) -> None:
    exp = EXPECTED[name]
    if exp["kind"] == "log":
        _streamed_log(name, exp, tmp_path)
        return
    data = _read(name)
    if exp["kind"] == "segment":
        recs, torn = _segment(data, name)
        assert torn == exp.get("torn_tail_bytes", 0)
        assert [r["step"] for r in recs] == [r["step"] for r in exp["records"]]
        for got, want in zip(recs, exp["records"]):
            if "tensors" in want:
                assert got == want
    elif exp["kind"] == "base" and exp.get("reference"):
        with as_base(BaseFile(os.path.join(VECTORS, name))) as rb:
            assert isinstance(rb, ReferenceBase)
            rb.verify_all()
            assert rb.step == exp["step"]
            assert rb.meta() == exp["meta"]
            assert {n: rb.tensor(n).reshape(-1).tolist() for n in rb.names} == exp["tensors"]
    elif exp["kind"] == "base":
        p = tmp_path / "b.safetensors"
        p.write_bytes(data)
        with BaseFile(str(p)) as b:
            b.verify_all()
            assert b.step == exp["step"]
            assert b.meta() == exp["meta"]
            assert {n: b.tensor(n).reshape(-1).tolist() for n in b.names} == exp["tensors"]
            for n in b.names:  # every tensor is 64-byte aligned in the file
                assert (b.data_start + b._entries[n][2]) % 64 == 0
    elif exp["kind"] == "manifest":
        body = unpack_manifest(data)
        assert body["bases"] == exp["bases"]
        assert body["segments"] == exp["segments"]
        Manifest.from_body(body, name)
    elif exp["kind"] == "shards":
        _shards_dir(tmp_path, data, exp["world_size"])
        body = read_shards_manifest(tmp_path)
        assert (body["world_size"], body["layout"], body["meta"]) == \
            (exp["world_size"], exp["layout"], exp["meta"])
    elif exp["kind"] == "index":
        p = tmp_path / "i.ldidx"
        p.write_bytes(data)
        ents = load_index(LocalStore(str(tmp_path)), p.name, 0, bytes(range(16)), 1 << 20)
        assert ents is not None
        assert [[int(x) for x in e] for e in ents[["step", "offset", "length"]].tolist()] == \
            exp["entries"]


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.startswith("invalid/")
                                         and EXPECTED[n]["kind"] != "external"))
def test_invalid_vector(name: str, tmp_path: Any) -> None:
    exp = EXPECTED[name]
    data = b"" if exp["kind"] == "log" else _read(name)
    with pytest.raises(LowdiffError) as ei:
        if exp["kind"] == "log":
            _open_streamed(name, exp, tmp_path)
        elif exp["kind"] == "segment":
            _segment(data, name)
        elif exp["kind"] == "base" and "/reference_" in name:  # beside its ext/ files
            with as_base(BaseFile(os.path.join(VECTORS, name))) as b:
                b.verify_all()
        elif exp["kind"] == "base":
            p = tmp_path / "b.safetensors"
            p.write_bytes(data)
            with BaseFile(str(p)) as b:
                b.verify_all()
        elif exp["kind"] == "manifest":
            Manifest.from_body(unpack_manifest(data), name)
        elif exp["kind"] == "shards":
            _shards_dir(tmp_path, data, 0)
            read_shards_manifest(tmp_path)
    assert ei.value.reason.value == exp["reason"]
    if "offset" in exp:
        assert ei.value.offset == exp["offset"]


def test_inline_bytes_of_one_record() -> None:
    """The worked example of the spec, byte for byte (section 12)."""
    data = _read("valid/one_record.ldlog")
    assert data[:8] == b"LDSEG\x00\r\n"
    assert data[64:68] == b"LDRC"
    assert int.from_bytes(data[80:88], "little") == 1  # step
    length = int.from_bytes(data[88:96], "little")
    assert length == 0xC0
    assert len(data) == 64 + length
    assert data[192:208] == np.array([1, 2, 3, 4], "<f4").tobytes()
    assert codecs.CODECS >= {"raw", "sparse", "xor", "q8", "lowrank"}
