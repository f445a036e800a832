"""Distributed training with 2 processes on CPU (gloo): per-rank shards, DDP communication
hook reuse, restore of the newest step durable on every rank, bitwise continuation.

Each scenario launches ``dist_worker.py`` twice on 2 ranks: ``train`` (a reference run to
step 20 without checkpointing, then a checkpointed run stopped at 12 by a close, a crash
or a SIGKILL of one rank) and ``resume`` (fresh processes: restore, compare with the
reference at the restored step, continue to 20, compare with the reference at 20). The
offline tools (``replay_state``, ``inspect``, ``verify``, ``replay``, ``compact``) are then
run on the resulting checkpoint in this process. Each rank of a launch is forked by a
fork server of its rank (``dist_worker.py --serve``), which made the worker's imports once
for the module; every rank is still a process of its own.

The CI subset (plain all-reduce, fp16 + a SIGKILL, PowerSGD, ZeRO + the top-k all-gather
hook) takes about a minute; the other variants are ``@pytest.mark.slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lowdiff_store.cli import main as cli_main
from lowdiff_store.errors import ConfigError, Reason
from lowdiff_store.log.shards import read_shards_manifest
from lowdiff_store.torch import DiffCheckpointer, replay_state, restore
from lowdiff_store.verify import inspect_log, verify_log
from tests.helpers import fork_server
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port
from tests.helpers.timing import scaled

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = HERE / "dist_worker.py"

pytestmark = [NEEDS_GLOO, pytest.mark.consistent_bases]  # (tests/conftest.py)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


#: this module's launches: forked by ``dist_worker.py --serve`` servers (one per rank)
#: while ``dist_worker_servers`` holds them; a module that launches through :func:`launch`
#: without that fixture starts processes of its own
LAUNCHER = fork_server.Launcher(WORKER, _env)


@pytest.fixture(scope="module", autouse=True)
def dist_worker_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fork servers of this module's launches: the worker's imports made once per
    module, not once per rank of every launch (each rank is still a process of its own,
    SIGKILLed as a job's would be)."""
    with LAUNCHER.held(tmp_path_factory.mktemp("dist-worker-servers")):
        yield


def launch(phase: str, d: Path, *args: str, world: int = 2, killed: int | None = None,
           timeout: float = 120.0) -> None:
    """Run ``dist_worker.py`` on ``world`` ranks (:data:`LAUNCHER`); every rank must exit
    0, except the one expected to be SIGKILLed (``killed``), whose peers may fail or are
    killed here."""
    port = free_port()
    (d / "out").mkdir(parents=True, exist_ok=True)

    def argv(r: int) -> list[str]:
        return ["--phase", phase, "--rank", str(r), "--world", str(world), "--port",
                str(port), "--dir", str(d / "ck"), "--out", str(d / "out"), "--timeout",
                str(scaled(timeout)), *args]

    exits = LAUNCHER.run_ranks(argv, world, timeout=timeout, killed=killed,
                               peers_grace=15.0)
    check_exits(exits, killed=killed, peers="ok" if killed is None else "fail")


def results(d: Path, kind: str = "result") -> list[dict[str, Any]]:
    out = []
    for f in sorted((d / "out").glob(f"{kind}-*.json")):
        out.append(json.loads(f.read_text()))
    return out


