"""``shardgen verify``: no published file (of the manifest or of a kept snapshot) may have changed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from shardgen.errors import ManifestError, ShardError
from shardgen.format.check import check_shard
from shardgen.format.schema import Schema
from shardgen.store.manifest import Manifest, ShardEntry, Sidecar
from shardgen.store.naming import MANIFEST_NAME, snapshot_generations, snapshot_path

__all__ = ["verify_shard", "verify_store"]


def verify_shard(store: Path, entry: ShardEntry, schema: Schema, *, source: str = "the manifest") -> Optional[str]:
    """What is wrong with a shard (size, sha256, index, framing) against ``entry``, or None;
    ``source`` names where ``entry`` came from in the messages."""
    rec = Path(store) / entry.rec
    try:
        fd = os.open(rec, os.O_RDONLY)
    except OSError as exc:
        return f"{rec}: cannot read ({exc.strerror})"
    try:
        check_shard(fd, str(rec), str(Path(store) / entry.idx), entry, schema, verify="sha256", cache=False,
                    check_index=True)
    except ShardError as exc:
        return str(exc).replace("the manifest", source)
    finally:
        os.close(fd)
    return None


def _check_published_sidecar(store: Path, entry: ShardEntry) -> Optional[str]:
    """Whether the shard's sidecar and ``.idx`` are still what was published with it."""
    path = Path(store) / entry.sidecar if entry.sidecar else None
    try:
        sidecar = Sidecar.load(path) if path else None
    except ShardError as exc:
        return str(exc)
    if sidecar is None:
        return None  # adopted or older shards may have none; the .rec and .idx are checked anyway
    if (sidecar.records, sidecar.bytes, sidecar.sha256, sidecar.rec, sidecar.idx) != \
            (entry.records, entry.bytes, entry.sha256, entry.rec, entry.idx):
        return f"{path}: changed since publication (differs from the manifest's entry)"
    try:
        size = (Path(store) / entry.idx).stat().st_size
    except OSError as exc:
        return f"{Path(store) / entry.idx}: cannot read ({exc.strerror})"
    if size != sidecar.idx_bytes:
        return f"{Path(store) / entry.idx}: changed since publication ({size} bytes, published {sidecar.idx_bytes})"
    return None


def verify_store(store: Path) -> tuple[Manifest, list[tuple[str, str]]]:
    """Check every published shard of the manifest and of every kept snapshot (size, sha256,
    index, framing, sidecar): no published file may have changed. (date, problem) pairs."""
    store = Path(store)
    manifest = Manifest.load(store / MANIFEST_NAME)
    entries = {e.rec: e for e in manifest.shards}
    problems = []
    for generation in snapshot_generations(store):
        if generation == manifest.generation:
            continue
        try:
            snap = Manifest.load(snapshot_path(store, generation))
        except ManifestError as exc:
            problems.append(("-", str(exc)))
            continue
        for e in snap.shards:
            if entries.setdefault(e.rec, e) != e:
                problems.append((e.date, f"{snapshot_path(store, generation)}: lists {e.rec} with another "
                                         "size or sha256 than a newer generation (a published file was rewritten)"))
    for entry in sorted(entries.values(), key=lambda e: (e.date, e.rec)):
        problem = verify_shard(store, entry, manifest.schema) or _check_published_sidecar(store, entry)
        if problem:
            problems.append((entry.date, problem))
    return manifest, problems
