"""The stores every benchmark reads: one schema (the question's shapes: 60 steps x 32 inputs, a
return and four eval labels), one builder, one page-cache eviction and stock MXNet's best case
(the store concatenated into one file)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from loader.source.plan import cache_root
from shardgen.format import LabelSpec, Layout, Schema, codec_for
from shardgen.format.index import combine, parse_index, shard_index_text
from shardgen.process import RunSpec, sliding_windows
from shardgen.produce.writer import write_store
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["T", "C", "LABELS", "RUN_PACK", "PER_DATE", "LAYOUTS", "schema_for", "raw_rows", "build", "make_store",
           "evict", "touch", "concat_store", "synthetic_store"]

T, C = 60, 32
LABELS = [LabelSpec("bd_return", 1), LabelSpec("eval_y", 4)]
RUN_PACK = 64
PER_DATE = 2000  # windows per synthetic date in the throughput benches
LAYOUTS = {"samples": Layout(), "windows": Layout("windows", 8), "runs": Layout("runs", RUN_PACK, T + RUN_PACK - 1)}


def bench_cache() -> Path:
    """The loader's ``cache_dir`` in every bench: on tmpfs where there is one (the numbers compare
    with earlier runs, measured there), else the default root. The default root is on disk: a new
    plan at 400 shards took 43 ms there against 34 ms on tmpfs (medians of 7, 2026-12-05), once per
    new generation."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm / f"shardgen-bench-{os.getuid()}"
    return cache_root() / "bench"


def schema_for(layout: Layout) -> Schema:
    return Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=layout)


def raw_rows(date: dt.date, rows: int) -> np.ndarray:
    """Rows of one date; feature 0 is the row number, so a window's start can be read back."""
    rng = np.random.default_rng(date.toordinal())
    raw = rng.standard_normal((rows, C + 5), dtype=np.float32)
    raw[:, 0] = np.arange(rows)
    return raw


def build(folder: Path, schema: Schema, specs: Iterable[tuple], *, fsync: bool = False) -> tuple[float, Manifest]:
    """A fresh store of ``(date, RunSpec)`` pairs; (build seconds, manifest)."""
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    write_store(folder, schema, ((date, spec, None) for date, spec in specs), fsync=fsync)
    return time.perf_counter() - t0, Manifest.load(folder / MANIFEST_NAME)


def make_store(folder: Path, layout: Layout, n_dates: int, windows: int) -> tuple[float, Manifest]:
    """``windows`` stride-1 windows over ``n_dates`` dates in ``layout``; (build seconds, manifest)."""
    per = windows // n_dates
    dates = [dt.date(2023, 1, 2) + dt.timedelta(days=i) for i in range(n_dates)]
    specs = ((d, sliding_windows(raw_rows(d, per + T - 1), d, time_steps=T, num_inputs=C, labels=LABELS))
             for d in dates)
    return build(folder, schema_for(layout), specs)


def touch(arrays: list) -> None:
    """Wait until MXNet has really produced each array (its engine is asynchronous)."""
    for a in arrays:
        a.wait_to_read()


def evict(store: Path) -> bool:
    """Drop the store's files from the page cache (for a cold epoch); False if not possible."""
    ok = hasattr(os, "posix_fadvise")
    for path in Path(store).glob("*.rec"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if ok:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ok


def concat_store(manifest_dir: Path, out: Path) -> tuple[str, str, int]:
    """The store's shards as ONE .rec with its .idx (stock MXNet's best case)."""
    m = Manifest.load(manifest_dir / MANIFEST_NAME)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "all.rec", "wb") as fh:
        for s in m.shards:
            fh.write((manifest_dir / s.rec).read_bytes())
    offsets = combine([parse_index((manifest_dir / s.idx).read_bytes())[1] for s in m.shards],
                      [s.bytes for s in m.shards])
    (out / "all.idx").write_bytes(shard_index_text(offsets))
    return str(out / "all.rec"), str(out / "all.idx"), m.schema.record_floats


def synthetic_store(folder: Path, n_dates: int, rows: int, *, layout: Layout | None = None, seed: int = 0,
                    fsync: bool = False) -> Manifest:
    """A fresh store of ``n_dates`` weekdays from 2015-01-05, each ``rows`` random float32 rows of ``C``
    inputs with every stride-1 window of ``T`` rows (random labels), written straight through
    ``write_store`` (no generator, no raw files); ``layout`` defaults to what a config that does not
    set ``store.pack`` gives (``Runs.default_pack``). Its manifest."""
    if layout is None:
        pack = codec_for("runs").default_pack
        layout = Layout("runs", pack, T + pack - 1)
    schema, n = schema_for(layout), rows - T + 1
    days = [d for d in (dt.date(2015, 1, 5) + dt.timedelta(days=i) for i in range(n_dates * 7 // 5 + 7))
            if d.weekday() < 5][:n_dates]

    def shards() -> Iterable[tuple]:
        rng = np.random.default_rng(seed)
        for d in days:
            x = rng.standard_normal((rows, C), dtype=np.float32)
            y = rng.standard_normal((n, 5), dtype=np.float32)
            yield d, RunSpec(x, np.arange(n), {"bd_return": y[:, 0], "eval_y": y[:, 1:]}, T), None

    shutil.rmtree(folder, ignore_errors=True)
    return write_store(folder, schema, shards(), fsync=fsync)
