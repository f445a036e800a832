"""The torch metadata parsed without torch (``lowdiff_store.torchmeta``): a well-formed map
becomes frozen dataclasses whose attributes consumers read; a crafted one gets one
``bad_metadata`` error naming the file; every tensor-name prefix is spelled out in
``torchmeta/names.py`` only."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.torchmeta import LogMeta, ShardMeta, parse, parse_base
from lowdiff_store.torchmeta import names as N

PKG = Path(__file__).resolve().parent.parent / "lowdiff_store"
NAMES = PKG / "torchmeta" / "names.py"

#: every prefix a tensor name of a torch log may start with
PREFIXES = (N.GRAD, N.OPT, N.EF, N.RNG, N.PSGD, N.HOOK)

RAW: dict[str, Any] = {
    "schema": 1, "mode": "grad", "capture": "dense", "optimizer": "torch.optim.sgd.SGD",
    "params": ["w", "v"], "groups": [1, 1],
    "model": [["w", "F32", [4, 2]], ["v", "BF16", [3]], ["b", "F32", [2]]],
    "buffers": ["b"], "aliases": {"w_tied": "w"}, "state_dict": ["w", "w_tied", "v", "b"],
    "compressor": {"kind": "topk", "ratio": 0.1, "error_feedback": True, "ef_state": "base"},
    "grad_codec": "sparse", "grad_zstd": None, "delta_codec": None, "digest_every": 4,
    "snapshot_every": 10, "scheduler": "torch.optim.lr_scheduler.StepLR", "scaler": None,
    "torch_version": "2.5.0", "device": "cpu",
}

FSDP: dict[str, Any] = {
    "rank": 1, "world_size": 2, "layout": "fsdp", "owned": ["w"],
    "global_params": ["w", "v"], "global_groups": [1, 1],
    "global_model": [["w", "F32", [8, 2]], ["v", "BF16", [3]], ["b", "F32", [2]]],
    "mesh": {"shape": [2], "dim_names": ["dp"], "coord": [1]}, "replica": 0, "replicas": 1,
    "pieces": {"w": {"global_shape": [8, 2], "placements": [["S", 0]], "offset": [4, 0],
                     "shape": [4, 2]}},
    "global_aliases": {"w_tied": "w"},
}


def _bad(raw: Any, where: str) -> LowdiffError:
    with pytest.raises(LowdiffError) as ei:
        parse(raw, "/logs/run/MANIFEST")
    err = ei.value
    assert err.reason is Reason.BAD_METADATA, str(err)
    assert err.path == "/logs/run/MANIFEST"
    assert len(str(err).splitlines()) == 1
    assert "/logs/run/MANIFEST" in str(err)
    assert where in str(err), str(err)
    return err


# ------------------------------------------------------------------ parsed values


def test_a_log_map_parses_into_attributes() -> None:
    meta = parse(copy.deepcopy(RAW), "MANIFEST")
    assert isinstance(meta, LogMeta)
    assert (meta.mode, meta.params, meta.groups) == ("grad", ("w", "v"), (1, 1))
    assert [tuple(t) for t in meta.model] == [("w", "F32", (4, 2)), ("v", "BF16", (3,)),
                                              ("b", "F32", (2,))]
    assert meta.model[1].shape == (3,)
    assert (meta.buffers, dict(meta.aliases)) == (("b",), {"w_tied": "w"})
    assert meta.state_dict == ("w", "w_tied", "v", "b")
    assert meta.compressor is not None
    assert (meta.compressor.kind, meta.compressor.error_feedback,
            meta.compressor.ef_state) == ("topk", True, "base")
    assert meta.compressor.config["ratio"] == 0.1
    assert (meta.digest_every, meta.snapshot_every, meta.grad_codec) == (4, 10, "sparse")
    assert meta.shard is None
    assert meta.param_set == frozenset({"w", "v"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.mode = "delta"  # type: ignore[misc]


def test_a_restricted_copy_keeps_its_own_parameter_set() -> None:
    meta = parse(copy.deepcopy(RAW))
    part = dataclasses.replace(meta, params=("v",), groups=(0, 1))
    assert part.param_set == frozenset({"v"})
    assert meta.param_set == frozenset({"w", "v"})


def test_a_moved_class_name_reads_as_the_current_one() -> None:
    raw = {**copy.deepcopy(RAW), "optimizer": "lowdiff_store.torch.demo_optim.DeMo"}
    meta = parse(raw)
    assert meta.optimizer == "lowdiff_store.torch.compressors.demo.DeMo"
    assert meta.raw["optimizer"] == "lowdiff_store.torch.demo_optim.DeMo"  # as recorded
    written = meta.as_written()
    assert written["optimizer"] == "lowdiff_store.torch.compressors.demo.DeMo"
    assert list(written) == list(raw)  # the same keys in the same order
    assert {k: v for k, v in written.items() if k != "optimizer"} == \
        {k: v for k, v in raw.items() if k != "optimizer"}


def test_an_fsdp_shard_section_parses_into_attributes() -> None:
    meta = parse({**copy.deepcopy(RAW), "shard": copy.deepcopy(FSDP)})
    sh = meta.shard
    assert isinstance(sh, ShardMeta)
    assert (sh.rank, sh.world_size, sh.layout, sh.owned) == (1, 2, "fsdp", ("w",))
    assert (sh.global_params, sh.global_groups) == (("w", "v"), (1, 1))
    assert sh.global_model is not None
    assert sh.global_model[0].shape == (8, 2)
    assert sh.mesh is not None
    assert (sh.mesh.shape, sh.mesh.coord, sh.mesh.dim_names) == ((2,), (1,), ("dp",))
    p = sh.pieces["w"]
    assert (p.global_shape, p.placements, p.offset, p.shape) == \
        ((8, 2), (("S", 0),), (4, 0), (4, 2))
    assert dict(sh.global_aliases or {}) == {"w_tied": "w"}
    assert sh.global_state_dict is None


def test_a_zero_shard_section_has_no_fsdp_parts() -> None:
    shard = {"rank": 0, "world_size": 2, "layout": "zero", "owned": ["w"],
             "global_params": ["w", "v"], "global_groups": [1, 1]}
    sh = parse({**copy.deepcopy(RAW), "shard": shard}).shard
    assert sh is not None
    assert (sh.layout, sh.global_params, sh.mesh, dict(sh.pieces)) == \
        ("zero", ("w", "v"), None, {})


def test_a_base_map_parses_against_its_log() -> None:
    log = parse(copy.deepcopy(RAW))
    hyper = [{"lr": 0.1}, {"lr": 0.2}]
    raw = {"step": 10, "hyper": hyper, "sched": {"last_epoch": 10}, "scaler": None,
           "extra": None, "opt": {"tensors": {"w": ["momentum_buffer"]}, "values": {}}}
    tensors = {"w": ("F32", (4, 2)), "v": ("BF16", (3,)), "b": ("F32", (2,)),
               "@opt/w/momentum_buffer": ("F32", (4, 2))}
    bm = parse_base(raw, log, path="base", tensors=tensors, step=10)
    assert (bm.step, bm.hyper, bm.sched, bm.ef_approx) == (10, hyper, {"last_epoch": 10},
                                                          False)
    assert bm.hyper is hyper  # replay compares hyperparameter lists by identity
    assert dict(bm.opt.tensors) == {"w": ["momentum_buffer"]}
    with pytest.raises(LowdiffError) as ei:
        parse_base(raw, log, path="base", tensors={k: v for k, v in tensors.items()
                                                   if not k.startswith("@opt/")}, step=10)
    assert ei.value.reason is Reason.BAD_METADATA
    assert "@opt/w/momentum_buffer is missing from the base" in str(ei.value)


# ------------------------------------------------------------------ crafted maps


def test_an_alias_to_a_non_name_is_one_error() -> None:
    """An alias whose target is a list (unhashable) was a TypeError before parsing."""
    _bad({**copy.deepcopy(RAW), "aliases": {"x": ["w"]}}, "alias 'x'")


def test_a_global_alias_to_a_non_name_is_one_error() -> None:
    """The same in an FSDP2 shard's ``global_aliases``."""
    shard = copy.deepcopy(FSDP)
    shard["global_aliases"] = {"x": ["w"]}
    _bad({**copy.deepcopy(RAW), "shard": shard}, "meta.torch.shard: global_aliases")


