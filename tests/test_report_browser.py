"""The report page as a person sees it, in a real browser: headless Chromium (Debian's
``chromium``) renders the pages of a gradient log, a sharded FSDP2 checkpoint, a
local-update checkpoint and a corrupted log, whole (the window as tall as the page).

- Not blank: the screenshot has the page's size, its dark header band and thousands of
  colours.
- The plots are drawn: every plot the report embedded has loaded (its natural size is the
  PNG's), the screenshot at its place on the page is that PNG (scaled as the page
  scales it), and the plot's lines or bars (the palette's first colours) are on screen.
- The numbers are on the page: the cards' text, as rendered, is the report's own figures
  (durable step, records, bytes on disk... from ``Report.summary()``), drawn in dark
  pixels (a font rendered them); each problem's row (file, offset, reason, detail) and each
  rank's row (health, durable and last step, records, bases) are lines of the rendered text.

One Chromium serves the whole module, driven over the DevTools protocol on a pipe (a
launch costs about what a page does). Where no chromium binary is installed the page test
is skipped with the reason, except under CI (env ``CI`` set): `.ci/run` installs chromium,
so there a missing one fails."""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store.progress import human_bytes
from lowdiff_store.report import Report, report_log
from lowdiff_store.report.plots import PALETTE
from tests.helpers.timing import scaled
from tests.test_report import golden, pngs, write_local_checkpoint

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                       "google-chrome")) if p), None)
NO_CHROMIUM = "no chromium binary on PATH (Debian: apt-get install chromium)"
PIL = pytest.importorskip("PIL.Image", reason="Pillow (a matplotlib dependency) decodes "
                          "the screenshot")
WIDTH = 1280
#: The plots' data colours (the first two of lowdiff_store/report/plots.py PALETTE: the
#: single log or rank 0, rank 1), as RGB.
DATA_COLOURS = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in PALETTE[:2]]


def in_ci(env: Mapping[str, str]) -> bool:
    """``CI`` is set to something other than empty, ``0`` or ``false``."""
    return env.get("CI", "").strip().lower() not in ("", "0", "false")


def require_chromium(path: str | None, env: Mapping[str, str]) -> str:
    """The chromium binary to drive. Without one the page test is skipped, with the reason;
    under CI it fails: CI installs chromium (`.ci/run`) and must not skip what it runs."""
    if path is None:
        if in_ci(env):
            pytest.fail(f"{NO_CHROMIUM}; CI={env['CI']!r} is set, and CI must run this test "
                        "(.ci/run installs chromium)", pytrace=False)
        pytest.skip(NO_CHROMIUM)
    return path


