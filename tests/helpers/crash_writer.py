"""Child process of the crash tests (tests/test_writer_crash.py).

Appends diff records with deterministic content (see :func:`step_specs`) to the log at PATH
through a :class:`AsyncLogWriter`, resuming after the last step already in the log, writes a
base every ``BASE_EVERY`` steps, and prints ``durable N`` on stdout (flushed) each time the
writer acknowledges step N as durable. The parent SIGKILLs it at a random moment and checks
the log against the same content functions.

``--enospc``: append until the disk is full (run inside a small tmpfs), then check the log
in-process (the tmpfs vanishes with the mount namespace) and print one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from lowdiff_store import LogReader, codecs
from lowdiff_store.errors import LowdiffError
from lowdiff_store.writer import AsyncLogWriter, TensorSpec

BASE_EVERY = 7
SPARSE_NUMEL = 10_000


def step_arrays(step: int, big: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The dense tensor, sparse indices and sparse values of ``step``. Every 5th step is
    large (2 MiB, or 16 MiB with ``big``: a kill then lands inside a write now and then)."""
    rng = np.random.default_rng(1000 + step)
    size = ((1 << 22) if big else (1 << 19)) if step % 5 == 0 else int(rng.integers(1, 1 << 15))
    dense = rng.standard_normal(size).astype(np.float32)
    idx = np.sort(rng.choice(SPARSE_NUMEL, 100, replace=False)).astype(np.int32)
    val = rng.standard_normal(100).astype(np.float32)
    return dense, idx, val


def step_specs(step: int, big: bool = False) -> list[TensorSpec]:
    dense, idx, val = step_arrays(step, big)
    return [TensorSpec("w", "F32", dense, zstd=1 if step % 3 == 0 else None),
            TensorSpec("g", "F32", encoded=codecs.encode_sparse(idx, val, SPARSE_NUMEL, "F32"),
                       shape=(100, 100))]


def step_side(step: int) -> dict[str, Any]:
    return {"step": step, "lr": 0.001 * step}


def base_state(step: int) -> dict[str, tuple[str, np.ndarray]]:
    return {"p": ("F32", np.full(1000, step, np.float32))}


def check_log(path: str, big: bool = False) -> tuple[int, list[int]]:
    """Assert the log holds steps 1..N exactly, bit for bit, and valid bases; returns
    (N, bases)."""
    with LogReader(path, strict=True) as r:
        steps = [int(s) for s in r.steps]
        n = steps[-1] if steps else 0
        assert steps == list(range(1, n + 1)), f"steps {steps[:5]}... are not 1..{n}"
        for s in steps:
            rec = r.record(s)
            dense, idx, val = step_arrays(s, big)
            assert np.array_equal(rec.tensor("w"), dense), f"step {s}: w differs"
            sparse = np.zeros(SPARSE_NUMEL, np.float32)
            sparse[idx] = val
            assert np.array_equal(rec.tensor("g"), sparse.reshape(100, 100)), f"step {s}: g"
            assert rec.side == step_side(s), f"step {s}: side differs"
        for b in r.bases:
            with r.base(b) as bf:
                assert np.array_equal(bf.tensor("p"), base_state(b)["p"][1]), f"base {b}"
        assert r.report.clean, r.report.to_dict()
        if steps and r.bases:
            assert r.durable_step == n, f"durable_step {r.durable_step} != {n}"
        return n, list(r.bases)


def _ack(step: int) -> None:
    sys.stdout.write(f"durable {step}\n")
    sys.stdout.flush()


def run(path: str, steps: int, batch: int, big: bool) -> None:
    with AsyncLogWriter(path, batch=batch, max_delay_s=0.01, segment_bytes=8 << 20,
                    on_durable=_ack) as w:
        start = w.last_step + 1
        if start == 0:
            w.write_base(0, base_state(0))
            start = 1
        print("ready", flush=True)
        for step in range(start, start + steps):
            w.append(step, step_specs(step, big), kind="grad", side=step_side(step))
            if step % BASE_EVERY == 0:
                w.write_base(step, base_state(step))
    print("done", flush=True)


def run_until_full(path: str, batch: int) -> None:
    acked: list[int] = []
    out: dict[str, Any] = {}
    w = AsyncLogWriter(path, batch=batch, max_delay_s=0.01, on_durable=acked.append)
    step = 0
    try:
        w.write_base(0, base_state(0))
        for step in range(1, 10_000):
            w.append(step, step_specs(step), kind="grad", side=step_side(step))
        w.flush()
        out["error"] = None
    except LowdiffError as e:
        out.update(error=str(e), type=type(e).__name__, failed_at_append=step,
                   cause_errno=getattr(e.__cause__, "errno", None))
    w.close()
    out["acked"] = max(acked) if acked else None
    try:
        out["n"], _bases = check_log(path)
        out["ok"] = True
    except AssertionError as e:
        out.update(ok=False, check=str(e))
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--enospc", action="store_true")
    ap.add_argument("--big", action="store_true", help="16 MiB records every 5th step")
    args = ap.parse_args()
    if args.enospc:
        run_until_full(args.path, args.batch)
    else:
        run(args.path, args.steps, args.batch, args.big)


if __name__ == "__main__":
    main()
