"""The shard check: a shard's framing and the payload words the reader relies on, before MXNet's
native reader meets it. Shared by ``shardgen verify`` and the loader (which checks every shard
before MXNet reads it).

dmlc aborts the whole process (``dmlc::Error`` thrown in a native thread) on a bad magic or length
word, and MXNet fails without naming the file on a bad header flag or image. So every shard is
checked here first, once per process and file version (inode, size, mtime, ctime): the framing of
every record (magic, length, cflag, header flag == record_floats, id == the date's day, id2's low
word == the record's number in its shard (shards with checksums), the constant image and padding)
and what the codec checks inside the payload (items used, day, runs' row counts and window
starts). The check reads a few words per record through a memory map; the
common case (no record split by dmlc's magic word; split ones: :mod:`shardgen.format.split`) is
vectorised. ``verify="crc"`` (the default) also checks every record's CRC32 of its payload and
image (``framing.CRC_WORD``), so a flipped payload byte is an error naming the record, not wrong
data; shards written before record checksums (their manifest entry has no ``checksum``) are
checked by frame only.
``verify="sha256"`` also hashes the whole file against the manifest: a mismatch in a file whose
every record is sound is the manifest's error, and is said so.

The published shard is described by any object with ``date`` (ISO), ``records``, ``bytes``,
``sha256`` and ``windows`` (0: one per record), such as the manifest's ``ShardEntry``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from shardgen.format.codec import Columns, Damage
from shardgen.format.errors import ShardError
from shardgen.format.filemap import mapped
from shardgen.format.framing import (
    CHECKSUM,
    CRC_WORD,
    MAGIC,
    NUMBER_WORD,
    PAYLOAD_WORD,
    data_bytes,
    image_tail,
    payload_crcs,
)
from shardgen.format.index import check_index_file, read_offsets
from shardgen.format.schema import Schema, day_number
from shardgen.format.split import split_record_words

__all__ = ["VERIFY_MODES", "ShardFrames", "Published", "check_shard", "read_offsets", "check_index_file", "needs_index",
           "has_checksums", "REBUILD"]

VERIFY_MODES = ("crc", "frame", "sha256", "none")  # the first is the default
REBUILD = "run `shardgen verify`, then rebuild it with `shardgen build --force`"  # what a damaged shard needs
_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


class Published(Protocol):
    date: str
    records: int
    bytes: int
    sha256: str
    windows: int
    checksum: str


def has_checksums(entry: Published) -> bool:
    """Whether ``entry``'s records carry a CRC32 (written since 2026-12-06)."""
    return getattr(entry, "checksum", "") == CHECKSUM


def _check_numbers(stored: np.ndarray, numbers: np.ndarray) -> None:
    """Damage naming the first record whose number (``id2``'s low word) is not its place."""
    bad = np.flatnonzero(stored != numbers)
    if len(bad):
        raise Damage(int(numbers[bad[0]]), f"record number (id2) is {int(stored[bad[0]])}")


def _check_crcs(buf: memoryview, starts: np.ndarray, stored: np.ndarray, length: int,
                where: Optional[np.ndarray] = None) -> None:
    """Damage naming the first record whose payload's CRC32 is not the one stored in it."""
    got = payload_crcs(buf, starts, length)
    bad = np.flatnonzero(got != stored)
    if len(bad):
        i = int(bad[0])
        raise Damage(int(where[i]) if where is not None else i, f"payload checksum differs: CRC32 stored "
                     f"{int(stored[i]):#010x}, the bytes give {int(got[i]):#010x}")


@dataclass(frozen=True)
class ShardFrames:
    """What the loader needs of one checked shard: record offsets and the samples in each."""

    offsets: np.ndarray  # int64, one per record
    counts: np.ndarray  # int64 samples per record

    @property
    def samples(self) -> int:
        return int(self.counts.sum())


