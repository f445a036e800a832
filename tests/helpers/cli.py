"""Running the CLI in-process from a test."""

from __future__ import annotations

import pytest

from lowdiff_store import cli


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``cli.main(argv)`` in-process: (exit code, stdout, stderr). argparse's exits count."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err
