"""A base file built piece by piece (:class:`BaseBuilder`, the writer process's base in
pieces): the same bytes as the base written whole, in a local directory straight into its
temp file (never whole in memory) or assembled where the store publishes whole objects;
aborted, nothing is left."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store.errors import FormatError, Reason
from lowdiff_store.log.base import BaseBuilder, BaseFile, store_base
from lowdiff_store.storage import LocalStore

LOG_ID = bytes(range(16))


def _tensors() -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return {"a": ("F32", rng.standard_normal((33, 7)).astype(np.float32)),
            "z": ("I32", np.zeros((0, 4), np.int32)),
            "s": ("F64", np.array(2.5)),
            "b": ("BF16", rng.integers(0, 1 << 16, 1001).astype(np.uint16)),
            "u": ("U8", rng.integers(0, 256, 77).astype(np.uint8))}


class _WholeObjects(LocalStore):
    """A store that publishes whole objects only (as an object store)."""

    def open_publish(self, name: str) -> None:
        return None


def _build(store: LocalStore, piece: int, meta: dict[str, object]) -> BaseBuilder:
    t = _tensors()
    b = BaseBuilder(store, "base-0000000000000007.safetensors", 7,
                    [(n, tag, a.shape) for n, (tag, a) in t.items()], meta, LOG_ID)
    for n, (_tag, a) in t.items():
        raw = a.reshape(-1).view(np.uint8).tobytes()
        for at in range(0, max(1, len(raw)), piece):
            b.add(n, at, raw[at:at + piece])
    return b


@pytest.mark.parametrize("kind", ["in_place", "whole_objects"])
@pytest.mark.parametrize("piece", [8, 1000, 1 << 20])
def test_a_built_base_is_the_base_written_whole_byte_for_byte(tmp_path: Path, kind: str,
                                                              piece: int) -> None:
    meta = {"opt": {"lr": 0.1}, "slice": None}
    whole = LocalStore(tmp_path / "whole")
    whole.ensure_root()
    size = store_base(whole, 7, _tensors(), meta, LOG_ID)
    cls = LocalStore if kind == "in_place" else _WholeObjects
    store = cls(tmp_path / "built")
    store.ensure_root()
    b = _build(store, piece, meta)
    assert b.in_memory == (kind == "whole_objects")
    if kind == "in_place":  # the bytes are in the temp file already, nothing in memory
        assert [f for f in os.listdir(tmp_path / "built") if f.endswith(".tmp")]
    assert store_base(store, 7, b, meta, LOG_ID) == size
    name = "base-0000000000000007.safetensors"
    assert (tmp_path / "built" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert not [f for f in os.listdir(tmp_path / "built") if f.endswith(".tmp")]
    with BaseFile(str(tmp_path / "built" / name)) as f:
        f.verify_all()
        assert f.tensor("a").tobytes() == _tensors()["a"][1].tobytes()
    b.abort()  # (after publishing: nothing happens)
    assert (tmp_path / "built" / name).exists()


def test_an_aborted_base_leaves_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.ensure_root()
    b = BaseBuilder(store, "base-0000000000000001.safetensors", 1, [("a", "F32", (4,))],
                    {}, LOG_ID)
    b.add("a", 0, np.ones(2, np.float32).tobytes())
    assert len(os.listdir(tmp_path)) == 1
    b.abort()
    b.abort()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("name", "at", "n", "match"), [
    ("b", 0, 4, "does not follow"),        # the second tensor before the first is whole
    ("a", 4, 4, "does not follow"),        # a gap in the first tensor
    ("a", 0, 20, "does not follow"),       # past the first tensor's 16 bytes
])
def test_a_piece_out_of_order_is_refused_naming_it(tmp_path: Path, name: str, at: int,
                                                   n: int, match: str) -> None:
    store = LocalStore(tmp_path)
    store.ensure_root()
    b = BaseBuilder(store, "base-0000000000000001.safetensors", 1,
                    [("a", "F32", (4,)), ("b", "F32", (2,))], {}, LOG_ID)
    with pytest.raises(FormatError, match=match) as ei:
        b.add(name, at, bytes(n))
    assert ei.value.reason is Reason.BAD_METADATA
    with pytest.raises(FormatError, match="0 of its 16 bytes arrived"):
        b.check_complete()
    b.abort()
    assert os.listdir(tmp_path) == []


def test_a_layout_naming_a_tensor_twice_or_a_reserved_name_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.ensure_root()
    with pytest.raises(FormatError, match="twice") as ei:
        BaseBuilder(store, "base-0000000000000001.safetensors", 1,
                    [("a", "F32", (4,)), ("a", "F32", (4,))], {}, LOG_ID)
    assert ei.value.reason is Reason.BAD_METADATA
    with pytest.raises(FormatError, match="reserved prefix") as ei:
        BaseBuilder(store, "base-0000000000000001.safetensors", 1,
                    [("__lowdiff__.meta", "U8", (4,))], {}, LOG_ID)
    assert ei.value.reason is Reason.UNSAFE_NAME
    assert os.listdir(tmp_path) == []  # (refused before any file was made)