def scenario(d: Path, *args: str, killed: int | None = None) -> list[dict[str, Any]]:
    """Train (stopped at 12 per ``args``), then resume to 20; returns each rank's result
    after checking the bitwise claims common to every scenario."""
    launch("train", d, *args, killed=killed)
    for r in results(d, "train"):
        assert r["perturbed"] == [], "the checkpointer changed training"
    launch("resume", d, *args)
    res = results(d)
    assert len(res) == 2
    for r in res:
        assert r["restored_bad"] == [], "restored state differs from the reference"
        assert r["final_bad"] == [], "continued run differs from the uninterrupted one"
        assert r["exact"], r["notes"]
        assert r["stats"]["tee_fallbacks"] == 0
    assert res[0]["step"] == res[1]["step"]
    return res


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def allreduce_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Plain all-reduce through the wrapped hook; both ranks crash (no close) after 12."""
    d = tmp_path_factory.mktemp("allreduce")
    res = scenario(d, "--hook", "allreduce", "--end", "crash", "--every", "5",
                   "--flush-at", "11")
    return d, res


def test_allreduce_crash_restore_continue(allreduce_run: tuple[Path, list[Any]]) -> None:
    d, res = allreduce_run
    # flushed after 11, crashed after 12's optimizer step: 12 was never complete
    assert res[0]["step"] == 11
    assert res[0]["base_step"] == 10
    assert res[0]["extra"] == {"batches": res[0]["step"] - 1}
    body = read_shards_manifest(d / "ck")
    assert body["world_size"] == 2
    assert body["layout"] == "replicated"
    # the ranks split the parameters: each logged only its share of the gradients
    assert res[0]["stats"]["owned_params"] + res[1]["stats"]["owned_params"] == 8
    # plain all-reduce: nothing to tee, the pre-step copy is the averaged bucket
    assert res[0]["stats"]["tee_params"] == 0


def test_replay_state_merges_shards(allreduce_run: tuple[Path, list[Any]]) -> None:
    d, _res = allreduce_run
    ref = torch.load(d / "out" / "ref-0.pt")
    for step in (None, 7, 13):
        state, opt = replay_state(d / "ck", step, with_optimizer=True)
        s = 20 if step is None else step
        assert set(state) == {k[len("model/"):] for k in ref[s] if k.startswith("model/")}
        for k, v in state.items():  # buffers as rank 0 holds them
            assert same_bits(v, ref[s]["model/" + k]), (s, k)
        assert opt is not None
        assert len(opt["state"]) == 8
        for i, name in enumerate(opt["param_groups"][0]["param_names"]):
            st = opt["state"][i]
            assert same_bits(st["exp_avg"], ref[s][f"opt/{name}/exp_avg"]), (s, name)


def test_one_process_reshards_and_cannot_log_into_it(
        allreduce_run: tuple[Path, list[Any]]) -> None:
    """This process is a job of one rank: restore reshards the 2-rank checkpoint (bitwise
    the reference at that step); logging into it is refused."""
    d, _res = allreduce_run
    sys.path.insert(0, str(HERE))
    from dist_worker import Net

    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    res = restore(d / "ck", m, opt, step=13)
    ref = torch.load(d / "out" / "ref-0.pt")[13]
    for k, v in m.state_dict().items():
        assert same_bits(v, ref["model/" + k]), k
    for n, p in m.named_parameters():
        assert same_bits(opt.state[p]["exp_avg_sq"], ref[f"opt/{n}/exp_avg_sq"]), n
    assert any("written by 2 rank(s)" in n for n in res.notes)
    with pytest.raises(ConfigError) as e:
        DiffCheckpointer(d / "ck", m, opt)
    assert e.value.reason is Reason.WORLD_SIZE_MISMATCH
    assert "written by 2 ranks but this job has 1" in str(e.value)


def test_cli_on_sharded_checkpoint(allreduce_run: tuple[Path, list[Any]], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    d, _res = allreduce_run
    assert verify_log(str(d / "ck")).ok
    info = inspect_log(str(d / "ck"))
    assert info["sharded"]
    assert info["world_size"] == 2
    assert info["durable_step"] == 20
    assert cli_main(["inspect", str(d / "ck"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["torch"]["sharded"]
    assert len(out["torch"]["shards"]) == 2
    owned = sum(s["owned_params"] for s in out["torch"]["shards"])
    assert owned == 8
    assert cli_main(["verify", str(d / "ck")]) == 0
    dst = tmp_path / "s15.pt"
    assert cli_main(["replay", str(d / "ck"), "--to-step", "15", "--out", str(dst),
                     "--format", "pt"]) == 0
    ref = torch.load(d / "out" / "ref-0.pt")[15]
    got = torch.load(dst, weights_only=True)
    for k, v in got.items():
        assert same_bits(v, ref["model/" + k]), k


def test_compact_sharded(allreduce_run: tuple[Path, list[Any]], tmp_path: Path) -> None:
    d, _res = allreduce_run
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    before = verify_log(str(ck))
    assert cli_main(["compact", str(ck), "--step", "18", "--keep-bases", "2"]) == 0
    for r in (0, 1):  # every shard got the base of step 18; older bases went
        info = inspect_log(str(ck / f"rank-0000{r}"))
        assert info["bases"] == [18, 20]
    assert verify_log(str(ck)).ok
    assert verify_log(str(ck)).bases < before.bases
    ref = torch.load(d / "out" / "ref-0.pt")
    for s in (18, 19, 20):
        state, _ = replay_state(ck, s)
        for k, v in state.items():
            assert same_bits(v, ref[s]["model/" + k]), (s, k)


def test_sharded_materializer_rebuilds_bases_exactly(
        allreduce_run: tuple[Path, list[Any]]) -> None:
    """A base made from the log (compaction) equals the one the rank's checkpointer wrote:
    same tensors bit for bit, same metadata."""
    import numpy as np

    from lowdiff_store.log import LogReader
    from lowdiff_store.torch.distributed.restore import shard_materializer

    d, _res = allreduce_run
    mat = shard_materializer(d / "ck")
    for r in (0, 1):
        with LogReader(d / "ck" / f"rank-0000{r}") as rd:
            step = rd.bases[-2]
            tensors, meta = mat(r)(rd, step)
            with rd.base(step) as bf:
                assert sorted(bf.names) == sorted(tensors)
                for n in bf.names:
                    assert bf.info(n)[0] == tensors[n][0], n
                    assert bf.tensor(n).tobytes() == np.asarray(tensors[n][1]).tobytes(), n
                assert bf.meta() == meta


def test_fp16_one_rank_killed(tmp_path: Path) -> None:
    """Rank 1 (group commit of 3 records) is SIGKILLed after step 9 while rank 0 (flushed
    every step) is ahead: restore takes the newest step durable on both, continues
    bitwise, and rank 0's later steps are cut from its shard."""
    d = tmp_path
    args = ("--hook", "fp16", "--end", "kill", "--stop", "9", "--kill-rank", "1",
            "--batch-rank1", "3", "--flush-rank0", "--every", "4")
    launch("train", d, *args, killed=1)
    ahead = [inspect_log(str(d / "ck" / f"rank-0000{r}"))["durable_step"] for r in (0, 1)]
    assert ahead[0] == 9
    assert ahead[1] < 9
    launch("resume", d, *args)
    res = results(d)
    assert [r["step"] for r in res] == [ahead[1], ahead[1]]
    for r in res:
        assert r["restored_bad"] == []
        assert r["final_bad"] == []
        assert r["exact"]
        assert r["stats"]["tee_fallbacks"] == 0
    # fp16 reuse: the gradients were logged as fp16 (half the bytes of fp32)
    from lowdiff_store.log import LogReader

    with LogReader(d / "ck" / "rank-00000") as rd:
        rec = rd.record(15)
        grads = [rec.entry(n) for n in rec.names if n.startswith("@grad/")]
        assert grads
        assert all(e.dtype == "F16" for e in grads)
    info = inspect_log(str(d / "ck"))
    assert info["durable_step"] == 20
    assert [s["durable_step"] for s in info["shards"]] == [20, 20]


