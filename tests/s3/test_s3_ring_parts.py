"""A base through the writer process in pieces onto an ``s3://`` log (ring 2.1, section
3.2): an object store publishes whole objects, so the writer process assembles the pieces
in its memory and publishes the base as any; it reads back bit for bit."""

from __future__ import annotations

import numpy as np

from lowdiff_store import LogReader
from lowdiff_store.writer.ring_client import RingClient


def test_a_base_in_pieces_onto_s3_is_assembled_and_reads_back_bitwise(s3_url: str) -> None:
    rng = np.random.default_rng(11)
    base = {"w": ("F32", rng.standard_normal(5000).astype(np.float32)),  # 20 KB: cut
            "e": ("I64", np.zeros((0, 2), np.int64)),
            "b": ("BF16", rng.integers(0, 1 << 16, (9, 9)).astype(np.uint16))}
    with RingClient(s3_url, slots=4, slot_size=4096) as c:  # messages of at most 8 KiB
        c.put_step(1, "grad", [("g", "I32", (3,), np.arange(3, dtype=np.int32))])
        c.put_base(1, base, {"m": 1})
        assert c.flush() == 1
        assert c.stats()["base_parts"] >= 3
    with LogReader(s3_url) as r:
        assert r.bases == [1]
        b = r.base(1)
        for n, (tag, a) in base.items():
            assert b.info(n) == (tag, a.shape)
            assert b.tensor(n).tobytes() == a.tobytes()
        assert b.meta()["m"] == 1
        assert list(r.record(1).tensor("g")) == [0, 1, 2]
