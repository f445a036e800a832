#!/usr/bin/env python3
"""Generate the golden vectors in format_spec/vectors/ (or check them with --check).

Every vector is built from fixed inputs (fixed log id, zero timestamps), so the bytes are
deterministic. Valid vectors come with the decoded expectation as JSON; invalid ones with
the expected reason code and offset. ``--check`` regenerates into memory and fails (exit 1)
when a committed file differs: the writer and the spec cannot drift apart silently.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import struct
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store import codecs
from lowdiff_store.format.checksum import crc32c, mask
from lowdiff_store.format.constants import INDEX_MAGIC, SEGMENT_MAGIC, SHARDS_MAGIC
from lowdiff_store.format.framing import FileHeader, pack_manifest
from lowdiff_store.format.record import PartInput, TensorInput, build_record
from lowdiff_store.log.base import encode_base
from lowdiff_store.log.index import make_entries
from lowdiff_store.log.tensors import from_encoded
from lowdiff_store.storage.s3 import lock_bytes, piece_name, tombstone_bytes

LOG_ID = bytes(range(16))
VECTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "format_spec",
                       "vectors")


def seg_header(first_step: int = 0, major: int = 1, segment_id: int = 0) -> bytes:
    return FileHeader(SEGMENT_MAGIC, LOG_ID, segment_id, first_step, 0, major=major).encode()


def raw(name: str, arr: np.ndarray, tag: str) -> TensorInput:
    flat = np.ascontiguousarray(arr).reshape(-1)
    return TensorInput(name, tag, tuple(arr.shape), "raw", {}, [PartInput(tag, flat.size, flat)])


def rec_bytes(step: int, tensors: list[TensorInput], side: dict[str, Any] | None = None,
              kind: str = "grad") -> bytes:
    r = build_record(step, tensors, kind=kind, side=side or {})
    return b"".join(bytes(memoryview(c).cast("B")) for c in r.chunks)


def rewrite_crc(rec: bytearray) -> bytearray:
    """Recompute a record's CRC after byte surgery (to make 'valid CRC, bad content')."""
    struct.pack_into("<I", rec, 4, mask(crc32c(bytes(rec[8:]))))
    return rec


def w_vals() -> np.ndarray:
    return np.array([1, 2, 3, 4], dtype="<f4")


def record_set() -> list[tuple[int, list[TensorInput], dict[str, Any]]]:
    """Three steps covering raw F32/BF16/I64, sparse, and a zstd-compressed part."""
    bf = np.array([0x3F80, 0x4000, 0xBF80], dtype="<u2")  # 1.0, 2.0, -1.0 in bfloat16
    sp = codecs.encode_sparse(np.array([7, 2], dtype="<i4"), np.array([0.5, -0.25], "<f4"),
                              10, "F32")
    big = np.arange(256, dtype="<f4") / np.float32(8)
    return [
        (1, [raw("w", w_vals(), "F32"), raw("b", bf, "BF16")], {"lr": 0.5}),
        (2, [from_encoded("g", "F32", (10,), sp)], {"lr": 0.25, "skipped": False}),
        (3, [from_encoded("z", "F32", (16, 16), codecs.Encoded(
            "raw", {}, (codecs.Part("F32", big),)), zstd=3),
             raw("n", np.array([[1, -2], [3, 4]], dtype="<i8"), "I64")], {}),
    ]


def expect_records(recs: list[tuple[int, list[TensorInput], dict[str, Any]]]
                   ) -> list[dict[str, Any]]:
    """Decoded values as JSON (BF16 as bit patterns)."""
    dense = {
        "w": [1.0, 2.0, 3.0, 4.0], "b": [0x3F80, 0x4000, 0xBF80],
        "g": [0, 0, -0.25, 0, 0, 0, 0, 0.5, 0, 0],
        "z": (np.arange(256, dtype="<f4") / np.float32(8)).tolist(), "n": [1, -2, 3, 4],
    }
    out = []
    for step, ts, side in recs:
        out.append({"step": step, "side": side, "tensors": [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "codec": t.codec,
             "values": dense[t.name]} for t in ts]})
    return out


