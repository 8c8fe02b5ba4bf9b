"""``shardgen verify``: no published file may have changed.

The files a store publishes: ``manifest.json``; every kept snapshot ``generations/<N>.json`` up to
the manifest's generation (each must parse and hold generation ``N``; the newest, which a reader
pinned to that generation or a ``for_kvstore`` job opens, must be there and hold what
``manifest.json`` holds); and every shard that the manifest or a kept snapshot lists: its ``.rec``
(size, sha256, the framing and payload checks the loader applies), its ``.idx`` (byte for byte the
index of the ``.rec``'s records, as MXNet writes it) and its sidecar (what the manifest's entry
says, the manifest's schema). A snapshot numbered past the manifest's generation was never
published (a writer killed before ``manifest.json`` named it) and is not checked.

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
from shardgen.store.manifest import FORMAT, Manifest, ShardEntry, declared_format
from shardgen.store.naming import MANIFEST_NAME, snapshot_name

__all__ = ["verify_shard", "verify_store", "check_snapshot", "newest_snapshot_problem"]


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
    """What is wrong with a shard's ``.rec`` or ``.idx`` in the store (size, sha256, framing, the
    index byte for byte) against ``entry``, or None; ``source`` names where ``entry`` came from."""
    store = open_store(store)
    with store.local_files([entry.rec, entry.idx]) as folder:
        problem = _check_files(folder, entry, schema, source)
    return problem.replace(str(folder), store.where()) if problem else None


def _check_published_sidecar(store: Store, entry: ShardEntry, schema: Schema, idx_sound: bool) -> Optional[str]:
    """What is wrong with the shard's sidecar: it must be there and say what the manifest's entry
    says, with the manifest's schema (and, when the ``.idx`` is sound, its size)."""
    where = store.where(entry.sidecar)
    try:
        sidecar = store.read_sidecar(entry.sidecar)
    except ShardError as exc:
        return str(exc)
    if sidecar is None:
        return f"{where}: missing (every shard is published with its sidecar, which marks it complete)"
    differ = sidecar.differences(entry, schema.fingerprint)
    if differ:
        return f"{where}: changed since publication ({'; '.join(differ)})"
    if idx_sound:
        size = store.size(entry.idx)
        if size is not None and size != sidecar.idx_bytes:
            return f"{where}: changed since publication (idx_bytes {sidecar.idx_bytes}, the sound .idx has {size})"
    return None


def _differences(snap: Manifest, manifest: Manifest) -> list[str]:
    """What differs between two manifests, by key (and by date for the shards)."""
    a, b = snap.to_json(), manifest.to_json()
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        if key == "shards":
            mine = {s.date: s for s in snap.shards}
            theirs = {s.date: s for s in manifest.shards}
            dates = sorted(d for d in set(mine) | set(theirs) if mine.get(d) != theirs.get(d))
            out.append("the shards of " + ", ".join(dates[:3]) + (", ..." if len(dates) > 3 else ""))
        else:
            out.append(key)
    return out


def check_snapshot(store: Store, generation: int, manifest: Optional[Manifest] = None
                   ) -> tuple[Optional[Manifest], Optional[str]]:
    """The kept snapshot of ``generation`` (None: not there) and what is wrong with it (None:
    sound): it must parse and hold that generation and, given the ``manifest`` that names it,
    hold what ``manifest.json`` holds."""
    name = snapshot_name(generation)
    try:
        snap = store.load_manifest(name)
    except ManifestError as exc:
        return None, f"{exc} (a reader of generation {generation} fails on it)"
    if snap is not None and snap.generation != generation:
        return snap, f"{store.where(name)}: holds generation {snap.generation}, expected {generation}"
    if snap is not None and manifest is not None and snap != manifest:
        return snap, (f"{store.where(name)}: differs from {MANIFEST_NAME}, which is a copy of it "
                      f"({', '.join(_differences(snap, manifest))}); one of them changed after publication")
    return snap, None


def newest_snapshot_problem(store: Store, manifest: Manifest, fmt: Optional[str]) -> Optional[str]:
    """What is wrong with the snapshot of the manifest's own generation, or None. ``fmt`` is the
    format ``manifest.json`` declares: a ``shardgen/1`` store has no snapshots."""
    if fmt != FORMAT or not manifest.generation:
        return None
    snap, problem = check_snapshot(store, manifest.generation, manifest)
    if snap is None and problem is None:
        now = store.load_manifest()
        if now is not None and now.generation != manifest.generation:
            return None  # a newer generation was published meanwhile (and this one collected)
        problem = (f"{store.where(snapshot_name(manifest.generation))}: missing, though {MANIFEST_NAME} names "
                   f"generation {manifest.generation} (a reader pinned to it fails once a newer one is published)")
    return problem


def verify_store(store: Union[Store, str, os.PathLike]) -> tuple[Manifest, list[tuple[str, str]]]:
    """Check every file the store publishes (see the module's docstring): ``manifest.json``, the
    kept snapshots, and the ``.rec``, ``.idx`` and sidecar of every shard the manifest or a kept
    snapshot lists. (date, problem) pairs; the date is "-" for a manifest or snapshot."""
    store = open_store(store)
    data = store.manifest_bytes()
    if data is None:
        raise store.no_manifest()
    manifest = Manifest.parse(data, store.where(MANIFEST_NAME))
    entries = {e.rec: e for e in manifest.shards}
    problems = []
    newest = newest_snapshot_problem(store, manifest, declared_format(data))
    if newest:
        problems.append(("-", newest))
    for generation in store.snapshot_generations():
        if generation >= manifest.generation:
            continue  # the newest is checked above; a later one was never published
        name = snapshot_name(generation)
        snap, problem = check_snapshot(store, generation)
        if problem:
            problems.append(("-", problem))
            continue
        for e in snap.shards if snap is not None else ():  # None: collected meanwhile
            if entries.setdefault(e.rec, e) != e:
                problems.append((e.date, f"{store.where(name)}: lists {e.rec} with another "
                                         "size or sha256 than a newer generation (a published file was rewritten)"))
    for entry in sorted(entries.values(), key=lambda e: (e.date, e.rec)):
        files = verify_shard(store, entry, manifest.schema)
        side = _check_published_sidecar(store, entry, manifest.schema, files is None)
        problems += [(entry.date, p) for p in (files, side) if p]
    return manifest, problems
