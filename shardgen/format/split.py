"""Records dmlc split at a magic word (``framing.frame_record``), the shard check's rare case: their
parts put back together (``reassemble``) and checked as a whole record's header and image are
(``split_record_words``). A Damage they raise names record 0: the caller knows which record it is."""

from __future__ import annotations

import numpy as np

from shardgen.format.codec import Damage
from shardgen.format.framing import HEADER_BYTES, MAGIC, data_bytes, split_lrec
from shardgen.format.schema import Schema

__all__ = ["reassemble", "split_record_words"]


def reassemble(data: memoryview, start: int, end: int) -> bytes:
    """The data of a record dmlc split at magic words (the magic words put back)."""
    pos, body = start, b""
    while True:
        if pos + 8 > end:
            raise Damage(0, "record runs past its index entry")
        magic, word = np.frombuffer(data, "<u4", 2, pos)
        cflag, length = split_lrec(word)
        if magic != MAGIC:
            raise Damage(0, f"bad magic word at byte {pos}")
        if cflag > 3 or (cflag == 0 and body) or (cflag in (2, 3) and pos == start) or (cflag == 1 and pos != start):
            raise Damage(0, f"bad continuation flag {cflag} at byte {pos}")  # dmlc aborts on 4-7 (review)
        if pos + 8 + length > end:
            raise Damage(0, "record runs past its index entry")
        body += bytes(data[pos + 8: pos + 8 + length])
        pos += 8 + length + (-length % 4)
        if cflag in (0, 3):
            break
        body += np.uint32(MAGIC).tobytes()
    if pos != end:
        raise Damage(0, f"record spans {pos - start} bytes, the index says {end - start}")
    return body


def split_record_words(data: memoryview, start: int, end: int, schema: Schema, day: int) -> np.ndarray:
    """A split record, reassembled and checked; its words laid out as a whole record's."""
    f = schema.record_floats
    body = reassemble(data, start, end)
    want = data_bytes(f, schema.image)
    if len(body) != want:
        raise Damage(0, f"record has {len(body)} data bytes, expected {want}")
    flag, label, rid, rid_high = np.frombuffer(body, "<u4", 4)
    if flag != f or rid != day or label != 0 or rid_high != 0:
        raise Damage(0, f"header flag is not {f}, label not 0 or id is not day {day}")
    if body[HEADER_BYTES + 4 * f:] != schema.image:
        raise Damage(0, "image bytes differ from the constant image")
    return np.frombuffer(b"\0" * 8 + body + b"\0" * (-len(body) % 4), "<u4")
