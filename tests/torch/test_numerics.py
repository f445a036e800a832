"""Replay's bits across machines (issue 42, item 1; docs/torch.md "Exactness across
machines"): a log records the numerics each run of its writer trained under, and a replay
either runs under the same ones (pinning MKL's vector-math branch where it can) and is
bitwise, or is refused before it starts with the remedy; never a divergence after the work.

Each case is real processes (``numerics_worker.py``) under the numerics their environment
gives them: every ATen kernel capability this CPU has (``ATEN_CPU_CAPABILITY``), MKL's
compatible branch (``MKL_CBWR=COMPATIBLE``) and MKL's Intel branch, which an ``LD_PRELOAD``
stand-in for MKL's CPU-vendor check makes it take on any x86-64 CPU that has AVX-512 (its
bits are those measured on an Intel Xeon: ``shared/tools/cpu_bits.py``). So on one machine,
AMD or Intel, both MKL branches and every capability are replayed across, and a dependence
shows. The torch-free record and its comparison: ``tests/test_numerics_record.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lowdiff_store.torch import describe_log  # noqa: E402

WORKER = Path(__file__).with_name("numerics_worker.py")
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "logs" / "grad_adamw"
ORDER = ("DEFAULT", "AVX2", "AVX512")
NATIVE = torch.backends.cpu.get_cpu_capability()
#: the capabilities this CPU can run (torch picks the best one it has)
CAPS = ORDER[:ORDER.index(NATIVE) + 1] if NATIVE in ORDER else (NATIVE,)
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="ATen/MKL dispatch checked on Linux x86-64")
#: what the environment of a worker may carry from the test session's
_SCRUBBED = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "LD_PRELOAD")


def run(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One worker process: its JSON line."""
    base = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    res = subprocess.run([sys.executable, str(WORKER), *args], env={**base, **(env or {})},
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def intel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment in which MKL takes the CPU for an Intel one (a two-line stand-in for
    its vendor check, compiled here)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not torch.backends.mkl.is_available():
        pytest.skip("no C compiler (or torch without MKL) for the Intel stand-in")
    d = tmp_path_factory.mktemp("fakeintel")
    (d / "f.c").write_text("int mkl_serv_intel_cpu_true(void) { return 1; }\n"
                           "int mkl_serv_intel_cpu(void) { return 1; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libf.so"), str(d / "f.c")],
                   check=True, timeout=120)
    env = {"LD_PRELOAD": str(d / "libf.so")}
    if run("probe", "-", env=env)["here"]["mkl_vml"] == 0:
        pytest.skip("MKL runs its generic branch here even for an Intel CPU (no AVX-512)")
    return env


@pytest.fixture(scope="module")
def native_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("native") / "log")
    return path, run("write", path, "6")


def check_exact(got: dict[str, Any], wrote: dict[str, Any]) -> None:
    assert "error" not in got, got.get("message")
    assert (got["step"], got["exact"], got["sha"]) == (6, True, wrote["sha"]), got
    assert got["verified"]
    assert got["verified"][-1] == 6


def check_refused(got: dict[str, Any], *words: str) -> None:
    assert got.get("error") == "numerics_mismatch", got
    for w in words:
        assert w in got["message"], got["message"]


# ---------------------------------------------------------------------- the record


def test_the_log_records_the_writers_numerics(native_log: tuple[str, dict[str, Any]]
                                              ) -> None:
    path, wrote = native_log
    runs = describe_log(path)["numerics"]
    assert len(runs) == 1
    r = runs[0]
    assert (r["from_step"], r["device"], r["aten_cpu"], r["mkl_vml"], r["torch"]) == (
        0, "cpu", NATIVE, wrote["here"]["mkl_vml"], torch.__version__)
    assert r["cpu_vendor"]
    assert r["cpu_model"]


# ---------------------------------------------------------------------- ATen capability


@pytest.mark.parametrize("cap", ORDER)
def test_replay_under_every_kernel_capability(cap: str,
                                              native_log: tuple[str, dict[str, Any]]
                                              ) -> None:
    """The native log replayed under each capability of this CPU: AVX2 and AVX512 give the
    same bits (exact); DEFAULT's scalar kernels do not, and the replay is refused before it
    starts; without verify it runs and says the state is not bitwise, which it is not."""
    if cap not in CAPS:
        pytest.skip(f"this CPU has no {cap}")
    path, wrote = native_log
    env = {"ATEN_CPU_CAPABILITY": cap.lower()}
    got = run("restore", path, env=env)
    assert got["here"]["aten_cpu"] == cap
    if (cap == "DEFAULT") == (NATIVE == "DEFAULT"):
        check_exact(got, wrote)
        return
    check_refused(got, f"aten_cpu {NATIVE} (log) vs DEFAULT (here)",
                  f"ATEN_CPU_CAPABILITY={NATIVE.lower()}", "verify=False")
    loose = run("restore", path, "--no-verify", env=env)
    assert loose["exact"] is False
    assert any("not bitwise" in n for n in loose["notes"])
    assert loose["sha"] != wrote["sha"], "DEFAULT gave the same bits: the refusal is wrong"


