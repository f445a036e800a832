"""The progress bar: rate and ETA on a terminal (tqdm), nothing when piped or disabled; the
callback form every long operation takes (``ProgressFn``)."""

from __future__ import annotations

import io
import subprocess
import sys

from lowdiff_store.progress import Progress, ProgressFn


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_rate_and_eta() -> None:
    term = _Terminal()
    with Progress("verify", 0, stream=term, unit="B") as bar:
        fn: ProgressFn = bar
        fn(0, 4 << 20)
        fn(1 << 20, 4 << 20)
        fn(4 << 20, 4 << 20)
    text = term.getvalue()
    assert "verify" in text
    assert "4.00M/4.00M" in text  # sizes in binary units
    assert "B/s" in text  # a rate
    assert "<" in text  # elapsed<remaining: the ETA
    assert text.endswith("\n")
    assert bar.done == 4 << 20


def test_piped_or_disabled_prints_nothing() -> None:
    piped = io.StringIO()
    with Progress("replay", 3, stream=piped) as bar:
        bar.update()
        bar(3, 3)
    assert piped.getvalue() == ""
    term = _Terminal()
    with Progress("replay", 3, stream=term, enabled=False) as bar:
        bar(2, 3)
    assert term.getvalue() == ""
    assert bar.done == 2


def test_the_total_may_change_between_calls() -> None:
    term = _Terminal()
    with Progress("compact", 1, stream=term) as bar:
        bar(1, 1)
        bar(5, 10)
        bar(10, 10)
    assert (bar.done, bar.total) == (10, 10)
    assert "10/10" in term.getvalue()


def test_importing_the_callback_type_loads_no_bar_library() -> None:
    code = ("import sys; from lowdiff_store.progress import ProgressFn, Progress; "
            "Progress('x', 1, enabled=False); print('tqdm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"