def test_writer_processes_one_rank_killed(tmp_path: Path) -> None:
    """Each rank's log written by its own writer process (``writer_process=True``): rank 1
    is SIGKILLed after step 9, every step it handed over being in the ring (``settle``);
    its writer process makes them durable and exits; the resumed job restores the newest
    step durable on both ranks, exactly, and continues bitwise to the end."""
    d = tmp_path
    args = ("--hook", "allreduce", "--end", "kill", "--stop", "9", "--kill-rank", "1",
            "--every", "4", "--writer-process")
    launch("train", d, *args, killed=1)
    launch("resume", d, *args)
    res = results(d)
    steps = {r["step"] for r in res}
    assert len(steps) == 1
    assert steps.pop() == 8  # (step 8 was in the ring when rank 1 died: made durable)
    for r in res:
        assert r["restored_bad"] == []
        assert r["final_bad"] == []
        assert r["exact"]
    info = inspect_log(str(d / "ck"))
    assert info["durable_step"] == 20
    assert [s["durable_step"] for s in info["shards"]] == [20, 20]


def test_powersgd_stop_restore_continue(tmp_path: Path) -> None:
    """PowerSGD (compression from iteration 3, error feedback, warm start): the P and Q
    factors are logged; a clean stop at 12 (a base) restores and continues bitwise,
    including the hook's own state (error feedback, warm-start Q, iteration, RNG)."""
    res = scenario(tmp_path, "--hook", "powersgd", "--end", "close", "--every", "4")
    assert res[0]["step"] == 12
    assert res[0]["base_step"] == 12
    from lowdiff_store.log import LogReader

    with LogReader(tmp_path / "ck" / "rank-00001") as rd:
        rec = rd.record(15)
        names = rec.names
        assert any(n.startswith("@psgd/") and n.endswith("/P") for n in names)
        # rank 1 owns fc1.weight and fc3.weight: matrices go as factors, vectors densely
        assert {"@psgd/fc1.weight/P", "@psgd/fc3.weight/Q", "@grad/fc1.bias"} <= set(names)
        assert "@grad/fc1.weight" not in names
        assert rec.side["hook"]["kind"] == "powersgd"


