"""Whole-log checks (``verify``) and summaries (``inspect``), used by the CLI.

``verify_log`` reads every byte: the manifest, every segment header and record CRC, every
record's metadata, every index entry against the data, and every tensor of every base.
``inspect_log`` is cheap: it opens the log through its index and reads a sample of records.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .deep_check import check_base, check_record, check_streamed, located, log_schema
from .errors import CorruptRecordError, LowdiffError, Reason
from .format.constants import (
    BASE_NAME,
    BASE_RE,
    INDEX_NAME,
    INDEX_RE,
    MANIFEST_NAME,
    SEGMENT_NAME,
    SEGMENT_RE,
    SLICE_NAME,
    SLICE_RE,
)
from .format.dtypes import FLOAT_TAGS
from .log.index import load_index
from .log.manifest import load_manifest, manifest_moved
from .log.reader import BasePlan, LogReader, on_newest_manifest
from .log.reference import check_files, summary, table_of
from .log.segment import read_record_meta, read_segment_header, scan_segment
from .log.shards import (
    check_member,
    copied_logs,
    is_sharded,
    log_paths,
    read_shards_manifest,
)
from .log.streamed import StreamedBase
from .progress import ProgressFn
from .storage import Store
from .torchmeta import LogMeta


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_log`. ``ok`` when no problem was found."""

    path: str
    problems: list[LowdiffError] = field(default_factory=list)
    records: int = 0
    bases: int = 0
    #: streamed bases checked whole (every slice, spec section 7.2)
    streamed: int = 0
    bytes_checked: int = 0
    torn_tail_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (a torn tail left by a crash is not a problem)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"path": self.path, "ok": self.ok, "records": self.records, "bases": self.bases,
                "streamed": self.streamed, "bytes_checked": self.bytes_checked,
                "torn_tail_bytes": self.torn_tail_bytes,
                "problems": [p.to_dict() for p in self.problems], "notes": self.notes}


def _not_members(root: str) -> list[LowdiffError]:
    """The logs of a sharded checkpoint that are not their rank of it (what restore
    refuses: :func:`~lowdiff_store.log.shards.check_member`, and one log copied as several
    ranks: :func:`~lowdiff_store.log.shards.copied_logs`)."""
    try:
        layout = read_shards_manifest(root).get("layout", "replicated")
        paths = log_paths(root)
    except LowdiffError as e:
        return [e]
    out: list[LowdiffError] = []
    read: list[tuple[str, bytes]] = []
    for rank, log_dir in enumerate(paths):
        try:
            manifest = load_manifest(log_dir)
        except LowdiffError as e:
            out.append(e)
            continue
        read.append((log_dir, manifest.log_id))
        try:
            check_member(log_dir, manifest.meta.get("torch"), rank, len(paths), layout)
        except LowdiffError as e:
            out.append(e)
    return out + copied_logs([p for p, _ in read], [i for _, i in read])


def verify_log(path: str, *, progress: ProgressFn | None = None) -> VerifyReport:
    """Check every byte of the log in ``path`` (every shard of a sharded checkpoint);
    never raises for bad data (only reports)."""
    if is_sharded(path):
        rep = VerifyReport(path)
        try:
            paths = log_paths(path)
        except LowdiffError as e:
            rep.problems.append(e)
            return rep
        for p in paths:
            sub = _verify_one(p, progress)
            rep.problems += sub.problems
            rep.notes += [f"{os.path.basename(p)}: {n}" for n in sub.notes]
            rep.records += sub.records
            rep.bases += sub.bases
            rep.streamed += sub.streamed
            rep.bytes_checked += sub.bytes_checked
            rep.torn_tail_bytes += sub.torn_tail_bytes
        rep.problems += _not_members(path)
        return rep
    return _verify_one(path, progress)


def _verify_one(path: str, progress: ProgressFn | None) -> VerifyReport:
    """Verify one log; again on the newer manifest when files it found missing were
    deleted by a compaction that published it meanwhile (:func:`on_newest_manifest`)."""
    generation: list[int | None] = [None]

    def attempt() -> VerifyReport:
        rep, generation[0] = _verify_once(path, progress)
        return rep

    return on_newest_manifest(attempt, lambda: manifest_moved(path, generation[0]),
                              missing=lambda rep: any(p.reason is Reason.MISSING_FILE
                                                      for p in rep.problems))


