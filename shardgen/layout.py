"""Record layout of a shardgen shard: the single definition both writer and reader import.

A shard is one trading date: ``<date>.rec`` (dmlc RecordIO), ``<date>.idx`` (MXNet text index,
``key\\toffset`` per line) and ``<date>.json`` (sidecar, written last: its presence marks the
shard complete).

One sample is one RecordIO record. dmlc RecordIO frames a record as::

    uint32 magic = 0xced7230a
    uint32 lrec  = cflag << 29 | length      (cflag 0: whole record)
    length bytes of data, then zero padding to a multiple of 4

and, should the magic word appear at a 4-byte aligned offset of the data, splits the record
there into parts (cflag 1 first, 2 middle, 3 last) and drops that word: the reader puts it back.
:func:`frame_record` implements exactly that, so a shard is byte-identical to what
``mx.recordio.MXRecordIO`` writes.

The data of a record is MXNet's image-record format::

    IRHeader  uint32 flag = F, float32 label = 0, uint64 id = day, uint64 id2 = row   (24 bytes)
    payload   F float32: x row-major (time_steps * num_inputs), each label in schema order,
              then the date as days since 1970-01-01 (exact in float32)
    image     a constant 1x1 8-bit grayscale PNG (67 bytes): ImageRecordIter must decode it

``id`` is the day number again and ``id2`` the sample's row within its date. The whole sample
rides in the header label, which MXNet returns as an exact float32 array of width F.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "MAGIC",
    "HEADER_BYTES",
    "MAX_RECORD_BYTES",
    "PNG_1X1",
    "LabelSpec",
    "Schema",
    "frame_record",
    "record_data",
    "day_number",
    "from_day_number",
]

MAGIC = 0xCED7230A
HEADER_BYTES = 24  # IRHeader: uint32 flag, float32 label, uint64 id, uint64 id2
MAX_RECORD_BYTES = (1 << 29) - 1  # dmlc's length field has 29 bits
LAYOUT_VERSION = 1
_EPOCH = dt.date(1970, 1, 1)


def _png_1x1() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)  # 1x1, 8-bit, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0\0", 9)) + chunk(b"IEND", b"")


PNG_1X1 = _png_1x1()


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


@dataclass(frozen=True)
class Schema:
    """What one sample holds; ``labels`` always ends with ``date`` (width 1)."""

    time_steps: int
    num_inputs: int
    data_name: str
    labels: tuple[LabelSpec, ...]

    def __post_init__(self) -> None:
        for key in ("time_steps", "num_inputs"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"schema.{key} must be an integer >= 1, got {value!r}")
        if not isinstance(self.data_name, str) or not self.data_name.isidentifier():
            raise ValueError(f"schema.data_name {self.data_name!r} must be a Python identifier")
        names = [lab.name for lab in self.labels]
        if not names or names[-1] != "date" or self.labels[-1].width != 1:
            raise ValueError("schema labels must end with 'date' of width 1")
        dupes = {n for n in names if names.count(n) > 1} | ({self.data_name} & set(names))
        if dupes:
            raise ValueError(f"schema names must be unique, repeated: {sorted(dupes)}")
        if self.record_bytes > MAX_RECORD_BYTES:
            raise ValueError(
                f"a record would be {self.record_bytes} bytes; RecordIO records must stay under 2^29"
            )

    @classmethod
    def create(cls, *, time_steps: int, num_inputs: int, data_name: str,
               labels: Sequence[LabelSpec]) -> Schema:
        """A schema from the user's labels, with ``date`` appended."""
        if any(lab.name == "date" for lab in labels):
            raise ValueError("the label 'date' is added by shardgen; leave it out of schema.labels")
        return cls(time_steps, num_inputs, data_name, tuple(labels) + (LabelSpec("date", 1),))

    @property
    def x_floats(self) -> int:
        return self.time_steps * self.num_inputs

    @property
    def record_floats(self) -> int:
        """F: the number of float32 values in a record's header label."""
        return self.x_floats + sum(lab.width for lab in self.labels)

    @property
    def record_bytes(self) -> int:
        """Bytes of one framed record on disk (when no magic word forces a split)."""
        length = HEADER_BYTES + 4 * self.record_floats + len(PNG_1X1)
        return 8 + length + (-length) % 4

    def label_slices(self) -> dict[str, slice]:
        """Where each label sits in the payload, by name, in schema order."""
        out, start = {}, self.x_floats
        for lab in self.labels:
            out[lab.name] = slice(start, start + lab.width)
            start += lab.width
        return out

    @property
    def fingerprint(self) -> str:
        """A digest of everything that decides how a record is laid out."""
        blob = json.dumps({"layout": LAYOUT_VERSION, **self._core()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _core(self) -> dict:
        return {
            "time_steps": self.time_steps,
            "num_inputs": self.num_inputs,
            "data_name": self.data_name,
            "labels": [{"name": lab.name, "width": lab.width} for lab in self.labels],
        }

    def to_json(self) -> dict:
        return {**self._core(), "record_floats": self.record_floats, "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, obj: dict) -> Schema:
        """Parse the manifest's ``schema`` object; raises ValueError/KeyError/TypeError if off."""
        labels = tuple(LabelSpec(str(lab["name"]), lab["width"]) for lab in obj["labels"])
        schema = cls(obj["time_steps"], obj["num_inputs"], obj["data_name"], labels)
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


def record_data(payload: np.ndarray, day: int, row: int) -> bytes:
    """The data of one record (IRHeader + payload + PNG), before framing."""
    payload = np.ascontiguousarray(payload, dtype="<f4")
    return struct.pack("<IfQQ", payload.size, 0.0, day, row) + payload.tobytes() + PNG_1X1


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


def _check_png() -> None:
    words = np.frombuffer(PNG_1X1[: len(PNG_1X1) // 4 * 4], dtype="<u4")
    assert not (words == MAGIC).any()  # the constant image never forces a split


_check_png()
