"""Kept import path: the record layout now lives in :mod:`shardgen.format` (its modules'
docstrings are the spec). ``from shardgen.layout import unpack_samples, Schema, ...`` still works."""

from __future__ import annotations

from .format.codec import HEAD_FLOATS
from .format.framing import BMP_1X1, HEADER_BYTES, MAGIC, MAX_RECORD_BYTES, PNG_1X1, frame_record, record_data
from .format.registry import KINDS
from .format.schema import LabelSpec, Layout, Schema, day_number, from_day_number, unpack_samples

__all__ = ["MAGIC", "HEADER_BYTES", "HEAD_FLOATS", "MAX_RECORD_BYTES", "PNG_1X1", "BMP_1X1", "KINDS", "LabelSpec",
           "Layout", "Schema", "frame_record", "record_data", "unpack_samples", "day_number", "from_day_number"]
