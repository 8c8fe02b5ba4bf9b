"""``python -m benchmarks`` at scale: record layouts, many shards, stock MXNet on one file, randomness of
the shuffle buffer, parallel readers, resumption, and open/reset at 2M records. Every figure is
measured in the same run as the baseline it is compared with."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import mxnet as mx
import numpy as np

from loader.native import quiet_native_info
from loader.plan import default_cache_dir
from loader.shard_iter import ShardIter
from shardgen.layout import LabelSpec, Layout, Schema
from shardgen.manifest import MANIFEST_NAME, Manifest
from shardgen.process import sliding_windows
from shardgen.store import publish
from shardgen.writer import write_shard

__all__ = ["LAYOUTS", "make_store", "shuffled_rate", "stock_one_file", "randomness", "scale_suite"]

T, C = 60, 32
LABELS = [LabelSpec("bd_return", 1), LabelSpec("eval_y", 4)]
RUN_PACK = 64
LAYOUTS = {"samples": Layout(), "windows": Layout("windows", 8), "runs": Layout("runs", RUN_PACK, T + RUN_PACK - 1)}


def _raw(date: dt.date, rows: int) -> np.ndarray:
    """Rows of one date; feature 0 is the row number, so a window's start can be read back."""
    rng = np.random.default_rng(date.toordinal())
    raw = rng.standard_normal((rows, C + 5), dtype=np.float32)
    raw[:, 0] = np.arange(rows)
    return raw