def _verify_once(path: str, progress: ProgressFn | None) -> tuple[VerifyReport, int | None]:
    """One pass of :func:`verify_log` over one log; also the generation of the manifest it
    read (None if it could not open the log)."""
    rep = VerifyReport(path)
    try:
        reader = LogReader(path, strict=False, verify=True)
    except LowdiffError as e:
        rep.problems.append(e)
        return rep, None
    with reader:
        store = reader.store
        rep.problems.extend(reader.report.problems)
        man = reader.manifest
        try:
            schema = log_schema(path, reader.meta)
        except LowdiffError as e:
            rep.problems.append(e)
            schema = None
        segs = reader.segment_files()
        total = sum(size for _s, _p, size in segs) + sum(
            _size(store, BASE_NAME.format(b)) for b in reader.bases) + sum(
            _size(store, SLICE_NAME.format(s)) for s in man.slice_steps())
        done = 0
        # file -> offsets of the problems so far: a scan's finding already reported at the
        # open, or a record already reported, is one set lookup away (not a comparison
        # with every problem: issue 42)
        seen: dict[str | None, set[int | None]] = {}
        for p in rep.problems:
            seen.setdefault(p.path, set()).add(p.offset)
        for i, (sid, spath, size) in enumerate(segs):
            active = i == len(segs) - 1
            try:
                src = store.open(SEGMENT_NAME.format(sid), "pread")
            except LowdiffError:
                continue  # already reported at open (missing_file, not a regular file)
            try:
                try:
                    hdr = read_segment_header(src)
                except LowdiffError:
                    continue  # reported at open
                found: list[LowdiffError] = []
                res = scan_segment(src, hdr.header_len, active=active, reporter=found.append,
                                   known_end=_indexed_end(store, sid, hdr.log_id, src.size))
                rep.torn_tail_bytes += res.torn_tail_bytes
                for err in found:
                    at = seen.setdefault(err.path, set())
                    if err.offset not in at:
                        at.add(err.offset)
                        rep.problems.append(err)
                rep.records += len(res.records)
                for ref in res.records:
                    try:
                        _rh, meta, payload = read_record_meta(src, ref, verify=False)
                        check_record(meta, payload, schema, path=spath, offset=ref.offset,
                                     step=ref.step)
                    except LowdiffError as e:
                        rep.problems.append(located(e, spath, ref.offset))
                        seen.setdefault(e.path, set()).add(e.offset)
                _check_index(store, sid, hdr.log_id, src.size, res.records, active, rep,
                             seen.get(store.path_of(SEGMENT_NAME.format(sid)), set()))
            finally:
                src.close()
            done += size
            if progress:
                progress(done, total)
        for b in reader.bases:
            try:
                with reader.base(b) as bf:
                    bf.verify_all()
                    check_base(bf, schema)
                rep.bases += 1
            except LowdiffError as e:
                rep.problems.append(e)
            done += _size(store, BASE_NAME.format(b))
            if progress:
                progress(done, total)
        for c, slices in reader.streamed:
            done += _verify_streamed(reader, BasePlan(c, slices, streamed=True), schema, rep)
            if progress:
                progress(done, total)
        rep.bytes_checked = done
        _unreferenced(store, reader, rep)
        if not man.base_steps() and len(reader):
            # a crash before the first base was published leaves exactly this: nothing is
            # restorable yet, but nothing is corrupt either
            rep.notes.append("the log has diffs but no base yet: nothing is restorable "
                             "until a base is published")
    return rep, reader.manifest.generation


def _verify_streamed(reader: LogReader, plan: BasePlan, schema: LogMeta | None,
                     rep: VerifyReport) -> int:
    """Check the streamed base of ``plan`` (spec section 7.2): every slice file (each
    tensor's CRC), then, if they are sound, the slices as one base (each names this base,
    no tensor in two, the torch metadata as replay reads it) and every diff after the
    first slice up to the complete step. Returns the bytes of its slices."""
    nbytes = 0
    sound = True
    for s in plan.slices:
        nbytes += _size(reader.store, SLICE_NAME.format(s))
        try:
            with reader.slice_file(s) as f:
                f.verify_all()
        except LowdiffError as e:
            rep.problems.append(e)
            sound = False
    if sound:
        try:
            with StreamedBase(reader, plan) as sb:
                check_streamed(sb, schema, [reader.slice_path(s) for s in plan.slices])
            reader.chain_from(plan.complete)  # the diffs its replay starts with
            rep.streamed += 1
        except LowdiffError as e:
            rep.problems.append(e)
    return nbytes


def _unreferenced(store: Store, reader: LogReader, rep: VerifyReport) -> None:
    """A note for each log file the manifest does not name (garbage a crash or an
    unfinished streamed base left: removed by the next writer open)."""
    man = reader.manifest
    live = {INDEX_NAME.format(s) for s, _f in man.segments}
    live |= {SEGMENT_NAME.format(s) for s, _f in man.segments}
    live |= {BASE_NAME.format(b) for b in reader.bases}
    live |= {SLICE_NAME.format(s) for s in man.slice_steps()}
    for name in store.list():
        if (SEGMENT_RE.match(name) or INDEX_RE.match(name) or BASE_RE.match(name)
                or SLICE_RE.match(name)) and name not in live:
            rep.notes.append(f"{name}: not referenced by the manifest (removed by the "
                             "next writer open)")


