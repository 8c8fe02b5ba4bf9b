"""The ``.idx`` file: MXNet's text index, one ``key<TAB>offset`` line per record.

A shard's own index (:func:`shard_index_text`) is byte-identical to what
``mx.recordio.MXIndexedRecordIO`` writes (key = the record's number). dmlc's
``IndexedRecordIOSplitter`` ignores keys and line order (it sorts the offsets) and sizes each
record by the next offset, the last by the file's end; the loader's per-reader indexes
(:func:`reader_index`) rely on exactly that.
"""

from __future__ import annotations

import numpy as np

from shardgen.format.errors import ShardError

__all__ = ["shard_index_text", "reader_index", "parse_index", "combine", "read_offsets", "check_index_file"]


def shard_index_text(offsets: np.ndarray) -> bytes:
    """A shard's ``.idx``: ``i<TAB>offset`` per record, as MXNet writes it."""
    return "".join(f"{i}\t{o}\n" for i, o in enumerate(np.asarray(offsets).tolist())).encode()


def _fixed_width_text(offsets: np.ndarray) -> bytes:
    """``0<TAB>offset`` lines built with numpy (a Python join took 0.5 s at 2M records); offsets
    are zero-padded decimals, which dmlc reads as the same numbers."""
    if not len(offsets):
        return b""
    width = max(1, len(str(int(offsets.max()))))
    lines = np.empty((len(offsets), width + 3), np.uint8)
    lines[:, 0], lines[:, 1], lines[:, -1] = ord("0"), ord("\t"), ord("\n")
    value = offsets.astype(np.uint64)
    for col in range(width + 1, 1, -1):  # last digit first
        lines[:, col] = (value % 10).astype(np.uint8) + ord("0")
        value //= 10
    return lines.tobytes()


def reader_index(offsets: np.ndarray) -> tuple[bytes, int]:
    """An index that makes one dmlc reader read exactly the records at ``offsets`` of a file that
    holds them and nothing after (a read's tape), and the ``num_parts`` to open it with (read part 0)."""
    return _fixed_width_text(np.asarray(offsets, np.int64)), 1


def parse_index(text: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, offsets)`` as int64 arrays; ValueError if a line is not two integers."""
    pairs = np.array(text.split(), dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def combine(offsets: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """The offsets of several files' records once the files are concatenated in order."""
    bases = np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64)))
    return np.concatenate([np.asarray(o, np.int64) + b for o, b in zip(offsets, bases)]) if offsets else \
        np.zeros(0, np.int64)


# -- a published shard's .idx, checked against its manifest entry (``date``, ``records``, ``bytes``) --

def _index_text(idx_path: str, entry) -> bytes:
    try:
        with open(idx_path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ShardError(f"{idx_path}: cannot read the index of {entry.date} ({exc.strerror})") from None


def _listed_offsets(text: bytes, idx_path: str, entry) -> np.ndarray:
    try:
        offsets = parse_index(text)[1]
    except ValueError:
        raise ShardError(f"{idx_path}: malformed index of {entry.date} (expected 'key<TAB>offset' lines)") from None
    if len(offsets) != entry.records:
        raise ShardError(f"{idx_path}: {len(offsets)} records, the manifest says {entry.records} ({entry.date})")
    if len(offsets) and (offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= entry.bytes):
        raise ShardError(f"{idx_path}: offsets are not increasing within the {entry.bytes}-byte file ({entry.date})")
    return offsets


def read_offsets(idx_path: str, entry) -> np.ndarray:
    """The record offsets a shard's ``.idx`` lists, checked against the manifest's entry."""
    return _listed_offsets(_index_text(idx_path, entry), idx_path, entry)


def _first_difference(text: bytes, want: bytes) -> str:
    """Where ``text`` first differs from ``want``: the line, as it is and as it should be."""
    pos = next((i for i, (a, b) in enumerate(zip(text, want)) if a != b), min(len(text), len(want)))
    line = text.count(b"\n", 0, pos)

    def shown(data: bytes) -> str:
        lines = data.split(b"\n")
        if line >= len(lines) or (line == len(lines) - 1 and not lines[line]):
            return "the end of the file"
        return repr(lines[line].decode("latin-1"))

    return f"line {line + 1} is {shown(text)}, expected {shown(want)}"


def check_index_file(idx_path: str, offsets: np.ndarray, entry) -> None:
    """ShardError unless the ``.idx`` is byte for byte the index of the records at ``offsets``, as
    MXNet writes it (``shard_index_text``: key = the record's number, a tab, the offset): stock
    readers look records up by its keys and lines (``MXIndexedRecordIO``), dmlc by its offsets."""
    text = _index_text(idx_path, entry)
    if not np.array_equal(_listed_offsets(text, idx_path, entry), offsets):
        raise ShardError(f"{idx_path}: offsets differ from the records of the .rec ({entry.date})")
    want = shard_index_text(offsets)
    if text != want:
        raise ShardError(f"{idx_path}: changed since publication ({entry.date}): {_first_difference(text, want)} "
                         "(not the index written with the .rec)")
