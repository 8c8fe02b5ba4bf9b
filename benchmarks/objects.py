"""Training from a store on an S3-compatible server on loopback (``rclone serve s3``), issue 36:

* a cold epoch from S3 against a cold epoch from the same store on local disk, both timed from
  ``ShardIter(...)`` to the last batch (so the download counts), and the time to the first batch;
  the same first batch from a store 10x larger;
* the bytes each of 4 parts downloads, against a quarter of the store;
* distinct dates per batch with ``cache_limit`` at 10%, 25%, 50% and 100% of the part, against
  an exact shuffle."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.scale import randomness
from benchmarks.stores import LAYOUTS, evict, make_store, touch
from loader.shard_iter import ShardIter
from shardgen.store import objstore
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["object_store_suite"]

ROOT = Path(__file__).resolve().parent.parent


def _epoch(manifest, batch_size: int, **kw) -> dict:
    t0 = time.perf_counter()
    it = ShardIter(manifest, batch_size, shuffle=True, **kw)
    first, n = None, 0
    for b in it:
        touch(list(b.data) + list(b.label))
        if first is None:
            first = time.perf_counter() - t0
        n += batch_size - b.pad
    wall = time.perf_counter() - t0
    it.close()
    return {"samples": n, "wall_s": wall, "first_batch_s": first, "samples_per_s": n / wall}


def _upload(server, store: Path, prefix: str) -> tuple[int, float]:
    """The store's files into ``prefix`` (the manifest last); (bytes, seconds)."""
    remote = objstore.ObjectStore(server.url(prefix))
    files = sorted((p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")
                    and "leases" not in p.parts),
                   key=lambda p: (p.name == "manifest.json", "generations" in p.parts))
    t0 = time.perf_counter()
    for path in files:
        remote.upload(path.relative_to(store).as_posix(), path)
    return sum(p.stat().st_size for p in files), time.perf_counter() - t0


def _cold_pair(server, store: Path, prefix: str, workdir: Path, batch_size: int, cache: Path) -> dict:
    """A cold epoch from local disk and from S3 into an empty cache, then from S3 again (cached)."""
    size, upload_s = _upload(server, store, prefix)
    evict(store)
    local = _epoch(store, batch_size, cache_dir=cache)
    local_warm = _epoch(store, batch_size, cache_dir=cache)
    objects = workdir / f"object-cache-{prefix}"
    shutil.rmtree(objects, ignore_errors=True)
    s3 = _epoch(server.url(prefix) + "/manifest.json", batch_size, cache_dir=objects)
    warm = _epoch(server.url(prefix), batch_size, cache_dir=objects)  # everything cached: no download
    shutil.rmtree(objects, ignore_errors=True)
    return {"bytes": size, "upload_s": upload_s, "local_cold": local, "s3_cold": s3, "s3_cached": warm,
            "local_warm": local_warm, "warm_ratio": warm["samples_per_s"] / local_warm["samples_per_s"],
            "ratio": s3["samples_per_s"] / local["samples_per_s"],
            "first_batch_ratio": s3["first_batch_s"] / local["first_batch_s"]}


def _parts(server, store: Path, prefix: str, workdir: Path, batch_size: int, parts: int = 4) -> dict:
    """Bytes each of ``parts`` workers downloads (an empty cache each), against the store / parts and
    the shards straddling the part's bounds."""
    m = Manifest.load(store / MANIFEST_NAME)
    total = sum(s.bytes for s in m.shards)
    cum = np.cumsum([0] + [s.samples for s in m.shards])
    out = []
    for p in range(parts):
        objects = workdir / f"object-cache-part{p}"
        shutil.rmtree(objects, ignore_errors=True)
        with ShardIter(server.url(prefix), batch_size, num_parts=parts, part_index=p, cache_dir=objects) as it:
            for _ in it:
                pass
            got = it.stats["downloaded_bytes"]
        shutil.rmtree(objects, ignore_errors=True)
        lo, hi = p * cum[-1] // parts, (p + 1) * cum[-1] // parts
        straddling = sum(s.bytes for s, a, b in zip(m.shards, cum[:-1], cum[1:]) if a < lo < b or a < hi < b)
        out.append({"bytes": got, "allowed": total / parts + straddling})
    return {"store_bytes": total, "parts": out,
            "worst": max(o["bytes"] / o["allowed"] for o in out),
            "per_worker_of_store": max(o["bytes"] for o in out) / total}


