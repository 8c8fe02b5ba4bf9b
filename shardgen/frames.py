"""Check a shard's framing before MXNet's native reader meets it, and learn each record's count.
Shared by ``shardgen verify`` and the loader (which checks every shard before MXNet reads it).

dmlc aborts the whole process (``dmlc::Error`` thrown in a native thread) on a bad magic or length
word, and MXNet fails without naming the file on a bad header flag or image. So every shard is
checked here first, once per process and file version (inode, size, mtime, ctime): the framing of every
record (magic, length, cflag, header flag == record_floats, id == the date's day, the constant
image and padding) and what the reader relies on inside the payload (items used, day, runs' row
counts and window starts). The check reads a few words per record through a memory map; the
common case (no record split by dmlc's magic word) is vectorised. ``verify="sha256"`` also hashes
the whole file against the manifest, so a flipped payload byte is an error, not wrong data.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .errors import ShardError
from .layout import HEAD_FLOATS, HEADER_BYTES, MAGIC, Schema, day_number
from .manifest import ShardEntry

__all__ = ["VERIFY_MODES", "ShardFrames", "check_shard"]

VERIFY_MODES = ("frame", "sha256", "none")
_P0 = 2 + HEADER_BYTES // 4  # first payload word of a record
_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


@dataclass(frozen=True)
class ShardFrames:
    """What the loader needs of one checked shard: record offsets, the samples in each and each
    record's key (``Schema.key_words``; no columns for ``samples``)."""

    offsets: np.ndarray  # int64, one per record
    counts: np.ndarray  # int64 samples per record
    keys: np.ndarray  # float32 (records, len(key_words))

    @property
    def samples(self) -> int:
        return int(self.counts.sum())


class _Bad(Exception):
    def __init__(self, record: int, what: str):
        super().__init__(what)
        self.record, self.what = record, what


Columns = Callable[[int, int], np.ndarray]  # cols(a, b): words a..b-1 of every record, (n, b - a) uint32


def _keys(cols: Columns, n_rec: int, schema: Schema) -> np.ndarray:
    if not schema.key_words:
        return np.zeros((n_rec, 0), np.float32)
    return np.stack([cols(_P0 + w, _P0 + w + 1).view("<f4")[:, 0] for w in schema.key_words], axis=1)


def _payload_checks(cols: Columns, n_rec: int, schema: Schema, day: int) -> np.ndarray:
    """Counts per record from the payload words it needs; _Bad names the first record that is off."""
    kind, f = schema.layout.kind, schema.record_floats

    def fail(mask: np.ndarray, what: str) -> None:
        if mask.any():
            raise _Bad(int(np.flatnonzero(mask)[0]), what)

    if kind == "samples":
        fail(cols(_P0 + f - 1, _P0 + f).view("<f4")[:, 0] != day, f"date field is not day {day}")
        return np.ones(n_rec, np.int64)
    k, t = schema.pack, schema.time_steps
    head = cols(_P0, _P0 + HEAD_FLOATS).view("<f4")
    n = head[:, 0]
    fail((n != np.floor(n)) | (n < 1) | (n > k), f"items used is not an integer in [1, {k}]")
    fail(head[:, 1] != day, f"day field is not {day}")
    counts = n.astype(np.int64)
    if kind == "runs":
        rows = head[:, 3]
        fail((rows != np.floor(rows)) | (rows < t) | (rows > schema.layout.run_rows),
             f"rows used is not an integer in [{t}, {schema.layout.run_rows}]")
        isl = schema.items_slice
        starts = cols(_P0 + isl.start, _P0 + isl.stop).view("<f4").reshape(n_rec, k, schema.item_floats)[:, :, 0]
        used = np.arange(k)[None, :] < counts[:, None]
        bad = used & ((starts != np.floor(starts)) | (starts < 0) | (starts + t > rows[:, None]))
        fail(bad.any(axis=1), "a window start lies outside the run's rows")
    return counts


