"""The requests on the objects under one ``s3://bucket/prefix`` (:class:`Objects`): listing
and layouts, ranged GETs, create-only and plain uploads (one PUT or multipart), removal.

This is the part of a store that the source, the append handles and the locks share; the
:class:`~.store.S3Store` composes it with them. Every method sends requests; the rules it
applies to the keys it lists are :mod:`.keys`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ...errors import FormatError, LowdiffError, Reason, StorageError
from ..base import Buffer, ObjectExists, check_name
from .client import MULTIPART_MIN_BYTES, Client, S3Options
from .keys import PIECE, TOKEN_META, TOMB, WHOLE_CACHE, Layout, layouts, piece_name

#: The write-ahead recovery hook of :meth:`Objects.layout`: (objects, name, key, listed
#: layout) -> the layout to use.
Recover = Callable[["Objects", str, str, Layout], Layout]


class Objects:
    """The objects of ``s3://bucket/prefix``, as requests (see the module docstring).

    Attributes shared with the other modules of the package: ``bucket``, ``prefix``,
    ``options``, ``client`` (the :class:`Client`) and ``s3`` (its boto3 client).

    ``recover``, when given, is called by :meth:`layout` for an object that is not whole
    and not deleted, with the layout listed, and returns the layout to use: the store hands
    in the write-ahead recovery (:func:`.append.recover_wal`) when it has a write-ahead
    directory.
    """

    def __init__(self, bucket: str, prefix: str, options: S3Options,
                 recover: Recover | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.options = options
        self.client = Client.get(options)
        self.s3 = self.client.s3
        self.recover = recover
        self._single: Objects | None = None

    def single_try(self) -> Objects:
        """The same objects through a client that sends each request at most twice (the
        second for a pooled connection the restarted server closed): during an outage,
        uploads are retried by the caller's backoff instead of the client's."""
        one = self._single
        if one is None:
            attempts = min(2, self.options.max_attempts)
            one = self._single = Objects(self.bucket, self.prefix,
                                         dataclasses.replace(self.options,
                                                             max_attempts=attempts),
                                         self.recover)
        return one

    # ---------------------------------------------------------------- names

    def key(self, name: str) -> str:
        """The key of object ``name``."""
        check_name(name)
        if PIECE in name or name.endswith(TOMB):
            raise LowdiffError(f"invalid object name {name!r} ('@p', '@gc' are reserved)",
                               reason=Reason.UNSAFE_NAME)
        return f"{self.prefix}/{name}" if self.prefix else name

    def path_of(self, name: str) -> str:
        """``s3://bucket/prefix/name``."""
        return f"s3://{self.bucket}/{self.key(name)}"

    def name_of(self, key: str) -> str:
        """The object name of a key under the prefix."""
        return key[len(self.prefix) + 1:] if self.prefix else key

    def missing(self, name: str) -> StorageError:
        """The error for an object that does not exist."""
        return StorageError("object does not exist", reason=Reason.MISSING_FILE,
                            path=self.path_of(name))

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The I/O pool, one per client (shared by every store of the process that uses the
        same settings: stores are opened often, pools must not pile up)."""
        return self.client.pool()

    # ---------------------------------------------------------------- listing

    def list_keys(self, key_prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every key starting with ``key_prefix`` (all pages)."""
        out: list[tuple[str, int]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key_prefix}
        with self.client.call("list", f"s3://{self.bucket}/{key_prefix}"):
            while True:
                r = self.s3.list_objects_v2(**kw)
                out.extend((o["Key"], int(o["Size"])) for o in r.get("Contents", ()))
                if not r.get("IsTruncated"):
                    break
                kw["ContinuationToken"] = r["NextContinuationToken"]
        return out

    def layout(self, name: str) -> Layout:
        """What backs object ``name`` (whole objects cached briefly, see
        :class:`~.keys.LayoutCache`), after ``recover``."""
        key = self.key(name)
        hit = WHOLE_CACHE.get(self.bucket, key)
        if hit is not None:
            return hit
        lay = layouts(self.list_keys(key), key).get(key, Layout(None, (), False))
        if self.recover is not None and lay.whole is None and not lay.tomb:
            lay = self.recover(self, name, key, lay)
        if lay.whole is not None and not lay.tomb and not lay.pieces:
            WHOLE_CACHE.put(self.bucket, key, lay)
        return lay

    # ---------------------------------------------------------------- reading

    def get(self, key: str, start: int | None, n: int | None, path: str) -> bytes:
        """Object ``key`` (``start``, ``n``: a ranged GET of exactly ``n`` bytes)."""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start is not None and n is not None:
            if n == 0:
                return b""
            kw["Range"] = f"bytes={start}-{start + n - 1}"
        with self.client.call("read", path):
            body: bytes = self.s3.get_object(**kw)["Body"].read()
        if n is not None and len(body) != n:
            raise FormatError(f"short read: {len(body)} of {n} bytes",
                              reason=Reason.TRUNCATED, path=path, offset=start)
        return body

    # ---------------------------------------------------------------- writing

    def upload(self, key: str, views: Sequence[memoryview], *, create: bool,
               path: str, one_put: bool = False, token: str | None = None) -> None:
        """Upload an object: one PUT, or (from ``MULTIPART_MIN_BYTES``, unless ``one_put``)
        a multipart upload. ``token``: the create's token (``object_store.md`` section 3);
        a caller that retries the same bytes later passes the same one, so that a first
        attempt which landed is recognised as its own."""
        WHOLE_CACHE.drop(self.bucket, key)
        total = sum(v.nbytes for v in views)
        if total >= MULTIPART_MIN_BYTES and not one_put:
            self.multipart(key, split(views, self.options.part_bytes), create=create,
                           path=path, token=token)
            return
        body = b"".join(views)
        token = token or uuid.uuid4().hex
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": body,
                              "Metadata": {TOKEN_META: token}}
        if create:
            kw["IfNoneMatch"] = "*"
        try:
            with self.client.call("create" if create else "publish", path):
                self.s3.put_object(**kw)
        except ObjectExists:
            if not (create and self.written_by(key, token)):
                raise
        finally:
            WHOLE_CACHE.drop(self.bucket, key)  # also after: a LIST may have raced the PUT

    def written_by(self, key: str, token: str) -> bool:
        """After a 412 on a create-only write: was the object created by this very write
        (a retry after a response lost on the network)?"""
        try:
            with self.client.call("check", f"s3://{self.bucket}/{key}"):
                h = self.s3.head_object(Bucket=self.bucket, Key=key)
        except StorageError:
            return False
        return bool(h.get("Metadata", {}).get(TOKEN_META) == token)

    def multipart(self, key: str, parts: Iterator[bytes], *, create: bool,
                  path: str, token: str | None = None) -> None:
        """A multipart upload with at most ``concurrency`` parts in flight (bounded memory:
        the iterator is pulled only as parts complete). ``token``: as for :meth:`upload`."""
        token = token or uuid.uuid4().hex
        WHOLE_CACHE.drop(self.bucket, key)
        with self.client.call("start upload", path):
            up = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                 Metadata={TOKEN_META: token})
        uid = up["UploadId"]
        done: dict[int, str] = {}
        ex = self.executor()

        def send(num: int, data: bytes) -> tuple[int, str]:
            with self.client.call(f"upload part {num}", path):
                r = self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=uid,
                                        PartNumber=num, Body=data)
            return num, str(r["ETag"])

        try:
            inflight: set[concurrent.futures.Future[tuple[int, str]]] = set()
            for num, data in enumerate(parts, 1):
                if len(inflight) >= self.options.concurrency:
                    finished, inflight = concurrent.futures.wait(
                        inflight, return_when=concurrent.futures.FIRST_COMPLETED)
                    for f in finished:
                        n, etag = f.result()
                        done[n] = etag
                inflight.add(ex.submit(send, num, data))
            for f in concurrent.futures.as_completed(inflight):
                n, etag = f.result()
                done[n] = etag
            if not done:  # an empty object: one empty part
                done[1] = send(1, b"")[1]
            kw: dict[str, Any] = {
                "Bucket": self.bucket, "Key": key, "UploadId": uid,
                "MultipartUpload": {"Parts": [{"PartNumber": n, "ETag": done[n]}
                                              for n in sorted(done)]}}
            if create:
                kw["IfNoneMatch"] = "*"
            try:
                with self.client.call("complete upload", path):
                    self.s3.complete_multipart_upload(**kw)
            except ObjectExists:
                if not (create and self.written_by(key, token)):
                    raise
            except StorageError as e:
                # NoSuchUpload after a retry: the first completion landed.
                if not self.written_by(key, token):
                    raise e from None
        except BaseException:
            with contextlib.suppress(Exception):
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            raise

    # ---------------------------------------------------------------- deleting

    def remove(self, name: str, lay: Layout) -> None:
        """Remove the object's pieces, its whole object, then its tombstone (last: while
        the tombstone exists the object stays hidden)."""
        key = self.key(name)
        WHOLE_CACHE.drop(self.bucket, key)
        keys = [piece_name(key, off) for off, _ in lay.pieces]
        if lay.whole is not None:
            keys.append(key)
        with self.client.call("delete", self.path_of(name)):
            self.delete_keys(keys)
            self.s3.delete_object(Bucket=self.bucket, Key=key + TOMB)

    def delete_keys(self, keys: Sequence[str]) -> None:
        """DeleteObjects, 1000 keys a request (raises on any key not deleted)."""
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            if len(batch) == 1:
                self.s3.delete_object(Bucket=self.bucket, Key=batch[0])
                continue
            r = self.s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in batch], "Quiet": True})
            errs = r.get("Errors") or []
            if errs:
                e = errs[0]
                raise StorageError(f"delete of {e.get('Key')} failed: {e.get('Code')} "
                                   f"{e.get('Message', '')}".rstrip(),
                                   path=f"s3://{self.bucket}/{e.get('Key')}")

    def clear_tomb(self, name: str) -> None:
        """Before reusing a deleted name: remove what its tombstone still hides."""
        lay = self.layout(name)
        if lay.tomb:
            self.remove(name, lay)

    def drop_pieces(self, name: str, lay: Layout) -> None:
        """Delete the pieces of ``lay`` (superseded by a whole object)."""
        key = self.key(name)
        with self.client.call("delete", self.path_of(name)):
            self.delete_keys([piece_name(key, off) for off, _ in lay.pieces])


def views_of(chunks: Sequence[Buffer]) -> list[memoryview]:
    """Byte views of ``chunks``, empty ones dropped."""
    # Converts first: a chunk that is not a buffer fails here, before any request is sent.
    out = []
    for c in chunks:
        v = memoryview(c)
        if v.ndim != 1 or v.format != "B":
            v = v.cast("B")
        if v.nbytes:
            out.append(v)
    return out


def split(views: Sequence[memoryview], part: int) -> Iterator[bytes]:
    """Consecutive ``part``-byte pieces of the concatenated views (the last may be short)."""
    buf = bytearray()
    for v in views:
        while v.nbytes:
            take = min(part - len(buf), v.nbytes)
            buf += v[:take]
            v = v[take:]
            if len(buf) == part:
                yield bytes(buf)
                buf = bytearray()
    if buf:
        yield bytes(buf)
