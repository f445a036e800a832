"""FSDP2 (``torch.distributed.fsdp.fully_shard``): DTensor placements and each rank's share.

With ``fully_shard`` every parameter the optimizer sees is a DTensor: rank *r* holds a
*piece* of it (its local tensor), a box of the global tensor given by the device mesh and
the placements. The log of rank *r* (layout ``"fsdp"``) holds the pieces it owns, exactly
as the optimizer consumed and updated them: the sharded gradient (after reduce-scatter,
clipping, accumulation), the sharded fp32 parameters and optimizer state in bases. Its
torch metadata records, under ``shard``, the mesh and for every parameter its placements,
global shape and box (offset and length per dimension), so any reader knows which part of
the global tensor a piece is, without torch (see ``docs/distributed.md``, "FSDP2").

On a 2-D mesh (HSDP: replicate x shard) the ranks of one replica group hold the same
pieces; they split the writing as DDP ranks do (a greedy partition of the parameters by
global bytes, the same on every shard coordinate).

Placements supported: ``Shard(d)`` (even or uneven, torch's ``chunk`` rule) and
``Replicate()``; ``Partial`` and strided shards (FSDP combined with tensor parallel) are
refused at checkpointer creation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError, Reason
from ..capture.layout import Partition
from ..core import schema as L
from ..core.partition import partition_by_bytes
from ..core.tensors import local_of, tag_of


def is_dtensor(t: Any) -> bool:
    """True for a DTensor (or an ``nn.Parameter`` wrapping one)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def has_dtensor(tensors: Sequence[Any]) -> bool:
    """True when any of ``tensors`` is a DTensor."""
    return any(is_dtensor(t) for t in tensors)


def encode_placements(placements: Sequence[Any], what: str) -> list[list[Any]]:
    """``[["S", dim]]`` for ``Shard(dim)``, ``["R"]`` for ``Replicate()``; anything else
    (``Partial``, strided shards of FSDP + tensor parallel) is refused."""
    out: list[list[Any]] = []
    for p in placements:
        kind = type(p).__name__
        if kind == "Shard":
            out.append(["S", int(p.dim)])
        elif kind == "Replicate":
            out.append(["R"])
        else:
            raise ConfigError(f"{what}: placement {p!r} is not supported (Shard(dim) and "
                              f"Replicate() are)", reason=Reason.NOT_ALLOWED)
    return out


