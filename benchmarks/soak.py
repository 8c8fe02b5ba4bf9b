"""Soak for ``make bench``: one ``ShardIter`` reset every epoch for hundreds of epochs while new
generations are published, with RSS, open file descriptors and threads sampled along the way."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from pathlib import Path
from typing import Callable

from benchmarks.stores import LABELS, LAYOUTS, C, T, make_store, raw_rows
from benchmarks.subproc import json_from_subprocess
from loader.pipeline.memory import malloc_stats
from loader.shard_iter import ShardIter
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.publish import publish

__all__ = ["soak", "soak_in_subprocess", "rss_mb"]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _counts() -> tuple[int, int, float]:
    """Descriptors, threads and MB glibc has handed out (in use: what a leak grows; RSS also holds
    what glibc keeps free for reuse). In use is printed, not judged: it holds the queues (up to 16
    batches each) of whichever native readers are open at that moment, and moved by +-25 MB between
    samples with no trend in Python's own allocations (tracemalloc: +1.9 MB over epochs 100-300)."""
    stats = malloc_stats()
    return len(os.listdir("/proc/self/fd")), threading.active_count(), (stats["in_use"] / 2**20 if stats else 0.0)


def _sample(epoch: int, generation: int, recent: list) -> dict:
    """RSS now; memory in use, fds and threads as the least seen over the last 30 epochs (besides the plan's one
    descriptor per shard, the native readers hold 1-2 more .rec files open as they go: 32-35 over
    120 epochs of 25 shards, 33 most of the time; over 10 epochs the least still moved by +-1-2
    between runs with no trend). At any one instant a plan
    switch or a native reader being opened holds a few more for a moment; a leak raises the least)."""
    return {"epoch": epoch, "rss_mb": rss_mb(), "in_use_mb": min(m for _, _, m in recent),
            "fds": min(f for f, _, _ in recent), "threads": min(t for _, t, _ in recent), "generation": generation}


def soak(workdir: Path, cache: Path, *, epochs: int = 300, publish_every: int = 10, windows: int = 50_000,
         batch_size: int = 512, log: Callable[[str], None] = lambda m: None) -> dict:
    """A demo-sized store (25 dates, runs); every ``publish_every`` epochs a new date is written and
    published in a rolling window of 25 (the oldest retired), as ``shardgen watch`` does, so the
    iterator moves to a new plan (new files, new native readers). Samples at epochs 5, 100, ``epochs``."""
    store = workdir / "soak"
    _build_s, manifest = make_store(store, LAYOUTS["runs"], 25, windows)
    per_date, next_day = windows // 25, dt.date.fromisoformat(manifest.shards[-1].date)
    marks = sorted({5, min(100, epochs), epochs})
    out: dict = {"epochs": epochs, "publish_every": publish_every, "samples": []}
    t0 = time.perf_counter()
    with ShardIter(store, batch_size, cache_dir=cache) as it:
        out["planned_mb"] = it.memory["total"] / 2**20
        recent: list = []
        for epoch in range(1, epochs + 1):
            for _ in it:
                pass
            if epoch % publish_every == 0:
                next_day += dt.timedelta(days=1)
                spec = sliding_windows(raw_rows(next_day, per_date + T - 1), next_day, time_steps=T, num_inputs=C,
                                       labels=LABELS)
                schema = Manifest.load(store / MANIFEST_NAME).schema
                publish(store, schema, 25, [write_shard(store, next_day, spec, None, schema, fsync=False).entry()])
            it.reset()
            recent = (recent + [_counts()])[-30:]
            if epoch in marks:
                out["samples"].append(_sample(epoch, it.generation, recent))
                log(f"bench: soak epoch {epoch}: {out['samples'][-1]['rss_mb']:.0f} MB")
    out["seconds"] = time.perf_counter() - t0
    first, last = out["samples"][0], out["samples"][-1]
    out["rss_growth_pct"] = 100 * (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"]
    mid = out["samples"][1] if len(out["samples"]) > 2 else first
    out["rss_growth_after_100_pct"] = 100 * (last["rss_mb"] - mid["rss_mb"]) / mid["rss_mb"]
    out["fds_delta"] = last["fds"] - mid["fds"]  # once running (epoch 100 on): no growth allowed
    out["threads_delta"] = last["threads"] - mid["threads"]
    return out


def soak_in_subprocess(workdir: Path, cache: Path, **kw: object) -> dict:
    """``soak`` in a fresh interpreter, so its RSS is the iterator's and not the rest of the bench's."""
    return json_from_subprocess("import json, sys; from pathlib import Path; from benchmarks.soak import soak; "
                                f"print(json.dumps(soak(Path({str(workdir)!r}), Path({str(cache)!r}), **{kw!r})))",
                                "soak")
