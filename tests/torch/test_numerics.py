"""Replay's bits across machines (issues 42 and 48; docs/torch.md "Exactness across
machines"): a log records the numerics each run of its writer trained under and what of its
replay reaches MKL, and a replay either runs under the same bits (pinning MKL's branch
where that can give them) and is bitwise, or is refused before it starts with a remedy
that is true; never a divergence after the work.

Each case is real processes (``numerics_worker.py``) under the numerics their environment
gives them: every ATen kernel capability this CPU has (``ATEN_CPU_CAPABILITY``) and every
MKL branch it accepts (``MKL_CBWR``). Each run is forked by a server started under its
environment (one per environment, its imports made once: ``tests/helpers/fork_server.py``),
which has run no kernel and no MKL call, so a run picks its numerics as a fresh process
does. This machine's bits are checked against the rows
measured on its vendor (``tests/helpers/cpu_bits.py``: an Intel Xeon and an AMD EPYC), and
a log of the other vendor is the log's record rewritten to name it: what is tested there is
the decision before the replay, which ``tests/test_numerics_record.py`` checks against both
vendors' measured bits.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lowdiff_store.log import LogReader  # noqa: E402
from lowdiff_store.torch import describe_log  # noqa: E402
from lowdiff_store.verify import inspect_log  # noqa: E402
from lowdiff_store.writer import AsyncLogWriter  # noqa: E402
from tests.helpers.cpu_bits import MEASURED, capability_class  # noqa: E402
from tests.helpers.fork_server import ForkServer  # noqa: E402
from tests.helpers.timing import scaled  # noqa: E402

WORKER = Path(__file__).with_name("numerics_worker.py")
#: fused AdamW's hash per capability class: the same on every vendor and MKL branch
PORTABLE_FUSED = {"vector": "0dab75d7bd18", "DEFAULT": "48653081c950"}
ORDER = ("DEFAULT", "AVX2", "AVX512")
NATIVE = torch.backends.cpu.get_cpu_capability()
#: the capabilities this CPU can run (torch picks the best one it has)
CAPS = ORDER[:ORDER.index(NATIVE) + 1] if NATIVE in ORDER else (NATIVE,)
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="ATen/MKL dispatch checked on Linux x86-64"),
              # one worker runs the module, so each environment's numerics are measured
              # once per test run (:func:`numerics_row`), not once per test and worker
              pytest.mark.xdist_group("module:tests/torch/test_numerics.py")]
#: what the environment of a worker may carry from the test session's
_SCRUBBED = ("MKL_CBWR", "ATEN_CPU_CAPABILITY")


class _Servers:
    """``numerics_worker.py --serve`` fork servers, one per environment (each started with
    it: what a run's numerics are is decided from the environment at its imports and first
    kernels, which the server makes for all its runs); their files in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.by_env: dict[tuple[tuple[str, str], ...], ForkServer] = {}

    def run(self, args: Sequence[str], env: dict[str, str]
            ) -> subprocess.CompletedProcess[str]:
        """``numerics_worker.py ARGS`` forked by the server of ``env``."""
        key = tuple(sorted(env.items()))
        server = self.by_env.get(key)
        if server is None:
            log = self.root / f"server-{len(self.by_env)}.log"
            server = self.by_env[key] = ForkServer(
                [sys.executable, str(WORKER), "--serve"], _environment(env), log)
        return server.run(args, _environment(env), self.root / "run", scaled(300))

    def close(self) -> None:
        for server in self.by_env.values():
            server.close()


#: the fork servers while ``_fork_servers`` holds them (else each run is a process of its own)
_SERVERS: list[_Servers] = []


