"""Where a ``ShardIter`` reads a store from, resolved once (:func:`resolve`) into a value the
iterator passes down: a store folder, or a store on an object store (``s3://bucket/prefix``)
mirrored into the local cache (:mod:`loader.source.objcache`). Both are read the same way from a
local folder; they differ only in what happens before a file is read (nothing, or a download),
and where the reader lease lives (in the store).

Everything the loader writes locally lives under ONE root, ``cache_dir`` (default
``$XDG_CACHE_HOME/shardgen``, else ``~/.cache/shardgen``): the plan folders of this host's
processes in ``<cache_dir>/plans/`` and the downloads of object-store stores in
``<cache_dir>/objects/<bucket>/<prefix>/``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from loader.errors import LoaderError
from loader.sizes import parse_size
from loader.source.objcache import ObjectCache, outage_wait_s
from loader.source.selection import load_manifest, manifest_path_of
from shardgen.errors import ManifestError
from shardgen.format.check import REBUILD
from shardgen.format.schema import Schema
from shardgen.store import FolderStore, S3Store, Store, open_store
from shardgen.store.lease import Lease
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.objstore import ObjectStoreError

__all__ = ["Location", "FolderLocation", "MirrorLocation", "resolve", "cache_root", "PLANS", "OBJECTS"]

PLANS = "plans"  # <cache_dir>/plans: this host's plan folders (an index and one link per shard)
OBJECTS = "objects"  # <cache_dir>/objects: the mirrors of object-store stores


def cache_root(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The loader's local root: ``cache_dir``, else ``$XDG_CACHE_HOME/shardgen``, else ``~/.cache/shardgen``."""
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardgen"


class Location:
    """A store as the loader reads it: ``origin`` (the ``shardgen.store.Store`` itself, where the
    reader lease lives), ``manifest_path`` (local) and what comes before reading."""

    downloads = False  # files come from elsewhere: a worker fetches only what its part reads

    def __init__(self, origin: Store, manifest_path: Path, root: Path):
        self.origin = origin
        self.manifest_path = manifest_path
        self.root = root

    @property
    def store(self) -> Path:
        """The local folder the shard files are read from."""
        return self.manifest_path.parent

    @property
    def plans(self) -> Path:
        """Where this host's plan folders go."""
        return self.root / PLANS

    def manifest(self) -> Manifest:
        """The newest manifest."""
        return load_manifest(self.manifest_path)

    def generation(self, generation: int) -> Manifest:
        """Generation ``generation`` exactly; LoaderError naming it when it is gone."""
        try:
            return FolderStore(self.store).load_generation(generation)
        except ManifestError as exc:
            raise LoaderError(f"cannot open generation {generation} of {self.store}: {exc}") from None

    def lease(self) -> Lease:
        """A reader lease in the store (it tells gc which generation this process reads)."""
        return Lease(self.origin)

    @property
    def downloaded_bytes(self) -> int:
        """Bytes this process downloaded from the store (shards and indexes)."""
        return 0

    @property
    def cache_limit(self) -> Optional[int]:
        """The bound on what downloads may hold on disk (None: none)."""
        return None

    @property
    def url(self) -> str:
        """Where the store is, as the user named it."""
        return str(self.store)

    def fetch(self, shards: Iterable[ShardEntry], *, who: str, schema: Schema,
              halt: Optional[threading.Event] = None) -> None:
        """Every file reading ``shards`` needs is in ``store``: LoaderError naming what is missing.
        ``halt``: wait for room in a cache under ``cache_limit`` until it is set (else no wait)."""
        for s in shards:
            if not (self.store / s.idx).is_file():
                raise LoaderError(f"{self.store / s.idx}: index file is missing (shard {s.date})")

    def fetch_index(self, shard: ShardEntry) -> bool:
        """Fetch ``shard``'s ``.idx`` if it was left out; True if it was (a check may then be retried)."""
        return False

    def drop_damaged(self, shard: ShardEntry) -> str:
        """``shard``'s local file failed its check: what to tell the user (a cache drops its copy)."""
        return REBUILD

    def fetch_ahead(self, select: Callable[[Manifest], tuple], after: Optional[threading.Event] = None) -> None:
        """Start fetching the newest generation's files in the background (``select`` picks the
        shards), once ``after`` is set (this epoch's own downloads first)."""

    def claim(self, who: str) -> None:
        """``who`` (an iterator) reads from here (a cache under ``cache_limit`` takes one)."""

    def check_room(self, shards: list) -> None:
        """LoaderError unless a cache under ``cache_limit`` can stream ``shards``."""

    def group_bytes(self) -> Optional[int]:
        """Bytes of shard files a feed group may hold at once (None: no bound)."""
        return None

    def pin(self, shard: ShardEntry) -> None:
        """``shard``'s file is held open: not evicted (its bytes stay on disk) until ``unpin``."""

    def unpin(self, shard: ShardEntry) -> None:
        """The file of ``shard`` was closed once more."""

    def release(self, who: str) -> None:
        """``who`` (an iterator) no longer needs its files kept."""