def make_store(folder: Path, layout: Layout, n_dates: int, windows: int) -> tuple[float, Manifest]:
    """``windows`` stride-1 windows over ``n_dates`` dates in ``layout``; (build seconds, manifest)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=layout)
    per = windows // n_dates
    t0, entries = time.perf_counter(), []
    for i in range(n_dates):
        date = dt.date(2023, 1, 2) + dt.timedelta(days=i)
        spec = sliding_windows(_raw(date, per + T - 1), date, time_steps=T, num_inputs=C, labels=LABELS)
        entries.append(write_shard(folder, date, spec, None, schema, fsync=False).entry())
    publish(folder, schema, 0, entries)
    return time.perf_counter() - t0, Manifest.load(folder / MANIFEST_NAME)


def _drain(it: ShardIter, seconds: float, on_batch: Callable = lambda b: None) -> float:
    """Samples/s over whole epochs (at least one), every array waited on."""
    n, t0 = 0, time.perf_counter()
    while True:
        for b in it:
            for a in b.data + b.label:
                a.wait_to_read()
            on_batch(b)
            n += it.batch_size - b.pad
        if time.perf_counter() - t0 >= seconds:
            return n / (time.perf_counter() - t0)
        it.reset()


def shuffled_rate(store: Path, cache: Path, seconds: float, batch_size: int = 512, **kw) -> float:
    with ShardIter(store, batch_size, shuffle=True, cache_dir=cache, **kw) as it:
        it.next()  # the first batch is ready: opening is measured elsewhere
        return _drain(it, seconds)


def evict(store: Path) -> None:
    for path in store.glob("*.rec"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_rate(store: Path, cache: Path, batch_size: int = 512) -> float:
    evict(store)
    t0 = time.perf_counter()
    with ShardIter(store, batch_size, shuffle=True, cache_dir=cache) as it:
        n = sum(batch_size - b.pad for b in it)
    return n / (time.perf_counter() - t0)


def concat_store(manifest_dir: Path, out: Path) -> tuple[str, str, int]:
    """The store's shards as ONE .rec with its .idx (stock MXNet's best case)."""
    m = Manifest.load(manifest_dir / MANIFEST_NAME)
    out.mkdir(parents=True, exist_ok=True)
    lines, base, key = [], 0, 0
    with open(out / "all.rec", "wb") as fh:
        for s in m.shards:
            fh.write((manifest_dir / s.rec).read_bytes())
            for line in (manifest_dir / s.idx).read_text().split("\n"):
                if line:
                    lines.append(f"{key}\t{int(line.split()[1]) + base}\n")
                    key += 1
            base += s.bytes
    (out / "all.idx").write_text("".join(lines))
    return str(out / "all.rec"), str(out / "all.idx"), m.schema.record_floats


def stock_one_file(rec: str, idx: str, floats: int, seconds: float, batch_size: int = 512) -> dict:
    """Stock ``ImageRecordIter``, shuffled, one sample per record, one file: (open s, samples/s)."""
    t0 = time.perf_counter()
    it = mx.io.ImageRecordIter(path_imgrec=rec, path_imgidx=idx, data_shape=(1, 1, 1), label_width=floats,
                               batch_size=batch_size, shuffle=True, round_batch=False, preprocess_threads=4,
                               prefetch_buffer=4)
    opened = time.perf_counter() - t0
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        it.reset()
        while it.iter_next():
            it.getlabel().wait_to_read()
            n += batch_size
    rate = n / (time.perf_counter() - t0)
    del it
    return {"open_s": opened, "samples_per_s": rate}


def randomness(store: Path, cache: Path, per_date: int, batch_size: int = 512, seed: int = 0) -> dict:
    """Distinct dates per batch, and windows per (batch, run), against an exact shuffle."""
    dates_seen, per_run = [], []

    def on_batch(b) -> None:
        n = batch_size - b.pad
        day = b.label[-1].asnumpy()[:n]
        start = b.data[0].asnumpy()[:n, 0, 0]
        dates_seen.append(len(np.unique(day)))
        runs = np.unique(day.astype(np.int64) * 1_000_000 + start.astype(np.int64) // RUN_PACK)
        per_run.append(n / len(runs))

    with ShardIter(store, batch_size, shuffle=True, seed=seed, cache_dir=cache) as it:
        for b in it:
            on_batch(b)
    m = Manifest.load(store / MANIFEST_NAME)
    days = np.repeat(np.arange(len(m.shards)), per_date)
    starts = np.tile(np.arange(per_date), len(m.shards))
    perm = np.random.default_rng(seed).permutation(len(days))
    ex_dates, ex_runs = [], []
    for b0 in range(0, len(perm) - batch_size + 1, batch_size):
        sel = perm[b0:b0 + batch_size]
        ex_dates.append(len(np.unique(days[sel])))
        ex_runs.append(batch_size / len(np.unique(days[sel] * 1_000_000 + starts[sel] // RUN_PACK)))
    return {"dates_per_batch": float(np.mean(dates_seen)), "exact_dates_per_batch": float(np.mean(ex_dates)),
            "windows_per_run_per_batch": float(np.mean(per_run)),
            "exact_windows_per_run_per_batch": float(np.mean(ex_runs))}


def resume_cost(store: Path, cache: Path, batch_size: int = 512, at: float = 0.9) -> dict:
    """Seconds to read to ``at`` of an epoch, against resuming there from ``state_dict()``."""
    it = ShardIter(store, batch_size, shuffle=True, cache_dir=cache)
    k = int(it.batches_per_epoch * at)
    t0 = time.perf_counter()
    for _ in range(k):
        for a in it.next().data:
            a.wait_to_read()
    read = time.perf_counter() - t0
    state = it.state_dict()
    it.close()
    t0 = time.perf_counter()
    it = ShardIter(store, batch_size, shuffle=True, cache_dir=cache)
    it.load_state_dict(state)
    it.next().data[0].wait_to_read()
    resumed = time.perf_counter() - t0
    it.close()
    return {"read_to_s": read, "resume_s": resumed, "ratio": resumed / read, "batches": k}


def open_reset(folder: Path, cache: Path, records: int, n_dates: int = 200) -> dict:
    """Open and reset at ``records`` small one-sample records, against stock MXNet opening them."""
    schema = Schema.create(time_steps=1, num_inputs=1, data_name="seq_var", labels=[LabelSpec("a", 1)])
    store = folder / "many"
    if not (store / MANIFEST_NAME).exists():
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)
        per, entries = records // n_dates, []
        for i in range(n_dates):
            date = dt.date(2022, 1, 1) + dt.timedelta(days=i)
            x = np.arange(per, dtype=np.float32).reshape(per, 1, 1)
            entries.append(write_shard(store, date, x, {"a": x[:, 0, 0].copy()}, schema, fsync=False).entry())
        publish(store, schema, 0, entries)
    rec, idx, floats = concat_store(store, folder / "many_one")
    t0 = time.perf_counter()
    it = ShardIter(store, 512, cache_dir=cache)
    it.next()
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    it.reset()
    it.next()
    reset = time.perf_counter() - t0
    it.close()
    t0 = time.perf_counter()
    paths = ";".join(str(store / s.rec) for s in Manifest.load(store / MANIFEST_NAME).shards)
    combined = folder / "many_comb.idx"
    shutil.copy(idx, combined)
    with quiet_native_info():  # MXNet's INFO line lists every path
        stock = mx.io.ImageRecordIter(path_imgrec=paths, path_imgidx=str(combined), data_shape=(1, 1, 1),
                                      label_width=floats, batch_size=512, shuffle=True, round_batch=False)
    stock_open = time.perf_counter() - t0
    del stock
    return {"records": records, "open_s": opened, "reset_s": reset, "stock_open_s": stock_open,
            "open_ratio": opened / stock_open, "reset_ratio": reset / stock_open}


def scale_suite(workdir: Path, *, quick: bool, seconds: float, log: Callable[[str], None]) -> dict:
    cache = default_cache_dir() / "bench"
    total = 8000 if quick else 80_000
    out: dict = {"layouts": {}, "shards": {}}
    log("bench: layouts on the same raw rows")
    for name, layout in LAYOUTS.items():
        folder = workdir / f"layout_{name}"
        build_s, m = make_store(folder, layout, 40, total)
        out["layouts"][name] = {"build_s": build_s, "bytes": m.bytes, "windows": m.samples,
                                "bytes_per_window": m.bytes / m.samples,
                                "warm_samples_per_s": shuffled_rate(folder, cache, seconds),
                                "cold_samples_per_s": cold_rate(folder, cache)}
    log("bench: shards 4 / 40 / 200 / 400 and stock MXNet on one file")
    for n in (4, 40, 200, 400):
        folder = workdir / f"shards_{n}"
        make_store(folder, LAYOUTS["runs"], n, total)
        out["shards"][str(n)] = shuffled_rate(folder, cache, seconds)
    make_store(workdir / "stock_src", LAYOUTS["samples"], 200, total)
    out["stock_one_file"] = stock_one_file(*concat_store(workdir / "stock_src", workdir / "stock_one"), seconds)
    shutil.rmtree(workdir / "stock_src", ignore_errors=True)
    log("bench: readers, randomness, resume, open/reset")
    out["readers"] = {str(r): shuffled_rate(workdir / "shards_200", cache, seconds, readers=r) for r in (1, 2)}
    out["randomness"] = randomness(workdir / "shards_200", cache, total // 200)
    log("bench: resume at 90% over 500 shards")
    make_store(workdir / "resume_500", LAYOUTS["runs"], 50 if quick else 500, 20_000 if quick else 2_000_000)
    out["resume"] = resume_cost(workdir / "resume_500", cache)
    shutil.rmtree(workdir / "resume_500", ignore_errors=True)
    out["open_reset"] = open_reset(workdir, cache, 20_000 if quick else 2_000_000)
    return out
