"""Write one date's windows as a shard: ``<date>.rec``, ``<date>.idx``, then ``<date>.json``.

Records are packed in bulk: one ``(records, record_bytes)`` uint8 matrix filled block by block
with numpy (header words, payload, image), so each value is copied once. The rare record whose
payload holds the RecordIO magic word at an aligned offset is framed on its own (see
``layout.frame_record``). What a payload holds per layout is specified in ``layout``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import numpy as np

from .errors import ShardError
from .fsutil import atomic_write
from .layout import HEAD_FLOATS, HEADER_BYTES, MAGIC, Schema, day_number, frame_record, record_data
from .manifest import Sidecar
from .naming import shard_paths
from .process import RunSpec, WindowSet, as_window_set

__all__ = ["PackedShard", "pack_records", "plan_records", "write_shard", "shard_paths", "BLOCK_ROWS"]

BLOCK_ROWS = 256  # records packed (and handed to the hasher) at a time
Fill = Callable[[np.ndarray, int, int], None]  # fill(payload block (m, F) float32, first, stop)


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


def _date_rng(date: dt.date) -> np.random.Generator:
    """The fixed pseudo-random order of a date's windows and runs: seeded by the date alone."""
    return np.random.default_rng(day_number(date) + 0x5EED)


# -- what goes into each record's payload, per layout ------------------------------------------


def _samples_fill(ws: WindowSet, schema: Schema, day: int) -> Fill:
    slices = schema.label_slices()

    def fill(fl: np.ndarray, b0: int, b1: int) -> None:
        fl[:, :schema.x_floats].reshape(b1 - b0, schema.time_steps, schema.num_inputs)[...] = ws.windows(slice(b0, b1))
        for lab in schema.labels[:-1]:
            fl[:, slices[lab.name]] = ws.labels[lab.name][b0:b1]
        fl[:, -1] = day

    return fill


def _item_labels(ws: WindowSet, schema: Schema) -> np.ndarray:
    """(n, 1 + W): a slot for the item's index, then every user label, in schema order."""
    out = np.zeros((ws.n, schema.item_floats), np.float32)
    col = 1
    for lab in schema.labels[:-1]:
        out[:, col:col + lab.width] = ws.labels[lab.name]
        col += lab.width
    return out


