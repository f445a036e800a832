"""``lowdiff-store report`` as a person would read it: the page of golden logs of several
kinds (a DeMo gradient log, FSDP2 and 2-rank ZeRO checkpoints), of a local-update
checkpoint and of broken logs (corrupt middle record, torn tail, missing manifest, not a
log at all), checked on its text, its numbers and its embedded images; the CLI's exit
codes; the series behind the plots; and the bounds that keep a long log fast."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.cli import main
from lowdiff_store.log.shards import write_shards_manifest
from lowdiff_store.report import facts as facts_mod
from lowdiff_store.report import html as html_mod
from lowdiff_store.report import report_log
from lowdiff_store.report import series as series_mod
from lowdiff_store.report.series import binned, recovery_curve

GOLDEN = Path(__file__).resolve().parent / "golden" / "logs"


def golden(name: str, tmp_path: Path) -> Path:
    """A private copy of a golden log (the report only reads, but a test may damage it)."""
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst)
    return dst


def pngs(page: str) -> list[tuple[int, int, bytes]]:
    """(width, height, bytes) of every embedded PNG, each checked to decode: signature,
    IHDR, and every chunk's CRC."""
    import base64

    out = []
    for b64 in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page):
        data = base64.b64decode(b64)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pos = 8
        while pos < len(data):
            (n,) = struct.unpack(">I", data[pos:pos + 4])
            kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
            (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
            assert zlib.crc32(kind + body) == crc, kind
            pos += 12 + n
        w, h = struct.unpack(">II", data[16:24])
        out.append((w, h, data))
    return out


def cells(page: str) -> list[str]:
    """Every table cell's text, in order."""
    return [html.unescape(re.sub(r"<[^>]+>", "", c))
            for c in re.findall(r"<td[^>]*>(.*?)</td>", page, re.S)]


def self_contained(page: str) -> None:
    for bad in ("<script", "<link", "http://", "https://", "@import", "url("):
        assert bad not in page, bad


# ---------------------------------------------------------------- golden logs


def test_page_of_a_gradient_log_shows_its_numbers(tmp_path: Path) -> None:
    log = golden("grad_demo", tmp_path)
    out = tmp_path / "page.html"
    rep = report_log(log, out)
    page = out.read_text()
    self_contained(page)
    for title in ("Health", "Timeline", "Bases", "Tuner decisions", "Compactions", "Recovery",
                  "Bytes by tensor and by codec", "By codec", "Metadata", "Measured costs"):
        assert f">{title}</h" in page, title
    assert "No problem found." in page
    assert "Checked as <code>lowdiff-store verify" in page
    with LogReader(log) as r:
        records, bases, durable = len(r), list(r.bases), r.durable_step
        rbytes = r.record_bytes
    assert rep.health == "ok"
    assert rep.durable_step == durable == 7
    assert records == 7
    assert bases == [0, 4]
    c = cells(page)
    # the bases table: each base's step and its file's size
    for b in bases:
        size = (log / f"base-{b:016d}.safetensors").stat().st_size
        assert html_mod.human_bytes(size) in c
    # the metadata the log recorded
    for v in ("grad", "lowdiff_store.torch.compressors.demo.DeMo", "4", "2", "sign",
              "torch.optim.lr_scheduler.StepLR", "raw, sign"):
        assert v in c, v
    assert any(x.startswith("demo(") and "error feedback (step)" in x for x in c)
    # the recovery table: the tooth's top before and after base 4
    i = c.index("3")
    assert c[i - 1] == "log"
    assert c[i + 1] == "0"
    assert c[i + 2] == "3"
    # bytes per step on the card: every record's bytes over the records
    assert f">{html_mod.human_bytes(rbytes / records)}<" in page
    images = pngs(page)
    assert len(images) == 3  # timeline, recovery, bytes by tensor
    for w, h, _d in images:
        assert 500 <= w <= 1200
        assert 150 <= h <= 800


CASES = json.loads((GOLDEN.parent / "expected.json").read_text())["cases"]


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c["kind"] != "s3"))
def test_every_golden_log_gets_its_page(tmp_path: Path, name: str) -> None:
    """Every kind of log the project writes (gradient, delta, DDP, ZeRO, FSDP2, background
    bases): the page's numbers are inspect's (expected.json)."""
    want = CASES[name]["inspect"]
    rep = facts_mod.collect(GOLDEN / name, full_check="never")
    page = html_mod.render(rep, with_plots=False)
    assert rep.health == "ok", rep.all_problems()
    assert rep.durable_step == want["durable_step"]
    if "bases" in want:
        assert [b.step for b in rep.logs[0].bases] == want["bases"]
    if "world_size" in want:
        assert rep.world_size == want["world_size"] == len(rep.logs)
        assert len(_rank_rows(page)) == want["world_size"]
    c = cells(page)
    assert want["mode"] in c
    # the optimizer under the name it has now (earlier names are mapped)
    assert any(x.rsplit(".", 1)[-1] == want["optimizer"].rsplit(".", 1)[-1] for x in c)
    assert f"durable step</div><div class=\"v\">{want['durable_step']}<" in page


