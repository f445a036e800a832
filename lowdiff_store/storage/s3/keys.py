"""Keys and layouts of the objects of an ``s3://`` store (``format_spec/object_store.md``):
the names and bodies of pieces, tombstones and locks, ``s3://`` URLs, and :func:`layouts`,
which groups listed keys into logical objects (whole, pieces, deleted). Pure: no request is
sent from here.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack

from ...errors import LowdiffError, Reason
from ..base import check_name
from .client import WHOLE_CACHE_S

#: Suffix of a piece (``KEY@p<offset>``) and of a tombstone (``KEY@gc``).
PIECE = "@p"
TOMB = "@gc"
PIECE_RE = re.compile(r"@p(\d{20})$")
#: Suffix of a conditional-write probe (``KEY@probe<32 hex>``, ``object_store.md``
#: section 8): short-lived, never part of any object.
PROBE = "@probe"
#: User metadata key of the random token every create carries (``x-amz-meta-lowdiff-token``).
TOKEN_META = "lowdiff-token"


def piece_name(name: str, offset: int) -> str:
    """The name of the piece of object ``name`` holding its bytes from ``offset``
    (``NAME@p<offset, 20 digits>``, ``format_spec/object_store.md``)."""
    return f"{name}{PIECE}{offset:020d}"


def tombstone_bytes(deadline: float) -> bytes:
    """The body of a tombstone ``NAME@gc``: msgpack ``{"deadline": <unix seconds>}``."""
    out: bytes = msgpack.packb({"deadline": float(deadline)})
    return out


def lock_bytes(owner: dict[str, Any]) -> bytes:
    """The body of a lock object: msgpack of its holder (``host``, ``pid``, ``id``,
    ``time``, ``ttl``)."""
    out: bytes = msgpack.packb(owner)
    return out


def is_s3_url(location: str) -> bool:
    """True for ``s3://...`` locations."""
    return location[:5].lower() == "s3://"


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")`` (prefix without slashes at its ends)."""
    if not is_s3_url(url):
        raise LowdiffError(f"not an s3:// URL: {url!r}", reason=Reason.INVALID_ARGUMENT)
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise LowdiffError("s3:// URL without a bucket", reason=Reason.INVALID_ARGUMENT,
                           path=url)
    prefix = prefix.strip("/")
    if prefix:
        check_name(prefix)
    return bucket, prefix


@dataclass(frozen=True)
class Layout:
    """What backs a logical object: a whole object, pieces, or nothing."""

    whole: int | None                   # size of KEY, if it exists
    pieces: tuple[tuple[int, int], ...]  # (offset, size) of KEY@p<offset>, contiguous
    tomb: bool                          # deleted, within its grace period

    @property
    def exists(self) -> bool:
        return (self.whole is not None or bool(self.pieces)) and not self.tomb

    @property
    def size(self) -> int:
        if self.whole is not None:
            return self.whole
        return self.pieces[-1][0] + self.pieces[-1][1] if self.pieces else 0


class LayoutCache:
    """Recently listed whole objects, process-wide, for ``WHOLE_CACHE_S`` seconds.

    Whole objects of a log are immutable (sealed segments, bases, manifest versions), so a
    cached size is at worst an object deleted meanwhile, which stays readable for the grace
    period. Only positive results of whole objects are cached (never a missing object, never
    an object that is still growing as pieces); this process's own writes and deletes drop
    their entry. It saves the LIST that ``size`` and ``open`` would each send when the log
    asks both about the same object.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._d: OrderedDict[tuple[str, str], tuple[float, Layout]] = OrderedDict()

    def get(self, bucket: str, key: str) -> Layout | None:
        with self._lock:
            e = self._d.get((bucket, key))
            if e is None:
                return None
            if time.monotonic() - e[0] > WHOLE_CACHE_S:
                del self._d[(bucket, key)]
                return None
            return e[1]

    def put(self, bucket: str, key: str, lay: Layout) -> None:
        with self._lock:
            self._d[(bucket, key)] = (time.monotonic(), lay)
            while len(self._d) > 4096:
                self._d.popitem(last=False)

    def drop(self, bucket: str, key: str) -> None:
        with self._lock:
            self._d.pop((bucket, key), None)


#: The process's one cache (every store of every bucket shares it).
WHOLE_CACHE = LayoutCache()


def layouts(keys: list[tuple[str, int]], only: str | None, *, tombs_only: bool = False
            ) -> dict[str, Layout]:
    """Group listed keys into logical objects (``only``: just that key; ``tombs_only``:
    just the deleted ones, including a tombstone left alone by a crash in a removal)."""
    whole: dict[str, int] = {}
    pieces: dict[str, list[tuple[int, int]]] = {}
    tombs: set[str] = set()
    for k, size in keys:
        m = PIECE_RE.search(k)
        if m is not None:
            base = k[:m.start()]
            pieces.setdefault(base, []).append((int(m.group(1)), size))
        elif k.endswith(TOMB):
            tombs.add(k[:-len(TOMB)])
        elif PROBE in k:
            continue  # a writer's probe (or one a crash left): no object's
        else:
            whole[k] = size
    out: dict[str, Layout] = {}
    for k in set(whole) | set(pieces):
        if only is not None and k != only:
            continue
        ps = sorted(pieces.get(k, []))
        # Keep the contiguous run from offset 0 (a crash in a truncate may leave a piece
        # beyond a gap: it holds no byte of the object).
        run: list[tuple[int, int]] = []
        for off, size in ps:
            if off != (run[-1][0] + run[-1][1] if run else 0):
                break
            run.append((off, size))
        out[k] = Layout(whole.get(k), tuple(run), k in tombs)
    if only is not None and only in tombs and only not in out:
        out[only] = Layout(None, (), True)
    if tombs_only:
        return {k: out.get(k, Layout(None, (), True)) for k in tombs}
    return out
