"""Write one date's windows as a shard: ``<date>.rec``, ``<date>.idx``, then ``<date>.json``.

Records are packed in bulk: one ``(n, record_bytes)`` uint8 matrix filled column-wise with numpy
(header words, payload, PNG), so each value is copied once. The rare record whose payload holds
the RecordIO magic word at an aligned offset is framed on its own (see ``layout.frame_record``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np

from .errors import ProcessorError, ShardError
from .fsutil import atomic_write
from .layout import HEADER_BYTES, MAGIC, PNG_1X1, Schema, day_number, frame_record, record_data
from .manifest import Sidecar, shard_stem

__all__ = ["PackedShard", "pack_records", "write_shard", "shard_paths", "BLOCK_ROWS"]

BLOCK_ROWS = 256  # rows packed (and handed to the hasher) at a time


@dataclass
class PackedShard:
    """Framed records of one date, ready to write."""

    chunks: list  # buffers to write in order
    offsets: np.ndarray  # int64 start of each record in the .rec
    size: int
    streamed: bool = False  # every byte went to on_block, in order

    @property
    def records(self) -> int:
        return len(self.offsets)


def shard_paths(store: Path, date: dt.date, version: int = 1) -> dict[str, Path]:
    name = shard_stem(date.isoformat(), version)  # version 1: <date>.<ext>; k > 1: <date>.v<k>.<ext>
    return {ext: Path(store) / f"{name}.{ext}" for ext in ("rec", "idx", "json")}


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.any(axis=tuple(range(1, mask.ndim))))[0])


def pack_records(x: np.ndarray, labels: Mapping[str, np.ndarray], date: dt.date, schema: Schema, *,
                 on_block: Optional[Callable[[memoryview], object]] = None) -> PackedShard:
    """Frame every window of one date; ProcessorError names the first non-finite row and field.

    Rows are packed in blocks; ``on_block`` gets each finished block's bytes in file order (the
    writer hashes them meanwhile) for as long as no record needs dmlc's magic-word split.
    """
    n = x.shape[0]
    f = schema.record_floats
    rec_bytes = schema.record_bytes
    day = day_number(date)
    words = np.empty((n, rec_bytes // 4), dtype="<u4")
    floats = words.view("<f4")
    flat = words.view(np.uint8).reshape(n, rec_bytes)
    p0 = 2 + HEADER_BYTES // 4  # payload starts after magic, lrec and the IRHeader
    length = HEADER_BYTES + 4 * f + len(PNG_1X1)
    tail = np.frombuffer(PNG_1X1 + b"\0" * (rec_bytes - 8 - length), "<u4")  # image + padding
    slices = schema.label_slices()
    parts = [(labels[lab.name].reshape(n, lab.width), p0 + slices[lab.name].start, p0 + slices[lab.name].stop)
             for lab in schema.labels[:-1]]
    special: list[int] = []
    for b0 in range(0, n, BLOCK_ROWS):
        b1 = min(n, b0 + BLOCK_ROWS)
        w, fl = words[b0:b1], floats[b0:b1]
        # Payload: x, each label, date -- written straight into place.
        np.copyto(fl[:, p0:p0 + schema.x_floats].reshape(b1 - b0, schema.time_steps, schema.num_inputs), x[b0:b1])
        for arr, a, b in parts:
            fl[:, a:b] = arr[b0:b1]
        fl[:, p0 + f - 1] = day
        bad = ~np.isfinite(fl[:, p0:p0 + f])
        if bad.any():
            row = _first_bad(bad)
            col = int(np.flatnonzero(bad[row])[0])
            field = schema.data_name if col < schema.x_floats else next(
                name for name, sl in slices.items() if sl.start <= col < sl.stop)
            raise ProcessorError(f"{date}: non-finite value in {field!r} at window {b0 + row} "
                                 "(expected finite float32)")
        w[:, 0] = MAGIC
        w[:, 1] = length  # cflag 0
        w[:, 2] = f
        w[:, 3] = 0  # float32 0.0
        w[:, 4] = day
        w[:, 5] = 0
        w[:, 6] = np.arange(b0, b1, dtype="<u4")
        w[:, 7] = 0
        w[:, p0 + f:] = tail
        special += (np.flatnonzero((w[:, p0:p0 + f] == MAGIC).any(axis=1)) + b0).tolist()
        if on_block is not None and not special:
            on_block(memoryview(flat[b0:b1]).cast("B"))
    if not special:
        offsets = np.arange(n, dtype=np.int64) * rec_bytes
        return PackedShard([memoryview(flat).cast("B")], offsets, n * rec_bytes, streamed=on_block is not None)
    # A payload word equal to the magic: dmlc splits that record; frame it the slow, exact way.
    payload = floats[:, p0:p0 + f]
    chunks, sizes, start = [], np.full(n, rec_bytes, dtype=np.int64), 0
    for row in special:
        if row > start:
            chunks.append(memoryview(flat[start:row]).cast("B"))
        framed = frame_record(record_data(payload[row], day, row))
        chunks.append(framed)
        sizes[row] = len(framed)
        start = row + 1
    if start < n:
        chunks.append(memoryview(flat[start:]).cast("B"))
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return PackedShard(chunks, offsets, int(sizes.sum()))


def _idx_text(offsets: np.ndarray) -> bytes:
    return "".join(f"{i}\t{o}\n" for i, o in enumerate(offsets.tolist())).encode()


def write_shard(store: Path, date: dt.date, x: np.ndarray, labels: Mapping[str, np.ndarray],
                schema: Schema, *, fsync: bool = True, version: int = 1) -> Sidecar:
    """Pack and publish one shard's files (sidecar last); returns its sidecar. ``version`` > 1
    names the files ``<date>.v<version>.*`` (a rewrite never replaces published files)."""
    if x.shape[0] == 0:
        raise ShardError(f"{date}: no windows (fewer rows than time_steps?); no shard written")
    paths = shard_paths(store, date, version)
    # sha256 is the slowest pass: a thread hashes each block as soon as it is packed, beside the
    # packing, the writes and the fsyncs (hashlib and file I/O release the GIL).
    digest, blocks = hashlib.sha256(), queue.SimpleQueue()

    def hash_blocks() -> None:
        for block in iter(blocks.get, None):
            digest.update(block)

    hasher = threading.Thread(target=hash_blocks, name="shard-sha256")
    hasher.start()
    try:
        packed = pack_records(x, labels, date, schema, on_block=blocks.put)
        idx = _idx_text(packed.offsets)
        atomic_write(paths["rec"], packed.chunks, fsync=fsync)
        atomic_write(paths["idx"], idx, fsync=fsync)
    finally:
        blocks.put(None)
        hasher.join()
    if not packed.streamed:  # a split record changed the bytes after some blocks were hashed
        digest = hashlib.sha256()
        for chunk in packed.chunks:
            digest.update(chunk)
    sidecar = Sidecar(date=date.isoformat(), records=packed.records, bytes=packed.size,
                      sha256=digest.hexdigest(), idx_bytes=len(idx), fingerprint=schema.fingerprint,
                      rec=paths["rec"].name, idx=paths["idx"].name)
    atomic_write(paths["json"], json.dumps(sidecar.to_json(), sort_keys=True).encode(), fsync=fsync)
    return sidecar
