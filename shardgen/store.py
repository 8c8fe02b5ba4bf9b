"""A shard store on disk: publishing into the manifest (rolling window), verify and status."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from .errors import ConfigError, ShardError
from .layout import MAGIC, Schema
from .lock import MANIFEST_LOCK, StoreLock
from .manifest import MANIFEST_NAME, Manifest, RetiredEntry, ShardEntry, Sidecar, parse_utc, utc_now
from .watchstate import load_state

__all__ = ["open_manifest", "publish", "verify_shard", "verify_store", "status", "read_idx_offsets",
           "check_sidecar"]

log = logging.getLogger(__name__)


def open_manifest(store: Path, schema: Schema, window: int) -> Manifest:
    """The store's manifest, or an empty generation-0 one; ConfigError if the schema differs."""
    path = Path(store) / MANIFEST_NAME
    if not path.exists():
        return Manifest(schema=schema, window=window)
    manifest = Manifest.load(path)
    if manifest.schema.fingerprint != schema.fingerprint:
        raise ConfigError(
            f"{path}: the store holds schema {manifest.schema.fingerprint} but the config gives "
            f"{schema.fingerprint}; use a new store.dir for a new schema")
    return manifest


def publish(store: Path, schema: Schema, window: int, entries: Iterable[ShardEntry]) -> Optional[Manifest]:
    """Add or replace shards under the manifest lock, apply the window; the new manifest or None."""
    store = Path(store)
    entries = list(entries)
    with StoreLock(store / MANIFEST_LOCK, what="manifest"):
        old = open_manifest(store, schema, window)
        shards = {s.date: s for s in old.shards}
        shards.update({e.date: e for e in entries})
        dates = sorted(shards)
        keep = dates[-window:] if window else dates
        retired = {r.date: r for r in old.retired if r.date not in keep}
        now = utc_now()
        for date in dates[: len(dates) - len(keep)]:
            s = shards[date]
            if date not in retired:
                retired[date] = RetiredEntry(date, s.rec, s.idx, now, old.generation + 1)
        new = replace(old, window=window, shards=tuple(shards[d] for d in keep),
                      retired=tuple(retired[d] for d in sorted(retired)))
        if new.shards == old.shards and new.retired == old.retired and new.window == old.window:
            return None
        saved = new.save(store / MANIFEST_NAME)
    for r in saved.retired:
        if r.retired_generation == saved.generation:
            log.info("retired %s (left the %d-date window)", r.date, window)
    return saved


def read_idx_offsets(path: Path) -> np.ndarray:
    """Offsets of an MXNet text index (``key\\toffset`` lines); ShardError if malformed."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ShardError(f"{path}: cannot read index ({exc.strerror})") from None
    try:
        pairs = np.array(text.split(), dtype=np.int64).reshape(-1, 2)
    except ValueError:
        raise ShardError(f"{path}: malformed index (expected 'key<TAB>offset' lines)") from None
    return pairs[:, 1]


def check_sidecar(store: Path, sidecar: Sidecar, fingerprint: str) -> Optional[str]:
    """Why a shard described by its sidecar is not usable, or None if sizes and schema match."""
    if sidecar.fingerprint != fingerprint:
        return f"schema fingerprint {sidecar.fingerprint}, expected {fingerprint}"
    for name, size in ((sidecar.rec, sidecar.bytes), (sidecar.idx, sidecar.idx_bytes)):
        try:
            actual = (Path(store) / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, expected {size}"
    return None


def _check_records(data: memoryview, offsets: np.ndarray, schema: Schema) -> Optional[str]:
    """Every record framed right and of ``record_floats`` floats; None when all are."""
    size = len(data)
    ends = np.append(offsets[1:], size)
    if len(offsets) and (offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= size):
        return "index offsets are not increasing within the file"
    rb = schema.record_bytes
    if (ends - offsets == rb).all() and size == rb * len(offsets):
        words = np.frombuffer(data, dtype="<u4").reshape(len(offsets), rb // 4)
        bad = np.flatnonzero((words[:, 0] != MAGIC) | (words[:, 2] != schema.record_floats))
        return f"record {bad[0]} is not a {schema.record_floats}-float record" if bad.size else None
    buf = bytes(data)
    for i, (start, end) in enumerate(zip(offsets.tolist(), ends.tolist())):
        pos, body = start, b""
        while True:
            magic, lrec = np.frombuffer(buf, "<u4", 2, pos)
            cflag, length = int(lrec) >> 29, int(lrec) & ((1 << 29) - 1)
            if magic != MAGIC:
                return f"record {i}: bad magic at byte {pos}"
            body += buf[pos + 8: pos + 8 + length]
            pos += 8 + length + (-length % 4)
            if cflag in (0, 3):
                break
            body += np.uint32(MAGIC).tobytes()
        if pos != end:
            return f"record {i} spans {pos - start} bytes, the index says {end - start}"
        if int(np.frombuffer(body, "<u4", 1)[0]) != schema.record_floats:
            return f"record {i} has a header flag other than {schema.record_floats}"
    return None


def verify_shard(store: Path, entry: ShardEntry, schema: Schema, *, source: str = "the manifest") -> Optional[str]:
    """What is wrong with a shard (size, sha256, index, framing) against ``entry``, or None;
    ``source`` names where ``entry`` came from in the messages."""
    rec = Path(store) / entry.rec
    try:
        data = rec.read_bytes()
    except OSError as exc:
        return f"{rec}: cannot read ({exc.strerror})"
    if len(data) != entry.bytes:
        return f"{rec}: {len(data)} bytes, {source} says {entry.bytes}"
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        return f"{rec}: sha256 differs from {source}"
    try:
        offsets = read_idx_offsets(Path(store) / entry.idx)
    except ShardError as exc:
        return str(exc)
    if len(offsets) != entry.records:
        return f"{entry.idx}: {len(offsets)} records, {source} says {entry.records}"
    problem = _check_records(memoryview(data), offsets, schema)
    return f"{rec}: {problem}" if problem else None


def verify_store(store: Path) -> tuple[Manifest, list[tuple[str, str]]]:
    """Check every published shard; returns the manifest and (date, problem) pairs."""
    manifest = Manifest.load(Path(store) / MANIFEST_NAME)
    problems = []
    for entry in manifest.shards:
        problem = verify_shard(store, entry, manifest.schema)
        if problem:
            problems.append((entry.date, problem))
    return manifest, problems


def status(store: Path, *, today: Optional[dt.date] = None) -> dict:
    """A summary of the manifest, as ``shardgen status --json`` prints it."""
    path = Path(store) / MANIFEST_NAME
    m = Manifest.load(path)
    today = today or dt.date.today()
    age = None
    if m.updated:
        age = round((dt.datetime.now(dt.timezone.utc) - parse_utc(m.updated)).total_seconds(), 1)
    last = m.shards[-1].date if m.shards else None
    watch = load_state(store) or {}
    return {
        "manifest": str(path),
        "generation": m.generation,
        "shards": len(m.shards),
        "records": m.records,
        "bytes": m.bytes,
        "first_date": m.shards[0].date if m.shards else None,
        "last_date": last,
        "lag_days": (today - dt.date.fromisoformat(last)).days if last else None,
        "window": m.window,
        "retired": len(m.retired),
        "updated": m.updated,
        "age_s": age,
        "schema": m.schema.to_json(),
        "watch_updated": watch.get("updated"),  # the watcher's last cycle (None: no watcher state)
        "failing": watch.get("failing", []),  # date, kind, attempts, error, next_retry
    }


def dumps(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, indent=1)
