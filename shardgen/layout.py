"""Record layout of a shardgen shard: the single definition both writer and reader import.

A shard is one trading date: ``<date>.rec`` (dmlc RecordIO), ``<date>.idx`` (MXNet text index,
``key\\toffset`` per line) and ``<date>.json`` (sidecar, written last: its presence marks the
shard complete).

dmlc RecordIO frames a record as::

    uint32 magic = 0xced7230a
    uint32 lrec  = cflag << 29 | length      (cflag 0: whole record)
    length bytes of data, then zero padding to a multiple of 4

and, should the magic word appear at a 4-byte aligned offset of the data, splits the record
there into parts (cflag 1 first, 2 middle, 3 last) and drops that word: the reader puts it back.
:func:`frame_record` implements exactly that, so a shard is byte-identical to what
``mx.recordio.MXRecordIO`` writes.

The data of every record is MXNet's image-record format::

    IRHeader  uint32 flag = F, float32 label = 0, uint64 id = day, uint64 id2 = record number
    payload   F float32 (the "header label": ImageRecordIter returns it exactly, width F)
    image     a constant 1x1 image that ImageRecordIter decodes and we ignore

The payload depends on the store's layout (``[store] layout``), fixed per store and part of the
schema fingerprint:

``samples`` (format 1, one sample per record; PNG image, 67 bytes)::

    x (T*C, row-major), each label in schema order, date (days since 1970-01-01)

``windows`` (K = ``pack`` windows per record; BMP image, 58 bytes)::

    head   4: n (windows used, 1..K), day, 0, 0
    items  K x (1 + W): the window's number within the date, its labels (W = user label floats)
    data   K x T*C: the windows, row-major

``runs`` (a run of up to L = ``run_rows`` consecutive processed rows and up to K windows in it)::

    head   4: n (windows used, 1..K), day, first row (the run's row 0 within the date), rows used
    items  K x (1 + W): the window's start row within the run, its labels
    data   L x C: the rows

Window ``j`` of a runs record is ``data[start_j : start_j + T]``. Unused item and row slots are
zero. All values are float32; counts, rows and days are exact integers in float32. A date's
windows are packed in a fixed pseudo-random order seeded by the date (windows layout), and a
date's runs are written in a pseudo-random order too, so records hold scattered windows.
``id2`` is the record's number within its date (for ``samples``: the window's row).

A packed record is told apart from the other records of its date by its *key*, the payload words
:attr:`Schema.key_words`: the first item's window number (``windows``) or the run's first row
(``runs``), then the first item's first value after its index. The loader uses the key, with the
window count, to find a record whose windows two distributed parts share.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = [
    "MAGIC",
    "HEADER_BYTES",
    "HEAD_FLOATS",
    "MAX_RECORD_BYTES",
    "PNG_1X1",
    "BMP_1X1",
    "KINDS",
    "LabelSpec",
    "Layout",
    "Schema",
    "frame_record",
    "record_data",
    "unpack_samples",
    "day_number",
    "from_day_number",
]

MAGIC = 0xCED7230A
HEADER_BYTES = 24  # IRHeader: uint32 flag, float32 label, uint64 id, uint64 id2
HEAD_FLOATS = 4  # packed records: n, day, first row, rows used
MAX_RECORD_BYTES = (1 << 29) - 1  # dmlc's length field has 29 bits
KINDS = ("samples", "windows", "runs")
_EPOCH = dt.date(1970, 1, 1)


def _png_1x1() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)  # 1x1, 8-bit, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0\0", 9)) + chunk(b"IEND", b"")


def _bmp_1x1() -> bytes:
    """A 1x1 24-bit BMP (58 bytes): decodes faster than the PNG and is as exact (we ignore it)."""
    pixels = b"\0\0\0\0"  # one BGR pixel, padded to 4 bytes
    dib = struct.pack("<IiiHHIIiiII", 40, 1, 1, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(dib) + len(pixels), 0, 0, 14 + len(dib)) + dib + pixels


PNG_1X1 = _png_1x1()
BMP_1X1 = _bmp_1x1()


@dataclass(frozen=True)
class LabelSpec:
    """One label of a sample: a name and how many float32 values it has."""

    name: str
    width: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"label name {self.name!r} must be a Python identifier")
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 1:
            raise ValueError(f"label {self.name!r}: width must be an integer >= 1, got {self.width!r}")


def _positive(value: object, what: str, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """How samples become records: ``samples`` (one per record), ``windows`` (``pack`` per
    record) or ``runs`` (``run_rows`` consecutive rows and up to ``pack`` windows in them)."""

    kind: str = "samples"
    pack: int = 1
    run_rows: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout must be one of {', '.join(KINDS)}, got {self.kind!r}")
        _positive(self.pack, "store.pack")
        if self.kind == "samples" and (self.pack != 1 or self.run_rows):
            raise ValueError("layout 'samples' holds one sample per record (no pack, no run_rows)")
        if self.kind == "runs":
            _positive(self.run_rows, "store.run_rows")
        elif self.run_rows:
            raise ValueError("store.run_rows is only used with layout 'runs'")

    def to_json(self) -> dict:
        return {"kind": self.kind, "pack": self.pack, "run_rows": self.run_rows}

    @classmethod
    def from_json(cls, obj: object) -> Layout:
        if obj is None:  # format shardgen/1: one sample per record
            return cls()
        return cls(str(obj["kind"]), obj["pack"], obj["run_rows"])


@dataclass(frozen=True)
class Schema:
    """What one sample holds; ``labels`` always ends with ``date`` (width 1)."""

    time_steps: int
    num_inputs: int
    data_name: str
    labels: tuple[LabelSpec, ...]
    layout: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        for key in ("time_steps", "num_inputs"):
            _positive(getattr(self, key), f"schema.{key}")
        if not isinstance(self.data_name, str) or not self.data_name.isidentifier():
            raise ValueError(f"schema.data_name {self.data_name!r} must be a Python identifier")
        names = [lab.name for lab in self.labels]
        if not names or names[-1] != "date" or self.labels[-1].width != 1:
            raise ValueError("schema labels must end with 'date' of width 1")
        dupes = {n for n in names if names.count(n) > 1} | ({self.data_name} & set(names))
        if dupes:
            raise ValueError(f"schema names must be unique, repeated: {sorted(dupes)}")
        if self.layout.kind == "runs" and self.layout.run_rows < self.time_steps:
            raise ValueError(f"store.run_rows {self.layout.run_rows} must be >= time_steps {self.time_steps}")
        if self.record_bytes > MAX_RECORD_BYTES:
            raise ValueError(
                f"a record would be {self.record_bytes} bytes; RecordIO records must stay under 2^29"
            )

    @classmethod
    def create(cls, *, time_steps: int, num_inputs: int, data_name: str,
               labels: Sequence[LabelSpec], layout: Layout = Layout()) -> Schema:
        """A schema from the user's labels, with ``date`` appended."""
        if any(lab.name == "date" for lab in labels):
            raise ValueError("the label 'date' is added by shardgen; leave it out of schema.labels")
        return cls(time_steps, num_inputs, data_name, tuple(labels) + (LabelSpec("date", 1),), layout)

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def x_floats(self) -> int:
        return self.time_steps * self.num_inputs

    @property
    def label_floats(self) -> int:
        """W: the user labels' floats (``date`` excluded)."""
        return sum(lab.width for lab in self.labels[:-1])

    @property
    def pack(self) -> int:
        """K: samples (windows) a record holds at most."""
        return self.layout.pack

    @property
    def item_floats(self) -> int:
        return 1 + self.label_floats

    @property
    def record_floats(self) -> int:
        """F: the number of float32 values in a record's header label."""
        kind, k = self.layout.kind, self.layout.pack
        if kind == "samples":
            return self.x_floats + self.label_floats + 1
        data = k * self.x_floats if kind == "windows" else self.layout.run_rows * self.num_inputs
        return HEAD_FLOATS + k * self.item_floats + data

    @property
    def image(self) -> bytes:
        return PNG_1X1 if self.layout.kind == "samples" else BMP_1X1

    @property
    def record_bytes(self) -> int:
        """Bytes of one framed record on disk (when no magic word forces a split)."""
        length = HEADER_BYTES + 4 * self.record_floats + len(self.image)
        return 8 + length + (-length) % 4

    @property
    def items_slice(self) -> slice:
        """Packed layouts: where the K item slots sit in the payload."""
        return slice(HEAD_FLOATS, HEAD_FLOATS + self.layout.pack * self.item_floats)

    @property
    def key_words(self) -> tuple[int, ...]:
        """Packed layouts: the payload words that tell a record apart within its date (see the
        module docstring); empty for ``samples``, whose records are never shared between parts."""
        kind = self.layout.kind
        if kind == "samples":
            return ()
        return (HEAD_FLOATS if kind == "windows" else 2, HEAD_FLOATS + 1)

    @property
    def data_slice(self) -> slice:
        """Packed layouts: where the windows (or the run's rows) sit in the payload."""
        return slice(self.items_slice.stop, self.record_floats)

    def label_slices(self) -> dict[str, slice]:
        """``samples``: where each label sits in the payload. Packed layouts: where each user
        label sits inside an item slot's label part (after the item's index)."""
        out, start = {}, self.x_floats if self.layout.kind == "samples" else 0
        for lab in self.labels:
            out[lab.name] = slice(start, start + lab.width)
            start += lab.width
        return out

    # -- identity -------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """A digest of everything that decides how a record is laid out."""
        core = self._core()
        if self.layout.kind == "samples":  # format 1's digest, unchanged: old stores still match
            blob = {"layout": 1, **core}
        else:
            blob = {"layout": 2, **core, "record": self.layout.to_json()}
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]

    def _core(self) -> dict:
        return {
            "time_steps": self.time_steps,
            "num_inputs": self.num_inputs,
            "data_name": self.data_name,
            "labels": [{"name": lab.name, "width": lab.width} for lab in self.labels],
        }

    def to_json(self) -> dict:
        out = {**self._core(), "record_floats": self.record_floats, "fingerprint": self.fingerprint}
        if self.layout.kind != "samples":
            out["layout"] = self.layout.to_json()
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Schema:
        """Parse the manifest's ``schema`` object; raises ValueError/KeyError/TypeError if off."""
        labels = tuple(LabelSpec(str(lab["name"]), lab["width"]) for lab in obj["labels"])
        schema = cls(obj["time_steps"], obj["num_inputs"], obj["data_name"], labels,
                     Layout.from_json(obj.get("layout")))
        if obj.get("record_floats") != schema.record_floats:
            raise ValueError(f"record_floats {obj.get('record_floats')} != {schema.record_floats}")
        if obj.get("fingerprint") != schema.fingerprint:
            raise ValueError(f"fingerprint {obj.get('fingerprint')} != {schema.fingerprint}")
        return schema