def codec_tensors() -> list[tuple[str, TensorInput, list[Any]]]:
    """The worked examples of codecs.md (1.1 codecs) as record tensors, with their decode."""
    f32 = np.float32
    tern = codecs.encode_ternary(np.array([[1, 0, -1], [-1, 0, 1]], np.int8),
                                 np.array([0.5, 2.0], f32), "F32", block=3)
    qsgd = codecs.encode_qsgd(np.array([3, -1, 0, 2, -3]), np.array([1.5, 6.0], f32), "F32",
                              levels=3, bucket=3)
    neg = np.zeros(10, np.bool_)
    neg[[1, 2, 8]] = True
    sign = codecs.encode_signs(neg, "F32", scale=0.25)
    idx = np.array([2, 3, 9, 19])
    vals = np.array([0.5, -1.0, 2.0, 0.1], f32)
    rice = codecs.encode_sparse(idx, vals, 20, "F32", coding="rice")
    ef = codecs.encode_sparse(idx, vals, 20, "F32", coding="ef")
    dense = np.zeros(20, f32)
    dense[idx] = vals
    lx = np.array([0.3, -1.0, 0.6, 0.1, 0.0, -0.4, 2.0, 0.25], f32)
    lcc = codecs.encode("lcc", lx, "F32", bits=2)
    return [
        ("tern", from_encoded("tern", "F32", (2, 3), tern), [0.5, 0.0, -0.5, -2.0, 0.0, 2.0]),
        ("qsgd", from_encoded("qsgd", "F32", (5,), qsgd), [1.5, -0.5, 0.0, 4.0, -6.0]),
        ("sign", from_encoded("sign", "F32", (10,), sign),
         [-0.25 if b else 0.25 for b in neg.tolist()]),
        ("rice", from_encoded("rice", "F32", (4, 5), rice), dense.tolist()),
        ("ef", from_encoded("ef", "F32", (4, 5), ef), dense.tolist()),
        ("lcc", from_encoded("lcc", "F32", (8,), lcc),
         [0.0, -1.0, float(f32(0.6)), 0.0, 0.0, 0.0, 2.0, 0.0]),
    ]


def lcc_edge_tensors() -> list[tuple[TensorInput, list[Any]]]:
    """``lcc`` at the edges of the float formats (codecs.md section 12, "What the reference
    writer promises"), with their decode: issue 35's two subnormals, every kind of float32
    neighbour, the largest finites of F32 and F64, F16 and BF16 subnormals. Each kept
    bucket holds one value (or equal values, or an exact mean), so every expectation is an
    input, 0 or a mean written out here."""
    f32, f64 = np.float32, np.float64
    tiny = float(f32(2.0**-149))
    top32, top64 = float(np.finfo(f32).max), float(np.finfo(f64).max)
    cases: list[tuple[str, str, np.ndarray, dict[str, int], list[Any]]] = [
        # two subnormals 2^9 apart, one bucket kept: the larger binade only
        ("issue35", "F32", np.array([4.344e-44, 1.4075e-41], f32), {"bits": 1, "chunk": 1},
         [0.0, float(f32(1.4075e-41))]),
        # the same pair with two buckets, the least subnormal (negative), the largest
        # subnormal beside 2^-127 (a mean), the least normal, zeros of both signs
        ("sub32", "F32", np.array([4.344e-44, 1.4075e-41, -tiny, 2.0**-140, 1.5 * 2.0**-140,
                                   2.0**-126, 0.0, -0.0], f32), {"bits": 4},
         [float(f32(4.344e-44)), float(f32(1.4075e-41)), -tiny, 1.25 * 2.0**-140,
          1.25 * 2.0**-140, 2.0**-126, 0.0, 0.0]),
        # largest finites: the top bucket's representative stays finite
        ("max32", "F32", np.array([top32, top32, -top32, 1.5, 2.0**-149], f32), {"bits": 2},
         [top32, top32, -top32, 1.5, 0.0]),
        ("max64", "F64", np.array([top64, top64, top64, -top64, 5e-324, 1e-320, -0.0], f64),
         {"bits": 3}, [top64, top64, top64, -top64, 5e-324, 1e-320, 0.0]),
        # F16: the least subnormal, 3 * 2^-24, the largest finite (widened to float32 normals)
        ("sub16", "F16", np.array([2.0**-24, 3 * 2.0**-24, 65504.0, -65504.0, 0.0],
                                  np.float16), {"bits": 3},
         [2.0**-24, 3 * 2.0**-24, 65504.0, -65504.0, 0.0]),
        # BF16 bit patterns: the least subnormal, 3 * 2^-133, -2^-130, the largest finite
        ("sub_bf16", "BF16", np.array([0x0001, 0x0003, 0x8008, 0x7F7F, 0x8000], np.uint16),
         {"bits": 3}, [0x0001, 0x0003, 0x8008, 0x7F7F, 0x0000]),
    ]
    out = []
    for name, tag, x, opts, want in cases:
        enc = codecs.encode("lcc", x, tag, **opts)
        out.append((from_encoded(name, tag, x.shape, enc), want))
    return out


