"""Large synthetic stores for the issue 65 rows (ten years; larger than memory), written cheaply and
kept: synthetic rows go straight through shardgen's writer in the DEFAULT store layout (whatever
``[store]`` gives without a ``layout`` key), and the memmap loop's files are written from the same
rows (never decoded back from the records). Both live on disk under :func:`store_cache`, keyed by
their parameters, so a second ``make bench`` reuses them.

Disk, not :func:`benchmarks.stores.bench_cache` (tmpfs where there is one): tmpfs pages are RAM and
cannot be dropped from a page cache, so a store "larger than memory" would sit in memory, and gigabytes
of it would stay held there between runs."""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from benchmarks.stores import LABELS, C, T, raw_rows
from loader.source.plan import cache_root
from shardgen.config import ProcessConfig, _layout
from shardgen.format import Layout, Schema, day_number
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_store
from shardgen.toml_table import Table

__all__ = ["default_layout", "store_cache", "weekdays", "synthetic_store", "drop_pages", "raw_bytes"]

DONE = "built.json"  # written last: a folder without it is a build that did not finish


def default_layout() -> Layout:
    """The layout a config without ``store.layout`` gets for the default processor."""
    return _layout(Table({}, "store"), ProcessConfig(), T)


def store_cache() -> Path:
    """Where the big stores are kept: on disk, beside the loader's default cache root."""
    return Path(os.environ.get("SHARDGEN_BENCH_STORES") or cache_root() / "bench-stores")


def weekdays(n: int, start: dt.date = dt.date(2015, 1, 5)) -> list[dt.date]:
    out, d = [], start
    while len(out) < n:
        if d.weekday() < 5:
            out.append(d)
        d += dt.timedelta(days=1)
    return out


def _writer_version() -> str:
    """A digest of the code that decides a shard's bytes (shardgen/format, the writer): a store
    written by other code is written again."""
    import shardgen

    pkg = Path(shardgen.__file__).parent
    h = hashlib.sha256()
    for path in sorted([*(pkg / "format").glob("*.py"), pkg / "produce" / "writer.py", pkg / "process.py"]):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:10]


def _key(n_dates: int, rows: int, layout: Layout) -> str:
    return f"d{n_dates}x{rows}-T{T}C{C}-{layout.kind}{layout.pack}r{layout.run_rows}-{_writer_version()}"


def synthetic_store(n_dates: int, rows: int, *, root: Optional[Path] = None,
                    log: Callable[[str], None] = lambda m: None) -> dict:
    """``n_dates`` weekdays of ``rows`` rows each (T=60, C=32, the demo's labels), stride-1 windows, in
    the default layout: ``{"store", "memmap", "build_s", "cached", "windows", "raw_bytes", "store_bytes"}``.
    ``memmap`` is the folder :func:`benchmarks.memmap._memmap_loop` reads (rows, starts, labels)."""
    layout = default_layout()
    base = root or store_cache()
    base.mkdir(parents=True, exist_ok=True)
    folder = base / _key(n_dates, rows, layout)
    with open(base / f"d{n_dates}x{rows}.lock", "w") as lock:  # one writer of a size at a time (two benches)
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = (folder / DONE).exists()
        if not cached:
            for old in base.glob(f"d{n_dates}x{rows}-*"):  # the same size by other code or layout: gigabytes
                shutil.rmtree(old, ignore_errors=True)
            _write(folder, n_dates, rows, layout, log)
    return {**json.loads((folder / DONE).read_text()), "cached": cached, "store": str(folder / "store"),
            "memmap": str(folder / "memmap")}


def _write(folder: Path, n_dates: int, rows: int, layout: Layout, log: Callable[[str], None]) -> None:
    (folder / "memmap").mkdir(parents=True)
    log(f"bench: writing {n_dates} dates x {rows} rows ({layout.kind}, pack {layout.pack}) to {folder}")
    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=layout)
    per = rows - T + 1
    mm = folder / "memmap"
    x = np.lib.format.open_memmap(mm / "rows.npy", "w+", np.float32, (n_dates * rows, C))
    lab = np.lib.format.open_memmap(mm / "labels.npy", "w+", np.float32, (n_dates * per, 1 + 4 + 1))
    t0 = time.perf_counter()

    def specs():
        for i, d in enumerate(weekdays(n_dates)):
            raw = raw_rows(d, rows)
            spec = sliding_windows(raw, d, time_steps=T, num_inputs=C, labels=LABELS)
            x[i * rows:(i + 1) * rows] = raw[:, :C]
            lab[i * per:(i + 1) * per, :5] = raw[T - 1:, C:C + 5]
            lab[i * per:(i + 1) * per, 5] = day_number(d)
            yield d, spec, None

    m = write_store(folder / "store", schema, specs(), fsync=False)
    x.flush(), lab.flush()
    np.save(mm / "starts.npy", (np.arange(n_dates)[:, None] * rows + np.arange(per)).ravel().astype(np.int64))
    (mm / "shape.json").write_text(json.dumps({"time_steps": T}))
    info = {"build_s": time.perf_counter() - t0, "windows": m.samples, "store_bytes": m.bytes,
            "raw_bytes": raw_bytes(mm), "dates": n_dates, "rows_per_date": rows,
            "layout": f"{layout.kind} pack {layout.pack} run_rows {layout.run_rows}"}
    (folder / DONE).write_text(json.dumps(info))


def raw_bytes(memmap: Path) -> int:
    """The memmap's rows and labels (the bytes the memmap loop reads), without the .npy headers."""
    return sum(np.load(Path(memmap) / f"{n}.npy", mmap_mode="r").nbytes for n in ("rows", "labels"))


def drop_pages(*folders: Path) -> bool:
    """Drop every file of ``folders`` from the page cache (``POSIX_FADV_DONTNEED``); False where the
    platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)  # dirty pages are not dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return True
