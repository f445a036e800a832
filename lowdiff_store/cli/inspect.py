"""``lowdiff-store inspect``: a summary of a log (no full read; ``verify`` reads everything)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import LowdiffError, Reason
from .output import EXIT_OK, human_bytes, print_json


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "inspect", help="summarize a log: steps, bases, sizes, codecs, health",
        description="Summarize a log: bases (streamed ones with their slices), "
                    "first/last/durable step, records, bytes on disk, "
                    "bytes per step, codecs, ratio to dense fp32, and health (checked on the "
                    "newest records it reads; `verify` reads every byte).")
    s.add_argument("path", help="log directory")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the summary."""
    from ..verify import inspect_log

    info = inspect_log(args.path)
    torch_info = _torch_describe(args.path)
    if torch_info is not None:
        # the torch layer's description replaces the raw torch metadata: shown once
        info["torch"] = torch_info
        for part in [info, *info.get("shards", [])]:
            if isinstance(part.get("meta"), dict):
                part["meta"].pop("torch", None)
    if args.json:
        print_json(info)
        return EXIT_OK
    if info["sharded"]:
        print(f"sharded checkpoint: {info['world_size']} ranks ({info['layout']}), "
              f"durable step {info['durable_step']}, {info['records']} records, "
              f"{human_bytes(info['bytes_on_disk'])}, health {info['health']}")
        tshards = (torch_info or {}).get("shards") or []
        for i, sh in enumerate(info["shards"]):
            coord = tshards[i].get("mesh_coord") if i < len(tshards) else None
            where = f" (mesh coordinate {coord})" if coord is not None else ""
            streamed = (f", streamed bases {_streamed(sh['streamed'])}"
                        if sh.get("streamed") else "")
            print(f"  rank {i}{where}: {sh['records']} records, bases {sh['bases']}"
                  f"{streamed}, durable {sh['durable_step']}, "
                  f"{human_bytes(sh['bytes_per_step'])}/step, health {sh['health']}")
            for b, ref in sh.get("references", {}).items():
                print(f"    base {b} references {_reference(ref)}")
        if torch_info and "mesh" in torch_info:
            try:
                _print_mesh(torch_info)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                raise LowdiffError(f"the FSDP2 mesh or placements in the shards' metadata "
                                   f"are malformed ({type(e).__name__}: {e})",
                                   reason=Reason.BAD_METADATA, path=args.path) from None
        _print_problems(info)
        for sh in info["shards"]:
            _print_problems(sh)
        return EXIT_OK
    ratio = info["ratio_to_dense_fp32"]
    rows = [
        ("log", info["path"]),
        ("log id", info["log_id"]),
        ("health", info["health"] + (f" (torn tail of {info['torn_tail_bytes']} bytes "
                                     "ignored)" if info["torn_tail_bytes"] else "")),
        ("records", info["records"]),
        ("bases at steps", ", ".join(map(str, info["bases"])) or "none"),
        ("streamed bases", _streamed(info["streamed"])),
        ("first / last / durable step",
         f"{info['first_step']} / {info['last_step']} / {info['durable_step']}"),
        ("segments", info["segments"]),
        ("bytes on disk", human_bytes(info["bytes_on_disk"])
         + f" (segments {human_bytes(info['segment_bytes'])}, bases "
           f"{human_bytes(info['base_bytes'])}"
           + (f", slices {human_bytes(info['slice_bytes'])}" if info["slice_bytes"] else "")
           + ")"),
        ("bytes per step", human_bytes(info["bytes_per_step"])),
        ("codecs", ", ".join(f"{k} x{v}" for k, v in sorted(info["codecs"].items())) or "-"),
        ("ratio to dense fp32", f"{ratio:.4f}" if ratio is not None else "-"),
    ]
    rows.extend((f"base {b} references", _reference(ref))
                for b, ref in info.get("references", {}).items())
    if info["base_slices"] is not None:
        rows.append(("base slices", _base_slices(info["base_slices"])))
    if torch_info:
        if "num_tensors" in torch_info:
            rows.append(("model tensors", f"{torch_info['num_tensors']} "
                         f"({torch_info.get('num_elements', 0):,} elements)"))
        keys = ("mode", "optimizer", "snapshot_every", "compressor")
        rows.extend((k.replace("_", " "), torch_info[k]) for k in keys if k in torch_info)
    width = max(len(k) for k, _v in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    _print_problems(info)
    return EXIT_OK


def _streamed(streamed: list[dict[str, Any]]) -> str:
    """``6 (slices 4, 5, 6; 55 KiB), ...``: the streamed bases by complete step."""
    return "; ".join(f"{e['complete']} (slices {', '.join(map(str, e['slices']))}: "
                     f"{human_bytes(e['bytes'])})" for e in streamed) or "none"


def _base_slices(bs: dict[str, Any]) -> str:
    """What ``base_slices=k`` did: streamed in k slices, or consistent bases and why."""
    if bs["in_force"] > 1 and bs["k"] == "auto":
        return f"auto: chosen before each base ({bs['in_force']} at the start)"
    if bs["in_force"] > 1:
        return f"{bs['in_force']} per base (asked {bs['k']})"
    return f"asked {bs['k']}, consistent bases taken instead: {bs['why']}"


def _reference(ref: dict[str, Any]) -> str:
    """One line for a reference base's external checkpoint."""
    return (f"{ref['kind']} checkpoint {ref['root']} ({ref['tensors']} tensors in "
            f"{len(ref['files'])} files, {human_bytes(ref['file_bytes'])}, not copied)")


def _placement(pl: list[Any]) -> str:
    """``Shard(0)`` / ``Replicate()`` from the log's ``["S", 0]`` / ``["R"]``."""
    return f"Shard({pl[1]})" if pl and pl[0] == "S" and len(pl) > 1 else \
        "Replicate()" if pl and pl[0] == "R" else repr(pl)


def _box(b: dict[str, Any]) -> str:
    """``[0:4, 0:30]``: a box as a slice per dimension."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(b["offset"], b["shape"],
                                                          strict=True)) + "]"


def _print_mesh(torch_info: dict[str, Any]) -> None:
    """The device mesh of an FSDP2 checkpoint and, per parameter, its placements, global
    shape and each rank's box (offset and shape per dimension)."""
    mesh = torch_info["mesh"]
    names = mesh.get("dim_names") or []
    dims = " x ".join(f"{n}={s}" if i < len(names) and (n := names[i]) else str(s)
                      for i, s in enumerate(mesh.get("shape") or []))
    print(f"device mesh: {dims or '-'}")
    shards = torch_info.get("shards") or []
    for name, p in (torch_info.get("placements") or {}).items():
        pls = ", ".join(_placement(x) for x in p["placements"])
        boxes = "; ".join(f"rank {sh['rank']} {_box(b)}" for sh in shards
                          if (b := (sh.get("pieces") or {}).get(name)) is not None)
        print(f"  {name}: ({pls}) global {list(p['global_shape'])}; {boxes}")


def _print_problems(info: dict[str, Any]) -> None:
    for p in info["problems"]:
        at = p["offset"] if p["offset"] is not None else "-"  # as verify prints it
        print(f"problem: {p['path']}:{at}: {p['reason']}: {p['detail']}")


def _torch_describe(path: str) -> dict[str, Any] | None:
    """The torch layer's description of a log it wrote; None without torch or for a log
    the torch layer did not write."""
    try:
        from ..torch import describe_log
    except ImportError:
        return None
    try:
        out: dict[str, Any] = describe_log(path)
        return out
    except LowdiffError:
        return None