class Browser:
    """One headless Chromium driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: the browser reads commands on its fd 3 and writes replies
    and events on its fd 4, each message a JSON object ended by a NUL byte)."""

    #: What the test reads of a rendered page: its height, its text as rendered
    #: (``innerText``: text-transform applied, hidden elements left out, table cells
    #: tab-separated), the cards, the plots (load state, natural size, place) and the
    #: problem boxes; places in CSS pixels from the top left of the page.
    SEEN = """(() => {
      const box = e => { const r = e.getBoundingClientRect();
                         return [r.left + scrollX, r.top + scrollY, r.width, r.height]; };
      return {
        height: document.documentElement.scrollHeight,
        text: document.body.innerText,
        cards: [...document.querySelectorAll('#summary .card')].map(c =>
                 [c.querySelector('.k').textContent, c.querySelector('.v').innerText,
                  box(c.querySelector('.v'))]),
        plots: [...document.images].map(i => ({alt: i.alt, complete: i.complete,
                 natural: [i.naturalWidth, i.naturalHeight], box: box(i)})),
        problems: [...document.querySelectorAll('.problem')].map(box),
      };
    })()"""

    def __init__(self, binary: str, profile: Path) -> None:
        cmd_r, self._cmd = os.pipe()
        self._events, events_w = os.pipe()
        # chromium reads and writes the fixed fds 3 and 4: bash puts the pipe ends there
        # (no preexec_fn: an xdist worker has threads); moved to 10 and up first, so that
        # neither redirection overwrites the other end
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, events_w)]
        for fd in (cmd_r, events_w):
            os.close(fd)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                "--remote-debugging-pipe", "about:blank"]
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{ends[0]} 4>&{ends[1]} {ends[0]}<&- {ends[1]}>&-',
             binary, *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=ends)
        for fd in ends:
            os.close(fd)
        self._buf = b""
        self._id = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.call("Target.attachToTarget",
                                  {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: bool = False) -> dict[str, Any]:
        """Send one command (to the page's session if ``session``) and return its result."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self._session
        os.write(self._cmd, json.dumps(msg).encode() + b"\0")
        reply = self._next(lambda m: m.get("id") == self._id, method)
        assert "error" not in reply, (method, reply["error"])
        return dict(reply["result"])

    def _next(self, wanted: Any, what: str) -> dict[str, Any]:
        """The next message ``wanted`` accepts (the others are dropped); a deadline bounds a
        hung browser, and a dead one fails with its stderr."""
        deadline = time.monotonic() + scaled(120)
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                if wanted(msg):
                    return dict(msg)
            left = deadline - time.monotonic()
            assert left > 0, f"chromium: no reply to {what} in {scaled(120):.0f} s"
            if select.select([self._events], [], [], left)[0]:
                chunk = os.read(self._events, 1 << 20)
                assert chunk, f"chromium exited during {what}: {self._stderr()}"
                self._buf += chunk

    def _stderr(self) -> str:
        assert self.proc.stderr is not None
        self.proc.kill()
        return self.proc.stderr.read().decode(errors="replace")[-2000:]

    def render(self, page: Path) -> tuple[dict[str, Any], Any]:
        """What :attr:`SEEN` reads of ``page`` and its screenshot, the whole page at
        :data:`WIDTH` CSS pixels (one device pixel each)."""
        metrics = {"width": WIDTH, "height": 900, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics, session=True)
        self.call("Page.navigate", {"url": page.as_uri()}, session=True)
        self._next(lambda m: m.get("method") == "Page.loadEventFired", f"loading {page}")
        seen = self.call("Runtime.evaluate", {"expression": self.SEEN, "returnByValue": True},
                         session=True)["result"]["value"]
        # the window as tall as the page, so the screenshot holds all of it
        self.call("Emulation.setDeviceMetricsOverride", {**metrics, "height": seen["height"]},
                  session=True)
        shot = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        return seen, PIL.open(io.BytesIO(base64.b64decode(shot))).convert("RGB")

    def close(self) -> None:
        """Close the browser (killed if it does not exit)."""
        os.write(self._cmd, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        try:
            self.proc.wait(scaled(30))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._cmd, self._events):
            os.close(fd)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(require_chromium(CHROMIUM, os.environ), tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()


def build(kind: str, tmp: Path) -> tuple[Path, Report]:
    out = tmp / f"{kind}.html"
    if kind in ("grad_demo", "fsdp2"):
        return out, report_log(golden(kind, tmp), out)
    if kind == "local":
        write_local_checkpoint(tmp / "local", [12, 9], {4, 8, 12})
        return out, report_log(tmp / "local", out)
    log = golden("grad_demo", tmp)
    seg = log / "seg-0000000000000000.ldlog"
    raw = bytearray(seg.read_bytes())
    raw[3000] ^= 0xFF
    seg.write_bytes(bytes(raw))
    return out, report_log(log, out)


def pixels(img: Any, box: list[float], dx: int = 0, dy: int = 0) -> np.ndarray:
    """The screenshot's RGB pixels inside ``box`` (x, y, width, height), moved by dx, dy."""
    x, y, w, h = (round(v) for v in box)
    return np.asarray(img.crop((x + dx, y + dy, x + dx + w, y + dy + h)), dtype=np.int16)


def near(px: np.ndarray, rgb: tuple[int, ...], tol: int = 40) -> int:
    """How many of ``px`` are within ``tol`` of ``rgb`` in every channel."""
    return int((np.abs(px - np.array(rgb, np.int16)).max(axis=-1) <= tol).sum())


def drawn_as(img: Any, box: list[float], png: bytes) -> float:
    """How far the screenshot at ``box`` is from ``png`` scaled to the box, as a fraction
    of how far a blank (white) box would be: about 0 where the browser drew that plot there
    (scaling rounds a little), 1 for nothing drawn. The best of one-pixel shifts, since the
    page places a box on fractional pixels."""
    w, h = round(box[2]), round(box[3])
    ref = np.asarray(PIL.open(io.BytesIO(png)).convert("RGB").resize((w, h)), dtype=np.int16)
    blank = float(np.abs(ref - 255).mean())
    assert blank > 0, "the plot is a blank image"
    best = min(float(np.abs(pixels(img, box, dx, dy) - ref).mean())
               for dx in (-1, 0, 1) for dy in (-1, 0, 1))
    return best / blank


def cards(rep: Report) -> dict[str, str]:
    """The cards the page must show, from the report's figures (``Report.summary()``)."""
    s = rep.summary()
    logs = s["logs"]
    return {
        "health": s["health"], "durable step": f"{s['durable_step']:,}",
        "last step": f"{max(f['last_step'] for f in logs):,}", "records": f"{s['records']:,}",
        "bases": f"{len({b for f in logs for b in f['bases']}):,}",
        "bytes on disk": human_bytes(s["bytes_on_disk"]),
        "bytes per step": human_bytes(sum(f["record_bytes"] for f in logs)
                                      / max(f["records"] for f in logs)),
    }


@pytest.mark.parametrize(("kind", "plots", "words"), [
    ("grad_demo", 3, ["lowdiff_store.torch.compressors.demo.DeMo", "No problem found."]),
    ("fsdp2", 4, ["sharded checkpoint, 2 ranks (fsdp)", "device mesh"]),
    ("local", 4, ["sharded checkpoint, 2 ranks (local)",
                  "newest step durable on every rank: 9"]),
    ("corrupt", 3, ["1 problem(s) found."]),
])
def test_page_as_a_person_sees_it(tmp_path: Path, browser: Browser, kind: str, plots: int,
                                  words: list[str]) -> None:
    page, rep = build(kind, tmp_path)
    seen, img = browser.render(page)

    # not blank: the whole page, its header band, text and plots in thousands of colours
    assert img.size == (WIDTH, seen["height"])
    assert seen["height"] > 2000, seen["height"]
    assert len(img.getcolors(maxcolors=1 << 22) or []) > 1500
    assert near(pixels(img, [0, 0, WIDTH, 60]), (0x0F, 0x17, 0x2A), 8) > WIDTH * 40

    # the plots are drawn: each embedded PNG loaded, on screen at its place, with its data
    embedded = pngs(page.read_text())
    assert len(seen["plots"]) == len(embedded) == plots, seen["plots"]
    for plot, (w, h, png) in zip(seen["plots"], embedded, strict=True):
        assert plot["complete"], plot
        assert plot["natural"] == [w, h], plot
        assert plot["box"][2] > w / 2, plot  # shown, not collapsed (scaled down to fit)
        assert drawn_as(img, plot["box"], png) < 0.25, plot
        on_screen = pixels(img, plot["box"])
        assert sum(near(on_screen, c) for c in DATA_COLOURS) > 500, plot

    # the numbers are on the page: the report's figures, rendered, in a visible font
    assert {k: v for k, v, _box in seen["cards"]} == cards(rep)
    for k, _v, box in seen["cards"]:
        if k != "health":  # the badge is white on colour
            assert near(pixels(img, box), (0x0F, 0x17, 0x2A), 60) > 20, k
    lines = seen["text"].splitlines()
    for p in rep.all_problems():
        row = "\t".join([p["path"], f"{p['offset']:,}", p["reason"], p["detail"]])
        assert row in lines, (row, seen["text"][:3000])
    assert len(seen["problems"]) == (1 if rep.all_problems() else 0)
    for box in seen["problems"]:  # the problem box, pale red, is on screen
        assert near(pixels(img, box), (0xFE, 0xF2, 0xF2), 3) > 0.5 * box[2] * box[3]
    for f in rep.summary()["logs"] if rep.sharded else []:
        row = "\t".join([f"rank {f['rank']}", f["health"], f"{f['durable_step']:,}",
                         f"{f['last_step']:,}", f"{f['records']:,}",
                         ", ".join(map(str, f["bases"]))]) + "\t"
        assert any(line.startswith(row) for line in lines), (row, seen["text"][-3000:])
    for want in words:
        assert want in seen["text"], (want, seen["text"][:3000])


def test_missing_chromium_skips_for_a_developer_and_fails_under_ci() -> None:
    """`make test` on a machine without chromium skips the page test with the reason; CI
    (env ``CI`` set, as CI runs `.ci/run`) fails instead: it promised to run it."""
    with pytest.raises(pytest.skip.Exception, match="no chromium binary on PATH"):
        require_chromium(None, {})
    for off in ("", "0", "false"):
        with pytest.raises(pytest.skip.Exception):
            require_chromium(None, {"CI": off})
    # a skip is an exception too: catch any, then require the failure
    with pytest.raises(BaseException) as under_ci:
        require_chromium(None, {"CI": "true"})
    assert under_ci.type is pytest.fail.Exception, under_ci.value
    assert str(under_ci.value).startswith(NO_CHROMIUM), under_ci.value
    assert "CI" in str(under_ci.value).removeprefix(NO_CHROMIUM), under_ci.value
    assert require_chromium("/usr/bin/chromium", {"CI": "true"}) == "/usr/bin/chromium"
