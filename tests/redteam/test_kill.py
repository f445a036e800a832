"""SIGKILL at random moments (issue 35 item 5) of real processes: an export (DCP
directory, ``.pt`` file), an import (a log started from a DCP checkpoint), and training
with bases staged beside the next step. A moment is the K-th file-system operation of the
process (``kill_worker.py``), K drawn from a seeded generator over the count of an
unkilled run: no test depends on timing. After each kill: nothing half-written looks
complete, every step reported durable restores bit for bit, and running the same command
again finishes the work. A fast smoke runs in CI; the campaigns are ``slow``. The import
and training campaigns run with a writer process too (``writer_process=True``), and one
kills the writer process itself at its K-th operation (its smoke runs in CI)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lowdiff_store import latest_step
from lowdiff_store.torch import DiffCheckpointer, replay_state, restore
from tests.helpers.fork_server import ForkServer
from tests.helpers.timing import scaled

from .common import ROOT, build, dcp_save, same_bits, train
from .kill_worker import KILL_WRITER_ENV, PROCESS_ENV

WORKER = Path(__file__).with_name("kill_worker.py")
#: Kills per slow campaign (each costs two runs forked by the module's server: the seven
#: campaigns took 73 s on 2 vCPUs, ~10 s a kill when every run was a fresh interpreter).
CAMPAIGN_KILLS = 12
#: the checkpointer's two writers: in the training process, or a writer process
#: (``kill_worker.py``, ``LOWDIFF_TEST_WRITER_PROCESS``)
WRITERS = [pytest.param({}, id="thread"), pytest.param({PROCESS_ENV: "1"}, id="process")]
#: a writer process whose own file-system operations are counted (and one killed)
COUNTED_WRITER = {PROCESS_ENV: "1", KILL_WRITER_ENV: "0"}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(extra or {}))


#: the module's fork server of ``kill_worker.py`` while ``_fork_server`` holds it, and the
#: directory of its runs' output
_SERVER: list[tuple[ForkServer, Path]] = []


@pytest.fixture(scope="module", autouse=True)
def _fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every run of the module forked by one ``kill_worker.py --serve`` (its imports made
    once; every run still a process of its own, killed as one)."""
    root = tmp_path_factory.mktemp("kill-worker-server")
    server = ForkServer([sys.executable, str(WORKER), "--serve"], _env(), root / "server.log")
    _SERVER.append((server, root))
    try:
        yield
    finally:
        _SERVER.remove((server, root))
        server.close()


def run(k: int, *argv: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """``kill_worker.py K ARGV`` (forked by the module's server): its exit status and
    output."""
    args = [str(k), *map(str, argv)]
    if not _SERVER:
        return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True,
                              text=True, timeout=scaled(300), env=_env(env))
    server, root = _SERVER[-1]
    return server.run(args, _env(env), root / "run", scaled(300))


