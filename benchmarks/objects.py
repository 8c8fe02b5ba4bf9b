"""A cold epoch from a store on an S3-compatible server on loopback (``rclone serve s3``), against a
cold epoch from the same store on local disk, both timed from ``ShardIter(...)`` to the last batch
(so the download counts), and the time to the first batch."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.stores import evict, touch
from loader.shard_iter import ShardIter
from shardgen.store import objstore

__all__ = ["object_store_epoch"]

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


def object_store_epoch(store: Path, workdir: Path, batch_size: int, cache: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import S3Server  # noqa: E402 - the tests' loopback server

    saved = {k: os.environ.get(k) for k in S3Server(workdir / "s3probe").env()}
    server = S3Server(workdir / "s3root").start()
    try:
        os.environ.update(server.env())
        objstore.forget_clients()
        remote = objstore.ObjectStore(server.url("bench"))
        files = sorted((p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")
                        and "leases" not in p.parts),
                       key=lambda p: (p.name == "manifest.json", "generations" in p.parts))
        t0 = time.perf_counter()
        for path in files:
            remote.upload(path.relative_to(store).as_posix(), path)
        upload_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in files)
        evict(store)
        local = _epoch(store, batch_size, cache_dir=cache)
        objects = workdir / "object-cache"
        shutil.rmtree(objects, ignore_errors=True)
        s3 = _epoch(server.url("bench") + "/manifest.json", batch_size, cache_dir=objects)
        warm = _epoch(server.url("bench"), batch_size, cache_dir=objects)  # everything cached: no download
        return {"bytes": size, "upload_s": upload_s, "local_cold": local, "s3_cold": s3, "s3_cached": warm,
                "ratio": s3["samples_per_s"] / local["samples_per_s"]}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        objstore.forget_clients()
