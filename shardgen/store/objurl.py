"""An object store's URL (``s3://bucket/prefix``) and its default local staging folder (the one
definition the config and ``S3Store`` share). The errors a request to it can end in live in
:mod:`shardgen.errors` (below every store) and are importable from here too."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from shardgen.errors import CredentialsRefused, NoSuchStore, ObjectMismatch, ObjectStoreError, StoreUnreachable

__all__ = ["is_remote", "parse_url", "default_staging", "ObjectInfo", "ObjectStoreError", "StoreUnreachable",
           "CredentialsRefused", "ObjectMismatch", "NoSuchStore", "store_errors_as"]


def is_remote(location: object) -> bool:
    """Whether ``location`` names a store on an object store (an ``s3://`` URL)."""
    return isinstance(location, str) and location.startswith("s3://")


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b/")`` (the prefix ends with '/' unless empty)."""
    if not is_remote(url):
        raise ObjectStoreError(f"{url!r}: not an s3:// URL")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket or any(c in bucket for c in " \\"):
        raise ObjectStoreError(f"{url!r}: no bucket name (expected s3://bucket/prefix)")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ObjectStoreError(f"{url!r}: empty, '.' and '..' parts are not allowed in the prefix")
    return bucket, (prefix + "/" if prefix else "")


def default_staging(bucket: str, prefix: str, base: Union[str, Path, None] = None) -> Path:
    """Where shard files for ``s3://bucket/prefix`` are written before upload when no staging folder
    is named: ``<base>/.shardgen-staging/<bucket>/<prefix>``; ``base`` is the config file's folder for
    a config, the working folder (``None``) for a store opened without one."""
    return Path(base if base is not None else ".") / ".shardgen-staging" / bucket / prefix


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    mtime: float  # by the store's clock (whole seconds on most servers)
    etag: str


@contextlib.contextmanager
def store_errors_as(kind: type, unreachable: Optional[type] = None) -> Iterator[None]:
    """Re-raise object-store errors as ``kind`` (e.g. the loader's LoaderError), same message;
    ``StoreUnreachable`` as ``unreachable`` if given."""
    try:
        yield
    except ObjectStoreError as exc:
        if unreachable is not None and isinstance(exc, StoreUnreachable):
            raise unreachable(str(exc)) from None
        raise kind(str(exc)) from None
