"""Sizes given as text ("256MB", "1GiB", "20 GB"): the one parser for ``shuffle_buffer`` and
the cache's limit."""

from __future__ import annotations

import re
from typing import Union

from loader.errors import LoaderError

__all__ = ["UNITS", "parse_size"]

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?(?:e\+?\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)


def parse_size(value: Union[int, str], what: str, expected: str, *, bare_bytes: bool = False) -> int:
    """Bytes in ``value``: a positive int, or a string with a unit ("256MB", "1GiB"); with
    ``bare_bytes`` also a string of bytes alone ("20000000000", "2e10": a cache's limit from a
    command line), which an argument whose int means something else (``shuffle_buffer``: records)
    refuses. A LoaderError names ``what`` and says ``expected`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LoaderError(f"{what} must be {expected}, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise LoaderError(f"{what} must be {expected}, got {value!r}")
        return value
    m = _SIZE.fullmatch(value)
    if m is None or (m.group(2) is None and not bare_bytes):
        raise LoaderError(f"{what} must be {expected}, got {value!r}")
    n = int(float(m.group(1)) * UNITS[(m.group(2) or "B").upper()])
    if n < 1:
        raise LoaderError(f"{what} {value!r} is empty")
    return n