def _whole_records(cols: Columns, n_rec: int, schema: Schema, day: int) -> np.ndarray:
    """Records of exactly ``record_bytes``, whole (not split): checked column-wise, reading only
    the words that matter (header, the codec's payload words, image)."""
    f = schema.record_floats
    header = cols(0, PAYLOAD_WORD)
    for col, want, what in ((0, MAGIC, "bad magic word"), (1, data_bytes(f, schema.image), "bad length word"),
                            (2, f, f"header flag is not {f}"), (3, 0, "header label is not 0"),
                            (4, day, f"id is not day {day}"), (5, 0, f"id is not day {day}")):
        bad = header[:, col] != want
        if bad.any():
            raise Damage(int(np.flatnonzero(bad)[0]), what)
    bad = (cols(PAYLOAD_WORD + f, schema.record_bytes // 4) != image_tail(f, schema.image)).any(axis=1)
    if bad.any():
        raise Damage(int(np.flatnonzero(bad)[0]), "image bytes differ from the constant image")
    return schema.codec.check(cols, n_rec, schema, day)


def _renumber(where: np.ndarray, run):
    """Run ``run()``; a Damage it raises names ``where[record]`` instead of ``record``."""
    try:
        return run()
    except Damage as bad:
        raise Damage(int(where[bad.record]), bad.what) from None


def _split_records(buf: memoryview, offsets: np.ndarray, schema: Schema, day: int, crcs: bool,
                   numbers: bool) -> np.ndarray:
    """The general case (some record split at a magic word): whole records column-wise as in
    ``_whole_records`` (gathered by offset), only the split ones one by one."""
    size, rb = len(buf), schema.record_bytes
    ends = np.append(offsets[1:], size)
    if (offsets % 4).any():
        raise Damage(int(np.flatnonzero(offsets % 4)[0]), "record is not 4-byte aligned")
    whole = np.flatnonzero(ends - offsets == rb)
    split = np.flatnonzero(ends - offsets != rb)
    flat = np.frombuffer(buf, "<u4", size // 4)
    counts = np.zeros(len(offsets), np.int64)
    first = offsets[whole] // 4

    def whole_cols(a: int, b: int) -> np.ndarray:
        return flat[first[:, None] + np.arange(a, b)]

    counts[whole] = _renumber(whole, lambda: _whole_records(whole_cols, len(whole), schema, day))
    length = data_bytes(schema.record_floats, schema.image)
    if numbers:
        _check_numbers(flat[first + NUMBER_WORD], whole)
    if crcs:
        _check_crcs(buf, offsets[whole], flat[first + CRC_WORD], length, whole)
    if len(split):
        rebuilt = np.empty((len(split), rb // 4), np.uint32)
        for j, i in enumerate(split.tolist()):
            try:
                words = split_record_words(buf, int(offsets[i]), int(ends[i]), schema, day)
            except Damage as bad:
                raise Damage(i, bad.what) from None
            rebuilt[j, :len(words)] = words[:rb // 4]

        def split_cols(a: int, b: int) -> np.ndarray:
            return rebuilt[:, a:b]

        counts[split] = _renumber(split, lambda: schema.codec.check(split_cols, len(split), schema, day))
        if numbers:
            _check_numbers(rebuilt[:, NUMBER_WORD], split)
        if crcs:
            _check_crcs(memoryview(rebuilt).cast("B"), np.arange(len(split)) * rb, rebuilt[:, CRC_WORD], length,
                        split)
    return counts


def _scan(buf: memoryview, offsets: np.ndarray, schema: Schema, day: int, verify: str,
          entry: Published) -> tuple[Optional[np.ndarray], object]:
    """(counts, None), or (None, "sha256" | "sha256-sound" | (record, what)); no view of
    ``buf`` outlives the call. "sha256-sound": the hash differs, every record's frame and CRC hold."""
    sha_ok = verify != "sha256" or hashlib.sha256(buf).hexdigest() == entry.sha256
    crcs = verify in ("crc", "sha256") and has_checksums(entry)
    numbers = verify != "none" and has_checksums(entry)  # a header field: the frame check's too
    rb = schema.record_bytes
    try:
        if len(offsets) * rb == len(buf) and (np.diff(offsets) == rb).all():
            words = np.frombuffer(buf, "<u4").reshape(len(offsets), rb // 4)

            def cols(a: int, b: int) -> np.ndarray:
                return words[:, a:b]

            if verify == "none":
                return schema.codec.counts(cols, len(offsets), schema), None
            found = _whole_records(cols, len(offsets), schema, day)
            if numbers:
                _check_numbers(words[:, NUMBER_WORD], np.arange(len(offsets)))
            if crcs:
                _check_crcs(buf, offsets, words[:, CRC_WORD], data_bytes(schema.record_floats, schema.image))
        else:
            found = _split_records(buf, offsets, schema, day, crcs, numbers)
        return (found, None) if sha_ok else (None, "sha256-sound" if crcs else "sha256")
    except Damage as bad:  # leaving the block drops the exception and its frames (views of the map)
        problem = (bad.record, bad.what)
    except (ValueError, IndexError, TypeError) as exc:  # bytes no check foresaw: still damage, named
        problem = ("?", f"{type(exc).__name__}: {exc}")
    return None, problem


def needs_index(entry: Published, schema: Schema) -> bool:
    """Whether reading a shard needs its ``.idx``: only when its records differ in size (else every
    record is whole and of the schema's size, and the offsets follow from the count)."""
    return entry.records * schema.record_bytes != entry.bytes


def _scan_file(fd: int, idx_path: str, entry: Published, schema: Schema, verify: str,
               check_index: bool) -> tuple[np.ndarray, Optional[tuple], object]:
    day = day_number(dt.date.fromisoformat(entry.date))
    rb = schema.record_bytes
    if not needs_index(entry, schema):  # every record whole and of one size: no index to parse
        offsets = np.arange(entry.records, dtype=np.int64) * rb
    else:
        offsets = read_offsets(idx_path, entry)
    with mapped(fd) as buf:  # unmapped at the end, or with the last view a profiler holds
        found, problem = _scan(buf, offsets, schema, day, verify, entry)
        if isinstance(problem, tuple) and not needs_index(entry, schema):
            # Whole-size records did not frame: maybe split records after all; ask the index
            # (none here, e.g. a cache that never needed it: the damage stands as found).
            try:
                listed = read_offsets(idx_path, entry)
            except ShardError:
                listed = offsets
            if not np.array_equal(listed, offsets):
                offsets = listed
                found, problem = _scan(buf, offsets, schema, day, verify, entry)
    if check_index and problem is None:  # the .rec is sound: its records say what the .idx must be
        check_index_file(idx_path, offsets, entry)
    return offsets, found, problem


def check_shard(fd: int, rec_path: str, idx_path: str, entry: Published, schema: Schema, *,
                verify: str = "crc", cache: bool = True, check_index: bool = False) -> ShardFrames:
    """Check the open shard file ``fd`` (what MXNet will read) once per file version; ShardError
    names the file, the date and the record. ``verify="none"`` only reads counts and sizes.
    The ``.idx`` is read only when records differ in size (or with ``check_index``): the loader
    builds its own index from the checked records, stock MXNet readers use the ``.idx``."""
    st = os.fstat(fd)
    if st.st_size != entry.bytes:
        raise ShardError(f"{rec_path}: {st.st_size} bytes, the manifest says {entry.bytes} for {entry.date} "
                         "(truncated or rewritten?)")
    # ctime too: mtime can be set back (touch -r, cp -p, rsync -t), ctime cannot from user space.
    # Everything of the entry the check compares the file with: a file checked for one entry is not
    # taken as checked for another (another window count, sha256, date, or the .idx asked for too).
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, verify, schema.fingerprint,
           entry.date, entry.records, entry.windows or entry.records, entry.sha256, has_checksums(entry), check_index)
    with _CACHE_LOCK:
        hit: Optional[ShardFrames] = _CACHE.get(key)
    if hit is not None and cache:
        return hit
    offsets, found, problem = _scan_file(fd, idx_path, entry, schema, verify, check_index)
    if problem == "sha256":
        raise ShardError(f"{rec_path}: sha256 differs from the manifest ({entry.date}): the file changed "
                         "after it was published")
    if problem == "sha256-sound":
        raise ShardError(f"{rec_path}: sha256 differs from the manifest ({entry.date}), yet every record's frame, "
                         "header and payload checksum hold: the manifest's sha256 is most likely wrong, not the "
                         "file; republish the shard (`shardgen build --force` for its date)")
    if problem is not None:
        raise ShardError(f"{rec_path}: record {problem[0]} of {entry.date} is damaged ({problem[1]}); {REBUILD}")
    frames = ShardFrames(offsets, found)
    expected = entry.windows or entry.records  # no count: one window per record (format 1)
    if frames.samples != expected:
        raise ShardError(f"{rec_path}: {frames.samples} windows in the records, the manifest says "
                         f"{expected} ({entry.date})")
    with _CACHE_LOCK:
        _CACHE[key] = frames
    return frames
