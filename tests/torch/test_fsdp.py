"""FSDP2 (``fully_shard``, DTensor parameters) and resharding, on CPU with gloo.

One training launch per module (``fsdp_run``): on 2 ranks, a DDP run and a ZeRO run
(closed cleanly), then an FSDP2 run with bf16 mixed precision, gradient clipping over
DTensors and gradient accumulation, stopped by a SIGKILL of rank 1; each with an
uninterrupted reference run whose gathered state is saved at every step. One resume
launch on 2 ranks then restores, compared bit for bit with the reference at the restored
step: FSDP2 -> FSDP2 (then training goes on to the end, bitwise), FSDP2 -> DDP,
DDP -> FSDP2, ZeRO -> FSDP2, and tries what must be refused. The other checks (world size
1, ``replay_state``, ``describe_log``, the CLI, compaction) run in this process.

The ``@pytest.mark.slow`` variants: 4 ranks with a 2-D mesh (HSDP, replicate x shard),
``reshard_after_forward=False`` and SGD, killed and restored at 4 ranks, and the 2-rank
log restored at 4 and 3 ranks (uneven shards: 30 and 7 rows over 3 and 4 ranks).
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

from lowdiff_store.errors import ConfigError, Reason
from lowdiff_store.log import LogReader
from lowdiff_store.log.shards import read_shards_manifest
from lowdiff_store.torch import DiffCheckpointer, describe_log, replay_state, restore
from tests.helpers import fork_server
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port
from tests.helpers.timing import scaled

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = HERE / "fsdp_worker.py"
sys.path.insert(0, str(HERE))

from fsdp_worker import Net, differences, gathered  # noqa: E402

pytestmark = [NEEDS_GLOO, pytest.mark.consistent_bases]  # (tests/conftest.py)

TRAIN = ("--mp", "--clip", "--accum", "2", "--steps", "12", "--stop", "9", "--every", "4")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


#: this module's launches: forked by ``fsdp_worker.py --serve`` servers (one per rank)
#: while ``fsdp_worker_servers`` holds them, else processes of their own
LAUNCHER = fork_server.Launcher(WORKER, _env)


@pytest.fixture(scope="module", autouse=True)
def fsdp_worker_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fork servers of this module's launches (the worker's imports made once per
    module; each rank still a process of its own, SIGKILLed as a job's would be)."""
    with LAUNCHER.held(tmp_path_factory.mktemp("fsdp-worker-servers")):
        yield


def launch(phase: str, d: Path, *args: str, world: int = 2, killed: int | None = None,
           timeout: float = 150.0) -> None:
    """Run ``fsdp_worker.py`` on ``world`` ranks (:data:`LAUNCHER`); every rank must exit
    0, except the one that SIGKILLs itself (``killed``)."""
    port = free_port()
    (d / "out").mkdir(parents=True, exist_ok=True)
    exits = LAUNCHER.run_ranks(lambda r: [
        "--phase", phase, "--rank", str(r), "--world", str(world), "--port", str(port),
        "--dir", str(d / "ck"), "--out", str(d / "out"), "--timeout", str(scaled(timeout)),
        *args], world, timeout=timeout)
    check_exits(exits, killed=killed)


def results(d: Path, tag: str) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted((d / "out").glob(f"{tag}-*.json"))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("fsdp")
    # (--flush-at 8: step 8 durable on every rank before rank 1 dies after step 9, however
    # slow the machine; else the job's step could be 7)
    launch("train", d, *TRAIN, "--end", "kill", "--kill-rank", "1", "--flush-at", "8",
           "--also-source", "ddp", "--also-source", "zero", killed=1)
    for r in results(d, "train-*"):
        assert r["perturbed"] == [], "the checkpointer changed training"
    launch("resume", d, *TRAIN, "--restore", ":fsdp", "--restore", ":ddp",
           "--restore", "ddp:fsdp", "--restore", "zero:fsdp", "--continue", "--refusals")
    res = results(d, "result")
    assert len(res) == 2
    return d, res


def _plain(lr: float = 1e-2) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    return m, opt, sched


