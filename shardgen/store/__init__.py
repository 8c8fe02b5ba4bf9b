"""A store: its file names, manifest and snapshots, publishing, the writer's locks, reader leases,
gc, verify and status.

One interface (:class:`Store`, in ``base``; what readers ask of it in ``reading``), two
implementations: :class:`FolderStore` (a folder) and :class:`S3Store` (a store on an object store,
``s3://bucket/prefix``), which a reader reads through its cache (:class:`CachedStore`).
:func:`open_store` picks one from a location, once, and :func:`open_reading` the one a reader
reads; nothing else asks which kind of store it has.

A new kind of object store (say ``gs://``) is one module, a client with the methods of
``objstore.ObjectStore``, and one line in ``OBJECT_STORES``; or, without editing shardgen,
``SHARDGEN_OBJECT_STORES="gs=mypackage.gcs:GcsObjects"`` (comma-separated).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Optional, Union

from shardgen.store.base import Store
from shardgen.store.cached import CachedStore
from shardgen.store.folder import FolderStore
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.objstore import ObjectStore
from shardgen.store.s3 import S3Store

__all__ = ["Store", "FolderStore", "S3Store", "CachedStore", "open_store", "open_reading", "object_client",
           "OBJECT_STORES"]

OBJECT_STORES: dict[str, str] = {"s3": "shardgen.store.objstore:ObjectStore"}  # URL scheme -> objects client


def _objects_kind(location: object) -> Optional[type]:
    """The objects client of a URL ``scheme://...`` (None: not a URL, a folder)."""
    text = str(location)
    scheme, sep, _ = text.partition("://")
    if not sep or not scheme.isidentifier():
        return None
    kinds = dict(OBJECT_STORES)
    for entry in filter(None, os.environ.get("SHARDGEN_OBJECT_STORES", "").split(",")):
        name, _, target = entry.partition("=")
        kinds[name.strip()] = target.strip()
    if scheme not in kinds:
        raise ValueError(f"{text}: no store kind for {scheme}:// (known: "
                         f"{', '.join(s + '://' for s in sorted(kinds))}; see SHARDGEN_OBJECT_STORES)")
    module, _, name = kinds[scheme].partition(":")
    return getattr(importlib.import_module(module), name)


def object_client(location: str) -> Optional[ObjectStore]:
    """The objects client of a store URL (``s3://bucket/prefix``, or a scheme ``SHARDGEN_OBJECT_STORES``
    adds), made without a request; None for a folder. ObjectStoreError (or ValueError, an unknown
    scheme) says what is wrong with the URL."""
    kind = _objects_kind(location)
    return None if kind is None else kind(str(location))


def open_store(location: Union[Store, ObjectStore, str, os.PathLike], *,
               staging: Optional[Path] = None) -> Store:
    """The store at ``location``: a URL (``s3://bucket/prefix``, or an objects client) is an
    ``S3Store`` whose shard files are written in ``staging`` before upload (default
    ``./.shardgen-staging/<bucket>/<prefix>``); anything else names a store folder. A ``Store`` is
    returned as it is."""
    if isinstance(location, Store):
        return location
    client = not isinstance(location, (str, os.PathLike))  # an objects client
    kind = None if client else _objects_kind(location)
    if client or kind is not None:
        return S3Store(location if kind is None else kind(str(location)), staging=staging)
    if staging is not None and Path(staging) != Path(location):
        raise ValueError(f"{location}: a store folder is its own staging folder (got staging={staging})")
    return FolderStore(Path(location))


def open_reading(location: Union[Store, str, os.PathLike], cache_dir: Path,
                 cache_limit: Optional[int] = None) -> Store:
    """The store a reader reads at ``location`` (a store, its ``manifest.json``, or a URL): a store
    folder itself, an object store through its cache in ``<cache_dir>/objects`` under ``cache_limit``."""
    if not isinstance(location, Store):
        text = str(location)
        if text.endswith("/" + MANIFEST_NAME):
            location = text[: -len(MANIFEST_NAME) - 1]
        elif os.path.isfile(text):
            raise ValueError(f"{text}: a store is read from its folder or its {MANIFEST_NAME} (a copy under another "
                             "name is not a store; generation=N reads one generation)")
    store = open_store(location)
    if isinstance(store, S3Store):  # every object store (any objects client) is read through its cache
        return CachedStore.of(store, cache_dir, cache_limit)
    if cache_limit is not None:
        raise ValueError("cache_limit is only used for stores on an object store (s3://)")
    return store
