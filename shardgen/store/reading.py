"""What a reader (the loader's ``ShardIter``) asks of a store, with the answers of a store read
where it is (a store folder). An object store is read through its cache
(:class:`shardgen.store.cached.CachedStore`), which gives its own answers: the one place that
downloads, bounds the cache by ``cache_limit``, fetches ahead and waits out an outage.

A reader names itself (``who``) when it makes files local; what it made local stays until it
lets go (``let_go``). A file it holds open is pinned (``pin``): its bytes are read, whatever
happens to its name.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterable, Optional

from shardgen.errors import ShardError
from shardgen.format.check import REBUILD
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["ReadInPlace", "REBUILD"]


class ReadInPlace:
    """The reading side of ``Store``: a store whose files are read where they are."""

    cache_limit: Optional[int] = None  # the bound on what reading keeps on local disk (None: none)
    downloaded_bytes = 0  # bytes this process downloaded to read the store
    in_place = True  # its files are local already: a reader opens and checks them all when it plans an epoch

    @property
    def local_dir(self) -> Path:
        """The local folder the shard files are read from."""
        raise NotImplementedError

    def newest_manifest_file(self) -> Path:
        """The newest manifest as a local file (a cache downloads it first)."""
        return self.local_dir / MANIFEST_NAME

    def make_local(self, shards: Iterable, *, who: str, schema=None, halt: Optional[threading.Event] = None) -> None:
        """Every file reading ``shards`` needs is in ``local_dir`` until ``let_go(who)``: ShardError naming
        what is missing. ``halt``: a cache under ``cache_limit`` waits for room (or the store) until it is set."""
        for s in shards:
            if not (self.local_dir / s.idx).is_file():
                raise ShardError(f"{self.local_dir / s.idx}: index file is missing (shard {s.date})")

    def let_go(self, who: str) -> None:
        """``who`` no longer needs what it made local (and is no longer the cache's reader)."""

    def forget_local(self, shard) -> Optional[str]:
        """``shard``'s local file failed its check: a cache drops its copy and says what happens next;
        None: the file is the store's own (rebuild it: ``REBUILD``)."""
        return None

    def fetch_part(self, shards: Iterable, *, who: str, schema=None) -> None:
        """At ``reset()``, a new generation's part: a cache that holds whole parts fetches it now
        (so a store lost since the manifest came is met at ``reset()``)."""

    def fetch_ahead(self, select: Callable, after: Optional[threading.Event] = None) -> None:
        """Once ``after`` is set, start fetching the newest generation's files (``select(manifest)``
        picks the shards) in the background, if the cache holds whole parts."""

    def claim(self, who: str) -> None:
        """``who`` (an iterator) reads from here: a cache under ``cache_limit`` is one reader's alone."""

    def check_room(self, shards: list) -> None:
        """``NoRoom`` unless a cache under ``cache_limit`` can stream ``shards``."""

    def group_bytes(self) -> Optional[int]:
        """Bytes of shard files a reader may hold at once (None: no bound)."""
        return None

    def pin(self, name: str, delta: int) -> None:
        """A descriptor on file ``name`` opened (+1) or closed (-1): never evicted while open."""
