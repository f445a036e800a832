"""Top-k selection for gradient sparsification on CPU, faster than ``torch.topk``.

``torch.topk`` over a large flat tensor costs about 8x a memory pass on CPU. The
``"sampled"`` selector (the sampled threshold of DGC, Lin et al. 2018, made exact):

1. take every ``stride``-th magnitude (a deterministic sample of about ``SAMPLE`` entries;
   no random state to checkpoint);
2. the threshold is the magnitude of rank ``k * OVERSHOOT`` in the sample (scaled to it);
3. candidates = the entries with magnitude >= the threshold (one compare, one nonzero);
4. if there are at least ``k`` candidates, the ``k`` largest of them are kept (a top-k over
   about ``k`` values): exactly the set ``torch.topk`` keeps (ties aside), since every
   entry left out is below the threshold and the ``k`` largest are all above it;
5. otherwise (the sample overestimated the threshold) the threshold is lowered
   (``OVERSHOOT`` x 4, then the exact selection).

So the selector keeps exactly ``k`` entries, the same ``k`` as :func:`exact_topk`; its
indices come out ascending (the log stores them sorted). Whatever it selects is what
training consumes and what is logged.
"""

from __future__ import annotations

import torch

#: sample size the threshold is estimated from
SAMPLE = 16384
#: candidates aimed for, as a multiple of k (more: fewer retries, a larger trim)
OVERSHOOT = 1.25
#: below this many entries the exact selection is as fast
MIN_NUMEL = 65536

SELECTORS = ("exact", "sampled")


def exact_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices of the ``k`` largest entries of ``mag`` (``torch.topk``, unsorted)."""
    return torch.topk(mag, k, sorted=False).indices


def sampled_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (ascending) of the ``k`` largest entries of the 1-D ``mag`` (see the
    module docstring); ``torch.topk``'s set up to ties."""
    n = mag.numel()
    if n < MIN_NUMEL or k * 4 > n:
        return torch.sort(exact_topk(mag, k)).values
    stride = max(1, n // SAMPLE)
    sample = mag[::stride]
    m = sample.numel()
    over = OVERSHOOT
    for _ in range(2):
        rank = min(m, max(1, round(k * over * m / n)))
        thr = torch.topk(sample, rank, sorted=False).values.min()
        cand = torch.nonzero(mag >= thr).reshape(-1)
        if cand.numel() >= k:
            if cand.numel() > k:
                keep = torch.topk(mag[cand], k, sorted=False).indices
                cand = cand[torch.sort(keep).values]
            return cand
        over *= 4
    return torch.sort(exact_topk(mag, k)).values


def select(selector: str, mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the 1-D ``mag`` with ``selector``."""
    if selector == "sampled":
        return sampled_topk(mag, k)
    return exact_topk(mag, k)


__all__ = ["SELECTORS", "exact_topk", "sampled_topk", "select"]
