"""The report page in a real browser: headless Chromium (Debian's ``chromium``) renders the
pages of a gradient log, a sharded FSDP2 checkpoint, a local-update checkpoint and a
corrupted log; the screenshot must be the window's size and show the plots (many distinct
colours, the plot palette's blue drawn over a large area) and the rendered document must
hold the numbers. Skipped, with the reason, where no chromium binary is installed
(``apt-get install chromium``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from lowdiff_store.report import report_log
from tests.test_report import golden, write_local_checkpoint

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                       "google-chrome")) if p), None)
NO_CHROMIUM = "no chromium binary on PATH (Debian: apt-get install chromium)"


def require_chromium(path: str | None, env: Mapping[str, str]) -> str:
    """The chromium binary to drive; without one the page test is skipped, with the reason."""
    if path is None:
        pytest.skip(NO_CHROMIUM)
    return path


@pytest.fixture
def chromium_path() -> str:
    return require_chromium(CHROMIUM, os.environ)
PIL = pytest.importorskip("PIL.Image", reason="Pillow (a matplotlib dependency) decodes "
                          "the screenshot")
WIDTH, HEIGHT = 1280, 3000
#: The plots' first colour (lowdiff_store/report/plots.py PALETTE[0]): lines and bars.
BLUE = (0x25, 0x63, 0xEB)


def chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)


def screenshot(page: Path, tmp: Path) -> PIL.Image:
    shot = tmp / (page.stem + ".png")
    res = chromium([f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}",
                    page.as_uri()], tmp)
    assert shot.exists(), res.stderr[-2000:]
    return PIL.open(shot).convert("RGB")


def dom(page: Path, tmp: Path) -> str:
    """The document as the browser rendered it, as text."""
    res = chromium(["--dump-dom", page.as_uri()], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", res.stdout))


def near(c: tuple[int, int, int], ref: tuple[int, int, int], tol: int = 40) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(c, ref, strict=True))


def plot_pixels(img: PIL.Image) -> tuple[int, int]:
    """(distinct colours, pixels close to the plots' blue) of the screenshot."""
    small = img.resize((WIDTH // 2, HEIGHT // 2))
    colours = small.getcolors(maxcolors=1 << 20) or []
    blue = sum(n for n, c in colours if near(c, BLUE))
    return len(colours), blue


def build(kind: str, tmp: Path) -> Path:
    out = tmp / f"{kind}.html"
    if kind == "grad_demo":
        report_log(golden("grad_demo", tmp), out)
    elif kind == "fsdp2":
        report_log(golden("fsdp2", tmp), out)
    elif kind == "local":
        write_local_checkpoint(tmp / "local", [12, 9], {4, 8, 12})
        report_log(tmp / "local", out)
    else:
        log = golden("grad_demo", tmp)
        seg = log / "seg-0000000000000000.ldlog"
        raw = bytearray(seg.read_bytes())
        raw[3000] ^= 0xFF
        seg.write_bytes(bytes(raw))
        report_log(log, out)
    return out


@pytest.mark.parametrize(("kind", "numbers"), [
    ("grad_demo", ["Durable step 7", "Records 7", "lowdiff_store.torch.compressors.demo.DeMo",
                   "No problem found."]),
    ("fsdp2", ["sharded checkpoint, 2 ranks (fsdp)", "rank 0", "rank 1", "device mesh"]),
    ("local", ["sharded checkpoint, 2 ranks (local)", "newest step durable on every rank: 9"]),
    ("corrupt", ["problem(s) found", "checksum_mismatch", "seg-0000000000000000.ldlog"]),
])
def test_page_renders_plots_and_numbers(tmp_path: Path, kind: str, numbers: list[str],
                                        chromium_path: str) -> None:
    page = build(kind, tmp_path)
    img = screenshot(page, tmp_path)
    assert img.size == (WIDTH, HEIGHT)
    colours, blue = plot_pixels(img)
    # text and white cards alone are a few hundred colours; antialiased plots add thousands
    assert colours > 1500, colours
    assert blue > 2000, blue  # the plot lines and bars are drawn
    top = img.crop((0, 0, WIDTH, 70)).getcolors(maxcolors=1 << 16) or []
    assert max(n for n, _c in top) > WIDTH * 40  # the dark header band
    text = dom(page, tmp_path)
    for want in numbers:
        assert want.lower() in text.lower(), (want, text[:3000])
    if kind == "corrupt":
        # the problem box (red border on a pale red ground) is on screen
        reds = sum(n for n, c in (img.getcolors(maxcolors=1 << 20) or [])
                   if near(c, (0xFE, 0xF2, 0xF2), 3))
        assert reds > 5000, reds


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
