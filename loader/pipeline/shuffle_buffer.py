"""The shuffle buffer: records as MXNet returns them go in, caller batches of single samples come
out, drawn uniformly from every sample the buffer holds (tf.data / WebDataset style), so one batch
spans many records and dates even though each read brings a whole pack or run.

Records are kept compact (a run's rows, not its windows) in preallocated slots; a batch is one
gather over the slots. Exact: every sample of every record added is drawn exactly once. The
draw order is a function of the generator passed in and the order records were added.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from shardgen.format.schema import Schema

__all__ = ["ShuffleBuffer", "default_capacity", "buffer_bytes"]

DEFAULT_BYTES = 128 << 20  # default shuffle buffer size


def default_capacity(schema: Schema, native_batch: int, nbytes: int = DEFAULT_BYTES) -> int:
    """Records the buffer holds by default: ``nbytes`` of payload (at most 8192 records), at least
    two native batches."""
    return max(2 * native_batch, min(8192, nbytes // (4 * schema.record_floats)))


def _arrays(schema: Schema, capacity: int) -> dict:
    """Name -> (shape, dtype) of every array a buffer of ``capacity`` records allocates."""
    k = schema.pack
    return {"data": ((capacity,) + schema.codec.slot_shape(schema), np.float32),
            "labels": ((capacity, k, schema.label_floats), np.float32),
            "starts": ((capacity, k), np.int64), "day": ((capacity,), np.float32),
            "remaining": ((capacity,), np.int64), "live": ((capacity * k,), np.int64)}


def buffer_bytes(schema: Schema, capacity: int) -> int:
    """Bytes a buffer of ``capacity`` records holds (its arrays, allocated up front)."""
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in _arrays(schema, capacity).values())


class ShuffleBuffer:
    """Slots for ``capacity`` records of ``schema``; items are ``slot * K + k``."""

    def __init__(self, schema: Schema, capacity: int):
        self.schema, self.capacity, self.k = schema, capacity, schema.pack
        self.codec = schema.codec
        for name, (shape, dtype) in _arrays(schema, capacity).items():
            setattr(self, name, np.zeros(shape, dtype) if name in ("starts", "day") else np.empty(shape, dtype))
        self._steps = np.arange(schema.time_steps)
        self.clear()

    def clear(self) -> None:
        """Empty, for another epoch (the arrays are kept: no allocation)."""
        self.free = list(range(self.capacity - 1, -1, -1))
        self.remaining[:] = 0
        self.count = 0  # items (samples) held

    @property
    def free_slots(self) -> int:
        return len(self.free)

    def add(self, payload: np.ndarray, lo: Optional[np.ndarray] = None, hi: Optional[np.ndarray] = None) -> None:
        """Records ``(m, F)`` as the native iterator returns them (their framing already checked);
        of record ``i`` only items ``[lo[i], hi[i])`` when given (a record shared between parts)."""
        n_rec = len(payload)
        slots = np.array(self.free[:-n_rec - 1:-1] if n_rec else [], np.int64)  # as n_rec pop()s would
        del self.free[len(self.free) - n_rec:]
        records = self.codec.decode(payload, self.schema)
        counts = records.counts
        self.day[slots] = records.day
        self.labels[slots] = records.labels
        self.data[slots] = records.data
        if records.starts is not None:
            self.starts[slots] = records.starts
        k = np.arange(self.k)[None, :]
        keep = k < counts[:, None]
        if lo is not None:
            keep &= (k >= lo[:, None]) & (k < hi[:, None])
        self.remaining[slots] = keep.sum(axis=1)
        codes = (slots[:, None] * self.k + k)[keep]
        self.live[self.count:self.count + len(codes)] = codes
        self.count += len(codes)

    def draw(self, n: int, rng: Optional[np.random.Generator]) -> np.ndarray:
        """``n`` live items: uniformly at random, or the oldest first when ``rng`` is None."""
        n = min(n, self.count)
        if rng is None:
            codes = self.live[:n].copy()
            self.live[:self.count - n] = self.live[n:self.count]
        else:
            pick = rng.choice(self.count, size=n, replace=False)
            codes = self.live[pick]
            # Swap-remove: fill the holes below m - n with the tail items that were not picked (in
            # order; a mask, not a sort: this runs with the GIL held, batch after batch).
            start = self.count - n
            in_tail = np.zeros(n, bool)
            in_tail[pick[pick >= start] - start] = True
            self.live[pick[pick < start]] = self.live[start:self.count][~in_tail]
        self.count -= n
        return codes

    def release(self, codes: np.ndarray) -> None:
        """The items ``codes`` are used up: free the slots with nothing left."""
        used = np.bincount(codes // self.k, minlength=self.capacity)  # no sort: see draw()
        slots = np.flatnonzero(used)
        self.remaining[slots] -= used[slots]
        self.free.extend(slots[self.remaining[slots] == 0].tolist())

    def gather(self, codes: np.ndarray, out: Optional[np.ndarray] = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``x (n, T, C)`` (into ``out`` if given), user labels ``(n, W)`` and days ``(n,)`` of the
        items, then release them. Indices were checked with the shard (frames), so take() clips
        instead of buffering its output."""
        slot = codes // self.k
        if self.codec.rows:  # one flat take: rows of slot s start at s * rows per slot
            rows = self.data.reshape(-1, self.data.shape[-1])
            first = slot * self.data.shape[1] + self.starts.reshape(-1)[codes]
            x = np.take(rows, first[:, None] + self._steps, axis=0, out=out, mode="clip")
        else:
            x = np.take(self.data.reshape((-1,) + self.data.shape[2:]), codes, axis=0, out=out, mode="clip")
        out = x, np.take(self.labels.reshape(-1, self.labels.shape[-1]), codes, axis=0), self.day[slot]
        self.release(codes)
        return out

