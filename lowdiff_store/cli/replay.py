"""``lowdiff-store replay``: the state at a step, written to a ``.pt``, safetensors or HDF5
file, a DCP checkpoint or Hugging Face sharded safetensors (needs the torch extra)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError, Reason, StepNotFoundError
from .output import (
    EXIT_MISSING_DEP,
    EXIT_OK,
    EXIT_USAGE,
    error,
    human_bytes,
    output_problem,
    print_json,
    progress,
    rank_problem,
    rank_value,
    step_value,
)


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "replay", help="materialize the state at a step: .pt/.safetensors/.h5, DCP, HF",
        description="Rebuild the model state at a step (nearest base, then the diffs after "
                    "it, every recorded digest checked) and publish it atomically: a file "
                    "(temp file beside it, .FILE.lowdiff-tmp-HOST-PID-RANDOM.tmp, fsync, "
                    "rename) or, for --format dcp/hf, a directory (temp directory beside "
                    "it, every file fsynced, rename). A temp file or directory left by an "
                    "export killed outright is removed by the next export into that "
                    "directory. A checkpoint of local-update training (post-local SGD, "
                    "DiLoCo: one replica per rank) needs --rank R: replica R's state, "
                    "replayed from its own shard (its rank directory PATH/rank-0000R is "
                    "the same). A rank directory of a DDP, ZeRO or FSDP2 checkpoint holds "
                    "a share of the state, not a whole one: refused (exit 2), replay the "
                    "checkpoint directory. Needs the torch extra.")
    s.add_argument("path", help="log directory (or sharded checkpoint directory; one of "
                                "its rank directories: that replica of a local-update "
                                "checkpoint, a usage error for the other layouts)")
    s.add_argument("--to-step", type=step_value, default=None, metavar="N",
                   help="step to rebuild (default: the newest durable step)")
    s.add_argument("--rank", type=rank_value, default=None, metavar="R",
                   help="local-update checkpoints (one divergent replica per rank): the "
                        "replica to rebuild, required there; missing, a rank the "
                        "checkpoint does not have, or given for another log: usage error "
                        "(exit 2)")
    s.add_argument("--out", required=True, metavar="PATH",
                   help="output file; its suffix names the format: .pt/.pth (torch.load "
                        "with weights_only=True), .safetensors, .h5/.hdf5; or a directory "
                        "that does not exist yet, for --format dcp or hf; never inside a "
                        "log (refused, exit 2)")
    s.add_argument("--format", choices=["pt", "safetensors", "hdf5", "dcp", "hf"],
                   default=None,
                   help="output format, for a PATH without one of those suffixes (one that "
                        "contradicts the suffix is refused). dcp: a PyTorch Distributed "
                        "Checkpoint ({'model': ..., 'optim': ...}, loadable with "
                        "torch.distributed.checkpoint.load at any world size); hf: Hugging "
                        "Face sharded safetensors (model-0000k-of-0000N.safetensors + "
                        "model.safetensors.index.json)")
    s.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="hf: the largest shard (e.g. 5GB, 500MB, 64MiB; default 5GB); a "
                        "tensor larger than SIZE gets a shard of its own")
    s.add_argument("--hf-config", default=None, metavar="FILE",
                   help="hf: a config.json copied into the checkpoint, so that "
                        "transformers' from_pretrained(PATH) loads it; checked before the "
                        "replay (exit 1): a FIFO, device or directory is "
                        "not_a_regular_file, a file over the size cap metadata_too_large")
    from ..torchmeta.names import OPT  # here: importing the CLI loads nothing heavy

    s.add_argument("--with-optimizer", action="store_true",
                   help="also write the optimizer state: each state tensor as "
                        f"'{OPT}<parameter name>/<key>' (e.g. '{OPT}fc.weight/exp_avg'), the "
                        "param groups' hyperparameters as JSON metadata "
                        "'optimizer_param_groups' (safetensors, HDF5); dcp: under 'optim' in "
                        "the layout of torch.distributed.checkpoint.state_dict; not with hf")
    s.add_argument("--json", action="store_true", help="print a JSON summary")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Replay and export."""
    from ..log.shards import replay_source

    try:
        from ..torch import replay_state
        from ..torch.replay.checkpoint_dirs import parse_size, read_hf_config
        from ..torch.replay.export import check_destination, export_state, format_for_path
        from ..torchmeta.names import OPT
    except ImportError as e:
        error(f"replay needs torch ({e}); install lowdiff-store[torch]")
        return EXIT_MISSING_DEP
    why = output_problem(args.out, args.path)
    if why is not None:
        error(why, command="replay")
        return EXIT_USAGE
    try:
        fmt = format_for_path(args.out, args.format)
        shard = parse_size(args.max_shard_size)
        if fmt == "hf" and args.with_optimizer:
            raise ConfigError("--format hf holds model weights only; use --format dcp to "
                              "export the optimizer state")
        if args.hf_config is not None and fmt != "hf":
            raise ConfigError("--hf-config goes with --format hf")
    except ConfigError as e:
        check_destination(args.out, args.format)  # a place that cannot be written: said first
        error(e.detail, command="replay")
        return EXIT_USAGE
    try:  # a rank directory: its checkpoint and rank, or refused
        path, rank = replay_source(args.path, args.rank)
    except ConfigError as e:
        error(str(e), command="replay")
        return EXIT_USAGE
    why = rank_problem(path, rank, needed=True)
    if why is not None:
        error(why, command="replay")
        return EXIT_USAGE
    check_destination(args.out, fmt)  # before the replay, not after it
    # Read once, before the replay: not a regular file, too large or not JSON is said now.
    hf_config = read_hf_config(args.hf_config) if args.hf_config is not None else None
    step = args.to_step if args.to_step is not None else newest_durable_step(path)
    with progress("replay", args) as bar:
        model_state, opt_state = replay_state(path, step, with_optimizer=args.with_optimizer,
                                              progress=bar, rank=rank)
    res = export_state(model_state, args.out, format=fmt, optimizer_state=opt_state,
                       max_shard_bytes=shard, hf_config=hf_config)
    summary: dict[str, Any] = {"step": step, "out": res.path, "format": res.format,
               "model_tensors": res.model_tensors, "optimizer_tensors": res.optimizer_tensors,
               "bytes": res.bytes}
    if rank is not None:
        summary["rank"] = rank
    if args.json:
        print_json(summary)
    else:
        opt = (f" and {res.optimizer_tensors} optimizer tensors ({OPT}...)"
               if args.with_optimizer else "")
        of = "" if rank is None else f" of replica {rank}"
        print(f"wrote {res.model_tensors} model tensors{opt}{of} at step {step} to "
              f"{res.path} ({res.format}, {human_bytes(res.bytes)})")
    return EXIT_OK


def newest_durable_step(path: str) -> int:
    """The newest step that can be rebuilt (for a sharded checkpoint: on every rank)."""
    from ..log import LogReader
    from ..log.shards import is_sharded, log_paths

    durable = []
    for p in log_paths(path) if is_sharded(path) else [path]:
        with LogReader(p) as r:
            durable.append(r.durable_step)
    if any(d is None for d in durable):
        raise StepNotFoundError("the log has no base yet: nothing to replay",
                                reason=Reason.NO_BASE, path=path)
    return min(d for d in durable if d is not None)
