"""The on-disk contract of a shardgen store's shards; these modules' docstrings are the spec.

A shard is one trading date: ``<date>.rec`` (dmlc RecordIO), ``<date>.idx`` (MXNet text index)
and ``<date>.json`` (sidecar, written last: its presence marks the shard complete). Where each
part of the format is defined:

============  ===========================================================================
framing       RecordIO frames (magic, length word, magic-word splits), the IRHeader, the 1x1
              images, and framing a date's records in bulk
schema        what a sample holds (``Schema``, ``LabelSpec``), the record layout (``Layout``),
              the fingerprint, day numbers
codec         what a layout's codec does (encode, check, decode); ``samples``, ``windows`` and
              ``runs`` are one module each, ``registry`` names them
index         the ``.idx`` text: a shard's own, the loader's per-reader ranges, combining files
check         the shard check every reader runs before MXNet reads a file
errors        ``ShardError`` (and the root of shardgen's errors)
============  ===========================================================================

This package imports nothing else of shardgen or the loader; both import it. A fourth layout is
one codec module and one line in ``registry``.
"""

from __future__ import annotations

from shardgen.format.check import VERIFY_MODES, ShardFrames, check_shard, read_offsets
from shardgen.format.codec import HEAD_FLOATS, Codec, Decoded
from shardgen.format.errors import ShardError, ShardgenError
from shardgen.format.framing import (
    BMP_1X1,
    HEADER_BYTES,
    MAGIC,
    MAX_RECORD_BYTES,
    PNG_1X1,
    FramedRecords,
    frame_record,
    frame_records,
    record_data,
)
from shardgen.format.index import combine, parse_index, reader_index, shard_index_text
from shardgen.format.registry import CODECS, KINDS, codec_for
from shardgen.format.schema import LabelSpec, Layout, Schema, day_number, from_day_number, unpack_samples

__all__ = ["VERIFY_MODES", "ShardFrames", "check_shard", "read_offsets", "HEAD_FLOATS", "Codec", "Decoded",
           "ShardError", "ShardgenError", "BMP_1X1", "HEADER_BYTES", "MAGIC", "MAX_RECORD_BYTES", "PNG_1X1",
           "FramedRecords", "frame_record", "frame_records", "record_data", "combine", "parse_index",
           "reader_index", "shard_index_text", "CODECS", "KINDS", "codec_for", "LabelSpec", "Layout", "Schema",
           "day_number", "from_day_number", "unpack_samples"]