def _fixed_size(cols: Columns, n_rec: int, schema: Schema, day: int) -> np.ndarray:
    """Records of exactly ``record_bytes``, whole (not split): checked column-wise, reading only
    the words that matter (header, payload head, item slots, image)."""
    f = schema.record_floats
    length = HEADER_BYTES + 4 * f + len(schema.image)
    tail = np.frombuffer(schema.image + b"\0" * (schema.record_bytes - 8 - length), "<u4")
    header = cols(0, 6)
    for col, want, what in ((0, MAGIC, "bad magic word"), (1, length, "bad length word"),
                            (2, f, f"header flag is not {f}"), (3, 0, "header label is not 0"),
                            (4, day, f"id is not day {day}"), (5, 0, f"id is not day {day}")):
        bad = header[:, col] != want
        if bad.any():
            raise _Bad(int(np.flatnonzero(bad)[0]), what)
    bad = (cols(_P0 + f, schema.record_bytes // 4) != tail).any(axis=1)
    if bad.any():
        raise _Bad(int(np.flatnonzero(bad)[0]), "image bytes differ from the constant image")
    return _payload_checks(cols, n_rec, schema, day)


def _one_split_record(data: memoryview, start: int, end: int, schema: Schema, day: int) -> np.ndarray:
    """A record dmlc split at magic words, reassembled and checked; its payload words."""
    f = schema.record_floats
    pos, body = start, b""
    while True:
        if pos + 8 > end:
            raise _Bad(0, "record runs past its index entry")
        magic, lrec = np.frombuffer(data, "<u4", 2, pos)
        cflag, length = int(lrec) >> 29, int(lrec) & ((1 << 29) - 1)
        if magic != MAGIC:
            raise _Bad(0, f"bad magic word at byte {pos}")
        if (cflag == 0 and body) or (cflag in (2, 3) and pos == start) or (cflag == 1 and pos != start):
            raise _Bad(0, f"bad continuation flag {cflag} at byte {pos}")
        if pos + 8 + length > end:
            raise _Bad(0, "record runs past its index entry")
        body += bytes(data[pos + 8: pos + 8 + length])
        pos += 8 + length + (-length % 4)
        if cflag in (0, 3):
            break
        body += np.uint32(MAGIC).tobytes()
    if pos != end:
        raise _Bad(0, f"record spans {pos - start} bytes, the index says {end - start}")
    want = HEADER_BYTES + 4 * f + len(schema.image)
    if len(body) != want:
        raise _Bad(0, f"record has {len(body)} data bytes, expected {want}")
    flag, _label, rid = np.frombuffer(body, "<u4", 3)
    if flag != f or rid != day:
        raise _Bad(0, f"header flag is not {f} or id is not day {day}")
    if body[HEADER_BYTES + 4 * f:] != schema.image:
        raise _Bad(0, "image bytes differ from the constant image")
    # The same words a whole record has, so the payload checks are shared.
    return np.frombuffer(b"\0" * 8 + body + b"\0" * (-len(body) % 4), "<u4")


def _split_records(buf: memoryview, offsets: np.ndarray, schema: Schema, day: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The general case (some record split at a magic word): whole records column-wise as in
    ``_fixed_size`` (gathered by offset), only the split ones one by one."""
    size, rb = len(buf), schema.record_bytes
    ends = np.append(offsets[1:], size)
    if (offsets % 4).any():
        raise _Bad(int(np.flatnonzero(offsets % 4)[0]), "record is not 4-byte aligned")
    whole = np.flatnonzero(ends - offsets == rb)
    split = np.flatnonzero(ends - offsets != rb)
    flat = np.frombuffer(buf, "<u4", size // 4)
    counts = np.zeros(len(offsets), np.int64)
    keys = np.zeros((len(offsets), len(schema.key_words)), np.float32)
    first = offsets[whole] // 4

    def whole_cols(a: int, b: int) -> np.ndarray:
        return flat[first[:, None] + np.arange(a, b)]

    try:
        counts[whole] = _fixed_size(whole_cols, len(whole), schema, day)
    except _Bad as bad:
        raise _Bad(int(whole[bad.record]), bad.what) from None
    keys[whole] = _keys(whole_cols, len(whole), schema)
    if len(split):
        rebuilt = np.empty((len(split), rb // 4), np.uint32)
        for j, i in enumerate(split.tolist()):
            try:
                words = _one_split_record(buf, int(offsets[i]), int(ends[i]), schema, day)
            except _Bad as bad:
                raise _Bad(i, bad.what) from None
            rebuilt[j, :len(words)] = words[:rb // 4]
        try:
            counts[split] = _payload_checks(lambda a, b: rebuilt[:, a:b], len(split), schema, day)
        except _Bad as bad:
            raise _Bad(int(split[bad.record]), bad.what) from None
        keys[split] = _keys(lambda a, b: rebuilt[:, a:b], len(split), schema)
    return counts, keys


def _read_offsets(idx_path: str, entry: ShardEntry) -> np.ndarray:
    try:
        with open(idx_path, "rb") as fh:
            text = fh.read()
    except OSError as exc:
        raise ShardError(f"{idx_path}: cannot read the index of {entry.date} ({exc.strerror})") from None
    try:
        pairs = np.array(text.split(), dtype=np.int64).reshape(-1, 2)
    except ValueError:
        raise ShardError(f"{idx_path}: malformed index of {entry.date} (expected 'key<TAB>offset' lines)") from None
    offsets = pairs[:, 1]
    if len(offsets) != entry.records:
        raise ShardError(f"{idx_path}: {len(offsets)} records, the manifest says {entry.records} ({entry.date})")
    if len(offsets) and (offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= entry.bytes):
        raise ShardError(f"{idx_path}: offsets are not increasing within the {entry.bytes}-byte file ({entry.date})")
    return offsets


def _scan(buf: memoryview, offsets: np.ndarray, schema: Schema, day: int, verify: str,
          entry: ShardEntry) -> tuple[Optional[tuple[np.ndarray, np.ndarray]], object]:
    """((counts, keys), None), or (None, "sha256" | (record, what)); no view of ``buf`` outlives the call."""
    if verify == "sha256" and hashlib.sha256(buf).hexdigest() != entry.sha256:
        return None, "sha256"
    rb = schema.record_bytes
    try:
        if len(offsets) * rb == len(buf) and (np.diff(offsets) == rb).all():
            words = np.frombuffer(buf, "<u4").reshape(len(offsets), rb // 4)

            def cols(a: int, b: int) -> np.ndarray:
                return words[:, a:b]

            keys = _keys(cols, len(offsets), schema)
            if verify == "none":
                if schema.layout.kind == "samples":
                    return (np.ones(len(offsets), np.int64), keys), None
                return (np.clip(words[:, _P0].view("<f4").astype(np.int64), 0, schema.pack), keys), None
            return (_fixed_size(cols, len(offsets), schema, day), keys), None
        return _split_records(buf, offsets, schema, day), None
    except _Bad as bad:  # leaving the block drops the exception and its frames (views of the map)
        problem = (bad.record, bad.what)
    except (ValueError, IndexError, TypeError) as exc:  # bytes no check foresaw: still damage, named
        problem = ("?", f"{type(exc).__name__}: {exc}")
    return None, problem


def check_shard(fd: int, rec_path: str, idx_path: str, entry: ShardEntry, schema: Schema, *,
                verify: str = "frame", cache: bool = True, check_index: bool = False) -> ShardFrames:
    """Check the open shard file ``fd`` (what MXNet will read) once per file version; ShardError
    names the file, the date and the record. ``verify="none"`` only reads counts and sizes.
    The ``.idx`` is read only when records differ in size (or with ``check_index``): the loader
    builds its own index from the checked records, stock MXNet readers use the ``.idx``."""
    st = os.fstat(fd)
    if st.st_size != entry.bytes:
        raise ShardError(f"{rec_path}: {st.st_size} bytes, the manifest says {entry.bytes} for {entry.date} "
                          "(truncated or rewritten?)")
    # ctime too: mtime can be set back (touch -r, cp -p, rsync -t), ctime cannot from user space.
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, verify, schema.fingerprint,
           entry.sha256)
    with _CACHE_LOCK:
        hit: Optional[ShardFrames] = _CACHE.get(key)
    if hit is not None and cache:
        return hit
    day = day_number(dt.date.fromisoformat(entry.date))
    rb = schema.record_bytes
    if entry.records * rb == st.st_size:  # every record whole and of one size: no index to parse
        offsets = np.arange(entry.records, dtype=np.int64) * rb
        if check_index and not np.array_equal(_read_offsets(idx_path, entry), offsets):
            raise ShardError(f"{idx_path}: offsets differ from the records of the .rec ({entry.date})")
    else:
        offsets = _read_offsets(idx_path, entry)
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
        buf = memoryview(mm)
        try:
            found, problem = _scan(buf, offsets, schema, day, verify, entry)
            if isinstance(problem, tuple) and entry.records * rb == st.st_size:
                # Whole-size records did not frame: maybe split records after all; ask the index.
                offsets = _read_offsets(idx_path, entry)
                found, problem = _scan(buf, offsets, schema, day, verify, entry)
        finally:
            buf.release()
    if problem == "sha256":
        raise ShardError(f"{rec_path}: sha256 differs from the manifest ({entry.date}): the file changed "
                         "after it was published")
    if problem is not None:
        raise ShardError(f"{rec_path}: record {problem[0]} of {entry.date} is damaged ({problem[1]}); run "
                         "`shardgen verify`, then rebuild it with `shardgen build --force`")
    frames = ShardFrames(offsets, *found)
    if entry.windows and frames.samples != entry.windows:
        raise ShardError(f"{rec_path}: {frames.samples} windows in the records, the manifest says "
                          f"{entry.windows} ({entry.date})")
    with _CACHE_LOCK:
        _CACHE[key] = frames
    return frames
