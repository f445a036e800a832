"""Constants shared by the readers and the writers. The bytes are defined in
``format_spec/log_format.md``; this module is the only thing reader and writer share.
Changing any value here changes the format: bump FORMAT_MINOR (compatible addition) or
FORMAT_MAJOR (readers of the old major must refuse), regenerate the golden vectors, and
record it in ``format_spec/CHANGES.md``.
"""

from __future__ import annotations

import re
from typing import Final

#: Format version written by this build. Readers accept any minor of a major they know.
FORMAT_MAJOR: Final = 1
FORMAT_MINOR: Final = 0

#: Every payload, record and segment header starts at a multiple of ALIGN bytes
#: (a cache line; enough for zero-copy numpy/torch views of any dtype).
ALIGN: Final = 64

# --- file magics (8 bytes: name, NUL, CR LF so text-mode mangling is detected) ---
SEGMENT_MAGIC: Final = b"LDSEG\x00\r\n"
INDEX_MAGIC: Final = b"LDIDX\x00\r\n"
MANIFEST_MAGIC: Final = b"LDMAN\x00\r\n"
#: the top-level manifest of a sharded (one log per rank) checkpoint directory
SHARDS_MAGIC: Final = b"LDSHD\x00\r\n"
#: Bases are safetensors files; their magic is this value of ``__metadata__.format``,
#: which the writer puts first in the JSON header (so it sits at byte offset 8).
BASE_FORMAT_NAME: Final = "lowdiff-base"
BASE_HEADER_PREFIX: Final = b'{"__metadata__":{"format":"lowdiff-base"'

# --- segment / index file header: 64 bytes ---
FILE_HEADER_SIZE: Final = 64

# --- record header: 32 bytes ---
RECORD_MAGIC: Final = b"LDRC"
RECORD_HEADER_SIZE: Final = 32
#: record types; types >= OPTIONAL_TYPE_MIN may be skipped by readers that do not know them
RECORD_TYPE_DIFF: Final = 1
OPTIONAL_TYPE_MIN: Final = 128

# --- index entries: step, offset, length, check (4 x u64) ---
INDEX_ENTRY_SIZE: Final = 32

# --- manifest header: magic, major, minor, body length, masked crc32c of body ---
MANIFEST_HEADER_SIZE: Final = 20

# --- limits (enforced by every reader before anything is allocated) ---
MAX_META_BYTES: Final = 64 << 20
MAX_MANIFEST_BYTES: Final = 64 << 20
MAX_BASE_HEADER_BYTES: Final = 100 << 20
MAX_TENSORS_PER_RECORD: Final = 1 << 18
MAX_PARTS_PER_TENSOR: Final = 16
MAX_NDIM: Final = 32
MAX_NAME_BYTES: Final = 1024
MAX_ELEMENTS: Final = 1 << 48
MAX_STEP: Final = (1 << 63) - 1

# --- file names: derived from numbers, never read from a file ---
SEGMENT_NAME: Final = "seg-{:016d}.ldlog"
INDEX_NAME: Final = "seg-{:016d}.ldidx"
BASE_NAME: Final = "base-{:016d}.safetensors"
#: one slice of a streamed base (format 1.3), named by the step it was taken after
SLICE_NAME: Final = "slice-{:016d}.safetensors"
MANIFEST_NAME: Final = "MANIFEST"
SHARDS_NAME: Final = "SHARDS"
RANK_DIR: Final = "rank-{:05d}"
LOCK_NAME: Final = "LOCK"
TMP_SUFFIX: Final = ".tmp"
SEGMENT_RE: Final = re.compile(r"^seg-(\d{16})\.ldlog$")
INDEX_RE: Final = re.compile(r"^seg-(\d{16})\.ldidx$")
BASE_RE: Final = re.compile(r"^base-(\d{16})\.safetensors$")
SLICE_RE: Final = re.compile(r"^slice-(\d{16})\.safetensors$")

#: CRC masking (leveldb util/crc32c.h): storing the CRC of data that itself holds CRCs
#: weakens it, so stored values are rotated and offset.
CRC_MASK_DELTA: Final = 0xA282EAD8