def hostile_codec_tensors() -> list[tuple[str, TensorInput]]:
    """One payload per 1.1 codec that a reader must refuse (bad_codec_params)."""
    f32 = np.float32

    def alter(name: str, enc: codecs.Encoded, shape: tuple[int, ...], part: int,
              data: np.ndarray) -> tuple[str, TensorInput]:
        parts = list(enc.parts)
        parts[part] = codecs.Part(parts[part].dtype, data)
        return name, from_encoded(name, "F32", shape, codecs.Encoded(enc.codec, enc.params,
                                                                     tuple(parts)))

    tern = codecs.encode_ternary(np.array([1, 0, -1], np.int8), np.ones(1, f32), "F32",
                                 block=3)
    qsgd = codecs.encode_qsgd(np.array([1, -2]), np.ones(1, f32), "F32", levels=2, bucket=2)
    sign = codecs.encode_signs(np.array([True, False, True]), "F32")
    ef = codecs.encode_sparse(np.array([2, 3, 9, 19]), np.ones(4, f32), 20, "F32",
                              coding="ef")
    lcc = codecs.encode("lcc", np.array([0.3, -1.0, 0.6, 0.1, 0.0, -0.4, 2.0, 0.25], f32),
                        "F32", bits=2)
    return [
        alter("tern_code_3", tern, (3,), 0, np.array([0x39], np.uint8)),   # codes 1, 2, 3
        alter("qsgd_level_above_s", qsgd, (2,), 1, np.array([0x2E], np.uint8)),  # level 3
        alter("sign_padding", sign, (3,), 0, np.array([0x0D], np.uint8)),  # bit 3 set
        alter("ef_not_ascending", ef, (20,), 0, np.array([0b11_01_01_10], np.uint8)),
        alter("lcc_incomplete_code", lcc, (8,), 1, np.array([1, 3, 3, 3], np.uint8)),
    ]


