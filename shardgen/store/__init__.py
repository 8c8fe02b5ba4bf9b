"""A store: its file names, manifest and snapshots, publishing, the writer's locks, reader leases,
gc, verify and status.

One interface (:class:`Store`, in ``base``), two implementations: :class:`FolderStore` (a folder)
and :class:`S3Store` (an ``s3://bucket/prefix``). :func:`open_store` picks one from a location,
once; nothing else asks which kind of store it has."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from shardgen.store.base import Store
from shardgen.store.folder import FolderStore
from shardgen.store.objstore import ObjectStore, is_remote
from shardgen.store.s3 import S3Store

__all__ = ["Store", "FolderStore", "S3Store", "open_store"]


def open_store(location: Union[Store, ObjectStore, str, os.PathLike], *,
               staging: Optional[Path] = None) -> Store:
    """The store at ``location``: an ``s3://bucket/prefix`` URL (or an ``ObjectStore``) is an
    ``S3Store`` whose shard files are written in ``staging`` before upload (default
    ``./.shardgen-staging/<bucket>/<prefix>``); anything else names a store folder. A ``Store`` is
    returned as it is."""
    if isinstance(location, Store):
        return location
    if isinstance(location, ObjectStore) or is_remote(location):
        return S3Store(location, staging=staging)
    if staging is not None and Path(staging) != Path(location):
        raise ValueError(f"{location}: a store folder is its own staging folder (got staging={staging})")
    return FolderStore(Path(location))
