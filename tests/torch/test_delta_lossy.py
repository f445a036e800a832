"""Lossy delta mode: encoded against the reconstruction, so the error stays bounded, and
replay rebuilds exactly the writer's reconstruction (its digests match)."""

from __future__ import annotations

from typing import Any

import pytest
from measure_delta_error import measure


@pytest.mark.parametrize(("codec", "opts", "bound"), [
    ("xor", {}, 0.0),
    ("q8", {}, 1e-4),
    ("topk", {"delta_ratio": 0.1}, 2e-2),
    ("lcc", {}, 2e-2),
])
def test_lossy_delta_error_is_bounded(codec: str, opts: dict[str, Any], bound: float,
                                      tmp_path: Any) -> None:
    rows = measure(codec, 24, (4, 12, 24), str(tmp_path / "log"), digest_every=1, **opts)
    for r in rows:
        assert r["rel_l2"] <= bound, r
        assert (r["rel_l2"] == 0.0) == (codec == "xor")
    # no accumulation: the error late in the run is not larger than early on
    assert rows[-1]["rel_l2"] <= max(2 * rows[0]["rel_l2"], bound / 10)
