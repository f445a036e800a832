"""Locks of an ``s3://`` store (``format_spec/object_store.md`` section 5): :class:`S3Lock`,
a create-only lock object held as a lease."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from typing import Any

import msgpack

from ...errors import Reason, StorageError
from ..base import ObjectExists, StoreLock
from .keys import lock_bytes
from .objects import Objects


class S3Lock(StoreLock):
    """A lease: a create-only object naming its holder, refreshed every ``ttl / 3``."""

    def __init__(self, objects: Objects, name: str, owner: dict[str, Any], etag: str) -> None:
        self.name = name
        self._objects = objects
        self._owner = owner
        self._etag = etag
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="lowdiff-s3-lease",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, objects: Objects, name: str) -> S3Lock | None:
        key = objects.key(name)
        path = objects.path_of(name)
        s3 = objects.s3
        for _attempt in range(3):
            owner = {"host": node_name(), "pid": os.getpid(),
                     "id": uuid.uuid4().hex, "time": time.time(),
                     "ttl": objects.options.lock_ttl_s}
            try:
                with objects.client.call("lock", path):
                    r = s3.put_object(Bucket=objects.bucket, Key=key, IfNoneMatch="*",
                                      Body=lock_bytes(owner))
                return cls(objects, name, owner, str(r["ETag"]))
            except ObjectExists:
                pass
            try:
                with objects.client.call("lock", path):
                    h = s3.get_object(Bucket=objects.bucket, Key=key)
                    raw = h["Body"].read()
            except StorageError as e:
                if e.reason is Reason.MISSING_FILE:
                    continue  # released meanwhile
                raise
            # the ETag of what was read, whatever its body: a lock whose body names no
            # holder is stale, and breaking it must match this very object
            etag = str(h["ETag"])
            held = _holder(raw)
            if held.get("id") == owner["id"]:
                return cls(objects, name, owner, etag)  # our own create, answered late (retry)
            if not _stale(held):
                return None
            with contextlib.suppress(StorageError), objects.client.call("break lock", path):
                s3.delete_object(Bucket=objects.bucket, Key=key, IfMatch=etag)
        return None

    def _refresh(self) -> None:
        ttl = float(self._owner["ttl"])
        objects = self._objects
        while not self._stop.wait(ttl / 3):
            self._owner["time"] = time.time()
            try:
                with objects.client.call("refresh lock", objects.path_of(self.name)):
                    r = objects.s3.put_object(Bucket=objects.bucket, Key=objects.key(self.name),
                                             IfMatch=self._etag,
                                             Body=lock_bytes(self._owner))
                self._etag = str(r["ETag"])
            except StorageError:
                etag = self._still_ours()
                if etag is None:
                    return  # lost (broken by another process): commits still conflict safely
                self._etag = etag  # our refresh landed, its answer was lost (a retry's 412)

    def _still_ours(self) -> str | None:
        """The lock object's ETag if it still names this holder, else None."""
        objects = self._objects
        try:
            with objects.client.call("refresh lock", objects.path_of(self.name)):
                h = objects.s3.get_object(Bucket=objects.bucket, Key=objects.key(self.name))
                held = msgpack.unpackb(h["Body"].read())
        except (StorageError, ValueError, msgpack.UnpackException):
            return None
        ok = isinstance(held, dict) and held.get("id") == self._owner["id"]
        return str(h["ETag"]) if ok else None

    def release(self) -> None:
        """Stop the lease and remove the lock object (only if it is still ours)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        objects = self._objects
        with contextlib.suppress(StorageError), \
                objects.client.call("unlock", objects.path_of(self.name)):
            objects.s3.delete_object(Bucket=objects.bucket, Key=objects.key(self.name),
                                    IfMatch=self._etag)


def _holder(raw: bytes) -> dict[str, Any]:
    """The holder a lock object's body names: a msgpack map, or ``{}`` (stale) for
    anything else (garbage, another type) another writer or a person may have put there."""
    try:
        held = msgpack.unpackb(raw)
    except (ValueError, msgpack.UnpackException):
        return {}
    return held if isinstance(held, dict) else {}


def _stale(held: dict[str, Any]) -> bool:
    """A lock is stale when its holder process is gone (same host) or its lease ran out."""
    try:
        if held.get("host") == node_name():
            pid = int(held["pid"])
            if pid == os.getpid():
                return False
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False
        return bool(time.time() - float(held["time"]) > float(held["ttl"]))
    except (KeyError, TypeError, ValueError):
        return True


def node_name() -> str:
    """The holder's ``host`` in a lock: ``LOWDIFF_NODE_NAME`` if set, else the host name.
    Set it where host names do not tell nodes apart (containers that share a host name):
    a lock held under this name by a process that no longer exists here is broken at once,
    one held under another name only once its lease ran out."""
    return os.environ.get("LOWDIFF_NODE_NAME") or socket.gethostname()