def test_zero_with_topk_allgather_hook(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer (each rank logs its own optimizer partition) with the
    project's top-k all-gather hook (sparse gradients, per-step residuals)."""
    res = scenario(tmp_path, "--hook", "topk", "--zero", "--ef-state", "step", "--end",
                   "crash", "--every", "5", "--flush-at", "11")
    assert res[0]["step"] == 11
    assert read_shards_manifest(tmp_path / "ck")["layout"] == "zero"
    from lowdiff_store.log import LogReader

    with LogReader(tmp_path / "ck" / "rank-00000") as rd:
        rec = rd.record(res[0]["step"] + 2)
        assert any(rec.entry(n).codec == "sparse" for n in rec.names
                   if n.startswith("@grad/"))
    ref = torch.load(tmp_path / "out" / "ref-0.pt")
    state, opt = replay_state(tmp_path / "ck", 20, with_optimizer=True)
    for k, v in state.items():
        assert same_bits(v, ref[20]["model/" + k]), k
    assert opt is not None
    assert len(opt["state"]) == 8


# ---------------------------------------------------------------------- slow variants


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args"), [
    ("psgd_ef_step", ("--hook", "powersgd", "--ef-state", "step")),
    ("psgd_no_ef", ("--hook", "powersgd", "--no-ef")),
    ("topk_replicated", ("--hook", "topk", "--ef-state", "step")),
    ("allreduce_zero", ("--hook", "allreduce", "--zero")),
    ("no_hook", ("--hook", "none",)),
    ("topk_compressor", ("--hook", "none", "--compressor", "--ef-state", "step")),
])
def test_restore_between_bases(name: str, args: tuple[str, ...], tmp_path: Path) -> None:
    """A crash after 12 with a base every 5 (11 flushed): restore replays step 11 from the
    base of 10, and everything the hooks need is in the records."""
    res = scenario(tmp_path, *args, "--end", "crash", "--every", "5", "--flush-at", "11")
    assert res[0]["step"] == 11
    assert res[0]["base_step"] == 10


@pytest.mark.slow
def test_powersgd_error_feedback_only_in_bases(tmp_path: Path) -> None:
    """With PowerSGD's error feedback kept only in bases, a restore between bases is
    exact for weights and optimizer state, and says the hook state was not."""
    args = ("--hook", "powersgd", "--end", "crash", "--every", "5", "--flush-at", "11")
    launch("train", tmp_path, *args)
    launch("resume", tmp_path, *args)
    for r in results(tmp_path):
        assert r["restored_bad"] == []
        assert r["step"] == 11
        assert not r["exact"]
        assert "error-feedback" in r["notes"][0]


@pytest.mark.slow
def test_refusals_with_two_ranks(tmp_path: Path) -> None:
    """A 2-rank job refuses to write into an unsharded log, to restore one of another
    model, and the options that cannot work with one log per rank; every rank raises (the
    error is agreed over the coordination group). FSDP2 is accepted."""
    m = torch.nn.Linear(2, 2)
    DiffCheckpointer(tmp_path / "ck", m, torch.optim.SGD(m.parameters(), lr=0.1)).close()
    launch("refusals", tmp_path)
    got = results(tmp_path, "refusals")
    assert got[0] == got[1]
    assert got[0] == {"unsharded_log": "world_size_mismatch", "auto": "not_allowed",
                      "delta": "not_allowed", "layerwise": "not_allowed",
                      "restore_unsharded": "state_mismatch", "fsdp2": None}
