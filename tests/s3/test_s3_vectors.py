"""The object-store layout vectors (format_spec/vectors/object_store/) put in a real bucket
and read through ``S3Store``: listing, assembly of pieces, tombstones, manifest versions,
a stale lock."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lowdiff_store.storage.s3 import S3Store
from tests.s3.servers import S3Server
from tests.test_vectors_object_store import CASES, VECTORS, _read, listing


@pytest.mark.parametrize("case", sorted(CASES))
def test_object_store_vector_in_a_bucket(case: str, s3_env: S3Server, s3_bucket: str
                                         ) -> None:
    exp: dict[str, Any] = CASES[case]
    client = s3_env.client()
    for key, body in listing(case).items():
        client.put_object(Bucket=s3_bucket, Key=f"run/{key}", Body=body)
    store = S3Store(f"s3://{s3_bucket}/run")
    assert store.list() == exp["listed"]
    for name, same_as in exp.get("objects", {}).items():
        want = _read(os.path.join(VECTORS, same_as))
        if name not in exp.get("tombstones", {}):
            assert store.size(name) == len(want)
        src = store.open(name, "pread")
        assert bytes(src.read(0, src.size)) == want
        src.close()
    for name in exp.get("tombstones", {}):
        assert not store.exists(name)  # hidden, yet read by name above
    for name, (seq, same_as) in exp.get("current", {}).items():
        v = store.read_versioned(name, max_bytes=1 << 20)
        assert v is not None
        assert (v.token, v.data) == (str(seq), _read(os.path.join(VECTORS, same_as)))
    for name in exp.get("locks", {}):
        lock = store.try_lock(name)  # another host's lease, long expired: broken, taken
        assert lock is not None
        lock.release()