def test_fsdp2_killed_restored_and_continued_bitwise(
        fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    d, res = fsdp_run
    body = read_shards_manifest(d / "ck")
    assert (body["world_size"], body["layout"]) == (2, "fsdp")
    for r in res:
        got = r[":fsdp"]
        assert got["restored_bad"] == [], "restored state differs from the reference"
        assert got["exact"]
        assert got["notes"] == []
        assert r["final_bad"] == [], "continued run differs from the uninterrupted one"
    assert res[0][":fsdp"]["step"] == res[1][":fsdp"]["step"] >= 8


@pytest.mark.parametrize("spec", [":ddp", "ddp:fsdp", "zero:fsdp"])
def test_restore_across_layouts_bitwise(fsdp_run: tuple[Path, list[dict[str, Any]]],
                                        spec: str) -> None:
    """FSDP2 -> DDP, DDP -> FSDP2, ZeRO-1 -> FSDP2, each compared with the gathered state
    of the source run's reference at the restored step."""
    _d, res = fsdp_run
    for r in res:
        got = r[spec]
        assert got["restored_bad"] == [], (spec, got)
        assert got["exact"]
        assert got["step"] >= 8
    if spec != ":ddp":   # another layout: where each part came from is said
        assert "resharded" in res[0][spec]["notes"][0]


def test_refusals(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _d, res = fsdp_run
    for r in res:
        assert r["refusals"] == {"adafactor": "not_allowed", "delta": "not_allowed",
                                 "zero_target": "not_allowed"}


def test_restore_into_one_process(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """World size 1, a plain model: every shard replayed and assembled, bitwise."""
    d, _res = fsdp_run
    ref = torch.load(d / "out" / "ref.pt")
    for step in (None, 5, 6):
        m, opt, sched = _plain()
        res = restore(d / "ck", m, opt, scheduler=sched, step=step)
        assert step is None or res.step == step
        assert res.exact
        assert differences(gathered(m, opt), ref[res.step]) == []
        if step == 6:   # the shards' digests of step 6 were checked
            assert res.verified == [6]
        assert "written by 2 rank(s)" in res.notes[0]
        # the restored objects cannot log into the 2-rank checkpoint
        with pytest.raises(ConfigError) as e:
            DiffCheckpointer(d / "ck", m, opt)
        assert e.value.reason is Reason.WORLD_SIZE_MISMATCH


def test_replay_state_merges_fsdp_shards(fsdp_run: tuple[Path, list[dict[str, Any]]]
                                         ) -> None:
    d, _res = fsdp_run
    ref = torch.load(d / "out" / "ref.pt")
    for step in (0, 3, 8):
        state, opt = replay_state(d / "ck", step, with_optimizer=True)
        assert opt is not None
        for k, v in state.items():
            assert same_bits(v, ref[step]["model/" + k]), (step, k)
        names = opt["param_groups"][0]["param_names"]
        assert names == [n for n, _p in Net().named_parameters()]
        for i, n in enumerate(names):
            for key, v in opt["state"].get(i, {}).items():
                assert same_bits(v, ref[step][f"opt/{n}/{key}"]), (step, n, key)


def test_describe_shows_mesh_and_placements(fsdp_run: tuple[Path, list[dict[str, Any]]]
                                            ) -> None:
    d, _res = fsdp_run
    info = describe_log(d / "ck")
    assert info["layout"] == "fsdp"
    assert info["mesh"]["shape"] == [2]
    assert info["placements"]["fc2.weight"] == {"placements": [["S", 0]],
                                                "global_shape": [7, 30]}
    pieces = [s["pieces"]["fc2.weight"] for s in info["shards"]]
    assert pieces == [{"offset": [0, 0], "shape": [4, 30]},
                      {"offset": [4, 0], "shape": [3, 30]}]   # uneven: 7 rows on 2 ranks
    assert [s["mesh_coord"] for s in info["shards"]] == [[0], [1]]
    with LogReader(d / "ck" / "rank-00001") as r:   # what rank 1 logs: its pieces
        rec = r.record(3)
        assert rec.entry("@grad/fc1.weight").shape == (15, 12)


def test_cli_inspect_prints_mesh_and_placements(fsdp_run: tuple[Path, list[dict[str, Any]]],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from lowdiff_store.cli import main as cli_main

    d, _res = fsdp_run
    assert cli_main(["inspect", str(d / "ck")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("sharded checkpoint: 2 ranks (fsdp)")
    assert out[1].startswith("  rank 0 (mesh coordinate [0]): ")
    assert out[2].startswith("  rank 1 (mesh coordinate [1]): ")
    assert "device mesh: 2" in out
    # uneven: 7 rows on 2 ranks
    assert "  fc2.weight: (Shard(0)) global [7, 30]; rank 0 [0:4, 0:30]; " \
        "rank 1 [4:7, 0:30]" in out


def test_cli_replay_merges_fsdp(fsdp_run: tuple[Path, list[dict[str, Any]]],
                                tmp_path: Path) -> None:
    from lowdiff_store.cli import main as cli_main

    d, _res = fsdp_run
    dst = tmp_path / "s6.pt"
    assert cli_main(["replay", str(d / "ck"), "--to-step", "6", "--out", str(dst),
                     "--format", "pt"]) == 0
    ref = torch.load(d / "out" / "ref.pt")[6]
    got = torch.load(dst, weights_only=True)
    assert set(got) == {k[len("model/"):] for k in ref if k.startswith("model/")}
    for k, v in got.items():
        assert same_bits(v, ref["model/" + k]), k


def test_compact_fsdp(fsdp_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    from lowdiff_store.cli import main as cli_main

    d, _res = fsdp_run
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    assert cli_main(["compact", str(ck), "--step", "11", "--keep-bases", "2"]) == 0
    for r in (0, 1):   # each shard got its base of step 11 (made from its pieces)
        with LogReader(ck / f"rank-0000{r}") as rd:
            assert list(rd.bases) == [11, 12]
    ref = torch.load(d / "out" / "ref.pt")
    for s in (11, 12):
        state, _ = replay_state(ck, s)
        for k, v in state.items():
            assert same_bits(v, ref[s]["model/" + k]), (s, k)


def test_non_elementwise_optimizer_is_not_resharded(tmp_path: Path) -> None:
    """A log of an optimizer with factored state cannot be cut into pieces."""
    from lowdiff_store.torch.distributed.reshard import Source
    from lowdiff_store.torch.replay.engine import log_meta

    m = torch.nn.Linear(4, 3)
    opt = torch.optim.Adafactor(m.parameters(), lr=1e-2)
    with DiffCheckpointer(tmp_path / "ck", m, opt, snapshot_every=2) as ck:
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        ck.flush()
    with LogReader(tmp_path / "ck") as r:
        src = Source(str(tmp_path / "ck"), [r], [log_meta(r)], "single")
        with pytest.raises(ConfigError) as e:
            src.check_elementwise()
    assert e.value.reason is Reason.NOT_ALLOWED
    assert "Adafactor" in str(e.value)


def test_model_mismatch_is_refused(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    d, _res = fsdp_run
    m = torch.nn.Linear(12, 30)
    with pytest.raises(ConfigError) as e:
        restore(d / "ck", m, torch.optim.AdamW(m.parameters()))
    assert e.value.reason is Reason.STATE_MISMATCH


# ---------------------------------------------------------------------- slow variants


@pytest.mark.slow
def test_hsdp_four_ranks_killed_restored_continued(tmp_path: Path) -> None:
    """2-D mesh (2 replicas x 2 shards): the replicas split the writing; rank 2 is
    killed; restore at 4 ranks and continue bitwise; the log also restores at 2, 3 and 1."""
    args = ("--hsdp", "--keep-unsharded", "--optimizer", "sgd", "--steps", "10",
            "--stop", "7", "--every", "3")
    launch("train", tmp_path, *args, "--end", "kill", "--kill-rank", "2", world=4,
           killed=2)
    launch("resume", tmp_path, *args, "--restore", ":fsdp", "--continue", world=4)
    for r in results(tmp_path, "result"):
        assert r[":fsdp"]["restored_bad"] == []
        assert r[":fsdp"]["exact"]
        assert r["final_bad"] == []
    info = describe_log(tmp_path / "ck")
    assert info["mesh"]["shape"] == [2, 2]
    # replicas split the writing: each parameter's piece is logged by one replica
    owned = [s["owned_params"] for s in info["shards"]]
    assert owned[0] + owned[2] == 6
    assert owned[1] + owned[3] == 6
    for world in (2, 3):
        launch("resume", tmp_path, "--optimizer", "sgd", "--restore", ":fsdp", "--tag",
               f"w{world}", world=world)
        for r in results(tmp_path, f"w{world}"):
            assert r[":fsdp"]["restored_bad"] == [], world


@pytest.mark.slow
def test_two_rank_log_restored_at_four_and_three(
        fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    d, _res = fsdp_run
    for world in (4, 3):
        launch("resume", d, *TRAIN, "--restore", ":fsdp", "--restore", "ddp:fsdp",
               "--tag", f"w{world}", world=world)
        got = results(d, f"w{world}")
        assert len(got) == world
        for r in got:
            assert r[":fsdp"]["restored_bad"] == [], world
            assert r["ddp:fsdp"]["restored_bad"] == [], world


# ---------------------------------------------------------------------- piece geometry


def _chunk_box(shape: tuple[int, ...], rank: int, world: int
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of ``rank`` when dim 0 is cut as ``torch.chunk`` cuts it (FSDP2's rule)."""
    size = -(-shape[0] // world) if shape else 0
    lo = min(shape[0], rank * size)
    hi = min(shape[0], lo + size)
    return (lo, *(0 for _ in shape[1:])), (hi - lo, *shape[1:])


def test_a_rank_reads_and_replays_only_the_pieces_it_needs(
        fsdp_run: tuple[Path, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """W' = 4 from the 2-rank log, rank by rank in this process: each replays only the
    parameters whose pieces overlap its boxes and reads only their base tensors (rank 1
    needs fc1 and ln rows 8..15 from both shards but fc2 rows 2..3 from shard 0 only: no
    fc2 tensor of shard 1's base is read), and its boxes come out bitwise."""
    from lowdiff_store.storage.local import LocalStore
    from lowdiff_store.torch.distributed.reshard import (
        Source,
        assemble_state,
        assemble_value,
        needed_shards,
        replay_shards,
    )
    from lowdiff_store.torch.distributed.restore import _Shards

    d, _res = fsdp_run
    ref = torch.load(d / "out" / "ref.pt")
    reads: list[tuple[str, int, int]] = []
    opened = LocalStore.open

    class Counted:
        def __init__(self, inner: Any) -> None:
            self._inner, self.path, self.size = inner, inner.path, inner.size

        def read(self, offset: int, n: int) -> memoryview:
            reads.append((self.path, offset, n))
            out: memoryview = self._inner.read(offset, n)
            return out

        def close(self) -> None:
            self._inner.close()

    monkeypatch.setattr(LocalStore, "open", lambda self, name, mode="mmap", **kw:
                        Counted(opened(self, name, mode, **kw)))
    step = 8
    with _Shards(str(d / "ck")) as shards:
        src = Source(shards.root, shards.readers, shards.metas, shards.layout)
        target, bases, _job = src.plan(step)
        with shards.readers[1].base(bases[1]) as bf:
            fc2 = [(bf.data_start + bf._entries[n][2], bf._entries[n][3] - bf._entries[n][2])
                   for n in bf.names if "fc2." in n]
            base1 = bf.path
        for rank in range(4):
            boxes = {n: _chunk_box(shape, rank, 4) for n, (_t, shape) in src.model.items()
                     if n in src.pieces}
            need = needed_shards(src, boxes)
            del reads[:]
            rep = replay_shards(src, sorted(need), min(need), target, bases, verify=True,
                                apply_rng=False, boxes=boxes)
            assert rep.partial == ([1] if rank == 1 else [])
            for n, box in boxes.items():
                sl = tuple(slice(o, o + k) for o, k in zip(*box, strict=True))
                assert same_bits(assemble_value(src, rep, n, box),
                                 ref[step]["model/" + n][sl]), (rank, n)
                for key, v in assemble_state(src, rep, n, box).items():
                    want = ref[step][f"opt/{n}/{key}"]
                    assert same_bits(v, want[sl] if v.dim() else want), (rank, n, key)
            read1 = [(o, k) for p, o, k in reads if p == base1]
            if 1 in need:
                assert read1   # shard 1's base was read ...
            if rank == 1:      # ... but none of its fc2 tensors
                assert fc2
                assert not set(fc2) & set(read1)


def _pieces_of(full: torch.Tensor, rows: list[tuple[int, int]]) -> tuple[Any, Any]:
    """A Source-like view of ``full`` cut into row ranges (one shard each), replayed."""
    from types import SimpleNamespace

    from lowdiff_store.torch.distributed.reshard import Piece, Replayed

    pieces = [Piece(s, (a, 0), (b - a, full.shape[1])) for s, (a, b) in enumerate(rows)]
    src = SimpleNamespace(pieces={"w": pieces}, root="ck", model={"w": ("F32", full.shape)})
    rep = Replayed()
    for s, (a, b) in enumerate(rows):
        rep.values[(s, "w")] = full[a:b].clone()
        rep.states[(s, "w")] = {"step": torch.tensor(3.0), "m": full[a:b] * 2}
    return src, rep


def test_pieces_assemble_into_any_partition() -> None:
    """Uneven pieces (7 rows over 3 shards as torch.chunk cuts them, one empty piece) give
    back, bit for bit, any box a new partition asks for (W' = 4, 3, 2, 1)."""
    from lowdiff_store.torch.distributed.reshard import (
        assemble_state,
        assemble_value,
        needed_shards,
    )

    full = torch.randn(7, 3)
    src, rep = _pieces_of(full, [(0, 3), (3, 6), (6, 7), (7, 7)])
    for chunks in ([(0, 2), (2, 4), (4, 6), (6, 7)], [(0, 3), (3, 6), (6, 7)], [(0, 4), (4, 7)],
                   [(0, 7)]):
        for a, b in chunks:
            box = ((a, 0), (b - a, 3))
            assert same_bits(assemble_value(src, rep, "w", box), full[a:b])
            st = assemble_state(src, rep, "w", box)
            assert same_bits(st["m"], full[a:b] * 2)
            assert same_bits(st["step"], torch.tensor(3.0))
    assert needed_shards(src, {"w": ((2, 0), (2, 3))}) == {0, 1}   # rows 2..3
    assert needed_shards(src, {"w": ((6, 0), (1, 3))}) == {2}


def test_pieces_that_are_not_elementwise_are_refused() -> None:
    from lowdiff_store.torch.distributed.reshard import assemble_state, assemble_value

    full = torch.randn(4, 2)
    src, rep = _pieces_of(full, [(0, 2), (2, 4)])
    rep.states[(1, "w")]["step"] = torch.tensor(4.0)   # a per-parameter scalar differs
    with pytest.raises(ConfigError) as e:
        assemble_state(src, rep, "w", ((0, 0), (4, 2)))
    assert e.value.reason is Reason.NOT_ALLOWED
    src, rep = _pieces_of(full, [(0, 2), (2, 4)])
    rep.states[(0, "w")]["row_mean"] = torch.zeros(2)   # factored state: not the shape
    rep.states[(1, "w")]["row_mean"] = torch.zeros(2)
    with pytest.raises(ConfigError) as e:
        assemble_state(src, rep, "w", ((0, 0), (4, 2)))
    assert e.value.reason is Reason.NOT_ALLOWED
    src, rep = _pieces_of(full, [(0, 2)])   # rows 2..3 are in no piece
    with pytest.raises(ConfigError) as e:
        assemble_value(src, rep, "w", ((0, 0), (4, 2)))
    assert e.value.reason is Reason.BAD_METADATA


def test_a_shard_with_an_empty_piece_is_replayed_whole_at_its_own_boxes() -> None:
    """A parameter with fewer rows than ranks (a 1-row bias over 2 ranks) has an empty
    piece on the last shard. A rank restoring its own boxes (W' = W) must keep every
    parameter of its shard, the empty piece included (it costs no read), so that the
    shard is not replayed in part and its step digests are still checked."""
    from types import SimpleNamespace

    from lowdiff_store.torch.distributed.reshard import Piece, keep_of

    pieces = {"w": [Piece(0, (0, 0), (2, 3)), Piece(1, (2, 0), (2, 3))],
              "b": [Piece(0, (0,), (1,)), Piece(1, (1,), (0,))]}
    src = SimpleNamespace(pieces=pieces)
    own1 = {"w": ((2, 0), (2, 3)), "b": ((1,), (0,))}   # rank 1's own boxes
    assert keep_of(src, 1, own1) == {"w", "b"}
    own0 = {"w": ((0, 0), (2, 3)), "b": ((0,), (1,))}
    assert keep_of(src, 0, own0) == {"w", "b"}
    # W' = 1 from shard 1 alone is not asked; a box of w's rows 0..1 keeps nothing of
    # shard 1 but its empty piece
    assert keep_of(src, 1, {"w": ((0, 0), (2, 3)), "b": ((0,), (1,))}) == {"b"}


def test_cli_inspect_of_malformed_mesh_metadata_is_one_line(
        fsdp_run: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Placements whose boxes do not match their rank (metadata with valid checksums but
    crafted) give one line naming the checkpoint and the reason, not a traceback."""
    import copy

    from lowdiff_store.cli import inspect as cli_inspect
    from lowdiff_store.cli import main as cli_main

    d, _res = fsdp_run
    real = cli_inspect._torch_describe(str(d / "ck"))
    assert real is not None
    bad = copy.deepcopy(real)
    bad["shards"][0]["pieces"]["fc2.weight"]["offset"] = [0]  # 1 offset for a 2-D box
    monkeypatch.setattr(cli_inspect, "_torch_describe", lambda _p: bad)
    rc = cli_main(["inspect", str(d / "ck")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert len(err) == 1
    assert str(d / "ck") in err[0]
    assert "bad_metadata" in err[0] or "malformed" in err[0]
    assert "Traceback" not in err[0]