def test_recovery_numbers_are_base_plus_diffs(tmp_path: Path) -> None:
    log = golden("grad_topk", tmp_path)
    rep = facts_mod.collect(log)
    f = rep.logs[0]
    curve = recovery_curve(f.steps, f.lengths, [(b.step, b.bytes) for b in f.bases])
    with LogReader(log) as r:
        for step in (int(s) for s in curve.steps):
            b, diffs = r.chain(step)
            want = (log / f"base-{b:016d}.safetensors").stat().st_size + sum(
                r.record_location(t)[2] for t in diffs)
            i = int(np.searchsorted(curve.steps, step))
            assert curve.bytes_read[i] == want
            assert curve.replayed[i] == len(diffs)


def test_fsdp2_checkpoint_shows_every_rank(tmp_path: Path) -> None:
    root = golden("fsdp2", tmp_path)
    out = tmp_path / "fsdp2.html"
    rep = report_log(root, out)
    page = out.read_text()
    assert rep.sharded
    assert rep.world_size == 2
    assert rep.layout == "fsdp"
    assert "sharded checkpoint, 2 ranks (fsdp)" in page
    assert ">Ranks</h2>" in page
    assert "device mesh" in page
    rows = _rank_rows(page)
    assert [r[0] for r in rows] == ["rank 0", "rank 1"]
    for rank, row in enumerate(rows):
        with LogReader(root / f"rank-{rank:05d}") as r:
            assert row[2] == str(r.durable_step) == "7"
            assert row[4] == str(len(r)) == "7"
            assert row[5] == ", ".join(map(str, r.bases))
    assert len(pngs(page)) == 4  # + the per-rank bars


def _rank_rows(page: str) -> list[list[str]]:
    sec = page[page.index('id="ranks"'):page.index('id="metadata"')]
    rows = re.findall(r"<tr>(.*?)</tr>", sec, re.S)[1:]
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in rows]


def test_zero_checkpoint_bytes_by_tensor_largest_first(tmp_path: Path) -> None:
    root = golden("zero_topk_allgather", tmp_path)
    rep = facts_mod.collect(root)
    page = html_mod.render(rep)
    sec = page[page.index("<h3>By tensor"):page.index("</table>", page.index("<h3>By tensor"))]
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td[^>]*>(.*?)</td>", sec)
    per = {k: 0 for k, *_r in rows}
    for f in rep.logs:
        for k, v in f.by_tensor.items():
            if k in per:
                per[k] += v
    sizes = [per[k] for k, *_r in rows]
    assert sizes == sorted(sizes, reverse=True)
    assert len(sizes) >= 5
    assert any(codec == "sparse" for _k, codec, _b in rows)
    assert rep.layout == "zero"
    assert [f.durable_step for f in rep.logs] == [7, 7]


# ---------------------------------------------------------------- local-update checkpoint


