"""RecordIO framing: how one record's bytes sit in a ``.rec`` file.

dmlc RecordIO frames a record as::

    uint32 magic = 0xced7230a
    uint32 lrec  = cflag << 29 | length      (cflag 0: whole record)
    length bytes of data, then zero padding to a multiple of 4

and, should the magic word appear at a 4-byte aligned offset of the data, splits the record
there into parts (cflag 1 first, 2 middle, 3 last) and drops that word: the reader puts it back.
:func:`frame_record` implements exactly that, so a shard is byte-identical to what
``mx.recordio.MXRecordIO`` writes.

The data of every record is MXNet's image-record format::

    IRHeader  uint32 flag = F, float32 label = 0, uint64 id = day,
              uint64 id2 = record number | CRC32(payload + image) << 32
    payload   F float32 (the "header label": ImageRecordIter returns it exactly, width F)
    image     a constant 1x1 image that ImageRecordIter decodes and we ignore

The CRC32 (zlib's) of each record's payload and image sits in the high word of ``id2``
(:data:`CRC_WORD`), which no MXNet reader uses; a manifest entry with ``checksum = "crc32"``
says the shard's records carry it (shards written before 2026-12-06 hold 0 there).

so a whole record is ``record_bytes(F, image)`` bytes and its payload starts at word
:data:`PAYLOAD_WORD`. What the payload holds is the layout's codec's business.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

__all__ = ["MAGIC", "HEADER_BYTES", "PAYLOAD_WORD", "NUMBER_WORD", "CRC_WORD", "CHECKSUM", "payload_crcs",
           "MAX_RECORD_BYTES", "PNG_1X1", "BMP_1X1", "lrec", "split_lrec",
           "data_bytes", "record_bytes", "image_tail", "record_data", "frame_record", "FramedRecords",
           "frame_records", "BLOCK_ROWS"]

MAGIC = 0xCED7230A
HEADER_BYTES = 24  # IRHeader: uint32 flag, float32 label, uint64 id, uint64 id2
PAYLOAD_WORD = 2 + HEADER_BYTES // 4  # a whole record's first payload word (after magic, lrec, IRHeader)
NUMBER_WORD = PAYLOAD_WORD - 2  # id2's low word: the record's number in its shard
CRC_WORD = PAYLOAD_WORD - 1  # id2's high word: CRC32 of the payload and image
CHECKSUM = "crc32"  # a manifest entry's ``checksum``: its records carry a CRC32 in CRC_WORD
MAX_RECORD_BYTES = (1 << 29) - 1  # dmlc's length field has 29 bits
BLOCK_ROWS = 256  # records framed (and handed on) at a time


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


PNG_1X1 = _png_1x1()  # format 1 (``samples``)
BMP_1X1 = _bmp_1x1()  # packed layouts


def lrec(cflag: int, length: int) -> int:
    """The length word of a frame."""
    return cflag << 29 | length


def split_lrec(word: int) -> tuple[int, int]:
    """``(cflag, length)`` of a length word."""
    return int(word) >> 29, int(word) & MAX_RECORD_BYTES


def data_bytes(floats: int, image: bytes) -> int:
    """A record's data (IRHeader + payload + image) before framing."""
    return HEADER_BYTES + 4 * floats + len(image)


def record_bytes(floats: int, image: bytes) -> int:
    """Bytes of one framed record on disk (when no magic word forces a split)."""
    length = data_bytes(floats, image)
    return 8 + length + (-length) % 4


def image_tail(floats: int, image: bytes) -> np.ndarray:
    """The words after a whole record's payload: the image and the padding."""
    return np.frombuffer(image + b"\0" * (record_bytes(floats, image) - 8 - data_bytes(floats, image)), "<u4")


def record_data(payload: np.ndarray, day: int, row: int, image: bytes = PNG_1X1) -> bytes:
    """The data of one record (IRHeader + payload + image), before framing."""
    body = np.ascontiguousarray(payload, dtype="<f4").tobytes() + image
    return struct.pack("<IfQII", len(body) - len(image) >> 2, 0.0, day, row & 0xFFFFFFFF, zlib.crc32(body)) + body


