"""CPU per window for ``make bench`` (issue 46): what the loader takes from the training process.

Each figure comes from a fresh interpreter (``cpu_in_subprocess``), so no other part of the bench
has touched its allocator or threads:

- the floor: gathering the same windows from RAM with fancy indexing (``X[idx]``, a fresh batch: the
  fastest gather numpy has here; ``np.take(X, idx, out=batch)`` is reported beside it, 1.3-1.5x
  slower) in a process that never imported the loader, process CPU per window;
- ShardIter shuffled and in order: process CPU per window over whole epochs (``reset()`` between),
  and the share of it spent in the loader's two threads (``shardgen-loader``, ``shardgen-batches``:
  Python, holding the GIL most of the time) read from each thread's CPU clock;
- an epoch boundary: process CPU from ``reset()`` to the next epoch's first batch;
- the trainer's own numpy work before and after a ShardIter ran in its process: a gather into a
  fresh batch-sized array (``np.take(X, idx, axis=0)``), as a training loop's own code does.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.subproc import json_from_subprocess

__all__ = ["cpu_in_subprocess", "cpu_suite"]

BATCH = 512
RAM_WINDOWS = 20_000  # windows the gathers draw from (T=60, C=32 float32: 150 MB)


def _ram(t: int, c: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((RAM_WINDOWS, t, c), dtype=np.float32)


def _gather_us(x: np.ndarray, fresh: bool, reps: int = 60, fancy: bool = False) -> float:
    """Process CPU µs per window of ``reps`` batch gathers: ``x[idx]`` (``fancy``, the floor), into
    one batch (``fresh=False``) or into a new array each time (``fresh=True``, a trainer's own
    code); best of 5."""
    rng = np.random.default_rng(0)
    idxs = [rng.integers(0, len(x), BATCH) for _ in range(reps)]
    out = np.empty((BATCH,) + x.shape[1:], x.dtype)
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for idx in idxs:
            if fancy:
                x[idx]
            elif fresh:
                np.take(x, idx, axis=0).sum()
            else:
                np.take(x, idx, axis=0, out=out)
        best = min(best, (time.process_time() - t0) / (reps * BATCH) * 1e6)
    return best


class ThreadCPU:
    """CPU seconds of the threads named ``names`` (Python's names: the OS's are all "python"),
    sampled now and then from each thread's own CPU clock (nanoseconds: /proc's ticks of 10 ms made
    a tiny epoch's share pass 1): each thread's largest reading is kept, so threads that ended count
    too (less what they spent after their last sample)."""

    def __init__(self, *names: str):
        self.names, self.seen = names, {}

    def sample(self) -> None:
        for t in threading.enumerate():
            if t.name not in self.names or t.ident is None:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):  # it ended meanwhile
                continue
            self.seen[t.ident] = max(self.seen.get(t.ident, 0.0), cpu)

    def total(self) -> float:
        return sum(self.seen.values())


def _loader(store: str, cache: str, epochs: int) -> dict:
    """In this (fresh) process: the trainer's gather before, ShardIter shuffled and in order, the
    trainer's gather after."""
    from shardgen.store.manifest import Manifest

    schema = Manifest.load(Path(store) / "manifest.json").schema  # the loader not made yet
    x = _ram(schema.time_steps, schema.num_inputs)
    out: dict = {"trainer_gather_before_us": _gather_us(x, fresh=True)}

    from loader.shard_iter import ShardIter
    for name, shuffle in (("shuffled", True), ("in_order", False)):
        with ShardIter(store, BATCH, cache_dir=cache, shuffle=shuffle) as it:
            for _ in it:  # warm: files in the page cache, buffers allocated
                pass
            it.reset()
            windows, boundary, producers = 0, [], ThreadCPU("shardgen-batches", "shardgen-loader")
            producers.sample()
            before = producers.total()  # the warm epoch's threads (and the next one's, begun)
            cpu0 = reset_cpu = time.process_time()
            for e in range(epochs):
                for i, b in enumerate(it):
                    if i == 0 and e:
                        boundary.append(time.process_time() - reset_cpu)
                    if i % 8 == 0:
                        producers.sample()
                    windows += BATCH - b.pad
                producers.sample()
                reset_cpu = time.process_time()
                it.reset()
            cpu = time.process_time() - cpu0
            producer = producers.total() - before
        out[name] = {"cpu_us_per_window": cpu / windows * 1e6, "windows": windows,
                     "producer_share": producer / cpu if cpu else 0.0,
                     "boundary_cpu_ms": 1000 * float(np.median(boundary)) if boundary else 0.0}
    out["trainer_gather_after_us"] = _gather_us(x, fresh=True)
    return out


def _floor(t: int, c: int) -> dict:
    x = _ram(t, c)
    return {"gather_us": _gather_us(x, fresh=False, fancy=True), "take_out_gather_us": _gather_us(x, fresh=False),
            "fresh_gather_us": _gather_us(x, fresh=True)}


def cpu_in_subprocess(kind: str, *args: object) -> dict:
    """``_floor`` or ``_loader`` in a fresh interpreter (nothing else of the bench in it)."""
    return json_from_subprocess(f"import json; from benchmarks.cpu import _{kind}; "
                                f"print(json.dumps(_{kind}(*{tuple(args)!r})))", f"cpu bench ({kind})", 1800)


def cpu_suite(store: Path, cache: Path, t: int, c: int, *, epochs: int = 4, workdir: Optional[Path] = None) -> dict:
    """The floor (a process without the loader), the loader's figures and the memmap loop
    (:mod:`benchmarks.memmap`) beside ShardIter, in one run."""
    from benchmarks.memmap import memmap_vs_shard_iter

    res = {"floor": cpu_in_subprocess("floor", t, c), **cpu_in_subprocess("loader", str(store), str(cache), epochs)}
    res["memmap"] = memmap_vs_shard_iter(store, cache, (workdir or store.parent) / "memmap",
                                         rounds=1 if epochs == 1 else 2)
    floor = res["floor"]["gather_us"]
    res["trainer_gather_ratio"] = res["trainer_gather_after_us"] / res["trainer_gather_before_us"]
    for name in ("shuffled", "in_order"):
        res[name]["floor_ratio"] = res[name]["cpu_us_per_window"] / floor
    return res
