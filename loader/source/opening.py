"""The store a ``ShardIter`` reads, opened from what its caller names."""

from __future__ import annotations

import os
from pathlib import Path

from loader.errors import LoaderError, as_loader_errors
from loader.sizes import parse_size
from shardgen.store import Store, open_reading

__all__ = ["open_store"]


def open_store(manifest: os.PathLike | str | Store, root: Path, cache_limit: object) -> Store:
    """The store ``manifest`` names, as a reader reads it (an object store through its cache under ``root``)."""
    limit = None if cache_limit is None else parse_size(cache_limit, "cache_limit",
                                                        "a positive number of bytes or a size such as '20GB'",
                                                        bare_bytes=True)
    try:
        with as_loader_errors():
            return open_reading(manifest, root, limit)
    except ValueError as exc:
        raise LoaderError(str(exc)) from None
