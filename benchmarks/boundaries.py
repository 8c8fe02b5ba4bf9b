"""``python -m benchmarks`` at epoch boundaries (issue 37): short epochs over 400 per-date shards, each ended
by ``reset()``, as a rolling window with frequent validation gives them. The stall and ``next()`` p99
beside the floor measured in the same run, ShardIter against stock ``ImageRecordIter`` on one file (both
reset every epoch), dates per batch against an exact shuffle, and the time spent in ``reset()`` itself."""

from __future__ import annotations

import datetime as dt
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.baselines import PoppedBatches
from benchmarks.measure import Loader, stall, throughput
from benchmarks.scale import randomness, stock_one_file
from benchmarks.stores import LABELS, LAYOUTS, C, T, concat_store, make_store, raw_rows, touch
from loader.shard_iter import ShardIter
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.publish import publish

__all__ = ["boundary_suite", "reset_cost"]


def _epochs_rate(store: Path, cache: Path, seconds: float, batch_size: int) -> dict:
    """Samples/s over whole epochs with a ``reset()`` at each end (at least ``seconds``)."""
    n, epochs = 0, 0
    with ShardIter(store, batch_size, shuffle=True, cache_dir=cache) as it:
        it.next()  # the first batch is ready: opening is not an epoch boundary
        t0 = time.perf_counter()
        while True:
            for b in it:
                touch(b.data + b.label)
                n += batch_size - b.pad
            epochs += 1
            if time.perf_counter() - t0 >= seconds:
                break
            it.reset()
        return {"samples_per_s": n / (time.perf_counter() - t0), "epochs": epochs}


def reset_cost(store: Path, cache: Path, batch_size: int, *, epochs: int, per_date: int) -> dict:
    """ms the caller spends in ``reset()`` after reading an epoch to its end: with the files unchanged, and
    after a new generation (a new date published in the rolling window, the oldest retired), as the
    watcher makes them."""
    same, new = [], []
    m = Manifest.load(store / MANIFEST_NAME)
    window, day = len(m.shards), dt.date.fromisoformat(m.shards[-1].date)
    with ShardIter(store, batch_size, shuffle=True, cache_dir=cache) as it:
        for epoch in range(2 * epochs):
            for b in it:
                touch(b.data)
            if epoch % 2:
                day += dt.timedelta(days=1)
                spec = sliding_windows(raw_rows(day, per_date + T - 1), day, time_steps=T, num_inputs=C,
                                       labels=LABELS)
                publish(store, m.schema, window, [write_shard(store, day, spec, None, m.schema, fsync=False).entry()])
            t0 = time.perf_counter()
            it.reset()
            (new if epoch % 2 else same).append(1000 * (time.perf_counter() - t0))
    return {"unchanged_ms": float(np.median(same)), "unchanged_max_ms": max(same),
            "new_generation_ms": float(np.median(new)), "new_generation_max_ms": max(new), "epochs": 2 * epochs}


def boundary_suite(workdir: Path, cache: Path, *, quick: bool, seconds: float, batch_size: int,
                   log: Callable[[str], None]) -> dict:
    n_dates, per = (12, 40) if quick else (400, 400)  # quick: that it runs, not speed
    store, out = workdir / f"boundaries_{n_dates}", {"shards": n_dates, "windows_per_shard": per}
    log(f"bench: epoch boundaries, {n_dates} shards of {per} windows")
    make_store(store, LAYOUTS["runs"], n_dates, n_dates * per)
    si = Loader("ShardIter", lambda: ShardIter(store, batch_size, shuffle=True, cache_dir=cache))
    with ShardIter(store, batch_size, shuffle=True, cache_dir=cache) as it:
        out["batches_per_epoch"] = it.batches_per_epoch
        kept = [[a.copy() for a in b.data + b.label] for b, _ in zip(it, range(8))]
    for a in kept:
        touch(a)
    # at least 3 epochs with reset() at each load: an epoch is batches_per_epoch steps
    r = throughput(si, batch_size, seconds)
    rate = r["samples_per_s"] / batch_size
    row, floor = {"samples_per_s": r["samples_per_s"]}, {}
    keep = Loader("batches popped from a list", lambda: PoppedBatches(kept, 200, batch_size))
    for key, load in (("stall_50", 0.5), ("stall_90", 0.9)):
        step = 1 / (load * rate)
        span = max(seconds, 3.2 * out["batches_per_epoch"] * step)  # at least 3 epochs, each ended by reset()
        row[key] = stall(si, step, span)
        floor[key] = stall(keep, step, span)  # the same consumer over batches built beforehand
    out["ShardIter"], out["floor"] = row, floor
    log("bench: epoch boundaries, ShardIter vs stock ImageRecordIter on one file (reset every epoch)")
    make_store(workdir / "boundaries_src", LAYOUTS["samples"], n_dates, n_dates * per)
    stock = concat_store(workdir / "boundaries_src", workdir / "boundaries_one")
    shutil.rmtree(workdir / "boundaries_src", ignore_errors=True)
    span = 2 * seconds
    # stock first and last, ShardIter twice between: the machine drifts by more than the ratio's margin
    stock_runs = [stock_one_file(*stock, span / 2)]
    runs = [_epochs_rate(store, cache, span / 2, batch_size) for _ in range(2)]
    stock_runs.append(stock_one_file(*stock, span / 2))
    shutil.rmtree(workdir / "boundaries_one", ignore_errors=True)
    out["rate"] = {"samples_per_s": float(np.mean([r["samples_per_s"] for r in runs])),
                   "epochs": sum(r["epochs"] for r in runs),
                   "stock_samples_per_s": float(np.mean([r["samples_per_s"] for r in stock_runs]))}
    out["randomness"] = randomness(store, cache, per, batch_size)
    log("bench: epoch boundaries, time in reset()")
    out["reset"] = reset_cost(store, cache, batch_size, epochs=3 if quick else 6, per_date=per)
    shutil.rmtree(store, ignore_errors=True)
    return out