def build_all() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    expect: dict[str, Any] = {}

    def add(name: str, data: bytes, exp: dict[str, Any]) -> None:
        files[name] = data
        expect[name] = exp

    recs = record_set()
    r1 = rec_bytes(1, [raw("w", w_vals(), "F32")], {"lr": 0.5})
    add("valid/empty.ldlog", seg_header(), {"kind": "segment", "valid": True, "records": []})
    add("valid/one_record.ldlog", seg_header() + r1,
        {"kind": "segment", "valid": True,
         "records": [{"step": 1, "side": {"lr": 0.5}, "tensors": [
             {"name": "w", "dtype": "F32", "shape": [4], "codec": "raw",
              "values": [1.0, 2.0, 3.0, 4.0]}]}]})
    body = b"".join(rec_bytes(s, t, side) for s, t, side in recs)
    add("valid/three_records.ldlog", seg_header() + body,
        {"kind": "segment", "valid": True, "records": expect_records(recs)})
    r2 = rec_bytes(2, [raw("w", w_vals() * 2, "F32")])
    add("valid/torn_tail.ldlog", seg_header() + r1 + r2[: len(r2) - 40],
        {"kind": "segment", "valid": True, "torn_tail_bytes": len(r2) - 40,
         "records": [{"step": 1}]})
    add("valid/zero_tail.ldlog", seg_header() + r1 + bytes(4096),
        {"kind": "segment", "valid": True, "torn_tail_bytes": 4096, "records": [{"step": 1}]})
    base = b"".join(bytes(memoryview(c).cast("B")) for c in encode_base(
        0, {"w": ("F32", w_vals()), "b": ("BF16", np.array([0x3F80], dtype="<u2"))},
        {"optimizer": "SGD"}, LOG_ID))
    add("valid/base.safetensors", base,
        {"kind": "base", "valid": True, "step": 0, "meta": {"optimizer": "SGD"},
         "tensors": {"w": [1.0, 2.0, 3.0, 4.0], "b": [0x3F80]}})
    man = pack_manifest({"log_id": LOG_ID, "generation": 1, "next_segment_id": 1,
                         "segments": [[0, 0]], "bases": [0], "meta": {}})
    add("valid/manifest", man, {"kind": "manifest", "valid": True, "bases": [0],
                                "segments": [[0, 0]]})
    idx = FileHeader(INDEX_MAGIC, LOG_ID, 0, 0, 0).encode() + make_entries(
        [(1, 64, len(r1))], 0, LOG_ID).tobytes()
    add("valid/one_record.ldidx", idx, {"kind": "index", "valid": True,
                                        "entries": [[1, 64, len(r1)]]})

    ct = codec_tensors()
    body = b"".join(rec_bytes(i + 1, [t]) for i, (_, t, _) in enumerate(ct))
    add("valid/codecs_1_1.ldlog", seg_header() + body,
        {"kind": "segment", "valid": True, "records": [
            {"step": i + 1, "side": {}, "tensors": [
                {"name": t.name, "dtype": "F32", "shape": list(t.shape), "codec": t.codec,
                 "values": vals}]} for i, (_, t, vals) in enumerate(ct)]})

    edges = lcc_edge_tensors()
    add("valid/lcc_edges.ldlog",
        seg_header() + b"".join(rec_bytes(i + 1, [t]) for i, (t, _) in enumerate(edges)),
        {"kind": "segment", "valid": True, "records": [
            {"step": i + 1, "side": {}, "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "codec": "lcc",
                 "values": vals}]} for i, (t, vals) in enumerate(edges)]})

    # ---- invalid
    for name, t in hostile_codec_tensors():
        add(f"invalid/codec_{name}.ldlog", seg_header() + rec_bytes(1, [t]),
            {"kind": "segment", "valid": False, "reason": "bad_codec_params", "on": "read"})
    bad = bytearray(seg_header() + r1)
    bad[0:8] = b"NOTALOG!"
    add("invalid/bad_magic.ldlog", bytes(bad), {"kind": "segment", "valid": False,
                                                "reason": "bad_magic", "offset": 0})
    add("invalid/future_version.ldlog", seg_header(major=2) + r1,
        {"kind": "segment", "valid": False, "reason": "unsupported_format_version",
         "offset": 8})
    bad = bytearray(seg_header() + r1)
    bad[40] ^= 0x01
    add("invalid/header_checksum.ldlog", bytes(bad),
        {"kind": "segment", "valid": False, "reason": "checksum_mismatch", "offset": 0})
    r3 = rec_bytes(3, [raw("w", w_vals() * 3, "F32")])
    mid = bytearray(r2)
    mid[len(mid) - 70] ^= 0x10
    add("invalid/record_checksum.ldlog", seg_header() + r1 + bytes(mid) + r3,
        {"kind": "segment", "valid": False, "reason": "checksum_mismatch",
         "offset": 64 + len(r1)})
    add("invalid/step_out_of_order.ldlog", seg_header() + r2 + r1,
        {"kind": "segment", "valid": False, "reason": "step_out_of_order",
         "offset": 64 + len(r2)})
    unk = rewrite_crc(bytearray(r2))
    unk[8] = 7
    unk = rewrite_crc(unk)
    add("invalid/unknown_record_type.ldlog", seg_header() + r1 + bytes(unk),
        {"kind": "segment", "valid": False, "reason": "unknown_record_type",
         "offset": 64 + len(r1)})
    oob = build_record(1, [raw("w", w_vals(), "F32")], kind="grad")
    ob = bytearray(b"".join(bytes(memoryview(c).cast("B")) for c in oob.chunks))
    # the part ["F32", 4, 0, 16, nil] is msgpack ... 04 00 10 c0: make its length 32,
    # which is not count * itemsize, keeping the metadata the same size
    hit = ob.find(b"\x04\x00\x10\xc0", 32)
    if hit < 0:
        raise SystemExit("gen_vectors: could not place the part-length edit")
    ob[hit + 2] = 0x20
    add("invalid/part_length.ldlog", seg_header() + bytes(rewrite_crc(ob)),
        {"kind": "segment", "valid": False, "reason": "bad_record_length", "offset": 64,
         "on": "read"})
    bb = bytearray(base)
    bb[-1] ^= 0xFF
    add("invalid/base_tensor_checksum.safetensors", bytes(bb),
        {"kind": "base", "valid": False, "reason": "checksum_mismatch", "on": "verify"})
    bb = bytearray(base)
    p = bb.find(b'"format_version":"1.0"') + len('"format_version":"')
    bb[p] = ord("2")
    add("invalid/base_header_checksum.safetensors", bytes(bb),
        {"kind": "base", "valid": False, "reason": "checksum_mismatch", "offset": 8})
    bm = bytearray(man)
    bm[8] = 2
    add("invalid/manifest_future_version", bytes(bm),
        {"kind": "manifest", "valid": False, "reason": "unsupported_format_version",
         "offset": 8})
    bm = bytearray(man)
    bm[-1] ^= 1
    add("invalid/manifest_checksum", bytes(bm),
        {"kind": "manifest", "valid": False, "reason": "checksum_mismatch", "offset": 16})
    # ---- the SHARDS top-level manifest of a sharded checkpoint (spec section 6.2)
    shards = pack_manifest({"world_size": 2, "layout": "replicated",
                            "meta": {"writer": "torch"}}, SHARDS_MAGIC)
    add("valid/SHARDS", shards, {"kind": "shards", "valid": True, "world_size": 2,
                                 "layout": "replicated", "meta": {"writer": "torch"}})
    sb = bytearray(shards)
    sb[-1] ^= 1
    add("invalid/shards_checksum", bytes(sb),
        {"kind": "shards", "valid": False, "reason": "checksum_mismatch", "offset": 16})
    add("invalid/shards_world_size",
        pack_manifest({"world_size": 0, "layout": "replicated", "meta": {}}, SHARDS_MAGIC),
        {"kind": "shards", "valid": False, "reason": "bad_metadata"})
    reference_bases(add)
    streamed_bases(files, expect, add)
    object_store(files, expect, seg_header() + r2)
    files["expected.json"] = (json.dumps(expect, indent=1, sort_keys=True) + "\n").encode()
    return files


