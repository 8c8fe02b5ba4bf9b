"""The two measurements every loader row of ``python -m benchmarks`` makes: the max rate, and the
stall of a consumer that spends a fixed time per batch outside the GIL (as a GPU step does)."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import mxnet as mx
import numpy as np

from benchmarks.stores import LAYOUTS, schema_for, touch

__all__ = ["Loader", "throughput", "stall"]

RECORD_FLOATS = schema_for(LAYOUTS["samples"]).record_floats


class Loader:
    """A uniform face over DataIters and DataLoaders: endless batches, epoch after epoch."""

    def __init__(self, name: str, make: Callable[[], object], note: str = ""):
        self.name, self.make, self.note = name, make, note

    def batches(self) -> Iterator[list]:
        obj = self.make()
        try:
            while True:
                if isinstance(obj, mx.io.DataIter):
                    for b in obj:
                        yield list(b.data) + list(b.label)
                    obj.reset()
                else:
                    for b in obj:
                        yield list(b)
        finally:
            if hasattr(obj, "close"):
                obj.close()


def throughput(loader: Loader, batch_size: int, seconds: float, warmup: int = 3) -> dict:
    """Max rate: take batches as fast as they come (each array waited on) for ``seconds``."""
    gen = loader.batches()
    for _ in range(warmup):
        touch(next(gen))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        touch(next(gen))
        n += 1
    wall = time.perf_counter() - t0
    gen.close()
    rate = n * batch_size / wall
    return {"samples_per_s": rate, "payload_gb_per_s": rate * RECORD_FLOATS * 4 / 1e9, "batches": n}


def stall(loader: Loader, step_s: float, seconds: float, warmup: int = 3) -> dict:
    """A consumer spending ``step_s`` per batch outside the GIL: fraction of wall time waiting."""
    gen = loader.batches()
    for _ in range(warmup):
        touch(next(gen))
    waits: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:  # across epoch boundaries: batches() resets
        t1 = time.perf_counter()
        touch(next(gen))
        waits.append(time.perf_counter() - t1)
        time.sleep(step_s)  # the GPU step: no GIL held
    wall = time.perf_counter() - t0
    gen.close()
    ms = 1000 * np.array(waits)
    return {"stall_pct": 100 * sum(waits) / wall, "step_ms": 1000 * step_s, "batches": len(waits),
            "next_p50_ms": float(np.percentile(ms, 50)), "next_p99_ms": float(np.percentile(ms, 99))}