def events(*argv: str, env: dict[str, str] | None = None, who: str = "") -> int:
    """The operations an unkilled run counts (``who="writer "``: its writer process's)."""
    p = run(0, *argv, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(rf"(?m)^{who}events (\d+)", p.stdout)
    assert m is not None, p.stdout
    return int(m.group(1))


def draws(n: int, total: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(rng.sample(range(1, total + 1), min(n, total)))


# ----------------------------------------------------------------------------- export


def _dcp_state(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    m, _opt = build(3)
    sd = {"model": {k: torch.empty_like(v) for k, v in m.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd["model"]


def _export_campaign(tmp_path: Path, fmt: str, kills: int, seed: int) -> None:
    m, opt = build(0)
    log = tmp_path / "log"
    with DiffCheckpointer(log, m, opt, snapshot_every=3):
        train(m, opt, 0, 5)
    want = replay_state(log)[0]
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / ("x" if fmt == "dcp" else "x.pt")
    total = events("export", str(log), str(out), fmt)
    assert out.exists()
    for k in draws(kills, total, seed):
        for f in outdir.iterdir():  # a complete export from the last round
            if f.name == out.name:
                subprocess.run(["rm", "-rf", str(f)], check=True)
        p = run(k, "export", str(log), str(out), fmt)
        assert p.returncode in (-9, 0), (k, p.stderr[-3000:])
        if out.exists():  # published whole, or not at all
            got = _dcp_state(out) if fmt == "dcp" else torch.load(out, weights_only=True)
            same_bits({n: got[n] for n in want}, want)
        left = [f for f in os.listdir(outdir) if f != out.name]
        assert all(f.startswith(".x") and f.endswith(".tmp") for f in left), left
        if out.exists():
            continue
        p = run(0, "export", str(log), str(out), fmt)  # again: finishes, cleans up
        assert p.returncode == 0, (k, p.stderr[-3000:])
        assert os.listdir(outdir) == [out.name], (k, os.listdir(outdir))


def test_killed_export_smoke(tmp_path: Path) -> None:
    _export_campaign(tmp_path, "dcp", kills=1, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fmt", ["dcp", "pt"])
def test_killed_export_campaign(tmp_path: Path, fmt: str) -> None:
    _export_campaign(tmp_path, fmt, kills=CAMPAIGN_KILLS, seed=2)


# ----------------------------------------------------------------------------- import


def _import_campaign(tmp_path: Path, kills: int, seed: int,
                     env: dict[str, str] | None = None) -> None:
    src, src_opt = build(0)
    train(src, src_opt, 0, 3)
    ck = tmp_path / "ck"
    dcp_save(ck, src, src_opt)
    train(src, src_opt, 3, 6)  # the uninterrupted run: 3 steps more
    total = events("import", str(tmp_path / "dry"), str(ck), "3", env=env)
    for i, k in enumerate(draws(kills, total, seed)):
        log = tmp_path / f"log{i}"
        p = run(k, "import", str(log), str(ck), "3", env=env)
        assert p.returncode in (-9, 0), (k, p.stderr[-3000:])
        p = run(0, "import", str(log), str(ck), "3", env=env)  # the user runs it again
        assert p.returncode == 0, (k, p.stderr[-3000:])
        m, opt = build(9)
        res = restore(log, m, opt)
        assert (res.step, res.exact) == (3, True), k
        same_bits(m.state_dict(), src.state_dict())


def test_killed_import_smoke(tmp_path: Path) -> None:
    _import_campaign(tmp_path, kills=1, seed=3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("env", WRITERS)
def test_killed_import_campaign(tmp_path: Path, env: dict[str, str]) -> None:
    _import_campaign(tmp_path, kills=CAMPAIGN_KILLS, seed=4, env=env)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_import_killed_before_base_0_runs_again(tmp_path: Path, writer: str) -> None:
    """The moment the campaign found: the manifest committed, base 0 not yet. Nothing was
    durable, ``latest_step`` says "start fresh", and the same ``DiffCheckpointer(...,
    initial_base=...)`` starts the log (it refused: "already holds one: restore() it",
    while restore() refused with ``no_base``). ``process``: the import's base 0 (a
    reference to the DCP checkpoint) goes through a writer process (the killed import runs
    against it in the slow campaign)."""
    src, src_opt = build(0)
    train(src, src_opt, 0, 3)
    ck = tmp_path / "ck"
    dcp_save(ck, src, src_opt)
    log = tmp_path / "log"
    from lowdiff_store import LogWriter

    LogWriter(log).close()  # a manifest, no base, no record
    assert latest_step(log) is None
    m, opt = build(5)
    with DiffCheckpointer(log, m, opt, snapshot_every=100, initial_base=ck,
                          writer_process=writer == "process") as ckpt:
        train(m, opt, 3, 5)
        assert ckpt.stats()["writer_process"] == float(writer == "process")
    train(src, src_opt, 3, 5)
    m2, opt2 = build(9)
    assert restore(log, m2, opt2).step == 2
    same_bits(m2.state_dict(), src.state_dict())


# ------------------------------------------------------------ training, staged bases


def _reference(steps: int) -> dict[int, dict[str, torch.Tensor]]:
    m, opt = build(1)
    out = {0: {k: v.clone() for k, v in m.state_dict().items()}}
    for t in range(steps):
        train(m, opt, t, t + 1)
        out[t + 1] = {k: v.clone() for k, v in m.state_dict().items()}
    return out


def _train_campaign(tmp_path: Path, kills: int, seed: int,
                    env: dict[str, str] | None = None) -> None:
    """Training killed at its K-th operation; with ``env=COUNTED_WRITER`` the *writer
    process* is killed at its K-th, and the trainer raises at its next call, one line
    naming the death (``CommitError``)."""
    steps = 8
    ref = _reference(steps)
    writer = env == COUNTED_WRITER
    total = events("train", str(tmp_path / "dry"), str(steps), env=env,
                   who="writer " if writer else "")
    for i, k in enumerate(draws(kills, total, seed)):
        log = tmp_path / f"log{i}"
        if writer:
            p = run(0, "train", str(log), str(steps), env={**COUNTED_WRITER,
                                                          KILL_WRITER_ENV: str(k)})
            assert p.returncode in (1, 0), (k, p.stderr[-3000:])
            if p.returncode == 1:
                assert "CommitError" in p.stderr, (k, p.stderr[-3000:])
                assert "writer process died (killed by signal 9 (SIGKILL))" in \
                    p.stderr.strip().splitlines()[-1], (k, p.stderr[-3000:])
        else:
            p = run(k, "train", str(log), str(steps), env=env)
            assert p.returncode in (-9, 0), (k, p.stderr[-3000:])
        reported = [int(x) for x in re.findall(r"durable (-?\d+)", p.stdout)]
        durable = max(reported, default=-1)
        if latest_step(log) is not None:
            m, opt = build(7)
            res = restore(log, m, opt)
            assert res.step >= durable, (k, res.step, durable)
            assert res.exact
            same_bits(m.state_dict(), ref[res.step])
        else:
            assert durable < 0, k  # nothing was acknowledged
        p = run(0, "train", str(log), str(steps), env=env)  # resumes and finishes
        assert p.returncode == 0, (k, p.stderr[-3000:])
        m, opt = build(7)
        assert restore(log, m, opt).step == steps
        same_bits(m.state_dict(), ref[steps])


def test_killed_training_with_staged_bases_smoke(tmp_path: Path) -> None:
    _train_campaign(tmp_path, kills=1, seed=5)


def test_killed_writer_process_smoke(tmp_path: Path) -> None:
    _train_campaign(tmp_path, kills=1, seed=7, env=COUNTED_WRITER)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("env", [*WRITERS, pytest.param(COUNTED_WRITER, id="writer-killed")])
def test_killed_training_with_staged_bases_campaign(tmp_path: Path, env: dict[str, str]
                                                    ) -> None:
    _train_campaign(tmp_path, kills=CAMPAIGN_KILLS, seed=6, env=env)
