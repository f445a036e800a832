"""Local-update training across ranks (gloo, CPU): post-local SGD with Periodic, QSR and
Hierarchical averaging, DiLoCo with a fixed period and with QSR. Every rank is SIGKILLed
(inside a local phase, on a synchronization step, right after one, or inside the inner
step before its synchronization), restored in fresh processes and continued: parameters,
optimizer state, averager / outer state, counters, learning rate and RNG equal the
uninterrupted run's, bit for bit. A fast 2-rank subset runs by default; the campaigns over
many kill points and 4 ranks are ``slow``.

The ranks are processes forked by a fork server per rank (``local_worker.py --serve``,
tests/helpers/fork_server.py), which made the worker's imports once for the module: a
process of its own for every rank of every launch all the same, SIGKILLed as a job's."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import fork_server
from tests.helpers.dist import NEEDS_GLOO, RankExit, check_exits, free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("local_worker.py")

pytestmark = NEEDS_GLOO


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


#: this module's launches: forked by ``local_worker.py --serve`` servers (one per rank)
#: while ``_fork_servers`` holds them (a launch outside this module's tests, as
#: ``tests/test_report_torch.py``'s, starts processes of its own)
LAUNCHER = fork_server.Launcher(WORKER, _env)


@pytest.fixture(scope="module", autouse=True)
def _fork_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fork servers of this module's launches: their imports made once (module scope:
    every test of the module runs on one xdist worker, which also runs each reference run
    once), their memory given back when the module is done."""
    with LAUNCHER.held(tmp_path_factory.mktemp("local-worker-servers")):
        yield


def _ranks(argv: Callable[[int], Sequence[str]], world: int, **kw: Any) -> list[RankExit]:
    """``run_ranks`` of ``local_worker.py ARGV(rank)`` (:data:`LAUNCHER`)."""
    return LAUNCHER.run_ranks(argv, world, **kw)


def launch(phase: str, d: Path, method: str, *args: str, world: int = 2,
           killed: bool = False, timeout: float = 900.0) -> None:
    """Run ``local_worker.py`` on ``world`` ranks; every rank exits 0, or (``killed``)
    every rank was SIGKILLed or failed out of a collective with a dead peer (an error
    exit, never an abort: see ``check_exits``)."""
    port = free_port()
    (d / "out").mkdir(parents=True, exist_ok=True)
    exits = _ranks(lambda r: [
        "--phase", phase, "--method", method, "--rank", str(r), "--world", str(world),
        "--port", str(port), "--dir", str(d / "ck"), "--out", str(d / "out"), *args],
        world, timeout=timeout)
    check_exits(exits, peers="fail" if killed else "ok")
    for e in exits if killed else ():
        assert not e.timed_out, str(e)
        assert e.returncode != 0, f"rank {e.rank} was not killed:\n{e.output[-3000:]}"


