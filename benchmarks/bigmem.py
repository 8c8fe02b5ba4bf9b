"""Issue 65: a store larger than the memory the trainer may use (250 dates x 125,000 rows, T=60,
C=32: ~4 GB of raw rows), each loop in a fresh process inside a cgroup v1 memory limit (2 GiB,
``memory.limit_in_bytes``: page cache counts), the store's and the memmap's pages dropped
(``POSIX_FADV_DONTNEED``) before each. ShardIter's dates per batch over the first 200 batches against
an exact shuffle's, and both loops' samples/s over a bounded time from construction."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

from benchmarks.bigstores import drop_pages, synthetic_store
from benchmarks.loops import exact_dates_per_batch, run_fresh
from benchmarks.tenyear import dates_summary
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["CGROUP_V1", "cgroup_unavailable", "MemoryLimit", "larger_than_memory", "bigmem_targets", "bigmem_lines"]

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
GIB = 1 << 30


def cgroup_unavailable(root: Path = CGROUP_V1) -> Optional[str]:
    """Why a cgroup v1 memory limit cannot be set here (None: it can)."""
    if not (root / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (a memory cgroup needs root)"
    return None


class MemoryLimit:
    """A fresh cgroup v1 memory cgroup of ``limit`` bytes; ``join`` (run in a child before exec) puts
    the calling process in it. Removed on exit (its page cache goes to the parent)."""

    def __init__(self, limit: int, root: Path = CGROUP_V1):
        self.path = root / f"shardgen-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.limit = limit

    def __enter__(self) -> MemoryLimit:
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        return self

    def join(self) -> None:
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def peak(self) -> int:
        """The cgroup's peak usage (bytes; page cache included)."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def __exit__(self, *exc) -> None:
        # The child has exited; its cgroup empties at once, or nearly (on a loaded machine it was still
        # busy after 5 s once): an empty cgroup left behind costs nothing, so never an error.
        deadline = time.monotonic() + 60
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.2)


def _limited(kind: str, source: str, cache: Optional[str], batch_size: int, seconds: float, limit: int,
             drop: tuple, cgroup: Path) -> dict:
    drop_pages(*drop)
    with MemoryLimit(limit, cgroup) as cg:
        r = run_fresh(kind, source, cache, batch_size, 2, seconds, preexec=cg.join, timeout=3 * seconds + 300)
        r["cgroup_peak"] = cg.peak()
    return r


def larger_than_memory(cache: Path, *, n_dates: int = 250, rows: int = 125_000, limit: int = 2 * GIB,
                       seconds: float = 60.0, loop_seconds: float = 40.0, batch_size: int = 512,
                       root: Optional[Path] = None, cgroup: Path = CGROUP_V1,
                       log: Callable[[str], None] = lambda m: None) -> dict:
    why = cgroup_unavailable(cgroup)
    res: dict = {"dates": n_dates, "rows_per_date": rows, "limit": limit, "seconds": seconds,
                 "loop_seconds": loop_seconds, "batch_size": batch_size}
    if why:
        return {**res, "unavailable": why}
    st = synthetic_store(n_dates, rows, root=root, log=log)
    res["store"] = {k: st[k] for k in ("build_s", "cached", "windows", "store_bytes", "raw_bytes", "layout")}
    counts = [s.samples for s in Manifest.load(Path(st["store"]) / MANIFEST_NAME).shards]
    exact = res["exact_dates_per_batch"] = exact_dates_per_batch(counts, batch_size)
    drop = (Path(st["store"]), Path(st["memmap"]))
    built = "reused" if st["cached"] else f"built in {st['build_s']:.0f} s"
    log(f"bench: larger than memory ({st['store_bytes'] / 1e9:.1f} GB of shards, {built}) under a "
        f"{limit / GIB:g} GiB cgroup: "
        f"ShardIter {seconds:g} s, the memmap loop {loop_seconds:g} s")
    res["shard_iter"] = _limited("shard_iter", st["store"], str(cache), batch_size, seconds, limit, drop, cgroup)
    res["memmap"] = _limited("memmap", st["memmap"], None, batch_size, loop_seconds, limit, drop, cgroup)
    for kind in ("shard_iter", "memmap"):
        r = res[kind]
        if "failed" not in r:
            r["dates"] = dates_summary(r, exact)
            del r["dates_per_batch"]
    if "failed" not in res["shard_iter"] and "failed" not in res["memmap"]:
        res["rate_ratio"] = res["shard_iter"]["samples_per_s"] / res["memmap"]["samples_per_s"]
    return res


def bigmem_targets(bm: dict) -> list[tuple]:
    what = f"larger than memory ({bm['dates']} dates x {bm['rows_per_date']:,} rows, {bm['limit'] / GIB:g} GiB cgroup)"
    why = bm.get("unavailable") or bm["shard_iter"].get("failed") or bm["memmap"].get("failed")
    if why:
        return [(f"{what}: not measured: {why}", float("nan"), ">=", 0.0)]
    d = bm["shard_iter"]["dates"].get("0")
    rows = [(f"{what}: ShardIter dates per batch / exact shuffle, first 200 batches of epoch 0, mean",
             d["mean_ratio"] if d else float("nan"), ">=", 0.8)]
    return rows + [(f"{what}: samples/s from construction, ShardIter ({bm['seconds']:g} s) / the memmap loop "
                    f"({bm['loop_seconds']:g} s)", bm["rate_ratio"], ">=", 100.0)]


def bigmem_lines(bm: dict) -> list[str]:
    head = (f"larger than memory: {bm['dates']} dates x {bm['rows_per_date']:,} rows under a "
            f"{bm['limit'] / GIB:g} GiB cgroup v1 limit, pages dropped first")
    if "unavailable" in bm:
        return ["", f"{head}: not measured ({bm['unavailable']})"]
    st = bm["store"]
    out = ["", f"{head}; store {st['store_bytes'] / 1e9:.1f} GB ({st['layout']}), raw {st['raw_bytes'] / 1e9:.1f} GB, "
           + ("reused" if st["cached"] else f"built in {st['build_s']:.0f}s")
           + f"; exact shuffle {bm['exact_dates_per_batch']:.1f} dates per batch"]
    for name, kind in (("ShardIter (defaults)", "shard_iter"), ("the memmap loop", "memmap")):
        r = bm[kind]
        if "failed" in r:
            out.append(f"  {name:22} failed: {r['failed']}")
            continue
        dates = "; ".join(f"epoch {e} {d['mean']:.1f} (least {d['least']}, {d['batches']} batches)"
                          for e, d in sorted(r["dates"].items()))
        out.append(f"  {name:22} {r['samples_per_s']:,.0f} samples/s over {r['seconds']:.1f}s ({r['windows']:,} "
                   f"windows), first batch {r['first_batch_s']:.2f}s, peak RSS {r['peak_rss'] / 1e9:.2f} GB, cgroup "
                   f"peak {r['cgroup_peak'] / 1e9:.2f} GB; dates per batch {dates or '-'}")
    return out