def piece_of(t: Any, what: str) -> dict[str, Any]:
    """The placement metadata of one DTensor on this rank: placements, global shape, and
    the box this rank holds (``offset`` and ``shape`` per dimension)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pls = encode_placements(t.placements, what)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                          t.placements)
    local = local_of(t)
    if tuple(local.shape) != tuple(shape):
        raise ConfigError(f"{what}: local tensor {tuple(local.shape)} is not the shard "
                          f"{tuple(shape)} its placements give", reason=Reason.NOT_ALLOWED)
    return {"placements": pls, "global_shape": [int(s) for s in t.shape],
            "offset": [int(o) for o in offset], "shape": [int(s) for s in shape]}


@dataclass
class FsdpShare:
    """What one rank of an FSDP2 job logs."""

    owned: list[str]                    # parameters whose pieces this rank logs
    mesh: dict[str, Any]                # shape, dim_names, coord (this rank's)
    pieces: dict[str, dict[str, Any]]   # every parameter: placements and this rank's box
    replica: int                        # this rank's index among the ranks holding its pieces
    replicas: int                       # how many ranks hold the same pieces


def fsdp_share(names: Sequence[str], params: Sequence[torch.Tensor]) -> FsdpShare:
    """The share of this rank: every parameter must be a DTensor on one device mesh, each
    mesh dimension either sharding every parameter or replicating every parameter."""
    plain = [n for n, p in zip(names, params, strict=True) if not is_dtensor(p)]
    if plain:
        raise ConfigError(f"parameter {plain[0]} is a plain tensor while others are DTensors: "
                          f"apply fully_shard to the root module so every parameter is "
                          f"sharded", reason=Reason.NOT_ALLOWED)
    if not params:
        raise ConfigError("the optimizer has no parameters", reason=Reason.NOT_ALLOWED)
    mesh = params[0].device_mesh  # type: ignore[attr-defined]
    pieces: dict[str, dict[str, Any]] = {}
    rep_dims: set[int] | None = None
    for n, p in zip(names, params, strict=True):
        if p.device_mesh != mesh:  # type: ignore[attr-defined]
            raise ConfigError(f"parameter {n} is on another device mesh than {names[0]}: one "
                              f"mesh per job is supported", reason=Reason.NOT_ALLOWED)
        pieces[n] = piece_of(p, n)
        reps = {i for i, pl in enumerate(pieces[n]["placements"]) if pl[0] == "R"}
        if rep_dims is None:
            rep_dims = reps
        elif reps != rep_dims:
            raise ConfigError(f"parameter {n} is replicated on mesh dims {sorted(reps)}, "
                              f"{names[0]} on {sorted(rep_dims)}: the mesh must replicate "
                              f"every parameter on the same dims", reason=Reason.NOT_ALLOWED)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError("this rank is not part of the parameters' device mesh",
                          reason=Reason.NOT_ALLOWED)
    shape = [int(s) for s in mesh.shape]
    replica, replicas = 0, 1
    for d in sorted(rep_dims or ()):
        replica = replica * shape[d] + int(coord[d])
        replicas *= shape[d]
    sizes = [(n, math.prod(pieces[n]["global_shape"]) * p.element_size())
             for n, p in zip(names, params, strict=True)]
    owned = set(partition_by_bytes(sizes, replicas)[replica])
    info = {"shape": shape, "dim_names": list(mesh.mesh_dim_names or []),
            "coord": [int(c) for c in coord]}
    return FsdpShare([n for n in names if n in owned], info, pieces, replica, replicas)


def shard_meta(share: FsdpShare, *, rank: int, world: int, names: Sequence[str],
               groups: Sequence[int], model: Mapping[str, torch.Tensor]
               ) -> dict[str, Any]:
    """The ``shard`` entry of an fsdp shard's torch metadata. ``names``/``groups``: every
    optimizer parameter and group size; ``model``: every model tensor (global shapes)."""
    return {"rank": rank, "world_size": world, "layout": "fsdp", "owned": list(share.owned),
            "global_params": list(names), "global_groups": list(groups),
            "global_model": [[n, tag_of(t, n), [int(s) for s in t.shape]]
                             for n, t in model.items()],
            "mesh": share.mesh, "replica": share.replica, "replicas": share.replicas,
            "pieces": {n: share.pieces[n] for n in share.owned}}


def select_fsdp(rank: int, world: int, names: list[str], params: list[torch.Tensor],
                model: dict[str, torch.Tensor], buffers: list[str], groups: list[int],
                meta: dict[str, Any]) -> Partition:
    """The share of rank ``rank`` in layout ``"fsdp"``: its owned DTensor parameters (their
    pieces are what is logged), out of every optimizer parameter (``names``/``params`` in
    ``groups``) and model tensor. Rewrites the log metadata ``meta`` so the shard replays on
    its own (local shapes, the owned parameters and their group sizes), with the
    placements under ``shard``."""
    share = fsdp_share(names, params)
    owned = set(share.owned)
    bufs = set(buffers)
    keep = [i for i, n in enumerate(names) if n in owned]
    mine = [names[i] for i in keep]
    kept_model = {n: t for n, t in model.items() if n in owned or n in bufs}
    counts, start = [], 0
    for g in groups:
        counts.append(sum(1 for i in keep if start <= i < start + g))
        start += g
    meta["params"] = list(mine)
    meta["groups"] = counts
    meta["model"] = [[n, tag_of(t, n), [int(s) for s in local_of(t).shape]]
                     for n, t in kept_model.items()]
    meta["shard"] = shard_meta(share, rank=rank, world=world, names=names, groups=groups,
                               model=model)
    # the state_dict order and aliases name the shard's own tensors (an HSDP replica
    # logs a part of the parameters); the whole job's go under ``shard``
    kept = set(kept_model)
    aliases = dict(meta.get("aliases") or {})
    meta["shard"]["global_aliases"] = aliases
    meta["aliases"] = {a: t for a, t in aliases.items() if t in kept}
    if meta.get("state_dict") is not None:
        meta["shard"]["global_state_dict"] = list(meta["state_dict"])
        meta["state_dict"] = [n for n in meta["state_dict"]
                              if n in kept or n in meta["aliases"]]
    return Partition(mine, [params[i] for i in keep], kept_model)


def check_fsdp_options(optimizer: torch.optim.Optimizer, kwargs: Mapping[str, Any]) -> None:
    """What an FSDP2 job refuses: weight deltas, compressors, and optimizers whose step
    is not elementwise (or not allow-listed: a shard is replayed without the others, so
    its optimizer must act on each element alone)."""
    if kwargs.get("mode", "grad") != "grad":
        raise ConfigError(
            "mode='delta' is not supported with FSDP2: weight deltas are captured from "
            "whole (non-DTensor) model and optimizer-state tensors and replayed without an "
            "optimizer, and neither the delta capture nor the resharding engine (which "
            "replays the sharded gradients per shard) handles a rank's DTensor pieces yet. "
            "Use mode='grad': bitwise, the optimizers FSDP2 allows are elementwise, and each "
            "rank logs only its gradient piece (delta mode would log a weight delta and, "
            "with Adam, two moment deltas per piece)",
            reason=Reason.NOT_ALLOWED)
    if kwargs.get("compressor") is not None:
        raise ConfigError("a TopKCompressor is not supported with FSDP2 (the sharded "
                          "gradient is logged as the optimizer consumes it)",
                          reason=Reason.NOT_ALLOWED)
    name = L.class_name(optimizer)
    if L.allowed_optimizer(name) is None or name in NOT_ELEMENTWISE:
        raise ConfigError(f"optimizer {name} is not supported with FSDP2: each rank's shard "
                          f"is replayed on its own, which is exact only for the elementwise "
                          f"torch.optim optimizers ({', '.join(ELEMENTWISE)})",
                          reason=Reason.NOT_ALLOWED)


#: torch.optim classes whose step acts on each element alone given the step count and the
#: hyperparameters: replaying any piece of a parameter gives the bits the whole would.
#: DeMo's optimizer (signum of the logged sign tensor with decoupled weight decay) too; its
#: compressor's DCT chunks are not elementwise, but they run in training only.
ELEMENTWISE: tuple[str, ...] = (*L.ALLOWED_OPTIMIZERS, "DeMo")
#: torch.optim classes known not to be elementwise (factored or closure-driven state)
NOT_ELEMENTWISE: tuple[str, ...] = ("torch.optim.adafactor.Adafactor",
                                    "torch.optim.lbfgs.LBFGS")


__all__ = ["ELEMENTWISE", "FsdpShare", "check_fsdp_options", "encode_placements",
           "fsdp_share", "has_dtensor", "is_dtensor", "piece_of", "select_fsdp",
           "shard_meta"]