@pytest.fixture(scope="module", autouse=True)
def _fork_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The module's fork servers (module scope: one xdist worker runs the module), their
    memory given back when it is done."""
    servers = _Servers(tmp_path_factory.mktemp("numerics-servers"))
    _SERVERS.append(servers)
    try:
        yield
    finally:
        _SERVERS.remove(servers)
        servers.close()


def _environment(env: dict[str, str]) -> dict[str, str]:
    """This session's environment without the numerics settings, then ``env``'s."""
    return {**{k: v for k, v in os.environ.items() if k not in _SCRUBBED}, **env}


def run(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One run of the worker, under the numerics ``env`` sets: its JSON line. Forked by the
    module's server of that environment, else a process of its own."""
    if _SERVERS:
        res = _SERVERS[-1].run(args, env or {})
    else:
        res = subprocess.run([sys.executable, str(WORKER), *args],
                             env=_environment(env or {}), capture_output=True, text=True,
                             timeout=scaled(300), check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


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
    assert r["mkl_use"] == "sqrt in AdamW's single step (MKL vector math)"


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


# ---------------------------------------------------------------------- MKL's bits


@functools.cache
def numerics_row(mkl_cbwr: str | None = None, cap: str | None = None) -> dict[str, Any]:
    """The row of ``tests/helpers/cpu_bits.py`` (the bits of AdamW's ops, and the numerics
    the process ran under: ``vendor``, ``mkl_vml``, ``capability``) of a run whose
    environment sets ``MKL_CBWR`` and ``ATEN_CPU_CAPABILITY`` (None: unset). What an
    environment gives does not change within a test run, so each is measured once."""
    env = {} if mkl_cbwr is None else {"MKL_CBWR": mkl_cbwr}
    if cap is not None:
        env["ATEN_CPU_CAPABILITY"] = cap.lower()
    return run("bits", env=env)


def test_this_machine_gives_its_vendors_measured_bits() -> None:
    """Under every MKL branch and kernel capability this CPU runs, its bits are the ones
    measured on its vendor (``tests/helpers/cpu_bits.py``), and fused AdamW's are the
    vendor-independent ones: the numerics rule is built on those measurements."""
    checked = 0
    for setting in ("AUTO", "COMPATIBLE", "AVX2"):
        for cap in {NATIVE, "DEFAULT"} & set(CAPS):
            row = numerics_row(setting, None if cap == NATIVE else cap)
            assert row["capability"] == cap
            cls = capability_class(row["capability"])
            assert row["adamw_fused"] == PORTABLE_FUSED[cls], (setting, cap, row)
            want = MEASURED.get((row["vendor"], row["mkl_vml"], cls))
            if want is None:
                continue
            for k, v in want.items():
                assert v is None or row[k] == v, (setting, cap, k, row)
            checked += 1
    if checked == 0:
        pytest.skip("no measured row for this CPU's vendor and MKL branches")


def _settings_by_branch() -> dict[int, str]:
    """The MKL_CBWR setting of each branch this CPU runs (one setting per branch)."""
    out: dict[int, str] = {}
    for setting in ("AUTO", "AVX2", "COMPATIBLE"):
        out.setdefault(numerics_row(setting)["mkl_vml"], setting)
    return out


def _as_if_written_on(path: str, vendor_id: str, branch: int) -> None:
    """The log's numerics record rewritten to name another CPU vendor and MKL branch (the
    log's bits stay this machine's: what the restore decides before replaying is tested)."""
    with LogReader(path) as r:
        meta = dict(r.meta["torch"])
    meta["numerics"] = [{**e, "cpu_vendor": vendor_id, "mkl_vml": branch}
                        for e in meta["numerics"]]
    with AsyncLogWriter(path) as w:
        w.update_meta({"torch": meta})


def test_a_log_of_another_branch_of_this_vendor(tmp_path: Path) -> None:
    """A log trained on this vendor under another MKL branch (MKL_CBWR=AVX2 on an Intel
    CPU): restore pins the log's branch (MKL has not run yet) and is exact; once MKL ran it
    is refused naming MKL_CBWR, and that remedy works."""
    by_branch = _settings_by_branch()
    native = numerics_row()["mkl_vml"]
    other = next((b for b in by_branch if b != native), None)
    if other is None:
        pytest.skip(f"MKL runs one branch on this CPU ({native}): nothing to pin")
    setting = by_branch[other]
    path = str(tmp_path / "log")
    wrote = run("write", path, "6", env={"MKL_CBWR": setting})
    assert wrote["here"]["mkl_vml"] == other
    got = run("restore", path)
    check_exact(got, wrote)
    assert got["here"]["mkl_vml"] == other
    assert any("pinned" in n for n in got["notes"])
    late = run("restore", path, "--mkl-first")
    check_refused(late, "mkl_vml", f"MKL_CBWR={setting}", "pin_numerics")
    check_exact(run("restore", path, "--mkl-first", env={"MKL_CBWR": setting}), wrote)
    loose = run("restore", path, "--mkl-first", "--no-verify")
    assert loose["exact"] is False
    assert loose["sha"] != wrote["sha"], "another MKL branch gave the same bits"
    assert run("restore", path, "--mkl-first", "--pin")["pin_error"] == "numerics_mismatch"


def test_a_log_of_the_other_vendor(tmp_path: Path) -> None:
    """A log whose replay reaches MKL, trained on the other vendor: refused before the
    replay under every MKL setting (none gives the other vendor's bits), naming the vendor
    and the portable path; ``pin_numerics`` refuses it too. The same log with fused AdamW
    (no MKL op) is not refused: it replays bitwise."""
    here = numerics_row()["vendor"]
    if here not in ("Intel", "AMD"):
        pytest.skip(f"a CPU of vendor {here}")
    theirs, vendor_id, branch = (("AMD", "AuthenticAMD", 0) if here == "Intel"
                                 else ("Intel", "GenuineIntel", 5))
    path = str(tmp_path / "single")
    run("write", path, "6")
    _as_if_written_on(path, vendor_id, branch)
    for setting in sorted(set(_settings_by_branch().values())):
        check_refused(run("restore", path, env={"MKL_CBWR": setting}),
                      f"cpu_vendor {theirs}", f"restore on an {theirs} CPU", "fused=True")
    assert run("restore", path, "--pin")["pin_error"] == "numerics_mismatch"
    fused = str(tmp_path / "fused")
    wrote = run("write", fused, "6", "--fused")
    assert describe_log(fused)["numerics"][0]["mkl_use"] is None
    _as_if_written_on(fused, vendor_id, branch)
    got = run("restore", fused, "--fused")
    check_exact(got, wrote)
    assert not any("pinned" in n for n in got["notes"]), got["notes"]


def test_the_checkpointer_says_when_its_log_is_bound_to_a_vendor(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Once at open, where the log's replay will reach MKL, with the portable path."""
    from lowdiff_store.torch import DiffCheckpointer

    for fused in (False, True):
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), fused=fused or None)
        caplog.clear()
        with caplog.at_level("WARNING"):
            DiffCheckpointer(str(tmp_path / f"log{fused}"), model, opt).close()
        said = [r.getMessage() for r in caplog.records if "reaches MKL" in r.getMessage()]
        if fused:
            assert said == []
        else:
            assert len(said) == 1
            assert "sqrt in AdamW's single step" in said[0]
            assert "fused=True" in said[0]