def day_number(date: dt.date) -> int:
    """Days since 1970-01-01."""
    return (date - _EPOCH).days


def from_day_number(day: int) -> dt.date:
    return _EPOCH + dt.timedelta(days=int(day))


def unpack_samples(payload: np.ndarray, schema: Schema) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples of one record's payload (``header.label`` from ``mx.recordio.unpack``), for any
    layout: ``x (n, T, C)``, user labels ``(n, W)``, days ``(n,)`` and each sample's position in its
    date (``samples``: the row; ``windows``: the window's number; ``runs``: its start row)."""
    payload = np.asarray(payload, np.float32)
    t, c, w = schema.time_steps, schema.num_inputs, schema.label_floats
    if schema.layout.kind == "samples":
        x = payload[:schema.x_floats].reshape(1, t, c)
        return x, payload[schema.x_floats:schema.x_floats + w][None], payload[-1:], np.zeros(1)
    n, day, base = int(payload[0]), payload[1], int(payload[2])
    items = payload[schema.items_slice].reshape(schema.pack, schema.item_floats)[:n]
    data = payload[schema.data_slice]
    if schema.layout.kind == "windows":
        x = data.reshape(schema.pack, t, c)[:n]
        position = items[:, 0]
    else:
        rows = data.reshape(schema.layout.run_rows, c)
        starts = items[:, 0].astype(np.int64)
        x = rows[starts[:, None] + np.arange(t)]
        position = base + starts
    return x, items[:, 1:], np.full(n, day, np.float32), position


def record_data(payload: np.ndarray, day: int, row: int, image: bytes = PNG_1X1) -> bytes:
    """The data of one record (IRHeader + payload + image), before framing."""
    payload = np.ascontiguousarray(payload, dtype="<f4")
    return struct.pack("<IfQQ", payload.size, 0.0, day, row) + payload.tobytes() + image


def frame_record(data: bytes) -> bytes:
    """Frame one record as dmlc's ``RecordIOWriter::WriteRecord`` does, magic splits included."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(data)} bytes; RecordIO records must stay under 2^29")
    magic = struct.pack("<I", MAGIC)
    words = np.frombuffer(data, dtype="<u4", count=len(data) // 4)
    splits = (np.flatnonzero(words == MAGIC) * 4).tolist()
    parts, start = [], 0
    for pos in splits:
        parts.append(magic + struct.pack("<I", (1 if start == 0 else 2) << 29 | (pos - start)))
        parts.append(data[start:pos])
        start = pos + 4
    parts.append(magic + struct.pack("<I", (3 if splits else 0) << 29 | (len(data) - start)))
    parts.append(data[start:])
    parts.append(b"\0" * (-len(data) % 4))
    return b"".join(parts)


def _check_images() -> None:
    for image in (PNG_1X1, BMP_1X1):
        words = np.frombuffer(image[: len(image) // 4 * 4], dtype="<u4")
        assert not (words == MAGIC).any()  # the constant image never forces a split
    assert len(BMP_1X1) == 58


_check_images()
