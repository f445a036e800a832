"""Measure the reconstruction error of lossy delta mode (numbers quoted in docs/torch.md).

Run: ``.venv/bin/python tests/torch/measure_delta_error.py`` (CPU, one thread, ~1 min).

A small transformer LM (vocab 256, width 64; 83k parameters) trains 100 AdamW steps with a
cosine schedule while a DiffCheckpointer logs weight diffs of the full state (parameters,
buffers, AdamW moments) with each codec. The log is then replayed with ``replay_state`` at
several steps and compared with the true state of the run.
"""

from __future__ import annotations

import math
import sys
import tempfile
from typing import Any

import torch

from lowdiff_store import LogReader
from lowdiff_store.torch import DiffCheckpointer, describe_log, replay_state


class LM(torch.nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = torch.nn.Embedding(vocab, d)
        self.layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0,
                                                      batch_first=True)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(x)))


def measure(codec: str, steps: int, at: tuple[int, ...], path: str, **opts: Any
            ) -> list[dict[str, float]]:
    """Train, log with ``codec``, replay at ``at``; errors against the true state."""
    torch.manual_seed(0)
    m = LM()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sch = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    truth: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
    with DiffCheckpointer(path, m, opt, scheduler=sch, mode="delta", delta_codec=codec,
                          snapshot_every=10_000, delta_min_numel=1024, **opts) as ckpt:
        for t in range(1, steps + 1):
            g = torch.Generator().manual_seed(t)
            x = torch.randint(0, m.vocab, (8, 33), generator=g)
            opt.zero_grad()
            out = m(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, m.vocab),
                                                     x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            sch.step()
            if t in at:
                truth[t] = ({k: v.clone() for k, v in m.state_dict().items()},
                            {i: {k: v.clone() for k, v in s.items()}
                             for i, s in opt.state_dict()["state"].items()})
        ckpt.flush()
    with LogReader(path) as r:
        disk = sum(size for _sid, _p, size in r.segment_files())
    param_bytes = sum(p.numel() * 4 for p in m.parameters())
    rows = []
    for t in at:
        state, ost = replay_state(path, t, with_optimizer=True)
        assert ost is not None
        w_true, o_true = truth[t]
        num = sum(float((state[k] - v).float().norm() ** 2) for k, v in w_true.items())
        den = sum(float(v.float().norm() ** 2) for v in w_true.values())
        wmax = max(float((state[k] - v).abs().max()) for k, v in w_true.items())
        dmax = 0.0
        for i, st in o_true.items():
            for k in ("exp_avg", "exp_avg_sq"):
                a, b = ost["state"][i][k], st[k]
                dmax = max(dmax, float(((a - b).abs() / (b.abs().max() + 1e-30)).max()))
        rows.append({"step": t, "rel_l2": math.sqrt(num / den), "max_abs": wmax,
                     "opt_rel_max": dmax})
    for r in rows:
        r["bytes_per_step_vs_fp32_params"] = disk / steps / param_bytes
    return rows


def main() -> None:
    torch.set_num_threads(1)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    at = tuple(sorted({10, steps // 2, steps}))
    print(f"{'codec':<10}{'step':>6}{'rel L2 (weights)':>18}{'max |dw|':>12}"
          f"{'max rel (moments)':>19}{'log bytes/step / fp32 params':>30}")
    for codec, opts in (("xor", {}), ("q8", {}), ("topk", {"delta_ratio": 0.1}),
                        ("topk", {"delta_ratio": 0.01}), ("lcc", {"delta_bits": 3}),
                        ("lcc", {"delta_bits": 4})):
        with tempfile.TemporaryDirectory() as d:
            rows = measure(codec, steps, at, d + "/log", **opts)
            assert describe_log(d + "/log")["codecs"]["delta"] == codec
        label = codec + "".join(f"{v:.0%}" if k == "delta_ratio" else f" {v}b"
                                for k, v in opts.items())
        for r in rows:
            print(f"{label:<10}{r['step']:>6}{r['rel_l2']:>18.2e}{r['max_abs']:>12.2e}"
                  f"{r['opt_rel_max']:>19.2e}{r['bytes_per_step_vs_fp32_params']:>30.3f}")


if __name__ == "__main__":
    main()