def _windows_plan(ws: WindowSet, schema: Schema, date: dt.date) -> tuple[int, Fill]:
    """K windows per record, in the date's pseudo-random order."""
    k, day = schema.pack, day_number(date)
    order = _date_rng(date).permutation(ws.n)
    items = _item_labels(ws, schema)
    items[:, 0] = np.arange(ws.n)
    n_rec = -(-ws.n // k)
    isl, dsl = schema.items_slice, schema.data_slice

    def fill(fl: np.ndarray, b0: int, b1: int) -> None:
        fl[:] = 0
        for r in range(b0, b1):
            sel = order[r * k:(r + 1) * k]
            row = fl[r - b0]
            row[0], row[1] = len(sel), day
            row[isl].reshape(k, -1)[:len(sel)] = items[sel]
            row[dsl].reshape(k, schema.time_steps, schema.num_inputs)[:len(sel)] = ws.windows(sel)

    return n_rec, fill


def _runs(starts: np.ndarray, k: int, run_rows: int, t: int) -> list[tuple[int, int]]:
    """Greedy runs over sorted starts: ``[j0, j1)`` windows whose rows fit in ``run_rows``."""
    out, j0, n = [], 0, len(starts)
    while j0 < n:
        fit = int(np.searchsorted(starts, starts[j0] + run_rows - t, side="right"))
        j1 = min(j0 + k, fit, n)
        out.append((j0, j1))
        j0 = j1
    return out


def _runs_plan(ws: WindowSet, schema: Schema, date: dt.date) -> tuple[int, Fill]:
    """Runs of consecutive rows with up to K windows each, the runs in a pseudo-random order."""
    k, day, t, c = schema.pack, day_number(date), schema.time_steps, schema.num_inputs
    lay = schema.layout
    order = np.argsort(ws.starts, kind="stable")
    starts = ws.starts[order]
    items = _item_labels(ws, schema)[order]
    runs = _runs(starts, k, lay.run_rows, t)
    runs = [runs[i] for i in _date_rng(date).permutation(len(runs))]
    isl, dsl = schema.items_slice, schema.data_slice

    def fill(fl: np.ndarray, b0: int, b1: int) -> None:
        fl[:] = 0
        for r in range(b0, b1):
            j0, j1 = runs[r]
            base = int(starts[j0])
            used = int(starts[j1 - 1]) + t - base
            row = fl[r - b0]
            row[:HEAD_FLOATS] = (j1 - j0, day, base, used)
            slots = row[isl].reshape(k, -1)
            slots[:j1 - j0] = items[j0:j1]
            slots[:j1 - j0, 0] = starts[j0:j1] - base
            row[dsl].reshape(lay.run_rows, c)[:used] = ws.rows[base:base + used]

    return len(runs), fill


def plan_records(ws: WindowSet, schema: Schema, date: dt.date) -> tuple[int, Fill]:
    """How many records the date's windows make in this layout, and how to fill their payloads."""
    kind = schema.layout.kind
    if kind == "samples":
        return ws.n, _samples_fill(ws, schema, day_number(date))
    if kind == "windows":
        return _windows_plan(ws, schema, date)
    if not ws.is_runs:
        raise ShardError(f"{date}: layout 'runs' needs rows and starts (a RunSpec), got windows")
    return _runs_plan(ws, schema, date)


# -- framing -------------------------------------------------------------------------------------


def pack_records(n: int, fill: Fill, date: dt.date, schema: Schema, *,
                 on_block: Optional[Callable[[memoryview], object]] = None) -> PackedShard:
    """Frame ``n`` records whose payloads ``fill`` writes, block by block.

    ``on_block`` gets each finished block's bytes in file order (the writer hashes them
    meanwhile) for as long as no record needs dmlc's magic-word split.
    """
    f, rec_bytes, day, image = schema.record_floats, schema.record_bytes, day_number(date), schema.image
    words = np.empty((n, rec_bytes // 4), dtype="<u4")
    floats = words.view("<f4")
    flat = words.view(np.uint8).reshape(n, rec_bytes)
    p0 = 2 + HEADER_BYTES // 4  # payload starts after magic, lrec and the IRHeader
    length = HEADER_BYTES + 4 * f + len(image)
    tail = np.frombuffer(image + b"\0" * (rec_bytes - 8 - length), "<u4")  # image + padding
    special: list[int] = []
    for b0 in range(0, n, BLOCK_ROWS):
        b1 = min(n, b0 + BLOCK_ROWS)
        w = words[b0:b1]
        fill(floats[b0:b1, p0:p0 + f], b0, b1)
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
        framed = frame_record(record_data(payload[row], day, row, image))
        chunks.append(framed)
        sizes[row] = len(framed)
        start = row + 1
    if start < n:
        chunks.append(memoryview(flat[start:]).cast("B"))
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return PackedShard(chunks, offsets, int(sizes.sum()))


def _idx_text(offsets: np.ndarray) -> bytes:
    return "".join(f"{i}\t{o}\n" for i, o in enumerate(offsets.tolist())).encode()


def write_shard(store: Path, date: dt.date, x: Union[np.ndarray, RunSpec, WindowSet],
                labels: Optional[Mapping[str, np.ndarray]], schema: Schema, *, fsync: bool = True,
                version: int = 1) -> Sidecar:
    """Pack and publish one shard's files (sidecar last); returns its sidecar.

    ``x`` is the windows ``(n, T, C)`` with ``labels``, or a ``RunSpec`` / checked ``WindowSet``
    (then ``labels`` is None). ``version`` > 1 names the files ``<date>.v<version>.*`` (a rewrite
    never replaces published files).
    """
    ws = x if isinstance(x, WindowSet) else as_window_set(x, labels, schema, date)
    if ws.n == 0:
        raise ShardError(f"{date}: no windows (fewer rows than time_steps?); no shard written")
    paths = shard_paths(store, date, version)
    n_records, fill = plan_records(ws, schema, date)
    # sha256 is the slowest pass: a thread hashes each block as soon as it is packed, beside the
    # packing, the writes and the fsyncs (hashlib and file I/O release the GIL).
    digest, blocks = hashlib.sha256(), queue.SimpleQueue()

    def hash_blocks() -> None:
        for block in iter(blocks.get, None):
            digest.update(block)

    hasher = threading.Thread(target=hash_blocks, name="shard-sha256")
    hasher.start()
    try:
        packed = pack_records(n_records, fill, date, schema, on_block=blocks.put)
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
                      rec=paths["rec"].name, idx=paths["idx"].name, windows=ws.n)
    atomic_write(paths["json"], json.dumps(sidecar.to_json(), sort_keys=True).encode(), fsync=fsync)
    return sidecar
