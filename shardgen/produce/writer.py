"""Write one date's windows as a shard: ``<date>.rec``, ``<date>.idx``, then ``<date>.json``.

The bytes come from :mod:`shardgen.format`: the layout's codec encodes the payloads,
``framing.frame_records`` frames them in bulk, ``index.shard_index_text`` writes the index. This
module publishes them: a hashing thread beside the writes, temp-and-rename, the sidecar last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Union

import numpy as np

from shardgen.errors import ShardError
from shardgen.format.framing import CHECKSUM, frame_records
from shardgen.format.index import shard_index_text
from shardgen.format.schema import Schema, day_number
from shardgen.fsutil import atomic_write, fsync_dir, link_new, write_temp
from shardgen.process import RunSpec, WindowSet, as_window_set
from shardgen.store import open_store
from shardgen.store.manifest import Manifest
from shardgen.store.naming import shard_paths
from shardgen.store.publish import publish
from shardgen.store.sidecar import Sidecar

__all__ = ["write_shard", "write_marker", "write_store", "shard_paths"]

log = logging.getLogger(__name__)


def _records(ws: WindowSet, schema: Schema, date: dt.date) -> tuple[int, Callable]:
    """How many records the date's windows make in the store's layout, and how to fill them."""
    try:
        return schema.codec.encode(ws, schema, day_number(date))
    except ValueError as exc:
        raise ShardError(f"{date}: {exc}") from None


MAX_VERSIONS = 1000  # an exclusive write tries this many names before it gives up


def write_shard(store: Path, date: dt.date, x: Union[np.ndarray, RunSpec, WindowSet],
                labels: Optional[Mapping[str, np.ndarray]], schema: Schema, *, fsync: bool = True,
                version: int = 1, exclusive: bool = False) -> Sidecar:
    """Pack and publish one shard's files (sidecar last); returns its sidecar.

    ``x`` is the windows ``(n, T, C)`` with ``labels``, or a ``RunSpec`` / checked ``WindowSet``
    (then ``labels`` is None). ``version`` > 1 names the files ``<date>.v<version>.*`` (a rewrite
    never replaces published files). ``exclusive`` (what ``build`` and ``watch`` use): a file is
    never written over; where a file of this version exists (another writer's, or what a killed
    run left), the shard takes the next free version, named in the sidecar it returns. Otherwise
    files of the same names are replaced (a store written from a notebook, tests).
    """
    ws = x if isinstance(x, WindowSet) else as_window_set(x, labels, schema, date)
    if ws.n == 0:
        raise ShardError(f"{date}: no windows (fewer rows than time_steps?); no shard written")
    paths = shard_paths(store, date, version)
    n_records, fill = _records(ws, schema, date)
    # sha256 is the slowest pass: a thread hashes each block as soon as it is packed, beside the
    # packing, the writes and the fsyncs (hashlib and file I/O release the GIL).
    digest, blocks = hashlib.sha256(), queue.SimpleQueue()

    def hash_blocks() -> None:
        for block in iter(blocks.get, None):
            digest.update(block)

    hasher = threading.Thread(target=hash_blocks, name="shard-sha256")
    hasher.start()
    temps: dict[str, Path] = {}
    try:
        try:
            packed = frame_records(n_records, fill, day_number(date), schema.record_floats, schema.image,
                                   on_block=blocks.put)
            idx = shard_index_text(packed.offsets)
            temps["rec"] = write_temp(paths["rec"], packed.chunks, fsync=fsync)
            temps["idx"] = write_temp(paths["idx"], idx, fsync=fsync)
        finally:
            blocks.put(None)
            hasher.join()
        if not packed.streamed:  # a split record changed the bytes after some blocks were hashed
            digest = hashlib.sha256()
            for chunk in packed.chunks:
                digest.update(chunk)
        sha256 = digest.hexdigest()
        for v in range(version, version + MAX_VERSIONS):
            paths = shard_paths(store, date, v)
            sidecar = Sidecar(date=date.isoformat(), records=packed.records, bytes=packed.size, sha256=sha256,
                              idx_bytes=len(idx), fingerprint=schema.fingerprint, rec=paths["rec"].name,
                              idx=paths["idx"].name, windows=ws.n, checksum=CHECKSUM)
            same = _already_there(paths, sidecar, idx) if exclusive else None
            if same is not None:  # these very bytes are published under this version already: nothing to write
                return same
            placed = _place(temps, paths, sidecar, schema, fsync=fsync, exclusive=exclusive)
            if placed is not None:
                return placed
            log.info("%s: version %d of the shard is taken (a file of it is there); writing version %d", date, v, v + 1)
        raise ShardError(f"{date}: {store}: versions {version}..{version + MAX_VERSIONS - 1} of the shard all "
                         "exist; remove what is not in the manifest")
    finally:
        for tmp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _already_there(paths: dict[str, Path], sidecar: Sidecar, idx: bytes) -> Optional[Sidecar]:
    """The sidecar of this version on disk if its files are byte for byte what ``sidecar`` and ``idx``
    describe (a date written again with the same windows), else None."""
    try:
        there = Sidecar.parse(paths["json"].read_bytes(), str(paths["json"]))
        if dataclasses.replace(there, distinct=None) != dataclasses.replace(sidecar, distinct=None):
            return None
        if paths["idx"].read_bytes() != idx or paths["rec"].stat().st_size != sidecar.bytes:
            return None
        digest = hashlib.sha256()
        with open(paths["rec"], "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except (OSError, ShardError):
        return None
    return there if digest.hexdigest() == sidecar.sha256 else None


def _place(temps: dict[str, Path], paths: dict[str, Path], sidecar: Sidecar, schema: Schema, *, fsync: bool,
           exclusive: bool) -> Optional[Sidecar]:
    """Give the temp files their names (``.rec``, ``.idx``), then write the sidecar; returns it.
    None, with nothing of this version left by us, if ``exclusive`` and any of its names is taken."""
    placed = []  # exclusive: the names we gave, removed again unless the sidecar follows
    try:
        for ext in ("rec", "idx"):
            if not exclusive:
                os.replace(temps[ext], paths[ext])
                continue
            if not link_new(temps[ext], paths[ext]):
                return None
            placed.append(paths[ext])
        if fsync:
            fsync_dir(paths["rec"].parent)
        text = json.dumps(sidecar.to_json(), sort_keys=True).encode()
        if exclusive:
            tmp = write_temp(paths["json"], text, fsync=fsync)
            try:
                if not link_new(tmp, paths["json"]):
                    return None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            if fsync:
                fsync_dir(paths["json"].parent)
        else:
            atomic_write(paths["json"], text, fsync=fsync)
        placed = []  # complete: a shard the manifest may list
        return sidecar
    finally:
        for path in placed:  # this version's files we named, never published (no sidecar): ours to remove
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def write_marker(store: Path, date: dt.date, schema: Schema, *, version: int = 1, exclusive: bool = False) -> str:
    """Write a date's empty marker (a sidecar of 0 records: the date has no windows); returns its
    name. ``exclusive``: never over a file there, as ``write_shard``."""
    for v in range(version, version + MAX_VERSIONS):
        path = shard_paths(store, date, v)["json"]
        marker = Sidecar(date.isoformat(), 0, 0, "", 0, schema.fingerprint, "", "")
        text = json.dumps(marker.to_json()).encode()
        if not exclusive:
            atomic_write(path, text)
            return path.name
        tmp = write_temp(path, text)
        try:
            if link_new(tmp, path):
                fsync_dir(path.parent)
                return path.name
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    raise ShardError(f"{date}: {store}: versions {version}..{version + MAX_VERSIONS - 1} of the shard all "
                     "exist; remove what is not in the manifest")


def write_store(store: Path, schema: Schema, shards: Iterable[tuple], *, window: int = 0,
                fsync: bool = True) -> Optional[Manifest]:
    """Write shards from windows already in hand and publish them as one generation: for stores
    made without a generator (tests, benchmarks, a notebook). ``shards`` yields ``(date, x,
    labels)`` as :func:`write_shard` takes them; returns the new manifest. A published file is never
    written over here either: a date written again takes the next version (``exclusive``)."""
    Path(store).mkdir(parents=True, exist_ok=True)
    with open_store(store).writer_lock("publish") as held:  # before any file: a refused writer leaves nothing
        entries = [write_shard(store, date, x, labels, schema, fsync=fsync, exclusive=True).entry()
                   for date, x, labels in shards]
        return publish(store, schema, window, entries, lock=held)
