"""A hostile lock object on an object store (issue 35 item 5): the body of ``LOCK`` is
whatever another writer (or anyone with write access to the prefix) put there. A body
that is not a msgpack map of a holder is a lock nobody can hold: it is broken (deleted on
its ETag) and taken, never a traceback. A live holder's lock is respected. Runs against an
in-memory fake of the few S3 calls the lock makes (no server)."""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

pytest.importorskip("boto3", reason="boto3 (lowdiff-store[s3]) is not installed")

from lowdiff_store.storage.base import ObjectExists
from lowdiff_store.storage.s3.lock import S3Lock, node_name


class FakeS3:
    """put_object (IfNoneMatch), get_object, delete_object (IfMatch) on one dict."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.n = 0

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, IfNoneMatch: str
                   ) -> dict[str, Any]:
        if Key in self.objects:
            raise ObjectExists("exists", path=Key)
        self.n += 1
        self.objects[Key] = (Body, f'"{self.n}"')
        return {"ETag": self.objects[Key][1]}

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        body, etag = self.objects[Key]
        return {"Body": io.BytesIO(body), "ETag": etag}

    def delete_object(self, *, Bucket: str, Key: str, IfMatch: str) -> None:
        if self.objects.get(Key, (b"", ""))[1] == IfMatch:
            del self.objects[Key]


@contextlib.contextmanager
def _call(*_a: object) -> Iterator[None]:
    yield


def _objects(s3: FakeS3) -> Any:
    return SimpleNamespace(key=lambda n: f"run/{n}", path_of=lambda n: f"s3://b/run/{n}",
                           s3=s3, bucket="b", client=SimpleNamespace(call=_call),
                           options=SimpleNamespace(lock_ttl_s=3600.0))


@pytest.mark.parametrize("body", [
    msgpack.packb([1, 2, 3]), msgpack.packb(7), msgpack.packb("LOCK"), b"\xc1garbage",
    msgpack.packb({"host": node_name(), "pid": "not a pid"}),
    msgpack.packb({"host": "elsewhere", "time": "yesterday", "ttl": None}),
])
def test_a_lock_body_that_names_no_holder_is_broken_and_taken(body: bytes) -> None:
    s3 = FakeS3()
    s3.objects["run/LOCK"] = (body, '"hostile"')
    lock = S3Lock.acquire(_objects(s3), "LOCK")
    assert lock is not None
    try:
        held = msgpack.unpackb(s3.objects["run/LOCK"][0])
        assert held["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_live_holder_is_respected() -> None:
    s3 = FakeS3()
    s3.objects["run/LOCK"] = (msgpack.packb({"host": "elsewhere", "pid": 1, "id": "x",
                                             "time": time.time(), "ttl": 3600.0}), '"1"')
    assert S3Lock.acquire(_objects(s3), "LOCK") is None
    assert msgpack.unpackb(s3.objects["run/LOCK"][0])["id"] == "x"