#: the fewest steps a shared reference run trains (the longest run of the default tests)
REF_STEPS = 14
#: the methods of the default tests: their 2-rank reference runs share one launch
REF_METHODS = ("periodic", "diloco", "demo")
#: ``reference(d, method, steps, world=2)``: the reference run's states in ``d / "out"``
Reference = Callable[..., None]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run (phase ``ref``) of a method at a world size, launched once per
    test process and copied into each test's ``out``: the state it saves after step t is a
    pure function of (method, world, t) (batches are functions of the step and rank, the
    RNG seeded per rank; ``--steps`` only says where it stops), so a run to at least
    ``steps`` serves every test. At 2 ranks the first launch also runs the other methods
    of the default tests (``REF_METHODS``), in turn in the same job (each built and seeded
    afresh, as in a process of its own: a run's states depend on nothing before it), since
    a launch costs far more than these steps. (The module's tests run on one xdist
    worker: ``_fork_servers``.)"""
    # (method, world): (the directory of its run's files, their prefix, steps)
    runs: dict[tuple[str, int], tuple[Path, str, int]] = {}

    def copy(d: Path, method: str, steps: int, world: int = 2) -> None:
        have = runs.get((method, world))
        if have is None or have[2] < steps:
            n = max(steps, REF_STEPS)
            methods = [method, *(m for m in REF_METHODS if world == 2 and m != method
                                 and runs.get((m, world), (None, "", -1))[2] < n)]
            root = tmp_path_factory.mktemp(f"ref-{method}-{world}")
            launch("ref", root, ",".join(methods), "--steps", str(n), world=world)
            for m in methods:
                runs[(m, world)] = (root / "out", f"ref-{m}-" if len(methods) > 1 else "ref-",
                                    n)
            have = runs[(method, world)]
        (d / "out").mkdir(parents=True, exist_ok=True)
        for r in range(world):
            shutil.copyfile(have[0] / f"{have[1]}{r}.pt", d / "out" / f"ref-{r}.pt")
    return copy


def results(d: Path) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted((d / "out").glob("result-*.json"))]


def campaign(reference: Reference, d: Path, method: str, steps: int,
             kills: list[tuple[int, str]], *, world: int = 2, snapshot_every: int = 5,
             base_slices: int = 1) -> list[dict[str, Any]]:
    """The reference run, then a run killed at each of ``kills`` (step, where) in turn,
    each restarted from the checkpoint, then a run to the end; returns each rank's last
    result after checking every restore and the end bitwise."""
    common = ("--steps", str(steps), "--snapshot-every", str(snapshot_every),
              "--base-slices", str(base_slices))
    reference(d, method, steps, world)
    for at, where in kills:
        launch("run", d, method, *common, "--kill-at", str(at), "--kill-where", where,
               world=world, killed=True)
    launch("run", d, method, *common, world=world)
    res = results(d)
    assert len(res) == world
    for r in res:
        assert r["restored_bad"] == [], (r["rank"], r["restored_bad"])
        assert r["final_bad"] == [], (r["rank"], r["final_bad"])
        assert r["exact"], r["notes"]
    assert len({r["restored"] for r in res}) == 1   # one job step, every rank
    return res


def test_periodic_two_ranks_kill_restore_continue(reference: Reference, tmp_path: Path
                                                  ) -> None:
    """PostLocalSGDOptimizer(AdamW, PeriodicModelAverager(period=4, warmup=3)), 2 ranks:
    killed right after the synchronization of step 7 (rank 0 flushed, rank 1 not), then
    inside step 11's inner step (before its synchronization); restored and continued to
    step 14, bitwise."""
    res = campaign(reference, tmp_path, "periodic", 14, [(7, "after"), (11, "inner")])
    assert all(r["restored"] is not None and r["restored"] <= 10 for r in res)
    assert all(r["stats"]["syncs"] >= 1 for r in res)


@pytest.mark.slow
def test_diloco_two_ranks_kill_restore_continue(reference: Reference, tmp_path: Path
                                                ) -> None:
    """DiLoCo (AdamW inner, SGD-Nesterov outer, H=3), 2 ranks, killed on an outer step
    (step 6) and inside a local phase (step 8): bitwise to step 10. Slow: the default run
    has the same flow with streamed bases (``test_streamed_bases_two_ranks_kill_restore_
    continue[diloco]``: killed on the outer step 9 and inside the local phase of step 11,
    each restore replaying DiLoCo's records from a base holding its outer state), and
    DiLoCo restored from a consistent base (``test_compact_and_replay_per_rank[diloco]``)."""
    res = campaign(reference, tmp_path, "diloco", 10, [(6, "after"), (8, "after")],
                   snapshot_every=4)
    assert all(r["stats"]["syncs"] >= 1 for r in res)


@pytest.mark.parametrize("method", [pytest.param("periodic", marks=pytest.mark.slow),
                                    "diloco"])
def test_streamed_bases_two_ranks_kill_restore_continue(method: str, reference: Reference,
                                                        tmp_path: Path) -> None:
    """Streamed bases (3 slices, a base complete every 4 steps) under post-local SGD and
    DiLoCo: the synchronizations and DiLoCo's outer steps after a base's first slice move
    a replica parameter only after its own slice (the global copies and outer state are in
    the first slice). Killed right after step 9 (a base complete at 8, slices 6-8) and
    inside step 11's window (slices of the base of 12 taken after 10 and 11): each restore
    replays from a streamed base, bitwise, and the run ends bitwise at step 14."""
    from lowdiff_store.log import LogReader

    res = campaign(reference, tmp_path, method, 14, [(9, "after"), (11, "after")],
                   snapshot_every=4, base_slices=3)
    # every restore replays from a streamed base of three slices (which one depends on
    # what each rank's kill left durable: a base whose last slice was not is never named,
    # and a resumed checkpointer owing a base starts one at once)
    for r in res:
        first = r["base_slices"][0]
        assert r["base_slices"] == [first, first + 1, first + 2], r
        assert first + 2 <= r["restored"] <= 11, r
    for r in range(2):
        with LogReader(tmp_path / "ck" / f"rank-{r:05d}") as reader:
            assert reader.meta["torch"]["base_slices"]["in_force"] == 3
            complete, slices = reader.streamed[-1]
            assert complete >= 12
            assert slices == tuple(range(complete - 2, complete + 1))


def test_demo_two_ranks_kill_restore_continue(reference: Reference, tmp_path: Path
                                              ) -> None:
    """FlexDeMo's setting: 2 ranks, no gradient all-reduce, DeMoCompressor exchanging DCT
    coefficients (all-gather) with each rank's own momenta, the DeMo optimizer; every
    rank logs its own replica (layout 'local', kind 'replica') with its momenta every
    step; killed at step 6 and inside step 9, restored (momenta included) and continued
    bitwise to step 11."""
    res = campaign(reference, tmp_path, "demo", 11, [(6, "after"), (9, "inner")], snapshot_every=4)
    assert all(r["restored"] is not None for r in res)


_DEMO = ("--steps", "7", "--snapshot-every", "4")


@pytest.fixture(scope="module")
def demo_checkpoint(reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank FlexDeMo checkpoint of step 7 (checked against the reference run as it
    trained) that both reshard tests restore, written once (module scope: the two tests
    run on one xdist worker)."""
    d = tmp_path_factory.mktemp("demo-ck")
    reference(d, "demo", 7)
    launch("run", d, "demo", *_DEMO)
    for r in results(d):
        assert r["final_bad"] == [], (r["rank"], r["final_bad"])
    return d


@pytest.mark.parametrize("world", [1, 2])
def test_demo_replicas_resharded(world: int, demo_checkpoint: Path, tmp_path: Path) -> None:
    """A 2-rank FlexDeMo checkpoint restored at world size 1 (plain model, DeMo, the
    compressor) and into FSDP2 at 2 ranks: parameters and scheduler bitwise the
    uninterrupted run's (the same on every rank); the momenta, each rank's own, are not
    carried: ``exact`` is False and the note says why."""
    shutil.copytree(demo_checkpoint / "ck", tmp_path / "ck")
    (tmp_path / "out").mkdir()
    for f in (demo_checkpoint / "out").glob("ref-*.pt"):
        shutil.copyfile(f, tmp_path / "out" / f.name)
    launch("demo_reshard", tmp_path, "demo", *_DEMO, world=world)
    files = sorted((tmp_path / "out").glob("demo-reshard-*.json"))
    assert len(files) == world, files
    for f in files:
        got = json.loads(f.read_text())
        assert got["step"] == 7
        assert got["bad"] == []
        assert got["exact"] is False
        assert any("momenta are not carried" in n for n in got["notes"]), got["notes"]


def test_one_rank_killed_restores_at_newest_step_durable_on_all(reference: Reference,
                                                                tmp_path: Path) -> None:
    """Rank 1 alone is SIGKILLed after step 9 (not flushed); rank 0 goes on until the next
    averaging all-reduce fails. Both restore at the newest step durable on both shards
    (rank 0's later steps are cut), then continue bitwise to step 14."""
    common = ("--steps", "14", "--snapshot-every", "5")
    reference(tmp_path, "periodic", 14)
    launch("run", tmp_path, "periodic", *common, "--kill-at", "9", "--kill-rank", "1",
           killed=True)
    from lowdiff_store import latest_step
    from lowdiff_store.log import LogReader

    durable = []
    for r in range(2):
        with LogReader(str(tmp_path / "ck" / f"rank-{r:05d}")) as rd:
            durable.append(rd.durable_step)
    job = latest_step(str(tmp_path / "ck"))
    assert job == min(durable)
    assert job <= 9
    assert durable[0] > job
    launch("run", tmp_path, "periodic", *common)
    res = results(tmp_path)
    for r in res:
        assert r["restored"] == job
        assert r["restored_bad"] == []
        assert r["final_bad"] == []
        assert r["exact"]


_PERIODIC_10 = ("--steps", "10", "--snapshot-every", "4")


@pytest.fixture(scope="module")
def periodic_10(reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank post-local SGD checkpoint written to step 10 (bases at 0, 4 and 8; every
    rank's state the reference run's at step 10), with the reference run's states to step
    14 in ``out``: written once (module scope: its tests run on one xdist worker), each
    test working on a copy (:func:`_copy_of`)."""
    d = tmp_path_factory.mktemp("periodic-10")
    reference(d, "periodic", 14)
    launch("run", d, "periodic", *_PERIODIC_10)
    res = results(d)
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["restored"] is None
        assert r["final_bad"] == [], (r["rank"], r["final_bad"])
    return d


def _copy_of(src: Path, d: Path) -> None:
    """``src``'s checkpoint and reference states in ``d`` (``ck``, ``out/ref-*.pt``)."""
    shutil.copytree(src / "ck", d / "ck")
    (d / "out").mkdir(parents=True, exist_ok=True)
    for f in (src / "out").glob("ref-*.pt"):
        shutil.copyfile(f, d / "out" / f.name)


def test_replica_at_world_size_one_and_refusals(periodic_10: Path, tmp_path: Path) -> None:
    """A 2-rank post-local SGD checkpoint: one process materializes each rank's replica
    (parameters, AdamW state, averager and hook counters, lr, RNG) bitwise with
    ``restore_replica``; ``restore`` at world size 1 is refused (one line). Bad input:
    an unknown averager, a period mismatch, a log of divergent replicas opened as one
    replicated state (``restore`` with the inner optimizer, ``replay_state``), another
    method, a plain log opened as local-update: one line naming the file, the stable
    reason, nothing written (the same process, after the replicas: one launch)."""
    _copy_of(periodic_10, tmp_path)
    d = tmp_path / "bad"
    launch("replica", tmp_path, "periodic", *_PERIODIC_10, "--from-world", "2",
           "--refusals-dir", str(d / "ck"), world=1)
    rep = json.loads((tmp_path / "out" / "replica.json").read_text())
    assert rep["bad"] == {"0": [], "1": []}
    assert rep["steps"] == {"0": 10, "1": 10}
    reason, msg = rep["world_refused"]
    assert reason == "world_size_mismatch"
    assert "divergent replicas" in msg
    assert "\n" not in msg
    assert str(tmp_path / "ck") in msg

    got = json.loads((tmp_path / "out" / "refusals.json").read_text())
    want = {"unknown_averager": "not_allowed", "period_mismatch": "state_mismatch",
            "opened_as_ddp": "state_mismatch", "replay_state": "state_mismatch",
            "other_method": "state_mismatch", "not_local": "not_a_log",
            "log_into_plain": "state_mismatch", "continued_other_period": "state_mismatch",
            "scaler": "not_allowed"}
    for case, reason in want.items():
        assert got[case] is not None, case
        r, msg, _exists = got[case]
        assert r == reason, (case, r, msg)
        assert "\n" not in msg, (case, msg)
        assert str(d / "ck") in msg, (case, msg)
    assert got["unknown_averager"][2] is False   # nothing written
    assert got["scaler"][2] is False   # refused before SHARDS: the directory not created
    assert "period" in got["period_mismatch"][1]
    assert "period" in got["continued_other_period"][1]


@pytest.mark.parametrize("method", ["periodic", "diloco",
                                    pytest.param("demo", marks=pytest.mark.slow)])
def test_compact_and_replay_per_rank(method: str, reference: Reference,
                                     request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A 2-rank checkpoint (post-local SGD with its hook's warmup: the one of
    ``periodic_10``; DiLoCo, H=3; slow: FlexDeMo's replicas, each rank's momenta logged
    every step) written to step 10 (bases at 0, 4, 8) is compacted with one base kept:
    periodic with ``lowdiff-store compact``, DiLoCo one rank at a time (``--rank 0``,
    ``--rank 1``). Every shard then holds only a base at step 10, made from its own shard;
    ``SHARDS`` is unchanged; ``replay --rank R --to-step 10`` writes replica R's parameters
    bitwise (the replicas differ); the job restores at step 10 from the compacted
    checkpoint and continues bitwise to step 14 (through a synchronization)."""
    import torch
    from safetensors.torch import load_file

    from lowdiff_store import cli
    from lowdiff_store.log import LogReader

    if method == "periodic":  # (the other methods do not build it)
        _copy_of(request.getfixturevalue("periodic_10"), tmp_path)
    else:
        reference(tmp_path, method, 14)
        launch("run", tmp_path, method, "--steps", "10", "--snapshot-every", "4")
    ck = tmp_path / "ck"
    shards = (ck / "SHARDS").read_bytes()
    for args in ([["--rank", "0"], ["--rank", "1"]] if method == "diloco" else [[]]):
        assert cli.main(["compact", str(ck), "--keep-bases", "1", *args]) == 0
    assert (ck / "SHARDS").read_bytes() == shards
    for r in range(2):
        with LogReader(str(ck / f"rank-{r:05d}")) as rd:
            assert list(rd.bases) == [10]
    params = []
    for r in range(2):
        out = tmp_path / f"replica-{r}.safetensors"
        assert cli.main(["replay", str(ck), "--rank", str(r), "--to-step", "10",
                         "--out", str(out)]) == 0
        ref = torch.load(str(tmp_path / "out" / f"ref-{r}.pt"), weights_only=True)[10]
        got = load_file(str(out))
        want = {k[2:]: v for k, v in ref.items() if k.startswith("p/")}
        assert sorted(got) == sorted(want)
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], r
        params.append(got)
    if method == "periodic":   # step 10 is inside a local phase: the replicas differ
        assert any(not torch.equal(params[0][k], params[1][k]) for k in params[0])
    launch("run", tmp_path, method, "--steps", "14", "--snapshot-every", "4")
    for r in results(tmp_path):
        assert r["restored"] == 10
        assert r["restored_bad"] == []
        assert r["final_bad"] == []
        assert r["exact"], r["notes"]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "world"), [("periodic", 2), ("qsr", 2), ("diloco", 2),
                                          ("diloco_qsr", 2), ("periodic", 4), ("hier", 4),
                                          ("diloco", 4), ("qsr", 4), ("demo", 2)])
def test_kill_campaign(method: str, world: int, reference: Reference, tmp_path: Path
                       ) -> None:
    """Four SIGKILLs of every rank at random steps (seeded), alternately after the step
    and inside the inner step, each restored and continued, then the run to the end."""
    rnd = random.Random(f"{method}-{world}")
    steps = 24
    points = sorted(rnd.sample(range(2, steps), 4))
    kills = [(p, "inner" if i % 2 else "after") for i, p in enumerate(points)]
    campaign(reference, tmp_path, method, steps, kills, world=world)


def _misplace(ck: Path, dst: Path, how: str) -> Path:
    """A copy of the checkpoint ``ck`` with its rank directories swapped, or rank 0's
    copied as rank 1 (every CRC valid, ``SHARDS`` unchanged)."""
    import shutil

    root = dst / how
    root.mkdir(parents=True)
    shutil.copy2(ck / "SHARDS", root / "SHARDS")
    src = {"swapped": (1, 0), "rank0_as_rank1": (0, 0)}[how]
    for r, s in enumerate(src):
        shutil.copytree(ck / f"rank-{s:05d}", root / f"rank-{r:05d}")
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_misplaced_rank_directories_are_refused(periodic_10: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A 2-rank post-local SGD checkpoint (step 10, inside a local phase: the replicas
    differ) whose rank directories are swapped, or whose rank 0 is copied as rank 1, every
    CRC valid: each rank's log says which rank of how many it is, and every reader checks
    it against the directory it is in. ``restore`` in the 2-rank job (every rank),
    ``restore_replica`` of the misplaced rank, ``replay --rank``, ``compact`` (one that
    makes a base, and ``--step 8``, at bases every shard holds: nothing to make) and
    ``verify`` refuse with ``bad_metadata`` in one line naming the shard's ``MANIFEST``
    and the rank it says; nothing is written or deleted. Before, restore gave the other
    rank's replica with ``exact`` True, and ``compact --step 8`` deleted bases and
    exited 0."""
    from lowdiff_store import cli

    d = tmp_path / "m" / "ck"
    roots = {how: _misplace(periodic_10 / "ck", d, how) for how in ("swapped", "rank0_as_rank1")}
    before = {how: _tree(root) for how, root in roots.items()}
    # the ranks whose directory holds another rank's log
    wrong = {"swapped": (0, 1), "rank0_as_rank1": (1,)}
    launch("misplaced", tmp_path / "m", "periodic")
    for job_rank in range(2):
        got = json.loads((tmp_path / "m" / "out" / f"misplaced-{job_rank}.json").read_text())
        assert sorted(got) == sorted(roots)
        for how, root in roots.items():
            assert sorted(got[how]) == ["replica-0", "replica-1", "restore"]
            for what, (reason, msg) in got[how].items():
                if what == "replica-0" and how == "rank0_as_rank1":
                    assert reason is None, (how, what, msg)   # rank 0 is in its place
                    continue
                assert reason == "bad_metadata", (job_rank, how, what, msg)
                assert "\n" not in msg
                # the shard refused: the replica asked for; in restore, the job rank's
                # own, or (a rank whose shard is in place) the failing rank's
                r = int(what[-1]) if what != "restore" else \
                    job_rank if job_rank in wrong[how] else wrong[how][0]
                assert f"{root / f'rank-{r:05d}' / 'MANIFEST'}: bad_metadata" in msg, \
                    (job_rank, how, what, msg)
                said = 1 - r if how == "swapped" else 0
                assert f"says rank {said} of 2, but it is rank {r} of" in msg, msg
    for how, root in roots.items():
        r = wrong[how][0]
        manifest = f"{root / f'rank-{r:05d}' / 'MANIFEST'}: bad_metadata"
        for argv in (["replay", str(root), "--rank", str(r), "--to-step", "10", "--out",
                      str(tmp_path / "x.safetensors")],
                     ["compact", str(root), "--keep-bases", "1"],
                     ["compact", str(root), "--keep-bases", "1", "--step", "8"],
                     ["verify", str(root)]):
            rc = cli.main(argv)
            out, err = capsys.readouterr()
            if argv[0] == "verify":   # a problem found: exit 3, each problem a line
                assert rc == cli.EXIT_CORRUPT, (how, rc, out, err)
                # a copied rank is also one log under two ranks (log_id_mismatch)
                copied = how == "rank0_as_rank1"
                assert f"{len(wrong[how]) + copied} problem(s)" in err, err
                assert ("log_id_mismatch" in out) == copied, out
                assert manifest.replace(": bad", ":-: bad") in out, out   # no offset
                continue
            assert rc == cli.EXIT_ERROR, (how, argv, rc, out, err)
            assert manifest in err, (how, argv, err)
            assert err.count("\n") == 1, err
        assert _tree(root) == before[how], how
        assert not (tmp_path / "x.safetensors").exists()


#: the run of the kill tests below and of their reference
_COMMON = ("--steps", "6", "--snapshot-every", "4")


def _killed_at(reference: Reference, tmp_path: Path, where: str, rank: int) -> Path:
    """The uninterrupted reference run, then a 2-rank job whose rank ``rank`` is SIGKILLed
    at ``where`` (the worker's ``--kill-where``) while the other fails out of the next
    agreement; returns the checkpoint directory."""
    reference(tmp_path, "periodic", 6)
    port = free_port()
    ck = tmp_path / "ck"
    exits = _ranks(lambda r: [
        "--phase", "run", "--method", "periodic", "--rank", str(r), "--world", "2",
        "--port", str(port), "--dir", str(ck), "--out", str(tmp_path / "out"),
        "--kill-where", where, "--kill-rank", str(rank), *_COMMON],
        2, timeout=300, killed=rank, peers_grace=20)
    check_exits(exits, killed=rank, peers="fail")
    other = 1 - rank
    assert exits[other].returncode != 0, str(exits[other])  # it never passed the agreement
    return ck


def test_rank0_killed_before_shards_then_the_job_reopens(reference: Reference, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """Rank 0 SIGKILLed at the moment its checkpointer would publish ``SHARDS`` (the
    local-update layout publishes it in ``select``, after the first agreement), while
    rank 1 opens its log and then fails out of (or hangs in) the next agreement: the
    directory holds ``rank-00001`` and no ``SHARDS``; ``verify`` says ``not_a_log`` in one
    line naming what is missing (exit 1, as for any path that is no log). The whole job
    relaunched on the same path opens (rank 0 publishes ``SHARDS``; rank 1's step-0 log
    is started over), trains to the end bitwise the uninterrupted run, and the result
    verifies clean and restores exactly."""
    from lowdiff_store import cli, latest_step

    ck = _killed_at(reference, tmp_path, "shards", 0)
    assert not (tmp_path / "out" / "result-1.json").exists()
    # rank 1 opened its log before the agreement; rank 0 wrote nothing
    assert sorted(p.name for p in ck.iterdir()) == ["rank-00001"]
    assert (ck / "rank-00001" / "MANIFEST").is_file()
    rc = cli.main(["verify", str(ck)])
    out, err = capsys.readouterr()
    # no log at all (no SHARDS, no MANIFEST): bad input, exit 1, one line on stderr
    assert (rc, out) == (cli.EXIT_ERROR, ""), (rc, out, err)
    assert err.count("\n") == 1, err
    assert f"{ck}: not_a_log: " in err, err
    assert "rank-00001 but no SHARDS" in err, err
    assert "open the checkpointer again on every rank" in err, err
    launch("run", tmp_path, "periodic", *_COMMON)
    assert (ck / "SHARDS").is_file()
    res = results(tmp_path)
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["restored"] is None   # nothing was durable on every rank: a new job
        assert r["final_bad"] == [], (r["rank"], r["final_bad"])
    assert latest_step(str(ck)) == 6
    assert cli.main(["verify", str(ck)]) == 0, capsys.readouterr()
    capsys.readouterr()
    launch("run", tmp_path, "periodic", *_COMMON)   # restores at 6 against the reference
    for r in results(tmp_path):
        assert r["restored"] == 6
        assert r["restored_bad"] == [], (r["rank"], r["restored_bad"])
        assert r["exact"], r["notes"]


@pytest.mark.slow
def test_rank1_killed_at_its_open_after_shards_then_the_job_reopens(reference: Reference,
                                                                    tmp_path: Path) -> None:
    """The same window the other way round: rank 1 SIGKILLed where its checkpointer opens
    its log, while rank 0 publishes ``SHARDS`` (in ``select``) and opens ``rank-00000``
    with its step-0 base. No step is durable on every rank (``latest_step`` is None: the
    worker starts afresh), so the relaunched job must open, train to the end bitwise the
    uninterrupted run and restore exactly, as when ``SHARDS`` is missing."""
    from lowdiff_store import latest_step
    from lowdiff_store.log import LogReader

    ck = _killed_at(reference, tmp_path, "open", 1)
    assert sorted(p.name for p in ck.iterdir()) == ["SHARDS", "rank-00000"]
    with LogReader(ck / "rank-00000") as rd:
        assert (rd.last_step, list(rd.bases)) == (0, [0])
    assert latest_step(str(ck)) is None
    launch("run", tmp_path, "periodic", *_COMMON)
    for r in results(tmp_path):
        assert r["restored"] is None   # nothing was durable on every rank: a new job
        assert r["final_bad"] == [], (r["rank"], r["final_bad"])
    assert latest_step(str(ck)) == 6
    launch("run", tmp_path, "periodic", *_COMMON)   # restores at 6 against the reference
    for r in results(tmp_path):
        assert r["restored"] == 6
        assert r["restored_bad"] == [], (r["rank"], r["restored_bad"])
        assert r["exact"], r["notes"]