def write_local_checkpoint(root: Path, steps: list[int], syncs: set[int]) -> None:
    """A 2-rank local-update checkpoint (layout ``local``) written with the core writer:
    each rank logs its own replica, and a synchronization step carries ``@sync/w``."""
    write_shards_manifest(root, 2, layout="local")
    for rank, last in enumerate(steps):
        state = np.full(8, rank, np.float32)
        with LogWriter(root / f"rank-{rank:05d}") as w:
            w.write_base(0, {"w": ("F32", state)})
            for t in range(1, last + 1):
                ts = [tensor_input("@grad/w", np.full(8, t + rank, np.float32), "F32")]
                if t in syncs:
                    ts.append(tensor_input("@sync/w", np.full(8, t, np.float32), "F32"))
                w.append(t, ts, kind="grad")
                if t % 5 == 0:
                    w.sync()
                    w.write_base(t, {"w": ("F32", state + t)})
            w.sync()


def test_local_update_checkpoint_per_rank(tmp_path: Path) -> None:
    root = tmp_path / "local"
    write_local_checkpoint(root, [12, 9], {4, 8, 12})
    out = tmp_path / "local.html"
    rep = report_log(root, out)
    page = out.read_text()
    assert rep.layout == "local"
    assert rep.durable_step == 9
    assert "the checkpoint restores to the newest step durable on every rank: <b>9</b>" in page
    rows = _rank_rows(page)
    assert [(r[0], r[2], r[3], r[4], r[5], r[8]) for r in rows] == [
        ("rank 0", "12", "12", "12", "0, 5, 10", "3"),
        ("rank 1", "9", "9", "9", "0, 5", "2")]
    assert [f.syncs for f in rep.logs] == [[4, 8, 12], [4, 8]]
    assert "not the torch checkpointer" in page


# ---------------------------------------------------------------- broken logs


def test_corrupt_middle_record_named_with_file_and_offset(tmp_path: Path) -> None:
    log = golden("grad_demo", tmp_path)
    seg = log / "seg-0000000000000000.ldlog"
    with LogReader(log) as r:
        _p, off, length = r.record_location(2)
    raw = bytearray(seg.read_bytes())
    raw[off + length - 8] ^= 0xFF
    seg.write_bytes(bytes(raw))
    out = tmp_path / "bad.html"
    rep = report_log(log, out)
    page = out.read_text()
    assert rep.health == "corrupt"
    probs = rep.all_problems()
    assert any(p["path"] == str(seg) and p["offset"] == off for p in probs), probs
    assert f"{seg}" in page
    assert f">{off:,}<" in page
    assert "checksum_mismatch" in page
    assert "from a sample of the records" not in page  # a bad record is no sample
    # no restore goes through step 2's record: steps 2 and 3 are cut off until base 4
    f = rep.logs[0]
    assert f.damaged_steps == [2]
    curve = html_mod.Page(rep).curves[0]
    assert curve.steps.tolist() == [0, 1, 4, 5, 6, 7]
    assert "the records of step(s) 2 are damaged" in page
    assert "problem(s) found" in page
    assert 'class="badge corrupt"' in page
    assert len(pngs(page)) == 3  # the rest of the page is still drawn


