"""Conformance: the object-store layout vectors (format_spec/object_store.md) read by the
S3 store's layout rule, offline: each case folder is a bucket listing (file name = key,
file = object body). ``tests/s3/test_s3_vectors.py`` reads the same folders from a real
server through ``S3Store``."""

from __future__ import annotations

import json
import os
from typing import Any

import msgpack
import pytest

from lowdiff_store.format.constants import MANIFEST_MAGIC
from lowdiff_store.format.framing import unpack_manifest
from lowdiff_store.storage.s3.keys import layouts, piece_name

VECTORS = os.path.join(os.path.dirname(__file__), "..", "format_spec", "vectors")
with open(os.path.join(VECTORS, "expected.json")) as _fh:
    CASES = {k: v for k, v in json.load(_fh).items() if v["kind"] == "object_store"}


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def listing(case: str) -> dict[str, bytes]:
    """The case's objects: key -> body."""
    d = os.path.join(VECTORS, case)
    return {k: _read(os.path.join(d, k)) for k in sorted(os.listdir(d))}


def assemble(objs: dict[str, bytes], name: str) -> bytes:
    """Object ``name`` as the spec says a reader sees it: the whole object, else its
    pieces from offset 0 up to the first gap."""
    lay = layouts([(k, len(v)) for k, v in objs.items()], name)[name]
    if lay.whole is not None:
        return objs[name]
    return b"".join(objs[piece_name(name, off)] for off, _n in lay.pieces)


def test_every_case_is_present() -> None:
    assert sorted(c.split("/")[1] for c in CASES) == [
        "gap", "lock", "manifest", "pieces", "tombstone", "whole_wins"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_object_store_vector(case: str) -> None:
    exp: dict[str, Any] = CASES[case]
    objs = listing(case)
    lays = layouts([(k, len(v)) for k, v in objs.items()], None)
    assert sorted(n for n, lay in lays.items() if lay.exists) == exp["listed"]
    for name, same_as in exp.get("objects", {}).items():
        assert assemble(objs, name) == _read(os.path.join(VECTORS, same_as)), name
    for name, deadline in exp.get("tombstones", {}).items():
        assert lays[name].tomb
        assert msgpack.unpackb(objs[name + "@gc"]) == {"deadline": deadline}
    for name, (seq, same_as) in exp.get("current", {}).items():
        versions = sorted(k for k in objs if k.startswith(name + "."))
        assert versions[-1] == f"{name}.{seq:020d}"
        assert objs[versions[-1]] == _read(os.path.join(VECTORS, same_as))
        unpack_manifest(objs[versions[-1]], MANIFEST_MAGIC)  # a valid manifest
    for name, owner in exp.get("locks", {}).items():
        assert msgpack.unpackb(objs[name]) == owner


def test_pieces_end_at_the_first_overlap() -> None:
    """Rule 2: a piece that overlaps the object so far ends it, even when a later piece
    would continue an earlier one (spec section 2's example: 100 bytes, not 150)."""
    keys = [(piece_name("seg", 0), 100), (piece_name("seg", 50), 100),
            (piece_name("seg", 100), 50)]
    lay = layouts(keys, "seg")["seg"]
    assert lay.whole is None
    assert lay.pieces == ((0, 100),)
    assert lay.size == 100
