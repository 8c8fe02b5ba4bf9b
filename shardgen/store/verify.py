"""``shardgen verify``: no published file (of the manifest or of a kept snapshot) may have changed.

Written once for every kind of store: each shard is checked in a local folder that holds its files
(a store folder: the store itself; an object store: a temporary download of them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from shardgen.errors import ManifestError, ShardError
from shardgen.format.check import check_shard
from shardgen.format.schema import Schema
from shardgen.store import Store, open_store
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import snapshot_name

__all__ = ["verify_shard", "verify_store"]


def _check_files(folder: Path, entry: ShardEntry, schema: Schema, source: str) -> Optional[str]:
    rec = folder / entry.rec
    try:
        fd = os.open(rec, os.O_RDONLY)
    except OSError as exc:
        return f"{rec}: cannot read ({exc.strerror})"
    try:
        check_shard(fd, str(rec), str(folder / entry.idx), entry, schema, verify="sha256", cache=False,
                    check_index=True)
    except ShardError as exc:
        return str(exc).replace("the manifest", source)
    finally:
        os.close(fd)
    return None


def verify_shard(store: Union[Store, str, os.PathLike], entry: ShardEntry, schema: Schema, *,
                 source: str = "the manifest") -> Optional[str]:
    """What is wrong with a shard in the store (size, sha256, index, framing) against ``entry``,
    or None; ``source`` names where ``entry`` came from in the messages."""
    store = open_store(store)
    with store.local_files([entry.rec, entry.idx]) as folder:
        problem = _check_files(folder, entry, schema, source)
    return problem.replace(str(folder), store.where()) if problem else None


def _check_published_sidecar(store: Store, entry: ShardEntry) -> Optional[str]:
    """Whether the shard's sidecar and ``.idx`` are still what was published with it."""
    try:
        sidecar = store.read_sidecar(entry.sidecar) if entry.sidecar else None
    except ShardError as exc:
        return str(exc)
    if sidecar is None:
        return None  # adopted or older shards may have none; the .rec and .idx are checked anyway
    if (sidecar.records, sidecar.bytes, sidecar.sha256, sidecar.rec, sidecar.idx) != \
            (entry.records, entry.bytes, entry.sha256, entry.rec, entry.idx):
        return f"{store.where(entry.sidecar)}: changed since publication (differs from the manifest's entry)"
    size = store.size(entry.idx)
    if size is None:
        return f"{store.where(entry.idx)}: cannot read (missing)"
    if size != sidecar.idx_bytes:
        return f"{store.where(entry.idx)}: changed since publication ({size} bytes, published {sidecar.idx_bytes})"
    return None


def verify_store(store: Union[Store, str, os.PathLike]) -> tuple[Manifest, list[tuple[str, str]]]:
    """Check every published shard of the manifest and of every kept snapshot (size, sha256,
    index, framing, sidecar): no published file may have changed. (date, problem) pairs."""
    store = open_store(store)
    manifest = store.require_manifest()
    entries = {e.rec: e for e in manifest.shards}
    problems = []
    for generation in store.snapshot_generations():
        if generation == manifest.generation:
            continue
        name = snapshot_name(generation)
        try:
            snap = store.load_manifest(name)
            if snap is None:
                raise ManifestError(f"{store.where(name)}: no manifest (run `shardgen build` first)")
        except ManifestError as exc:
            problems.append(("-", str(exc)))
            continue
        for e in snap.shards:
            if entries.setdefault(e.rec, e) != e:
                problems.append((e.date, f"{store.where(name)}: lists {e.rec} with another "
                                         "size or sha256 than a newer generation (a published file was rewritten)"))
    for entry in sorted(entries.values(), key=lambda e: (e.date, e.rec)):
        problem = verify_shard(store, entry, manifest.schema) or _check_published_sidecar(store, entry)
        if problem:
            problems.append((entry.date, problem))
    return manifest, problems
