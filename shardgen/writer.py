"""Write one date's windows as a shard: ``<date>.rec``, ``<date>.idx``, then ``<date>.json``.

Records are packed in bulk: one ``(n, record_bytes)`` uint8 matrix filled column-wise with numpy
(header words, payload, PNG), so each value is copied once. The rare record whose payload holds
the RecordIO magic word at an aligned offset is framed on its own (see ``layout.frame_record``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from .errors import ProcessorError, ShardError
from .fsutil import atomic_write
from .layout import HEADER_BYTES, MAGIC, PNG_1X1, Schema, day_number, frame_record, record_data
from .manifest import Sidecar

__all__ = ["PackedShard", "pack_records", "write_shard", "shard_paths"]


@dataclass
class PackedShard:
    """Framed records of one date, ready to write."""

    chunks: list  # buffers to write in order
    offsets: np.ndarray  # int64 start of each record in the .rec
    size: int

    @property
    def records(self) -> int:
        return len(self.offsets)


def shard_paths(store: Path, date: dt.date) -> dict[str, Path]:
    name = date.isoformat()
    return {ext: Path(store) / f"{name}.{ext}" for ext in ("rec", "idx", "json")}


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.any(axis=tuple(range(1, mask.ndim))))[0])


def pack_records(x: np.ndarray, labels: Mapping[str, np.ndarray], date: dt.date, schema: Schema) -> PackedShard:
    """Frame every window of one date; ProcessorError names the first non-finite row and field."""
    n = x.shape[0]
    f = schema.record_floats
    rec_bytes = schema.record_bytes
    day = day_number(date)
    words = np.empty((n, rec_bytes // 4), dtype="<u4")
    floats = words.view("<f4")
    p0 = 2 + HEADER_BYTES // 4  # payload starts after magic, lrec and the IRHeader
    # Payload: x, each label, date -- written straight into place.
    np.copyto(floats[:, p0:p0 + schema.x_floats].reshape(n, schema.time_steps, schema.num_inputs), x)
    for lab, sl in zip(schema.labels[:-1], list(schema.label_slices().values())[:-1]):
        floats[:, p0 + sl.start:p0 + sl.stop] = labels[lab.name].reshape(n, lab.width)
    floats[:, p0 + f - 1] = day
    payload = floats[:, p0:p0 + f]
    bad = ~np.isfinite(payload)
    if bad.any():
        row = _first_bad(bad)
        col = int(np.flatnonzero(bad[row])[0])
        field = schema.data_name if col < schema.x_floats else next(
            name for name, sl in schema.label_slices().items() if sl.start <= col < sl.stop)
        raise ProcessorError(f"{date}: non-finite value in {field!r} at window {row} (expected finite float32)")
    length = HEADER_BYTES + 4 * f + len(PNG_1X1)
    words[:, 0] = MAGIC
    words[:, 1] = length  # cflag 0
    words[:, 2] = f
    words[:, 3] = 0  # float32 0.0
    words[:, 4] = day
    words[:, 5] = 0
    words[:, 6] = np.arange(n, dtype="<u4")
    words[:, 7] = 0
    tail = np.frombuffer(PNG_1X1 + b"\0" * (rec_bytes - 8 - length), "<u4")  # image + padding
    words[:, p0 + f:] = tail
    special = np.flatnonzero((words[:, p0:p0 + f] == MAGIC).any(axis=1))
    flat = words.view(np.uint8).reshape(n, rec_bytes)
    if special.size == 0:
        offsets = np.arange(n, dtype=np.int64) * rec_bytes
        return PackedShard([memoryview(flat).cast("B")], offsets, n * rec_bytes)
    # A payload word equal to the magic: dmlc splits that record; frame it the slow, exact way.
    chunks, sizes, start = [], np.full(n, rec_bytes, dtype=np.int64), 0
    for row in special.tolist():
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
                schema: Schema, *, fsync: bool = True) -> Sidecar:
    """Pack and publish one shard's files (sidecar last); returns its sidecar."""
    if x.shape[0] == 0:
        raise ShardError(f"{date}: no windows (fewer rows than time_steps?); no shard written")
    packed = pack_records(x, labels, date, schema)
    paths = shard_paths(store, date)
    digest = hashlib.sha256()
    # sha256 is the slowest pass; it releases the GIL, so it runs beside the writes and fsyncs.
    hasher = threading.Thread(target=lambda: [digest.update(c) for c in packed.chunks], name="shard-sha256")
    hasher.start()
    try:
        idx = _idx_text(packed.offsets)
        atomic_write(paths["rec"], packed.chunks, fsync=fsync)
        atomic_write(paths["idx"], idx, fsync=fsync)
    finally:
        hasher.join()
    sidecar = Sidecar(date=date.isoformat(), records=packed.records, bytes=packed.size,
                      sha256=digest.hexdigest(), idx_bytes=len(idx), fingerprint=schema.fingerprint,
                      rec=paths["rec"].name, idx=paths["idx"].name)
    atomic_write(paths["json"], json.dumps(sidecar.to_json(), sort_keys=True).encode(), fsync=fsync)
    return sidecar