# ---------------------------------------------------------------------- runs


def test_a_log_continued_under_other_numerics_records_a_run(tmp_path: Path) -> None:
    """A log continued under another capability of the same bits (AVX2 after AVX512)
    records a second run from the first step it trained, starts it with a base (no replay
    spans two numerics: before issue 48 the log kept base 0 alone), and replays exactly."""
    if not {"AVX2", "AVX512"} <= set(CAPS):
        pytest.skip("this CPU has no two vector capabilities")
    path = str(tmp_path / "log")
    run("write", path, "4")
    cont = run("continue", path, "6", env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert (cont["step"], cont["exact"]) == (4, True)
    runs = describe_log(path)["numerics"]
    assert [(r["from_step"], r["aten_cpu"]) for r in runs] == [(0, "AVX512"), (5, "AVX2")]
    assert inspect_log(path)["bases"] == [0, 4]
    whole = run("restore", path)
    assert (whole["step"], whole["exact"], whole["verified"][-1]) == (6, True, 6)
    # the same numerics again: no new run, no new base
    run("continue", path, "8")
    runs = describe_log(path)["numerics"]
    assert [(r["from_step"], r["aten_cpu"]) for r in runs] == [
        (0, "AVX512"), (5, "AVX2"), (7, "AVX512")]
    assert inspect_log(path)["bases"] == [0, 4, 6]
