"""The zstd stage: round trips, the shuffle layout, size checks, hostile frames."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff_store.codecs import compress, decompress
from lowdiff_store.errors import CodecError, LowdiffError, Reason
from lowdiff_store.format.dtypes import STORAGE_DTYPE

from .profile import examples

TAGS = sorted(STORAGE_DTYPE)


def random_bits(rng: np.random.Generator, tag: str, n: int) -> np.ndarray:
    dt = STORAGE_DTYPE[tag]
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    if tag == "BOOL":
        raw %= 2
    return raw.view(dt)


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_round_trip_is_bit_exact(tag: str, shuffle: bool, n: int) -> None:
    a = random_bits(np.random.default_rng(12), tag, n)
    blob, params = compress(a, shuffle=shuffle)
    assert params == {"compressor": "zstd", "shuffle": shuffle and a.itemsize > 1}
    assert zstandard.frame_content_size(blob) == a.nbytes
    out = decompress(blob, params, dtype=tag, count=n)
    assert out.dtype == a.dtype
    assert out.shape == (n,)
    assert out.tobytes() == a.tobytes()


def test_shuffle_layout_groups_byte_k_of_every_element() -> None:
    a = np.array([0x0102, 0x0304, 0x0506], np.uint16)
    blob, _ = compress(a, shuffle=True)
    assert zstandard.ZstdDecompressor().decompress(blob) == bytes([2, 4, 6, 1, 3, 5])
    blob, _ = compress(a, shuffle=False)
    assert zstandard.ZstdDecompressor().decompress(blob) == a.tobytes()


def test_shuffle_compresses_smooth_floats_better() -> None:
    a = np.cumsum(np.random.default_rng(13).standard_normal(100_000)).astype(np.float32)
    shuffled, _ = compress(a, shuffle=True)
    plain, _ = compress(a, shuffle=False)
    assert len(shuffled) < 0.9 * len(plain)


def test_level_is_used_and_checked() -> None:
    a = np.tile(np.arange(4096, dtype=np.int32), 64) * 7
    fast, _ = compress(a, level=-50, shuffle=False)
    strong, _ = compress(a, level=19, shuffle=False)
    assert len(strong) < len(fast)
    for level in (23, -(2**17) - 1, 3.0, True):
        with pytest.raises(CodecError) as ei:
            compress(a, level=level)
        assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_compress_argument_checks() -> None:
    with pytest.raises(CodecError) as ei:
        compress(np.zeros(3, ">f4"))
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        compress(b"abc")  # type: ignore[arg-type]
    assert ei.value.reason is Reason.BAD_DTYPE
    with pytest.raises(CodecError) as ei:
        compress(np.zeros(3, np.float32), shuffle="yes")  # type: ignore[arg-type]
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


def test_compress_strided_and_readonly_input() -> None:
    a = np.arange(20, dtype=np.float64).reshape(4, 5).T
    a.setflags(write=False)
    blob, params = compress(a)
    assert decompress(blob, params, dtype="F64", count=20).tolist() == a.reshape(-1).tolist()


@pytest.mark.parametrize("kind", ["bytes", "memoryview", "ndarray", "mmap"])
def test_decompress_from_any_buffer(kind: str, tmp_path) -> None:
    a = np.linspace(0, 1, 300, dtype=np.float32)
    blob, params = compress(a)
    src: object
    if kind == "bytes":
        src = blob
    elif kind == "memoryview":
        src = memoryview(b"xx" + blob + b"yy")[2:-2]
    elif kind == "ndarray":
        src = np.frombuffer(blob, np.uint8)
    else:
        (tmp_path / "f").write_bytes(blob)
        src = np.memmap(tmp_path / "f", dtype=np.uint8, mode="r")
    assert decompress(src, params, dtype="F32", count=300).tolist() == a.tolist()  # type: ignore[arg-type]


def test_zstd_bomb_is_refused_before_allocating() -> None:
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(CodecError) as ei:
            decompress(bomb, {"compressor": "zstd", "shuffle": False}, dtype="U8", count=16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    assert peak < 1 << 20


def fcs_offset(frame: bytes) -> tuple[int, int]:
    """Where the frame header's content-size field is, and its width (RFC 8878 3.1.1.1)."""
    fhd = frame[4]
    single_segment = (fhd >> 5) & 1
    width = {0: single_segment, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    pos = 5 + (0 if single_segment else 1) + {0: 0, 1: 1, 2: 2, 3: 4}[fhd & 3]
    return pos, width


def test_frame_that_lies_about_its_size_is_refused() -> None:
    """A frame declaring what we expect but holding more must not overrun or succeed."""
    data = np.arange(1000, dtype=np.uint8).tobytes()
    frame = bytearray(zstandard.ZstdCompressor(level=1).compress(data))
    pos, width = fcs_offset(frame)
    assert width == 2  # 256..65791 is stored as a 2-byte value minus 256
    frame[pos : pos + 2] = (500 - 256).to_bytes(2, "little")
    assert zstandard.frame_content_size(bytes(frame)) == 500
    with pytest.raises(CodecError) as ei:
        decompress(bytes(frame), {"compressor": "zstd", "shuffle": False}, dtype="U8", count=500)
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH


def test_frame_without_content_size_is_refused() -> None:
    c = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = c.compress(b"abcd") + c.flush()
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(CodecError) as ei:
        decompress(frame, {"compressor": "zstd", "shuffle": False}, dtype="U8", count=4)
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH


@pytest.mark.parametrize("mutation", ["trailing", "two_frames", "truncated", "garbage", "empty"])
def test_malformed_frames_are_refused(mutation: str) -> None:
    a = np.arange(256, dtype=np.uint16)
    blob, params = compress(a)
    bad = {
        "trailing": blob + b"\0",
        "two_frames": blob + blob,
        "truncated": blob[:-3],
        "garbage": b"not a zstd frame at all",
        "empty": b"",
    }[mutation]
    with pytest.raises(CodecError) as ei:
        decompress(bad, params, dtype="U16", count=256)
    assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH


def test_count_and_dtype_must_match_the_frame() -> None:
    blob, params = compress(np.zeros(10, np.float32))
    for dtype, count in (("F32", 9), ("F64", 10), ("U8", 10)):
        with pytest.raises(CodecError) as ei:
            decompress(blob, params, dtype=dtype, count=count)
        assert ei.value.reason is Reason.DECODE_SIZE_MISMATCH
    assert decompress(blob, params, dtype="U8", count=40).tolist() == [0] * 40


def test_decompress_param_checks() -> None:
    blob, _ = compress(np.zeros(4, np.uint8))
    cases = [
        ({"compressor": "lz4", "shuffle": False}, "U8", 4, Reason.UNKNOWN_CODEC),
        ({"compressor": 1, "shuffle": False}, "U8", 4, Reason.BAD_CODEC_PARAMS),
        ({"compressor": "zstd", "shuffle": 0}, "U8", 4, Reason.BAD_CODEC_PARAMS),
        ({"compressor": "zstd"}, "U8", 4, Reason.BAD_CODEC_PARAMS),
        ({"compressor": "zstd", "shuffle": False, "level": 3}, "U8", 4, Reason.BAD_CODEC_PARAMS),
        ({"compressor": "zstd", "shuffle": False}, "X9", 4, Reason.BAD_DTYPE),
        ({"compressor": "zstd", "shuffle": False}, "U8", -1, Reason.BAD_CODEC_PARAMS),
        ({"compressor": "zstd", "shuffle": False}, "U8", 2**63, Reason.BAD_CODEC_PARAMS),
    ]
    for params, dtype, count, reason in cases:
        with pytest.raises(CodecError) as ei:
            decompress(blob, params, dtype=dtype, count=count)
        assert ei.value.reason is reason, params
    with pytest.raises(CodecError) as ei:
        decompress("text", {"compressor": "zstd", "shuffle": False}, dtype="U8", count=4)  # type: ignore[arg-type]
    assert ei.value.reason is Reason.INVALID_ARGUMENT


def test_bool_payload_must_be_0_or_1() -> None:
    blob, params = compress(np.array([0, 1, 7], np.uint8))
    with pytest.raises(CodecError) as ei:
        decompress(blob, params, dtype="BOOL", count=3)
    assert ei.value.reason is Reason.BAD_CODEC_PARAMS


_frame = compress(np.cumsum(np.ones(200, np.float32)), level=1)[0]


@settings(max_examples=examples(300), deadline=None)
@given(
    blob=st.one_of(
        st.binary(max_size=64),
        st.tuples(st.integers(0, len(_frame) - 1), st.integers(0, 255)).map(
            lambda m: _frame[: m[0]] + bytes([m[1]]) + _frame[m[0] + 1 :]
        ),
        st.integers(0, len(_frame)).map(lambda n: _frame[:n]),
    ),
    shuffle=st.booleans(),
    tag=st.sampled_from(TAGS),
    count=st.one_of(st.integers(0, 1000), st.none()),
)
def test_fuzz_decompress(blob: bytes, shuffle: bool, tag: str, count: int | None) -> None:
    if count is None:  # what the frame declares, so the body gets decoded
        count = 800 // STORAGE_DTYPE[tag].itemsize
    try:
        out = decompress(blob, {"compressor": "zstd", "shuffle": shuffle}, dtype=tag, count=count)
    except LowdiffError:
        return
    assert out.shape == (count,)
    assert out.dtype == STORAGE_DTYPE[tag]