def _resume(server, store: Path, prefix: str, workdir: Path, batch_size: int, at: float = 0.6) -> dict:
    """Bytes a resume at ``at`` of an epoch downloads (a new cache, ``cache_limit`` half the store or
    the least it may be)
    up to the epoch's end, against the shards the rest of the epoch reads plus one feed group (the
    next epoch's feed fetches once this one's has fetched its last)."""
    from loader.pipeline.job import order_spec
    from loader.pipeline.order import EpochOrder, Phase, remainder

    shards = Manifest.load(store / MANIFEST_NAME).shards
    total = sum(s.bytes for s in shards)
    kw = dict(cache_limit=max(total // 2, 4 * max(s.bytes for s in shards) + (1 << 20)), shuffle=True)
    with ShardIter(server.url(prefix), batch_size, cache_dir=workdir / "resume-a", **kw) as it:
        k = int(it.batches_per_epoch * at)
        for _ in range(k):
            it.next()
        state = it.state_dict()
        order = EpochOrder([s.samples for s in shards], order_spec(it.reader.params), 0)
        group = it.reader.pipeline.cap
    rest = sum(shards[i].bytes for i in order.shards_of(remainder(order.total, [Phase(1, batch_size, k)])))
    t0 = time.perf_counter()
    with ShardIter(server.url(prefix), batch_size, cache_dir=workdir / "resume-b", **kw) as it:
        it.load_state_dict(state)
        first = time.perf_counter() - t0
        for _ in it:
            pass
        got = it.stats["downloaded_bytes"]
    for d in ("resume-a", "resume-b"):
        shutil.rmtree(workdir / d, ignore_errors=True)
    return {"store_bytes": total, "rest_bytes": rest, "group_bytes": group, "downloaded": got, "first_batch_s": first,
            "ratio": got / (rest + group)}


def _quality(server, store: Path, prefix: str, workdir: Path, per_date: int, batch_size: int) -> dict:
    """Distinct dates per batch (one part, one epoch) with ``cache_limit`` a fraction of the part; and
    at 25% with a shuffle buffer holding half the part."""
    shards = Manifest.load(store / MANIFEST_NAME).shards
    total = sum(s.bytes for s in shards)
    out = {}
    objects = workdir / "object-cache-quality"
    least = 3 * max(s.bytes for s in shards) + (1 << 20)  # what a limit must hold (a quick store's shards are large)
    r = randomness(store, objects, per_date, batch_size, url=server.url(prefix),
                   cache_limit=max(int(0.25 * total), least), shuffle_buffer=sum(s.records for s in shards) // 2)
    out["half_buffer_0.25"] = r["dates_per_batch"] / r["exact_dates_per_batch"]
    for frac in (0.1, 0.25, 0.5, 1.0):
        objects = workdir / "object-cache-quality"
        shutil.rmtree(objects, ignore_errors=True)
        r = randomness(store, objects, per_date, batch_size, url=server.url(prefix),
                       cache_limit=max(int(frac * total) + (1 << 20), least))
        out[f"{frac:g}"] = r["dates_per_batch"] / r["exact_dates_per_batch"]
        out["exact_dates_per_batch"] = r["exact_dates_per_batch"]
        out[f"dates_per_batch_{frac:g}"] = r["dates_per_batch"]
    shutil.rmtree(workdir / "object-cache-quality", ignore_errors=True)
    return out


def object_store_suite(store: Path, workdir: Path, batch_size: int, cache: Path, *, quick: bool,
                       log: Callable[[str], None]) -> dict:
    """Every object-store row (the module docstring); ``store`` is the bench's main store."""
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import S3Server  # noqa: E402 - the tests' loopback server

    saved = {k: os.environ.get(k) for k in S3Server(workdir / "s3probe").env()}
    server = S3Server(workdir / "s3root").start()
    try:
        os.environ.update(server.env())
        objstore.forget_clients()
        out = _cold_pair(server, store, "bench", workdir, batch_size, cache)
        m = Manifest.load(store / MANIFEST_NAME)
        n_dates, windows = len(m.shards), sum(s.samples for s in m.shards)
        log(f"bench: S3, a store 10x larger ({10 * n_dates} dates)")
        big = workdir / "store_10x"
        make_store(big, LAYOUTS["runs"], 10 * n_dates, 10 * windows)
        out["x10"] = _cold_pair(server, big, "bench10", workdir, batch_size, cache)
        shutil.rmtree(big, ignore_errors=True)
        out["first_batch_10x_ratio"] = out["x10"]["s3_cold"]["first_batch_s"] / out["s3_cold"]["first_batch_s"]
        log("bench: S3, bytes per worker of 4")
        out["parts"] = _parts(server, store, "bench", workdir, batch_size)
        log("bench: S3, a resume at 60% of an epoch")
        out["resume"] = _resume(server, store, "bench", workdir, batch_size)
        n_q, per_q = (40, 100) if quick else (400, 400)
        log(f"bench: S3, dates per batch with a cache of 10-100% of the part ({n_q} dates)")
        qstore = workdir / "store_quality"
        make_store(qstore, LAYOUTS["runs"], n_q, n_q * per_q)
        _upload(server, qstore, "quality")
        out["quality"] = _quality(server, qstore, "quality", workdir, per_q, batch_size)
        shutil.rmtree(qstore, ignore_errors=True)
        return out
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        objstore.forget_clients()