def test_cli_exit_codes_and_problem_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    log = golden("grad_demo", tmp_path)
    out = tmp_path / "a.html"
    assert main(["report", str(log), "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out == ""
    assert f"report written to {out} (health ok)" in cap.err
    assert main(["report", str(log), "-o", str(out), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["health"] == "ok"
    assert js["durable_step"] == 7
    assert js["records"] == 7
    assert js["output"] == str(out)
    assert js["logs"][0]["bases"] == [0, 4]
    seg = log / "seg-0000000000000000.ldlog"
    raw = bytearray(seg.read_bytes())
    raw[200] ^= 0x55
    seg.write_bytes(bytes(raw))
    assert main(["report", str(log), "-o", str(out)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines
    assert all(ln.startswith(f"{seg}:") for ln in lines)
    assert "corrupt" in out.read_text()


def test_page_that_cannot_be_written_is_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    log = golden("grad_demo", tmp_path)
    out = tmp_path / "no" / "such" / "dir" / "x.html"
    assert main(["report", str(log), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("lowdiff-store: error: ")
    assert "x.html" in err[0]
    assert not out.parent.exists()


def test_progress_counts_up_to_its_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    facts_mod.collect(golden("fsdp2", tmp_path), progress=lambda d, t: calls.append((d, t)))
    assert calls[:2] == [(1, 2), (2, 2)]  # the two ranks read, then verify's bytes
    assert len(calls) > 2
    done = [d for d, _t in calls]
    assert done == sorted(done)
    assert calls[-1][0] == calls[-1][1]


def test_torn_tail_is_not_a_problem(tmp_path: Path) -> None:
    log = golden("grad_demo", tmp_path)
    with open(log / "seg-0000000000000000.ldlog", "ab") as fh:
        fh.write(b"LDREC\x00\x01" + bytes(50))
    out = tmp_path / "torn.html"
    rep = report_log(log, out)
    page = out.read_text()
    assert rep.health == "ok"
    assert rep.logs[0].torn_tail_bytes == 57
    assert "a torn tail of 57 bytes" in page
    assert "ok (torn tail)" in page


@pytest.mark.parametrize("damage", ["no_manifest", "empty_dir", "missing", "a_file",
                                    "garbage_manifest"])
def test_not_a_log_gets_a_page_and_exit_1(tmp_path: Path, damage: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    log = golden("grad_demo", tmp_path)
    if damage == "no_manifest":
        (log / "MANIFEST").unlink()
    elif damage == "empty_dir":
        log = tmp_path / "empty"
        log.mkdir()
    elif damage == "missing":
        log = tmp_path / "nowhere"
    elif damage == "a_file":
        log = tmp_path / "file.bin"
        log.write_bytes(b"hello")
    else:
        (log / "MANIFEST").write_bytes(b"\x00" * 40)
    out = tmp_path / "x.html"
    assert main(["report", str(log), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lowdiff-store: error: ")
    assert "Traceback" not in "".join(err)
    page = out.read_text()
    assert "Not readable as a lowdiff-store log." in page
    reason = re.search(r"error: \S+: (\w+):", err[-1])
    assert reason is not None
    assert reason.group(1) in page
    assert str(log) in page
    assert 'class="badge unreadable"' in page


def test_a_missing_rank_is_a_problem_of_that_rank(tmp_path: Path) -> None:
    root = golden("fsdp2", tmp_path)
    (root / "rank-00001" / "MANIFEST").unlink()
    rep = report_log(root, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert rep.health == "unreadable"
    assert rep.error is None
    assert rep.logs[0].health == "ok"
    assert rep.logs[1].health == "unreadable"
    assert "not_a_log" in page
    assert "rank-00001" in page
    assert [r[1] for r in _rank_rows(page)] == ["ok", "unreadable"]


# ---------------------------------------------------------------- without matplotlib


def test_without_matplotlib_tables_and_a_note(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    log = golden("grad_demo", tmp_path)
    out = tmp_path / "plain.html"
    report_log(log, out)
    page = out.read_text()
    assert pngs(page) == []
    assert "plots need the report extra" in page
    assert "lowdiff-store[report]" in page
    assert ">Recovery</h2>" in page
    assert "Worst case per base interval" in page


# ---------------------------------------------------------------- series and bounds


def test_recovery_curve_saw_tooth() -> None:
    steps = np.array([1, 2, 3, 4, 5, 6, 8], np.int64)  # step 7 lost: 8 unreachable
    lengths = np.array([10, 20, 30, 40, 50, 60, 80], np.int64)
    c = recovery_curve(steps, lengths, [(0, 1000), (4, 2000)], replay_cost=0.5,
                       base_load_time=2.0)
    assert c.steps.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert c.bytes_read.tolist() == [1000, 1010, 1030, 1060, 2000, 2050, 2110]
    assert c.replayed.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert c.seconds is not None
    assert c.seconds.tolist() == [2, 2.5, 3, 3.5, 2, 2.5, 3]
    assert len(recovery_curve(steps, lengths, [])) == 0


def test_binned_keeps_min_mean_max() -> None:
    x = np.arange(10_000, dtype=np.int64)
    y = (x % 10).astype(np.int64)
    b = binned(x, y, max_points=100)
    assert b.width == 100
    assert len(b.x) == 100
    assert b.x[1] == 100
    assert b.lo.tolist() == [0] * 100
    assert b.hi.tolist() == [9] * 100
    assert np.allclose(b.mean, 4.5)
    exact = binned(x[:50], y[:50], max_points=100)
    assert exact.width == 1
    assert exact.mean.tolist() == y[:50].tolist()


def test_long_log_is_sampled_and_aggregated_and_says_so(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    log = tmp_path / "long"
    with LogWriter(log) as w:
        w.write_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        for t in range(1, 601):
            w.append(t, [tensor_input("w", np.full(4 + t % 3, t, np.float32), "F32")],
                     kind="grad", extra={"tuning": {"step": t, "snapshot_every": 9,
                                                    "previous_snapshot_every": 8, "batch": 1,
                                                    "previous_batch": 1, "reason": "model",
                                                    "predicted_waste_before": 0.02,
                                                    "predicted_waste_after": 0.01}}
                     if t == 300 else None)
            if t % 100 == 0:
                w.sync()
                w.write_base(t, {"w": ("F32", np.zeros(4, np.float32))})
        w.sync()
    monkeypatch.setattr(facts_mod, "META_READ_ALL", 50)
    monkeypatch.setattr(facts_mod, "META_SAMPLE", 41)
    monkeypatch.setattr(facts_mod, "FULL_CHECK_RECORDS", 100)
    monkeypatch.setattr(series_mod, "MAX_POINTS", 60)
    rep = report_log(log, tmp_path / "long.html")
    page = (tmp_path / "long.html").read_text()
    f = rep.logs[0]
    assert f.records == 600
    assert f.meta_read == 41
    assert not rep.full_check
    assert "Aggregated: 10 consecutive steps per point" in page
    assert "an even sample of the log" in page
    assert "run <code>lowdiff-store verify" in page
    # the decision at step 300 is in the sample (index 299 of np.linspace(0, 599, 41))
    assert [d.step for d in f.decisions] == [300]
    assert "8 → 9" in cells(page)


@pytest.mark.parametrize("check", ["always", "never"])
def test_torch_metadata_that_does_not_parse_is_one_problem(tmp_path: Path, check: str
                                                           ) -> None:
    log = tmp_path / "log"
    with LogWriter(log, meta={"torch": {"schema": 1, "mode": "sideways"}}) as w:
        w.write_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        w.append(1, [tensor_input("w", np.ones(4, np.float32), "F32")], kind="grad")
        w.sync()
    rep = facts_mod.collect(log, full_check=check)  # type: ignore[arg-type]
    page = html_mod.render(rep, with_plots=False)
    bad = [p for p in rep.all_problems() if p["reason"] == "bad_metadata"]
    assert len(bad) == 1, bad
    assert bad[0]["path"].endswith("MANIFEST")
    assert rep.health == "corrupt"
    assert "bad_metadata" in page
    assert "its metadata does not parse (see Health)" in page  # the rest still renders


@pytest.mark.parametrize("seed", range(12))
def test_damaged_files_never_raise(tmp_path: Path, seed: int) -> None:
    """A bit flip or a cut anywhere (segment, index, base, manifest, SHARDS) gives a page
    whose health matches what it lists, never an exception."""
    import random

    rnd = random.Random(seed)
    name = rnd.choice(["grad_demo", "fsdp2", "zero_topk_allgather", "delta_q8"])
    root = golden(name, tmp_path)
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and p.name not in ("LOCK", "MANIFEST.lock"))
    f = rnd.choice(files)
    raw = bytearray(f.read_bytes())
    if rnd.random() < 0.5:
        for _ in range(rnd.randint(1, 4)):
            raw[rnd.randrange(len(raw))] ^= 1 << rnd.randrange(8)
    else:
        raw = raw[:rnd.randrange(len(raw))]
    f.write_bytes(bytes(raw))
    rep = report_log(root, tmp_path / "p.html", plots=False)
    page = (tmp_path / "p.html").read_text()
    assert page.rstrip().endswith("</html>")
    assert f'class="badge {rep.health}"' in page or "ok (torn tail)" in page
    if rep.health == "corrupt":
        assert rep.all_problems()
        assert "problem(s) found" in page
    elif rep.health == "unreadable":
        assert rep.error is not None or any(g.health == "unreadable" for g in rep.logs)
    else:
        assert not rep.all_problems()
