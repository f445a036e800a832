"""Shared pieces of the red-team tests: a small model trained deterministically, DCP
checkpoints written by torch itself, the CLI run in a fresh interpreter, and the checks
every case makes (one line, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import build as build
from tests.helpers.tiny import train as train

ROOT = Path(__file__).resolve().parents[2]




def dcp_save(path: Path, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """``torch.distributed.checkpoint.save`` of model and optimizer, as DCP users save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
                 checkpoint_id=str(path), no_dist=True)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The two state dicts hold the same names, dtypes, shapes and bits."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


def one_line(text: Any, *needles: str) -> None:
    """``text`` is one line, no traceback, and holds every needle."""
    s = str(text).strip()
    assert s, "empty message"
    assert "\n" not in s, s
    assert "Traceback" not in s, s
    for n in needles:
        assert n in s, (n, s)


def cli(*argv: str, timeout: float = 300) -> tuple[int, str, str]:
    """``lowdiff-store ARGV`` in a fresh interpreter: (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from lowdiff_store.cli import main; "
                        "sys.exit(main(sys.argv[1:]))", *argv],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return r.returncode, r.stdout, r.stderr


def cli_here(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``lowdiff-store ARGV`` in this process (``capsys`` captures): (exit code, stdout,
    stderr). Anything escaping ``main`` (a BaseException) fails the calling test."""
    from lowdiff_store.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err