def payload_crcs(buf: memoryview, starts: np.ndarray, length: int) -> np.ndarray:
    """CRC32 of the payload and image of each whole record of ``length`` data bytes whose frame
    starts at each of ``starts`` (byte offsets into ``buf``): one zlib call a record (6.7 GB/s
    here; docs/format.md)."""
    a, b = 8 + HEADER_BYTES, 8 + length
    return np.fromiter((zlib.crc32(buf[s + a:s + b]) for s in starts.tolist()), np.uint32, len(starts))


def frame_record(data: bytes) -> bytes:
    """Frame one record as dmlc's ``RecordIOWriter::WriteRecord`` does, magic splits included."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(data)} bytes; RecordIO records must stay under 2^29")
    magic = struct.pack("<I", MAGIC)
    words = np.frombuffer(data, dtype="<u4", count=len(data) // 4)
    splits = (np.flatnonzero(words == MAGIC) * 4).tolist()
    parts, start = [], 0
    for pos in splits:
        parts.append(magic + struct.pack("<I", lrec(1 if start == 0 else 2, pos - start)))
        parts.append(data[start:pos])
        start = pos + 4
    parts.append(magic + struct.pack("<I", lrec(3 if splits else 0, len(data) - start)))
    parts.append(data[start:])
    parts.append(b"\0" * (-len(data) % 4))
    return b"".join(parts)


Fill = Callable[[np.ndarray, int, int], None]  # fill(payload block (m, F) float32, first, stop)


@dataclass
class FramedRecords:
    """Framed records of one date, ready to write."""

    chunks: list  # buffers to write in order
    offsets: np.ndarray  # int64 start of each record in the .rec
    size: int
    streamed: bool = False  # every byte went to on_block, in order

    @property
    def records(self) -> int:
        return len(self.offsets)


def frame_records(n: int, fill: Fill, day: int, floats: int, image: bytes, *,
                  on_block: Optional[Callable[[memoryview], object]] = None) -> FramedRecords:
    """Frame ``n`` records of ``floats`` payload words that ``fill`` writes, block by block: one
    ``(records, record_bytes)`` matrix filled with numpy (header words, payload, image), so each
    value is copied once. The rare record whose payload holds the magic word is framed on its own.

    ``on_block`` gets each finished block's bytes in file order (the writer hashes them
    meanwhile) for as long as no record needs dmlc's magic-word split.
    """
    rec_bytes, p0, length = record_bytes(floats, image), PAYLOAD_WORD, data_bytes(floats, image)
    words = np.empty((n, rec_bytes // 4), dtype="<u4")
    floats_view = words.view("<f4")
    flat = words.view(np.uint8).reshape(n, rec_bytes)
    tail = image_tail(floats, image)
    special: list[int] = []
    for b0 in range(0, n, BLOCK_ROWS):
        b1 = min(n, b0 + BLOCK_ROWS)
        w = words[b0:b1]
        fill(floats_view[b0:b1, p0:p0 + floats], b0, b1)
        w[:, :p0] = (MAGIC, lrec(0, length), floats, 0, day, 0, 0, 0)  # flag, label 0.0, id = day, id2
        w[:, NUMBER_WORD] = np.arange(b0, b1, dtype="<u4")
        w[:, p0 + floats:] = tail
        w[:, CRC_WORD] = payload_crcs(memoryview(flat[b0:b1]).cast("B"), np.arange(b1 - b0) * rec_bytes, length)
        special += (np.flatnonzero((w[:, p0:p0 + floats] == MAGIC).any(axis=1) | (w[:, CRC_WORD] == MAGIC))
                    + b0).tolist()
        if on_block is not None and not special:
            on_block(memoryview(flat[b0:b1]).cast("B"))
    if not special:
        offsets = np.arange(n, dtype=np.int64) * rec_bytes
        return FramedRecords([memoryview(flat).cast("B")], offsets, n * rec_bytes, streamed=on_block is not None)
    # A payload word equal to the magic: dmlc splits that record; frame it the slow, exact way.
    payload = floats_view[:, p0:p0 + floats]
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
    return FramedRecords(chunks, offsets, int(sizes.sum()))


def _check_images() -> None:
    for image in (PNG_1X1, BMP_1X1):
        words = np.frombuffer(image[: len(image) // 4 * 4], dtype="<u4")
        assert not (words == MAGIC).any()  # the constant image never forces a split
    assert len(BMP_1X1) == 58


_check_images()