def test_each_broken_field_is_one_error_naming_it() -> None:
    cases: list[tuple[str, Any, str]] = [
        ("mode", "quantum", "mode 'quantum'"),
        ("groups", [3], "groups [3] must be sizes"),
        ("model", [["w", "F99", [1]]], "unknown dtype"),
        ("buffers", ["ghost"], "buffer 'ghost'"),
        ("state_dict", ["ghost"], "state_dict name 'ghost'"),
        ("compressor", {"kind": "topk", "ef_state": "never"}, "compressor.ef_state"),
        ("digest_every", -1, "digest_every"),
        ("device", 7, "device"),
    ]
    for key, value, where in cases:
        _bad({**copy.deepcopy(RAW), key: value}, where)
    _bad([RAW], "meta.torch: is not a map")


# ------------------------------------------------------------------ one home for the prefixes


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def prefix_literals(path: Path) -> list[str]:
    """``path:line: 'literal'`` for each string literal of ``path`` (f-string parts
    included, docstrings not) that holds a tensor-name prefix."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    return [f"{path}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and any(p in n.value for p in PREFIXES)]


def test_every_prefix_is_spelled_out_in_names_only() -> None:
    offenders = [hit for p in sorted(PKG.rglob("*.py")) if p != NAMES
                 for hit in prefix_literals(p)]
    assert not offenders, "\n".join(offenders)
    assert len(prefix_literals(NAMES)) >= len(PREFIXES)


def test_the_prefix_check_can_fail(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text('"""Names like ``@grad/w`` in a docstring are fine."""\n'
                   'KEY = "@rng/" + "cpu"\n'
                   'def f(n):\n    return f"@opt/{n}/exp_avg"\n')
    hits = prefix_literals(mod)
    assert [h.split(": ", 1)[1] for h in hits] == ["'@rng/'", "'@opt/'"]
