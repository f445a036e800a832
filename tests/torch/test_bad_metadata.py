"""Crafted torch metadata with valid checksums (issue #16): in the manifest's ``meta.torch``,
in a base's metadata, in a record's side channel. Every case gives one typed error
(``bad_metadata``, or ``state_mismatch`` where the live model differs from what the log
declares) from restore, replay_state, the CLI's ``replay`` (no output file) and verify;
never an internal error, a traceback, an allocation from a declared size, or a wrong answer.

Each case is written through the log layer's own APIs (manifest publish, ``write_base``,
``LogWriter.append``), so every CRC is valid: only the schema check can refuse it.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _cases import build, ckpt_kwargs, run

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.cli import main as cli_main
from lowdiff_store.log import LogReader, LogWriter, tensor_input, write_base
from lowdiff_store.log.base import BaseFile
from lowdiff_store.log.manifest import load_manifest, update_manifest
from lowdiff_store.torch import DiffCheckpointer, replay_state, restore
from lowdiff_store.torchmeta import check_log_meta
from lowdiff_store.verify import verify_log

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

BASE_STEP, TARGET, CRAFTED = 3, 5, 7
BAD = {Reason.BAD_METADATA}
BAD_OR_MISMATCH = {Reason.BAD_METADATA, Reason.STATE_MISMATCH}
T = "\x00tensor"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: Any) -> dict[str, str]:
    """A grad-mode log (SGD + BatchNorm + StepLR) and a delta-mode one, 6 steps, bases
    every 3 steps."""
    out = {}
    for case in ("sgd_bn", "delta"):
        path = tmp_path_factory.mktemp("logs") / case
        o = build(case)
        kw = {**ckpt_kwargs(case), "snapshot_every": 3}
        with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, **kw) as ck:
            run(case, o, 0, 6, ck)
        out[case] = str(path)
    return out


# ------------------------------------------------------------------ crafting


def manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[str], int]:
    def craft(path: str) -> int:
        update_manifest(path, lambda m: change(m.meta["torch"]))
        return TARGET
    return craft


def base(change: Callable[[dict[str, Any]], Any]) -> Callable[[str], int]:
    """Rewrite base 3 with its metadata changed (``change`` may return a new map)."""
    def craft(path: str) -> int:
        bpath = os.path.join(path, f"base-{BASE_STEP:016d}.safetensors")
        with BaseFile(bpath) as bf:
            tensors = {n: (bf.info(n)[0], bf.tensor(n).copy()) for n in bf.names}
            meta = copy.deepcopy(bf.meta())
            log_id = bf.log_id
        meta = change(meta) or meta
        write_base(bpath, BASE_STEP, tensors, meta, log_id)
        return TARGET
    return craft


def record(change: Callable[[dict[str, Any], dict[str, Any]], None]) -> Callable[[str], int]:
    """Append step 7: step 6's tensors (raw), its side channel changed by ``change(side,
    extra)``."""
    def craft(path: str) -> int:
        with LogReader(path) as r:
            rec = r.record(6)
            tensors = [(n, rec.entry(n).dtype, rec.tensor(n).copy()) for n in rec.names]
            side = copy.deepcopy(rec.side)
        extra: dict[str, Any] = {}
        change(side, extra)
        with LogWriter(path) as w:
            w.append(CRAFTED, [tensor_input(n, a, t) for n, t, a in tensors], kind="grad",
                     side=side, extra=extra)
            w.sync()
        return CRAFTED
    return craft


def _set(d: dict[str, Any], key: str, value: Any) -> None:
    d[key] = value


def _model0(m: dict[str, Any], i: int, value: Any) -> None:
    m["model"][0][i] = value


def _hyper_lr(meta: dict[str, Any], value: Any) -> None:
    meta["torch"]["hyper"][0]["lr"] = value


def _opt_ghost(meta: dict[str, Any]) -> None:
    opt = meta["torch"]["opt"]
    first = next(iter(opt["tensors"]))
    opt["tensors"][first] = [*opt["tensors"][first], "ghost"]


def _fsdp_shard(m: dict[str, Any]) -> dict[str, Any]:
    """A well-formed ``shard`` section of an FSDP2 rank (rank 0 of 2, each parameter cut
    along dim 0 of a 1-D mesh) for the model of ``m``."""
    shapes = {n: s for n, _t, s in m["model"]}
    pieces = {n: {"placements": [["S", 0]], "global_shape": list(shapes[n]),
                  "offset": [0] * len(shapes[n]),
                  "shape": [(shapes[n][0] + 1) // 2, *shapes[n][1:]] if shapes[n] else []}
              for n in m["params"]}
    return {"rank": 0, "world_size": 2, "layout": "fsdp", "owned": list(m["params"]),
            "global_params": list(m["params"]), "global_groups": list(m["groups"]),
            "global_model": copy.deepcopy(m["model"]),
            "mesh": {"shape": [2], "dim_names": ["dp"], "coord": [0]},
            "replica": 0, "replicas": 1, "pieces": pieces}


def _shard(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def put(m: dict[str, Any]) -> None:
        sh = _fsdp_shard(m)
        change(sh)
        m["shard"] = sh
    return put


def _piece0(sh: dict[str, Any], key: str, value: Any) -> None:
    sh["pieces"][sh["owned"][0]][key] = value


def _nest(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


# (id, log, craft, reasons for restore, reasons for replay_state)
CASES: list[tuple[str, str, Callable[[str], int], set[Reason], set[Reason]]] = [
    # the log's meta.torch (manifest)
    ("mode-quantum", "sgd_bn", manifest(lambda m: _set(m, "mode", "quantum")), BAD, BAD),
    ("mode-quantum-delta", "delta", manifest(lambda m: _set(m, "mode", "quantum")), BAD, BAD),
    ("schema-str", "sgd_bn", manifest(lambda m: _set(m, "schema", "1")), BAD_OR_MISMATCH,
     BAD_OR_MISMATCH),
    ("params-int", "sgd_bn", manifest(lambda m: _set(m, "params", 5)), BAD, BAD),
    ("param-unknown", "sgd_bn", manifest(lambda m: m["params"].__setitem__(0, "nope")), BAD,
     BAD),
    ("groups-sum", "sgd_bn", manifest(lambda m: _set(m, "groups", [99])), BAD, BAD),
    ("groups-str", "sgd_bn", manifest(lambda m: _set(m, "groups", "all")), BAD, BAD),
    ("model-entry", "sgd_bn", manifest(lambda m: m["model"].__setitem__(0, ["x"])), BAD, BAD),
    ("model-dtype", "sgd_bn", manifest(lambda m: _model0(m, 1, "F33")), BAD, BAD),
    ("model-dtype-other", "sgd_bn", manifest(lambda m: _model0(m, 1, "F16")),
     BAD_OR_MISMATCH, BAD),
    ("model-shape-huge", "sgd_bn", manifest(lambda m: _model0(m, 2, [1 << 40])),
     BAD_OR_MISMATCH, BAD),
    ("model-shape-neg", "sgd_bn", manifest(lambda m: _model0(m, 2, [-1])), BAD, BAD),
    ("model-shape-overflow", "sgd_bn", manifest(lambda m: _model0(m, 2, [1 << 30] * 3)), BAD,
     BAD),
    ("model-dup", "sgd_bn", manifest(lambda m: m["model"].append(m["model"][0])), BAD, BAD),
    ("buffer-unknown", "sgd_bn", manifest(lambda m: m["buffers"].append("ghost")), BAD, BAD),
    ("alias-unknown", "sgd_bn", manifest(lambda m: _set(m, "aliases", {"a": "ghost"})), BAD,
     BAD),
    ("state-dict-unknown", "sgd_bn", manifest(lambda m: m["state_dict"].append("ghost")),
     BAD, BAD),
    ("optimizer-int", "sgd_bn", manifest(lambda m: _set(m, "optimizer", 7)), BAD, BAD),
    ("compressor-str", "sgd_bn", manifest(lambda m: _set(m, "compressor", "topk")), BAD, BAD),
    ("grad-codec", "sgd_bn", manifest(lambda m: _set(m, "grad_codec", "lzma")), BAD, BAD),
    ("delta-codec", "delta", manifest(lambda m: _set(m, "delta_codec", "wavelet")), BAD, BAD),
    ("scheduler-int", "sgd_bn", manifest(lambda m: _set(m, "scheduler", 3)), BAD, BAD),
    # the shard section of a sharded checkpoint's log (what resharding and inspect read)
    ("shard-str", "sgd_bn", manifest(lambda m: _set(m, "shard", "fsdp")), BAD, BAD),
    ("shard-rank", "sgd_bn", manifest(_shard(lambda sh: _set(sh, "rank", 2))), BAD, BAD),
    ("shard-layout", "sgd_bn", manifest(_shard(lambda sh: _set(sh, "layout", "tp"))), BAD,
     BAD),
    ("shard-box-outside", "sgd_bn", manifest(_shard(lambda sh: _piece0(sh, "offset", [9] * 2))),
     BAD, BAD),
    ("shard-box-str", "sgd_bn", manifest(_shard(lambda sh: _piece0(sh, "offset", "x"))), BAD,
     BAD),
    ("shard-placement", "sgd_bn",
     manifest(_shard(lambda sh: _piece0(sh, "placements", [["P", 0]]))), BAD, BAD),
    ("shard-global-shape", "sgd_bn",
     manifest(_shard(lambda sh: _piece0(sh, "global_shape", [1 << 40]))), BAD, BAD),
    ("shard-mesh-coord", "sgd_bn",
     manifest(_shard(lambda sh: sh["mesh"].__setitem__("coord", [5]))), BAD, BAD),
    ("shard-owned-no-piece", "sgd_bn",
     manifest(_shard(lambda sh: sh["pieces"].pop(sh["owned"][0]))), BAD, BAD),
    # a base's metadata
    ("base-no-torch", "sgd_bn", base(lambda m: {"other": 1}), BAD, BAD),
    ("base-hyper-count", "sgd_bn", base(lambda m: _set(m["torch"], "hyper", [])), BAD, BAD),
    ("base-lr-str", "sgd_bn", base(lambda m: _hyper_lr(m, "fast")), BAD, BAD),
    ("base-lr-list", "sgd_bn", base(lambda m: _hyper_lr(m, [1, 2])), BAD, BAD),
    ("base-opt-unknown", "sgd_bn",
     base(lambda m: m["torch"]["opt"]["tensors"].__setitem__("ghost", ["momentum_buffer"])),
     BAD, BAD),
    ("base-opt-missing-tensor", "sgd_bn", base(_opt_ghost), BAD, BAD),
    ("base-sched-tensor-size", "sgd_bn",
     base(lambda m: _set(m["torch"], "sched", {T: ["F32", [4], b"\0" * 3]})), BAD, BAD),
    ("base-extra-deep", "sgd_bn", base(lambda m: _set(m["torch"], "extra", _nest(40))), BAD,
     BAD),
    ("base-extra-unknown-dtype", "sgd_bn",
     base(lambda m: _set(m["torch"], "extra", {T: ["Q9", [1], b"\0"]})), BAD, BAD),
    # a record's side channel and fields
    ("side-hyper-count", "sgd_bn", record(lambda s, e: _set(s, "hyper", [{}, {}])), BAD, BAD),
    ("side-hyper-kind", "sgd_bn",
     record(lambda s, e: _set(s, "hyper", [{"momentum": [1, 2]}])), BAD, BAD),
    ("side-clip-unknown", "sgd_bn",
     record(lambda s, e: _set(s, "clip", {"scale": {T: ["F32", [], b"\0\0\0?"]},
                                          "params": ["ghost"]})), BAD, BAD),
    ("side-clip-scale", "sgd_bn",
     record(lambda s, e: _set(s, "clip", {"scale": 0.5, "params": []})), BAD, BAD),
    ("side-amp-key", "sgd_bn",
     record(lambda s, e: _set(s, "amp", {"evil": {T: ["F32", [], b"\0\0\0?"]}})), BAD, BAD),
    ("side-skipped", "sgd_bn", record(lambda s, e: _set(s, "skipped", "yes")), BAD, BAD),
    ("side-sched-key", "sgd_bn",
     record(lambda s, e: _set(s, "sched", {"\x00map": [[[1], 2]]})), BAD, BAD),
    ("side-extra-tensor", "sgd_bn",
     record(lambda s, e: _set(s, "extra", {T: ["F32", [1 << 20], b""]})), BAD, BAD),
    ("digest-str", "sgd_bn", record(lambda s, e: _set(e, "digest", "abc")), BAD, BAD),
    ("tuning-int", "sgd_bn", record(lambda s, e: _set(e, "tuning", 3)), BAD, BAD),
]


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def crafted(request: Any, logs: dict[str, str], tmp_path: Any
            ) -> tuple[str, str, int, set[Reason], set[Reason], str]:
    _name, case, craft, restore_reasons, replay_reasons = request.param
    path = str(tmp_path / case)
    shutil.copytree(logs[case], path)
    return path, case, craft(path), restore_reasons, replay_reasons, craft.__qualname__.split(
        ".")[0]


def _one_typed(fn: Callable[[], Any], reasons: set[Reason]) -> LowdiffError:
    with pytest.raises(LowdiffError) as ei:
        fn()
    err = ei.value
    assert err.reason in reasons, str(err)
    assert err.path is not None
    assert "\n" not in str(err)
    return err


def test_crafted_metadata_gives_one_typed_error(crafted: Any, tmp_path: Any,
                                                capsys: Any) -> None:
    path, case, target, restore_reasons, replay_reasons, craft_kind = crafted
    o = build(case)
    _one_typed(lambda: restore(path, o.model, o.optimizer, scheduler=o.scheduler,
                               step=target), restore_reasons)
    _one_typed(lambda: replay_state(path, target, with_optimizer=True), replay_reasons)

    out = tmp_path / "x.safetensors"
    capsys.readouterr()
    rc = cli_main(["replay", path, "--to-step", str(target), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "internal error" not in err
    assert "Traceback" not in err
    assert any(r.value in err for r in replay_reasons), err
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("x.safetensors")]

    assert cli_main(["inspect", path]) == 0
    got = capsys.readouterr()
    err = got.err
    if craft_kind == "manifest":  # inspect names what is wrong in the log metadata itself
        try:
            check_log_meta(load_manifest(path).meta["torch"])
        except LowdiffError:
            assert "problem:" in got.out
            assert "bad_metadata" in got.out
    assert "internal error" not in err
    assert "Traceback" not in err

    rep = verify_log(path)  # verify checks what replay checks
    assert not rep.ok
    assert any(p.reason in (Reason.BAD_METADATA, Reason.METADATA_TOO_LARGE)
               for p in rep.problems), [str(p) for p in rep.problems]


def test_quantum_mode_in_a_real_process(logs: dict[str, str], tmp_path: Any) -> None:
    """The case that exported wrong weights with exit 0: now exit 1, one line, no file."""
    path = str(tmp_path / "log")
    shutil.copytree(logs["sgd_bn"], path)
    manifest(lambda m: _set(m, "mode", "quantum"))(path)
    out = tmp_path / "w.safetensors"
    r = subprocess.run([sys.executable, "-m", "lowdiff_store", "replay", path, "--to-step",
                        str(TARGET), "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r
    assert r.stderr.count("\n") == 1, r.stderr
    assert "bad_metadata" in r.stderr, r.stderr
    assert "mode" in r.stderr
    assert "quantum" in r.stderr
    assert not out.exists()


def test_untouched_logs_still_pass(logs: dict[str, str]) -> None:
    """The checks accept what the checkpointer writes (both modes)."""
    for case, path in logs.items():
        o = build(case)
        res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, step=TARGET)
        assert res.step == TARGET
        assert res.verified
        state, opt_state = replay_state(path, TARGET, with_optimizer=True)
        assert state
        assert opt_state is not None
        assert verify_log(path).ok
        assert torch.equal(state["net.0.weight"], o.model.net[0].weight.detach())


def test_a_well_formed_fsdp_shard_section_passes(logs: dict[str, str]) -> None:
    """The shard checks accept what an FSDP2 rank writes (the same keys and kinds as
    ``torch/fsdp.py``'s ``shard_meta``), and refuse each field broken in turn with one
    ``bad_metadata`` naming ``meta.torch.shard``."""
    meta = copy.deepcopy(load_manifest(logs["sgd_bn"]).meta["torch"])
    meta["shard"] = _fsdp_shard(meta)
    assert check_log_meta(copy.deepcopy(meta)) == meta
    first = meta["shard"]["owned"][0]
    breaks: list[Callable[[dict[str, Any]], None]] = [
        lambda sh: _set(sh, "world_size", 0),
        lambda sh: _set(sh, "owned", [1]),
        lambda sh: _set(sh, "global_groups", [1 << 10]),
        lambda sh: _set(sh, "global_model", {}),
        lambda sh: sh["global_model"].__setitem__(0, ["w", "F99", [1]]),
        lambda sh: _set(sh, "mesh", [2]),
        lambda sh: sh["mesh"].__setitem__("shape", [0]),
        lambda sh: sh["mesh"].__setitem__("dim_names", [3]),
        lambda sh: _set(sh, "replica", 1),
        lambda sh: sh["pieces"].__setitem__("ghost", sh["pieces"][first]),
        lambda sh: sh["pieces"].__setitem__(first, []),
        lambda sh: _piece0(sh, "placements", [["S", 0], ["R"]]),
        lambda sh: _piece0(sh, "placements", [["S", 7]]),
        lambda sh: _piece0(sh, "shape", [-1]),
    ]
    for i, brk in enumerate(breaks):
        bad = copy.deepcopy(meta)
        brk(bad["shard"])
        with pytest.raises(LowdiffError) as ei:
            check_log_meta(bad, "MANIFEST")
        assert ei.value.reason is Reason.BAD_METADATA, (i, str(ei.value))
        assert "meta.torch.shard" in str(ei.value), (i, str(ei.value))


def test_more_broken_shard_sections(logs: dict[str, str]) -> None:
    """What resharding, ZeRO replay and ``replay_state`` index without looking: the job's
    parameter order for the zero and fsdp layouts, the number of groups, pieces only of
    owned parameters, and the job's aliases and state_dict order."""
    meta = copy.deepcopy(load_manifest(logs["sgd_bn"]).meta["torch"])
    meta["shard"] = _fsdp_shard(meta)
    first = meta["shard"]["owned"][0]
    buffer = meta["buffers"][0]

    def zero(sh: dict[str, Any]) -> None:
        for k in ("global_model", "mesh", "replica", "replicas", "pieces"):
            sh.pop(k)
        sh["layout"] = "zero"

    assert check_log_meta(_changed(meta, zero))  # a well-formed zero section passes
    breaks: list[Callable[[dict[str, Any]], None]] = [
        lambda sh: sh.pop("global_params"),
        lambda sh: (zero(sh), sh.pop("global_groups")),
        lambda sh: (zero(sh), _set(sh, "global_groups", [1, len(sh["global_params"]) - 1])),
        lambda sh: (sh["owned"].remove(first)),                  # a piece not owned
        lambda sh: (sh["owned"].append(buffer),                   # not a job parameter
                    sh["pieces"].__setitem__(buffer, sh["pieces"][first])),
        lambda sh: _set(sh, "global_aliases", {"a": "ghost"}),
        lambda sh: _set(sh, "global_aliases", {first: first}),
        lambda sh: _set(sh, "global_state_dict", ["ghost"]),
    ]
    for i, brk in enumerate(breaks):
        with pytest.raises(LowdiffError) as ei:
            check_log_meta(_changed(meta, brk), "MANIFEST")
        assert ei.value.reason is Reason.BAD_METADATA, (i, str(ei.value))
        assert "meta.torch.shard" in str(ei.value), (i, str(ei.value))


def _changed(meta: dict[str, Any], brk: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    out = copy.deepcopy(meta)
    brk(out["shard"])
    return out


def test_a_shard_whose_layout_is_not_the_checkpoints_is_refused(logs: dict[str, str],
                                                               tmp_path: Any,
                                                               capsys: Any) -> None:
    """SHARDS says fsdp, the shards' metadata says replicated (each well formed on its
    own): restore and inspect give one bad_metadata line (a KeyError from the resharding
    engine before)."""
    from lowdiff_store.log.shards import shard_path, write_shards_manifest

    root = tmp_path / "job"
    for r in range(2):
        p = shard_path(root, r)
        shutil.copytree(logs["sgd_bn"], p)
        update_manifest(p, lambda m, r=r: m.meta["torch"].__setitem__("shard", {
            "rank": r, "world_size": 2, "layout": "replicated",
            "owned": list(m.meta["torch"]["params"])}))
    write_shards_manifest(root, 2, layout="fsdp")
    o = build("sgd_bn")
    err = _one_typed(lambda: restore(root, o.model, o.optimizer, scheduler=o.scheduler),
                     BAD)
    assert "layout" in str(err)
    capsys.readouterr()
    rep = verify_log(str(root))  # verify checks each shard belongs, as restore does
    assert not rep.ok
    assert [p for p in rep.problems if p.reason is Reason.BAD_METADATA
            and "shard section" in str(p)], [str(p) for p in rep.problems]
    assert cli_main(["verify", str(root)]) != 0
    got = capsys.readouterr()
    assert "bad_metadata" in got.out + got.err
    assert cli_main(["inspect", str(root)]) == 0  # inspect describes what is there
    got = capsys.readouterr()
    assert "Traceback" not in got.err + got.out
    assert "health corrupt" in got.out
    assert "problem:" in got.out
    assert "shard section" in got.out
