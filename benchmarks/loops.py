"""Both loops of the issue 65 rows, instrumented the same way, each run in a fresh interpreter
(optionally inside a cgroup v1 memory limit, :mod:`benchmarks.bigmem`): ShardIter at its defaults
(``shuffle=True``) and the memmap loop a user would write (:mod:`benchmarks.memmap`: every row in one
``np.memmap``, a permutation of window starts per epoch, ``X[starts[idx]]`` gathered in a thread,
handed to MXNet zero-copy).

Measured from before construction: construction seconds, the first batch (every array waited on),
distinct dates in each of the first ``FIRST_BATCHES`` full batches of every epoch, windows and
seconds (to the end of the epochs, or to ``seconds`` when bounded) and the process's peak RSS
(``VmHWM``)."""

from __future__ import annotations

import json
import math
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from benchmarks.memmap import PREFETCH

__all__ = ["FIRST_BATCHES", "measure", "run_fresh", "exact_dates_per_batch", "peak_rss"]

FIRST_BATCHES = 200
ROOT = Path(__file__).resolve().parent.parent


def peak_rss() -> int:
    """This process's peak resident set (bytes), ``VmHWM``."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _shard_iter(source: str, cache: Optional[str], batch_size: int, stop: threading.Event, **knobs):
    """(construction seconds are measured around this) -> epoch(e) yielding (arrays, n, day or None)."""
    from loader.shard_iter import ShardIter

    it = ShardIter(source, batch_size, shuffle=True, cache_dir=cache, **knobs)

    def epoch(e: int) -> Iterator:
        if e:
            it.reset()
        for b in it:
            yield list(b.data) + list(b.label), batch_size - b.pad, b.label[-1]
    return epoch, it.close


def _memmap(source: str, cache: Optional[str], batch_size: int, stop: threading.Event):
    import mxnet as mx

    folder = Path(source)
    rows = np.load(folder / "rows.npy", mmap_mode="r")
    starts = np.load(folder / "starts.npy")
    labels = np.load(folder / "labels.npy", mmap_mode="r")
    t = json.loads((folder / "shape.json").read_text())["time_steps"]
    x = np.lib.stride_tricks.as_strided(rows, (len(rows) - t + 1, t, rows.shape[1]),
                                        (rows.strides[0],) + rows.strides, writeable=False)

    def epoch(e: int) -> Iterator:
        q: queue.Queue = queue.Queue(PREFETCH)

        def produce() -> None:
            perm = np.random.default_rng(e).permutation(len(starts))
            for i in range(0, len(perm), batch_size):
                if stop.is_set():
                    break
                idx = perm[i:i + batch_size]
                lab = labels[idx]
                q.put(([mx.nd.from_numpy(x[starts[idx]], zero_copy=True),
                        mx.nd.from_numpy(np.ascontiguousarray(lab[:, :-1]), zero_copy=True),
                        mx.nd.from_numpy(np.ascontiguousarray(lab[:, -1]), zero_copy=True)], len(idx), lab[:, -1]))
            q.put(None)

        threading.Thread(target=produce, daemon=True).start()
        while (item := q.get()) is not None:
            yield item
    return epoch, lambda: None


LOOPS: dict[str, Callable] = {"shard_iter": _shard_iter, "memmap": _memmap}


def measure(kind: str, source: str, cache: Optional[str], batch_size: int = 512, epochs: int = 2,
            seconds: Optional[float] = None) -> dict:
    """One loop, ``epochs`` epochs from construction (or until ``seconds`` have passed)."""
    import mxnet  # noqa: F401  imported before the clock for both loops: a trainer has it already

    import loader.shard_iter  # noqa: F401

    stop = threading.Event()
    kind, _, knobs = kind.partition(":")  # "shard_iter:{json}": ShardIter's keyword arguments
    t0 = time.perf_counter()
    epoch, close = LOOPS[kind](source, cache, batch_size, stop, **(json.loads(knobs) if knobs else {}))
    constructed = time.perf_counter() - t0
    first, n, dates, done = None, 0, [[] for _ in range(epochs)], 0
    try:
        for e in range(epochs):
            for i, (arrays, k, day) in enumerate(epoch(e)):
                for a in arrays:
                    a.wait_to_read()
                if first is None:
                    first = time.perf_counter() - t0
                if i < FIRST_BATCHES and k == batch_size:  # full batches, as the exact shuffle's are
                    dates[e].append(len(np.unique(day.asnumpy() if hasattr(day, "asnumpy") else day)))
                n += k
                if seconds is not None and time.perf_counter() - t0 >= seconds:
                    break
            else:
                done += 1
                continue
            break
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        close()
    return {"construct_s": constructed, "first_batch_s": first, "windows": n, "seconds": wall,
            "samples_per_s": n / wall, "epochs_done": done, "dates_per_batch": [d for d in dates if d],
            "peak_rss": peak_rss()}


def run_fresh(kind: str, source: str, cache: Optional[str], batch_size: int = 512, epochs: int = 2,
              seconds: Optional[float] = None, *, prefix: Sequence[str] = (), timeout: float = 1800,
              preexec: Optional[Callable[[], None]] = None) -> dict:
    """:func:`measure` in a fresh interpreter (``preexec`` runs in the child before it starts: a
    cgroup to join). A child killed or failing gives ``{"failed": why}``, not an exception."""
    code = (f"import json; from benchmarks.loops import measure; "
            f"print(json.dumps(measure(*{(kind, source, cache, batch_size, epochs, seconds)!r})))")
    try:
        r = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT, preexec_fn=preexec)
    except subprocess.TimeoutExpired:
        return {"failed": f"{kind}: no result within {timeout:.0f} s"}
    if r.returncode != 0:
        why = "killed (SIGKILL: out of memory?)" if r.returncode == -9 else f"exit {r.returncode}"
        return {"failed": f"{kind}: {why}: {r.stderr.strip()[-600:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def exact_dates_per_batch(windows_per_date: Sequence[int], batch_size: int) -> float:
    """Expected distinct dates in a batch of an exact shuffle (``batch_size`` windows drawn without
    replacement from all): the sum over dates of 1 - C(N - n_d, B) / C(N, B)."""
    counts = np.asarray(windows_per_date, dtype=np.int64)
    total, b = int(counts.sum()), int(batch_size)
    base = math.lgamma(total - b + 1) - math.lgamma(total + 1)
    out = 0.0
    for n_d, times in zip(*np.unique(counts, return_counts=True)):
        rest = total - int(n_d)
        miss = 0.0 if rest < b else math.exp(math.lgamma(rest + 1) - math.lgamma(rest - b + 1) + base)
        out += int(times) * (1.0 - miss)
    return out