def _size(store: Store, name: str) -> int:
    try:
        return store.size(name)
    except LowdiffError:
        return 0


def _indexed_end(store: Store, sid: int, log_id: bytes, size: int) -> int:
    ents = load_index(store, INDEX_NAME.format(sid), sid, log_id, size)
    if ents is None or not len(ents):
        return 0
    return int(ents["offset"][-1] + ents["length"][-1])


def _regular(store: Store, name: str) -> bool:
    """``name`` opens as a regular file (a FIFO or a device in its place is no crash
    artefact: a problem, wherever it is)."""
    try:
        store.open(name, "pread").close()
    except LowdiffError:
        return False
    return True


def _zeros_after(store: Store, name: str, offset: int) -> bool:
    """Whether an index holds only zero bytes from ``offset`` on (read in pieces)."""
    try:
        src = store.open(name, "pread")
    except LowdiffError:
        return False
    try:
        while offset < src.size:
            n = min(src.size - offset, 1 << 20)
            if bytes(src.read(offset, n)).count(0) != n:
                return False
            offset += n
        return True
    except LowdiffError:
        return False
    finally:
        src.close()


def _check_index(store: Store, sid: int, log_id: bytes, size: int, records: list[Any],
                 active: bool, rep: VerifyReport, damaged: set[int | None]) -> None:
    """Check segment ``sid``'s index against its ``records``; ``damaged``: the offsets in
    the segment of the problems found so far (records already reported)."""
    iname = INDEX_NAME.format(sid)
    ipath = store.path_of(iname)
    if not store.exists(iname):
        rep.notes.append(f"{iname}: missing (rebuilt by the next writer open)")
        return
    raw_size = _size(store, iname)
    ents = load_index(store, iname, sid, log_id, size)
    # The active segment's index is never fsynced (it is a cache, rebuilt by scanning): a
    # power cut may leave any part of it lost or torn. Only a sealed segment's index (synced
    # at the roll) is expected to be whole.
    problems: list[LowdiffError] = []
    if ents is None:
        problems.append(CorruptRecordError("index file header is invalid",
                                           reason=Reason.INDEX_STALE, path=ipath, offset=0))
    else:
        n_file = max(0, (raw_size - 64) // 32)
        if active and len(ents) < n_file and _zeros_after(store, iname, 64 + 32 * len(ents)):
            n_file = len(ents)  # the writer's reserve (zeros entries are written into)
        if len(ents) < n_file:
            problems.append(CorruptRecordError(
                f"index entry {len(ents)} is inconsistent", reason=Reason.INDEX_STALE,
                path=ipath, offset=64 + 32 * len(ents)))
    if active and problems and _regular(store, iname):
        rep.notes += [f"{iname}: {p.detail} (the active segment's index is a cache a crash "
                      "may leave damaged; rebuilt by the next writer open)" for p in problems]
        problems = []
    rep.problems += problems
    if ents is None:
        return
    by_offset = {r.offset: r for r in records}
    for k, e in enumerate(ents):
        off = int(e["offset"])
        rec = by_offset.get(off)
        if rec is None and off in damaged:
            continue  # the record itself is corrupt: already reported against the segment
        if rec is None or (int(e["step"]), int(e["length"])) != (rec.step, rec.length):
            err = CorruptRecordError(
                f"index entry {k} (step {int(e['step'])}) does not match the data",
                reason=Reason.INDEX_STALE, path=ipath, offset=64 + 32 * k)
            if active:
                rep.notes.append(f"{iname}: {err.detail} (active segment's index: rebuilt "
                                 "by the next writer open)")
            else:
                rep.problems.append(err)
            return
    if len(ents) < len(records) and not active:
        rep.notes.append(f"{iname}: {len(records) - len(ents)} records not "
                         "indexed (scanned on open)")


def inspect_log(path: str, *, sample: int = 256) -> dict[str, Any]:
    """A summary of the log: steps, bases, sizes, codecs, compression ratio, health.
    For a sharded checkpoint: one summary per shard under ``"shards"``, totals, and the
    job's durable step (the minimum over the shards)."""
    if is_sharded(path):
        body = read_shards_manifest(path)
        shards = [_inspect_one(p, sample) for p in log_paths(path)]
        durable = [s["durable_step"] for s in shards]
        wrong = _not_members(path)  # each log must be its rank of this checkpoint
        return {
            "path": path, "sharded": True, "world_size": body["world_size"],
            "layout": body.get("layout"), "shards": shards,
            "records": sum(s["records"] for s in shards),
            "bytes_on_disk": sum(s["bytes_on_disk"] for s in shards),
            "durable_step": None if None in durable else min(durable),
            "health": "ok" if not wrong and all(s["health"] == "ok" for s in shards)
            else "corrupt",
            "problems": [e.to_dict() for e in wrong],
        }
    return _inspect_one(path, sample)


def _inspect_one(path: str, sample: int) -> dict[str, Any]:
    with LogReader(path, strict=False) as r:
        store = r.store
        segs = r.segment_files()
        seg_bytes = sum(s for _i, _p, s in segs)
        base_bytes = sum(_size(store, BASE_NAME.format(b)) for b in r.bases)
        idx_bytes = sum(_size(store, INDEX_NAME.format(i)) for i, _p, _s in segs)
        rec_bytes = r.record_bytes
        codecs: dict[str, int] = {}
        kinds: dict[str, int] = {}
        dense = 0
        stored = 0
        steps = [int(s) for s in r.steps[-sample:]]
        problems = list(r.report.problems)
        for s in steps:
            try:
                rec = r.record(s)
            except LowdiffError as err:
                # what inspect reads, it judges as verify does: a record that fails its
                # checks makes the log corrupt, never "ok"
                if not any(p.path == err.path and p.offset == err.offset for p in problems):
                    problems.append(err)
                continue
            kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
            for e in rec.entries:
                key = e.codec + ("+zstd" if any(p.zstd is not None for p in e.parts) else "")
                codecs[key] = codecs.get(key, 0) + 1
                if e.dtype in FLOAT_TAGS:
                    dense += 4 * e.numel
            stored += rec.length
        schema = None
        try:
            schema = log_schema(path, r.meta)  # the torch metadata replay would refuse
        except LowdiffError as e:
            problems.append(e)
        refs = _references(r, problems)
        streamed = _streamed(r, problems)
        slice_bytes = sum(e["bytes"] for e in streamed)
        health = "ok" if not problems else "corrupt"
        return {
            "path": path,
            "sharded": False,
            "format_version": "1",
            "log_id": r.log_id.hex(),
            "records": len(r),
            "bases": list(r.bases),
            "first_step": r.first_step,
            "last_step": r.last_step,
            "durable_step": r.durable_step,
            "segments": len(segs),
            "streamed": streamed,
            "bytes_on_disk": seg_bytes + base_bytes + slice_bytes + idx_bytes
            + _size(store, MANIFEST_NAME),
            "segment_bytes": seg_bytes,
            "base_bytes": base_bytes,
            "slice_bytes": slice_bytes,
            "index_bytes": idx_bytes,
            "bytes_per_step": (rec_bytes / len(r)) if len(r) else 0.0,
            "codecs": codecs,
            "kinds": kinds,
            "ratio_to_dense_fp32": (stored / dense) if dense else None,
            "health": health,
            "torn_tail_bytes": r.report.torn_tail_bytes,
            "problems": [p.to_dict() for p in problems],
            "meta": _jsonable(r.meta),
            "references": refs,
            "base_slices": None if schema is None or schema.base_slices is None
            else schema.base_slices.as_dict(),
        }


def _references(r: LogReader, problems: list[LowdiffError]) -> dict[str, Any]:
    """{base step: summary} of the reference bases; an external checkpoint missing or
    resized since the log started is a problem (its contents are ``verify``'s)."""
    out: dict[str, Any] = {}
    for b in r.bases:
        try:
            bf = r.base_file(b)
        except LowdiffError:
            continue  # the base file itself: verify's to judge, inspect reads no base
        try:
            ref = table_of(bf)
            if ref is not None:
                out[str(b)] = summary(ref)
                check_files(ref, contents=False)
        except LowdiffError as e:
            problems.append(e)
        finally:
            bf.close()
    return out


def _streamed(r: LogReader, problems: list[LowdiffError]) -> list[dict[str, Any]]:
    """The streamed bases (spec section 7.2): each one's complete step, slice steps and
    the bytes of its slice files; a slice file that is missing is a problem (what the
    slices hold is ``verify``'s to read)."""
    out = []
    for c, slices in r.streamed:
        nbytes = 0
        for s in slices:
            name = SLICE_NAME.format(s)
            if r.store.exists(name):
                nbytes += _size(r.store, name)
            else:
                problems.append(LowdiffError("slice named by the manifest is missing",
                                             reason=Reason.MISSING_FILE,
                                             path=r.slice_path(s)))
        out.append({"complete": c, "slices": list(slices), "bytes": nbytes})
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bytes):
        return x.hex()
    return x


__all__ = ["VerifyReport", "inspect_log", "verify_log"]
