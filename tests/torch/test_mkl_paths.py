"""Which optimizer paths reach MKL (issue 48): found by running them, not assumed.

A log's replay is bound to its writer's CPU vendor and MKL branch only where it reaches MKL
(:func:`lowdiff_store.torchmeta.numerics.mkl_use`, recorded per run as ``mkl_use``). Here
every class of the replay's allow-list, in each implementation it has and in float32 and
bfloat16, is stepped in real processes (``mkl_paths_worker.py``), and the table is checked
two ways:

- on every machine, against the ops the steps dispatch (those whose CPU float kernels are
  MKL's: ``sqrt``, ``exp``, ``log``, ``tanh``, ``erf``, matrix products);
- against the bits themselves, under each MKL branch this CPU accepts (``MKL_CBWR``): a
  path the table calls free of MKL gives the same bits under every branch, and a path it
  says reaches MKL gives other bits under some of MKL's branches (on an
  Intel CPU, AUTO, COMPATIBLE and AVX2 do; an AMD CPU runs one branch, so there the first
  check carries it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lowdiff_store.torchmeta.numerics import mkl_use  # noqa: E402

WORKER = Path(__file__).with_name("mkl_paths_worker.py")
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux")
                                 or not torch.backends.mkl.is_available(),
                                 reason="MKL's branches are checked on Linux x86-64"),
              pytest.mark.xdist_group("mkl_paths")]
_TAGS = {"float32": "F32", "bfloat16": "BF16"}


def _run(setting: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")}
    res = subprocess.run([sys.executable, str(WORKER)], env={**env, "MKL_CBWR": setting},
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def branches() -> dict[int, dict[str, Any]]:
    """The worker's paths under each MKL branch this CPU runs (one per branch)."""
    out: dict[int, dict[str, Any]] = {}
    for setting in ("AUTO", "COMPATIBLE", "AVX2"):
        got = _run(setting)
        out.setdefault(got["mkl_vml"], got["paths"])
    return out


def _table(key: str, cls: str) -> str | None:
    _name, impl, dtype = key.split("/")
    return mkl_use(cls, [impl], {_TAGS[dtype]}, None, "grad")


def test_the_table_is_what_the_steps_dispatch(branches: dict[int, dict[str, Any]]) -> None:
    paths = next(iter(branches.values()))
    assert len(paths) >= 40, sorted(paths)
    wrong = {k: (ops, _table(k, cls)) for k, (_h, ops, cls) in paths.items()
             if bool(ops) != (_table(k, cls) is not None)}
    assert not wrong, wrong
    # what the table was built from, as measured: AdamW's sqrt unless fused
    assert paths["AdamW/foreach/float32"][1] == ["sqrt"]
    assert paths["AdamW/fused/float32"][1] == []
    assert paths["SGD/foreach/float32"][1] == []


def test_the_table_is_what_the_bits_say(branches: dict[int, dict[str, Any]]) -> None:
    if len(branches) < 2:
        pytest.skip(f"MKL runs one branch on this CPU ({sorted(branches)}): the dispatched "
                    f"ops carry the check")
    runs = list(branches.values())
    for key, (_h, _ops, cls) in runs[0].items():
        hashes = {r[key][0] for r in runs}
        if _table(key, cls) is None:
            assert len(hashes) == 1, f"{key} changes with MKL's branch: {hashes}"
        elif key.endswith("float32"):
            assert len(hashes) > 1, f"{key} reaches MKL yet kept its bits"