def object_store(files: dict[str, bytes], expect: dict[str, Any], other: bytes) -> None:
    """The object-store layout (format_spec/object_store.md): each case is a folder of
    objects named by key (the store's prefix taken off) and what a reader must see in it.
    ``objects``: logical name -> the valid vector holding the same bytes; ``listed``: the
    names a listing shows."""
    one, three = files["valid/one_record.ldlog"], files["valid/three_records.ldlog"]
    base, man = files["valid/base.safetensors"], files["valid/manifest"]
    seg = "seg-0000000000000000.ldlog"
    hdr = 64

    def case(name: str, objs: dict[str, bytes], exp: dict[str, Any]) -> None:
        for key, data in objs.items():
            files[f"object_store/{name}/{key}"] = data
        expect[f"object_store/{name}"] = {"kind": "object_store", **exp}

    # an object as pieces from offset 0, cut anywhere (here after the header and inside the
    # last record): the active segment, or a sealed one (sealing adds no object)
    cut = [0, hdr, len(three) - 40, len(three)]
    case("pieces", {piece_name(seg, a): three[a:b] for a, b in itertools.pairwise(cut)},
         {"objects": {seg: "valid/three_records.ldlog"}, "listed": [seg]})
    # a piece beyond a gap holds no byte of the object (a crash inside a truncation)
    case("gap", {piece_name(seg, 0): one[:hdr], piece_name(seg, hdr): one[hdr:],
                 piece_name(seg, len(one) + 64): other[hdr:]},
         {"objects": {seg: "valid/one_record.ldlog"}, "listed": [seg]})
    # a whole object takes precedence over pieces of the same name
    case("whole_wins", {seg: one, piece_name(seg, 0): other},
         {"objects": {seg: "valid/one_record.ldlog"}, "listed": [seg]})
    # a deleted object: hidden from listings, still read by name until its deadline
    b5 = "base-0000000000000005.safetensors"
    case("tombstone", {b5: base, b5 + "@gc": tombstone_bytes(1_700_000_600.0)},
         {"objects": {b5: "valid/base.safetensors"}, "listed": [],
          "tombstones": {b5: 1_700_000_600.0}})
    # the manifest: create-only versions, the largest sequence is current
    old = pack_manifest({"log_id": LOG_ID, "generation": 1, "next_segment_id": 1,
                         "segments": [[0, 0]], "bases": [], "meta": {}})
    case("manifest", {"MANIFEST.00000000000000000000": old,
                      "MANIFEST.00000000000000000001": man},
         {"current": {"MANIFEST": [1, "valid/manifest"]},
          "listed": ["MANIFEST.00000000000000000000", "MANIFEST.00000000000000000001"]})
    owner = {"host": "node-0", "pid": 4242, "id": "00112233445566778899aabbccddeeff",
             "time": 1_700_000_000.0, "ttl": 60.0}
    case("lock", {"LOCK": lock_bytes(owner)}, {"locks": {"LOCK": owner}, "listed": ["LOCK"]})


