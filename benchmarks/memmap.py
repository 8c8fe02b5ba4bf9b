"""The loop a user could write instead of ShardIter (issue 53), measured beside it: every row of the
store in one numpy memmap, a permutation of window starts per epoch, ``X[starts[idx]]`` and the
labels gathered in a background thread and handed to MXNet with ``mx.nd.from_numpy(zero_copy=True)``.

The memmap holds the very windows the store holds (decoded from its records with the layout's
codec, so both loops read the same bytes); each loop runs in a fresh interpreter, two epochs from
construction, and the two alternate (the machine drifts by more than the ratios judged).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.subproc import json_from_subprocess

__all__ = ["build_memmap", "memmap_vs_shard_iter"]

PREFETCH = 8  # batches the loop's thread gathers ahead (ShardIter's default prefetch_buffer)


def build_memmap(store: Path, folder: Path) -> Path:
    """``rows.npy`` (every row of every date, dates end to end), ``starts.npy`` (each window's first
    row), ``labels.npy`` (its user labels and day), decoded from the store's records."""
    import mxnet as mx

    from shardgen.store.manifest import Manifest
    from shardgen.store.naming import MANIFEST_NAME

    m = Manifest.load(store / MANIFEST_NAME)
    schema, t = m.schema, m.schema.time_steps
    rows, starts, labels, base = [], [], [], 0
    for s in m.shards:
        xs, ls, ds, ps = [], [], [], []
        rec = mx.recordio.MXRecordIO(str(store / s.rec), "r")
        while (item := rec.read()) is not None:
            header, _ = mx.recordio.unpack(item)
            x, lab, day, pos = schema.codec.unpack(np.asarray(header.label, np.float32), schema)
            xs.append(x), ls.append(lab), ds.append(day), ps.append(np.asarray(pos, np.int64))
        rec.close()
        x, pos = np.concatenate(xs), np.concatenate(ps)
        date_rows = np.zeros((int(pos.max()) + t, schema.num_inputs), np.float32)
        date_rows[pos[:, None] + np.arange(t)] = x
        rows.append(date_rows)
        starts.append(pos + base)
        labels.append(np.column_stack([np.concatenate(ls), np.concatenate(ds)]))
        base += len(date_rows)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "rows.npy", np.concatenate(rows))
    np.save(folder / "starts.npy", np.concatenate(starts))
    np.save(folder / "labels.npy", np.concatenate(labels).astype(np.float32))
    return folder


def _memmap_loop(folder: str, batch_size: int, epochs: int) -> dict:
    """In a fresh process: the loop, ``epochs`` epochs from opening the memmap."""
    import mxnet as mx

    t0, c0 = time.perf_counter(), time.process_time()
    rows = np.load(Path(folder) / "rows.npy", mmap_mode="r")
    starts = np.load(Path(folder) / "starts.npy")
    labels = np.load(Path(folder) / "labels.npy", mmap_mode="r")
    t = json.loads((Path(folder) / "shape.json").read_text())["time_steps"]
    x = np.lib.stride_tricks.as_strided(rows, (len(rows) - t + 1, t, rows.shape[1]),
                                        (rows.strides[0],) + rows.strides, writeable=False)
    q: queue.Queue = queue.Queue(PREFETCH)

    def produce() -> None:
        for e in range(epochs):
            perm = np.random.default_rng(e).permutation(len(starts))
            for i in range(0, len(perm), batch_size):
                idx = perm[i:i + batch_size]
                lab = labels[idx]
                q.put([mx.nd.from_numpy(x[starts[idx]], zero_copy=True),
                       mx.nd.from_numpy(np.ascontiguousarray(lab[:, :-1]), zero_copy=True),
                       mx.nd.from_numpy(np.ascontiguousarray(lab[:, -1]), zero_copy=True)])
        q.put(None)

    threading.Thread(target=produce, daemon=True).start()
    n = 0
    while (batch := q.get()) is not None:
        for a in batch:
            a.wait_to_read()
        n += batch[0].shape[0]
    return {"windows": n, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _shard_iter(store: str, cache: str, batch_size: int, epochs: int) -> dict:
    """In a fresh process: ShardIter with its defaults, ``epochs`` epochs from construction."""
    from loader.shard_iter import ShardIter

    t0, c0, n = time.perf_counter(), time.process_time(), 0
    with ShardIter(store, batch_size, shuffle=True, cache_dir=cache) as it:
        for e in range(epochs):
            if e:
                it.reset()
            for b in it:
                for a in b.data + b.label:
                    a.wait_to_read()
                n += batch_size - b.pad
    return {"windows": n, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _in_subprocess(fn: str, *args: object) -> dict:
    return json_from_subprocess(f"import json; from benchmarks.memmap import {fn}; print(json.dumps({fn}(*{args!r})))",
                                f"memmap bench ({fn})", 1800)


def memmap_vs_shard_iter(store: Path, cache: Path, folder: Path, *, batch_size: int = 512, epochs: int = 2,
                         rounds: int = 2) -> dict:
    """samples/s and process CPU per window of both loops, each the mean of ``rounds`` fresh runs
    (alternating), and their ratios."""
    from shardgen.store.manifest import Manifest
    from shardgen.store.naming import MANIFEST_NAME

    build_memmap(store, folder)
    t = Manifest.load(store / MANIFEST_NAME).schema.time_steps
    (folder / "shape.json").write_text(json.dumps({"time_steps": t}))
    runs: dict = {"memmap": [], "shard_iter": []}
    for _ in range(rounds):
        runs["memmap"].append(_in_subprocess("_memmap_loop", str(folder), batch_size, epochs))
        runs["shard_iter"].append(_in_subprocess("_shard_iter", str(store), str(cache), batch_size, epochs))
    out: dict = {}
    for name, rs in runs.items():
        n = sum(r["windows"] for r in rs)
        out[name] = {"samples_per_s": n / sum(r["seconds"] for r in rs),
                     "cpu_us_per_window": sum(r["cpu_s"] for r in rs) / n * 1e6, "windows": n // len(rs)}
    out["rate_ratio"] = out["shard_iter"]["samples_per_s"] / out["memmap"]["samples_per_s"]
    out["cpu_ratio"] = out["shard_iter"]["cpu_us_per_window"] / out["memmap"]["cpu_us_per_window"]
    return out