def test_a_log_written_under_default_kernels(tmp_path: Path) -> None:
    if "DEFAULT" not in CAPS or NATIVE == "DEFAULT":
        pytest.skip("this CPU has one kernel capability")
    path = str(tmp_path / "log")
    wrote = run("write", path, "6", env={"ATEN_CPU_CAPABILITY": "default"})
    check_refused(run("restore", path), f"aten_cpu DEFAULT (log) vs {NATIVE} (here)",
                  "ATEN_CPU_CAPABILITY=default")
    check_exact(run("restore", path, env={"ATEN_CPU_CAPABILITY": "default"}), wrote)


# ---------------------------------------------------------------------- MKL's branch


def test_a_generic_branch_log_restores_on_intel(intel: dict[str, str],
                                                tmp_path: Path) -> None:
    """A log trained under MKL's generic branch (any AMD CPU, or MKL_CBWR=COMPATIBLE) on an
    Intel CPU: restore pins MKL's compatible branch (MKL has not run yet) and is exact;
    after a matrix product it is refused with the remedy, and the remedy works."""
    path = str(tmp_path / "log")
    wrote = run("write", path, "6", env={"MKL_CBWR": "COMPATIBLE"})
    assert wrote["here"]["mkl_vml"] == 0
    got = run("restore", path, env=intel)
    check_exact(got, wrote)
    assert got["here"]["mkl_vml"] == 0
    assert any("pinned" in n for n in got["notes"])
    late = run("restore", path, "--mkl-first", env=intel)
    check_refused(late, "mkl_vml generic (log)", "MKL_CBWR=COMPATIBLE", "pin_numerics")
    check_exact(run("restore", path, "--mkl-first",
                    env={**intel, "MKL_CBWR": "COMPATIBLE"}), wrote)
    loose = run("restore", path, "--mkl-first", "--no-verify", env=intel)
    assert loose["exact"] is False
    assert loose["sha"] != wrote["sha"], "Intel's branch gave the same bits"
    assert run("restore", path, "--mkl-first", "--pin", env=intel)["pin_error"] == \
        "numerics_mismatch"


def test_an_intel_branch_log_where_mkl_cannot_run_it(intel: dict[str, str],
                                                    tmp_path: Path) -> None:
    """A log trained under MKL's Intel branch replayed where MKL runs its generic one: on
    an AMD CPU (or once MKL ran under MKL_CBWR=COMPATIBLE) refused before replay, saying
    where it restores; on an Intel CPU the replay pins that branch and is exact. Restored
    exactly where MKL runs that branch."""
    path = str(tmp_path / "log")
    wrote = run("write", path, "6", env=intel)
    branch = wrote["here"]["mkl_vml"]
    assert branch not in (0, None)
    check_exact(run("restore", path, env=intel), wrote)
    late = run("restore", path, "--mkl-first", env={"MKL_CBWR": "COMPATIBLE"})
    check_refused(late, "(log) vs generic (here)", "only on an Intel CPU")
    got = run("restore", path, env={"MKL_CBWR": "COMPATIBLE"})
    if run("probe", "-")["here"]["mkl_vml"] == branch:  # an Intel CPU: MKL can run it
        check_exact(got, wrote)
        assert any("pinned" in n for n in got["notes"])
    else:
        check_refused(got, "(log) vs generic (here)", "only on an Intel CPU")


def test_golden_log_of_an_amd_machine_on_intel(intel: dict[str, str],
                                               tmp_path: Path) -> None:
    """The golden AdamW log (written on an AMD EPYC, before logs recorded numerics) on an
    Intel CPU: with MKL_CBWR=COMPATIBLE, what tests/conftest.py sets on such a machine, it
    restores the golden state; without, the divergence names this machine's numerics and
    where to read about it."""
    path = tmp_path / "grad_adamw"
    shutil.copytree(GOLDEN, path)
    good = run("golden", str(path), env={**intel, "MKL_CBWR": "COMPATIBLE"})
    assert good.get("error") is None, good
    assert good["sha"] == good["want"]
    assert good["exact"] is True
    bad = run("golden", str(path), env=intel)
    assert bad["error"] == "replay_diverged", bad
    assert "records no numerics" in bad["message"]
    assert "Exactness across machines" in \
        bad["message"]


# ---------------------------------------------------------------------- runs


def test_a_log_continued_under_other_numerics_records_a_run(tmp_path: Path) -> None:
    """A log continued under another capability of the same bits (AVX2 after AVX512)
    records a second run from the first step it trained, and replays exactly across both."""
    if not {"AVX2", "AVX512"} <= set(CAPS):
        pytest.skip("this CPU has no two vector capabilities")
    path = str(tmp_path / "log")
    run("write", path, "4")
    cont = run("continue", path, "6", env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert (cont["step"], cont["exact"]) == (4, True)
    runs = describe_log(path)["numerics"]
    assert [(r["from_step"], r["aten_cpu"]) for r in runs] == [(0, "AVX512"), (5, "AVX2")]
    whole = run("restore", path)
    assert (whole["step"], whole["exact"], whole["verified"][-1]) == (6, True, 6)