def safetensors_file(tensors: dict[str, tuple[str, np.ndarray]]) -> bytes:
    """A plain safetensors file (as any writer makes one: no lowdiff metadata)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off, data = 0, []
    for k, (tag, a) in tensors.items():
        header[k] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        data.append(a.tobytes())
        off += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(data)


def reference_bases(add: Any) -> None:
    """Reference bases (spec section 7.1): a base whose tensors ``w`` (a whole external
    tensor) and ``p`` (rows 1..2 of one: a box) live in ``ext/model.safetensors``, root
    relative to the base's directory; then a changed external file, a missing one and a
    table naming a path outside its root."""
    w = np.array([1, 2, 3, 4], dtype="<f4")
    pt = np.arange(6, dtype="<f4").reshape(3, 2)
    ext = safetensors_file({"model.w": ("F32", w), "model.p": ("F32", pt)})
    piece = np.ascontiguousarray(pt[1:3])

    def table(name: str = "model.safetensors", data: bytes = ext) -> dict[str, Any]:
        return {"kind": "safetensors", "root": "ext",
                "files": [[name, len(data), crc32c(data)]],
                "tensors": [["w", "model.w", "F32", [4], crc32c(w.tobytes()), [0], None],
                            ["p", "model.p", "F32", [2, 2], crc32c(piece.tobytes()), [0],
                             [[1, 0], [3, 2]]]]}

    def base(ref: dict[str, Any]) -> bytes:
        return b"".join(bytes(memoryview(c).cast("B")) for c in encode_base(
            0, {"b": ("BF16", np.array([0x3F80], dtype="<u2"))},
            {"optimizer": "SGD", "reference": ref}, LOG_ID))

    name = "base-0000000000000000.safetensors"
    add("valid/reference/ext/model.safetensors", ext, {"kind": "external"})
    add(f"valid/reference/{name}", base(table()),
        {"kind": "base", "valid": True, "step": 0, "reference": True,
         "meta": {"optimizer": "SGD", "reference": table()},
         "tensors": {"b": [0x3F80], "w": [1.0, 2.0, 3.0, 4.0], "p": [2.0, 3.0, 4.0, 5.0]}})
    changed = bytearray(ext)
    changed[-1] ^= 0x01  # the last byte of model.p: same size, other value
    add("invalid/reference_changed/ext/model.safetensors", bytes(changed),
        {"kind": "external"})
    add(f"invalid/reference_changed/{name}", base(table()),
        {"kind": "base", "valid": False, "reason": "reference_changed", "on": "verify"})
    add(f"invalid/reference_missing/{name}", base(table("gone.safetensors")),
        {"kind": "base", "valid": False, "reason": "missing_file"})
    bad = table()
    bad["files"][0][0] = "../model.safetensors"
    add(f"invalid/reference_table/{name}", base(bad),
        {"kind": "base", "valid": False, "reason": "bad_metadata"})


def streamed_bases(files: dict[str, bytes], expect: dict[str, Any], add: Any) -> None:
    """Streamed bases (spec section 7.2): a log directory whose manifest names base 0 and
    the streamed base complete at step 3, taken in two slices (``w`` after step 2, ``b``
    after step 3), with the diffs of steps 1..4; then a slice naming another base, a
    tensor in two slices, a slice the manifest names that is missing, and manifests whose
    ``streamed`` entry breaks a rule."""
    seg = "seg-0000000000000000.ldlog"
    segment = seg_header() + b"".join(
        rec_bytes(s, [raw("w", w_vals() * s, "F32")], {"lr": 0.5}) for s in range(1, 5))
    w2, b3 = w_vals() * 2, np.array([0x4000], dtype="<u2")  # the state after 2, after 3

    def manifest(streamed: list[Any]) -> bytes:
        return pack_manifest({"log_id": LOG_ID, "generation": 1, "next_segment_id": 1,
                              "segments": [[0, 0]], "bases": [0], "streamed": streamed,
                              "meta": {}})

    def framed(step: int, tensors: dict[str, tuple[str, np.ndarray]], sl: Any) -> bytes:
        meta = {"optimizer": "SGD"} if sl is None else {"optimizer": "SGD", "slice": sl}
        return b"".join(bytes(memoryview(c).cast("B")) for c in encode_base(
            step, tensors, meta, LOG_ID))

    base0 = framed(0, {"w": ("F32", w_vals()), "b": ("BF16", np.array([0x3F80], "<u2"))},
                   None)
    entry = [[3, [2, 3]]]
    sl = {"base": 3, "steps": [2, 3]}
    good = {"MANIFEST": manifest(entry), "base-0000000000000000.safetensors": base0,
            seg: segment,
            "slice-0000000000000002.safetensors": framed(2, {"w": ("F32", w2)}, sl),
            "slice-0000000000000003.safetensors": framed(3, {"b": ("BF16", b3)}, sl)}

    def log(name: str, objs: dict[str, bytes], exp: dict[str, Any]) -> None:
        """A log directory: its files, named as in a log, and what a reader finds there
        (its entry names the directory)."""
        for fname, data in objs.items():
            files[f"{name}/{fname}"] = data
        expect[name] = {"kind": "log", **exp}

    log("valid/streamed", good, {
        "valid": True, "bases": [0], "streamed": entry, "durable_step": 4,
        "restore": {"1": {"base": 0, "slices": [], "diffs": [1]},
                    "2": {"base": 0, "slices": [], "diffs": [1, 2]},
                    "3": {"base": 3, "slices": [2, 3], "diffs": [3]},
                    "4": {"base": 3, "slices": [2, 3], "diffs": [3, 4]}},
        "slice_of": {"w": 2, "b": 3},
        "tensors": {"w": [2.0, 4.0, 6.0, 8.0], "b": [0x4000]}})
    bad = {**good, "slice-0000000000000003.safetensors": framed(
        3, {"b": ("BF16", b3)}, {"base": 4, "steps": [3, 4]})}
    log("invalid/streamed_other_base", bad, {"valid": False, "reason": "bad_metadata",
                                             "step": 4})
    bad = {**good, "slice-0000000000000003.safetensors": framed(
        3, {"b": ("BF16", b3), "w": ("F32", w_vals() * 3)}, sl)}
    log("invalid/streamed_tensor_twice", bad, {"valid": False, "reason": "bad_metadata",
                                               "step": 4})
    bad = dict(good)
    del bad["slice-0000000000000003.safetensors"]
    log("invalid/streamed_missing_slice", bad, {"valid": False, "reason": "missing_file",
                                                "step": 4})
    for name, streamed in (("not_increasing", [[3, [3, 2]]]), ("last", [[3, [1, 2]]]),
                           ("overlap", [[3, [2, 3]], [5, [3, 4, 5]]])):
        add(f"invalid/manifest_streamed_{name}", manifest(streamed),
            {"kind": "manifest", "valid": False, "reason": "bad_metadata"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ap.add_argument("--out", default=VECTORS)
    args = ap.parse_args(argv)
    files = build_all()
    bad = []
    for name, data in sorted(files.items()):
        path = os.path.join(args.out, name)
        if args.check:
            try:
                with open(path, "rb") as fh:
                    if fh.read() != data:
                        bad.append(f"{name}: differs from what the writer produces")
            except FileNotFoundError:
                bad.append(f"{name}: missing")
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)
    if args.check:
        for b in bad:
            print(f"gen_vectors: {b}", file=sys.stderr)
        if bad:
            print("gen_vectors: run `make vectors` and review the diff", file=sys.stderr)
            return 1
        print(f"gen_vectors: {len(files)} files match")
        return 0
    print(f"gen_vectors: wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