class FolderLocation(Location):
    """A store folder on this host (or a shared filesystem): read in place."""


class MirrorLocation(Location):
    """A store on an object store, read from its mirror in ``<root>/objects`` (:class:`ObjectCache`)."""

    downloads = True

    def __init__(self, cache: ObjectCache, root: Path):
        super().__init__(cache.store, cache.manifest_path, root)
        self.cache = cache
        outage_wait_s()  # a bad SHARDGEN_OUTAGE_WAIT_S is said now, not during an outage

    def manifest(self) -> Manifest:
        self.cache.pull_manifest()
        return super().manifest()

    def generation(self, generation: int) -> Manifest:
        try:
            if not self.cache.pull_snapshot(generation):  # a cached snapshot needs no request
                self.cache.pull_manifest()  # no snapshot: the manifest may be that generation
        except ManifestError as exc:
            raise LoaderError(f"cannot open generation {generation} of {self.store}: {exc}") from None
        return super().generation(generation)

    @property
    def downloaded_bytes(self) -> int:
        return self.cache.downloaded_bytes

    @property
    def cache_limit(self) -> Optional[int]:
        return self.cache.limit

    @property
    def url(self) -> str:
        return self.cache.remote.url

    def fetch(self, shards: Iterable[ShardEntry], *, who: str, schema: Schema,
              halt: Optional[threading.Event] = None) -> None:
        self.cache.fetch(shards, who=who, schema=schema, halt=halt)

    def fetch_index(self, shard: ShardEntry) -> bool:
        if (self.store / shard.idx).is_file():
            return False
        self.cache.fetch_index(shard)
        return True

    def fetch_ahead(self, select: Callable[[Manifest], tuple], after: Optional[threading.Event] = None) -> None:
        self.cache.fetch_ahead(select, after)

    def drop_damaged(self, shard: ShardEntry) -> str:
        self.cache.drop(shard)
        return (f"the cached copy was removed: the next reset() downloads it again (`shardgen verify` on "
                f"{self.cache.remote.url} checks the store's own)")

    def claim(self, who: str) -> None:
        self.cache.claim(who)

    def check_room(self, shards: list) -> None:
        self.cache.check_room(shards)

    def group_bytes(self) -> Optional[int]:
        return self.cache.group_bytes()

    def pin(self, shard: ShardEntry) -> None:
        self.cache.pin(shard.rec, +1)

    def unpin(self, shard: ShardEntry) -> None:
        self.cache.pin(shard.rec, -1)

    def release(self, who: str) -> None:
        self.cache.release(who)


_MIRRORS: dict[Path, ObjectCache] = {}  # one cache per mirror folder in a process: iterators share it
_MIRRORS_LOCK = threading.Lock()


def _folder(store: FolderStore, root: Path, limit: object) -> Location:
    """A store folder, or a manifest file named by its path (its folder is the store)."""
    if limit is not None:
        raise LoaderError("cache_limit is only used for s3:// stores")
    manifest_path = manifest_path_of(store.dir)
    if manifest_path.parent != store.dir:
        store = FolderStore(manifest_path.parent)
    return FolderLocation(store, manifest_path, root)


def _mirror(store: S3Store, root: Path, limit: object) -> Location:
    folder = (root / OBJECTS / store.objects.bucket / store.objects.prefix).resolve()
    size = None if limit is None else parse_size(limit, "cache_limit",
                                                 "a positive number of bytes or a size such as '20GB'",
                                                 bare_bytes=True)
    with _MIRRORS_LOCK:
        cache = _MIRRORS.get(folder)
        if cache is None or cache.limit != size:
            cache = ObjectCache(store, folder, size)
            _MIRRORS[folder] = cache
    return MirrorLocation(cache, root)


_KINDS: dict[type, Callable[..., Location]] = {FolderStore: _folder, S3Store: _mirror}


def resolve(manifest: Union[os.PathLike, str, Location], cache_dir: Optional[os.PathLike] = None,
            cache_limit: Union[int, str, None] = None) -> Location:
    """Where to read ``manifest`` (a manifest file, a store folder or an ``s3://`` URL) from: the
    store ``shardgen.store.open_store`` finds there (which alone tells a folder from an object
    store), with what reading it locally needs."""
    if isinstance(manifest, Location):
        return manifest
    text = str(manifest)
    if text.endswith("/" + MANIFEST_NAME):
        text = text[: -len(MANIFEST_NAME) - 1]
    try:
        store = open_store(text)
    except (ObjectStoreError, ValueError) as exc:
        raise LoaderError(str(exc)) from None
    return _KINDS[type(store)](store, cache_root(cache_dir), cache_limit)
