"""The shuffle buffer: the records of one block of the epoch's order (:mod:`loader.pipeline.order`),
each in a slot of its own, as MXNet's native reader returns them; batches are gathered from it
in the block's permuted order.

Records are kept compact (a run's rows, not its windows) in preallocated slots; an item of a
record is ``slot * K + k`` (``K``: the layout's pack); a batch is one gather over the slots.
Which record lands in which slot is fixed by the block's layout, never by how reads interleave.
"""

from __future__ import annotations

import numpy as np

from loader.errors import LoaderError
from shardgen.format.schema import Schema

__all__ = ["ShuffleBuffer", "buffer_bytes", "size_class"]


def size_class(records: int, nominal: int) -> int:
    """The capacity a buffer for ``records`` is allocated with: a power of two up to the nominal
    block (plus an eighth for the records a block's edges add), so buffers are reused epoch after
    epoch instead of allocated in a new size for every block."""
    top = nominal + nominal // 8
    if records > top:
        return records
    return min(top, 1 << max(6, (records - 1).bit_length()))


def _arrays(schema: Schema, capacity: int) -> dict:
    """Name -> (shape, dtype) of every array a buffer of ``capacity`` records allocates."""
    k = schema.pack
    return {"data": ((capacity,) + schema.codec.slot_shape(schema), np.float32),
            "labels": ((capacity, k, schema.label_floats), np.float32),
            "starts": ((capacity, k), np.int64), "day": ((capacity,), np.float32)}


def buffer_bytes(schema: Schema, capacity: int) -> int:
    """Bytes a buffer of ``capacity`` records holds (its arrays, allocated up front)."""
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in _arrays(schema, capacity).values())


class ShuffleBuffer:
    """Slots for ``capacity`` records of ``schema``."""

    def __init__(self, schema: Schema, capacity: int):
        self.schema, self.capacity, self.k = schema, capacity, schema.pack
        self.codec = schema.codec
        for name, (shape, dtype) in _arrays(schema, capacity).items():
            setattr(self, name, np.zeros(shape, dtype) if name in ("starts", "day") else np.empty(shape, dtype))
        self._steps = np.arange(schema.time_steps)

    def put(self, slot: int, payload: np.ndarray, days: np.ndarray) -> None:
        """Records ``(m, F)`` as the native iterator returns them (their framing already checked)
        into slots ``[slot, slot + m)``; ``days``: the day each must be of (a record of another
        date means the file changed under the reader: a LoaderError, not a wrong batch)."""
        m = len(payload)
        if slot + m > self.capacity:
            raise LoaderError(f"a block's records overflow its buffer ({slot + m} > {self.capacity})")
        records = self.codec.decode(payload, self.schema)
        if not np.array_equal(records.day, days):
            bad = int(np.flatnonzero(records.day != days)[0])
            raise LoaderError(f"MXNet's reader returned a record of day {records.day[bad]:.0f} where the order "
                              f"expects day {days[bad]:.0f}: a shard changed under the reader?")
        span = slice(slot, slot + m)
        self.day[span] = records.day
        self.labels[span] = records.labels
        self.data[span] = records.data
        if records.starts is not None:
            self.starts[span] = records.starts

    def gather(self, codes: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``x (n, T, C)`` into ``out``, user labels ``(n, W)`` and days ``(n,)`` of the items
        ``codes``. Indices were checked with the shard (frames), so take() clips instead of
        buffering its output."""
        slot = codes // self.k
        if self.codec.rows:  # one flat take: rows of slot s start at s * rows per slot
            rows = self.data.reshape(-1, self.data.shape[-1])
            first = slot * self.data.shape[1] + self.starts.reshape(-1)[codes]
            x = np.take(rows, first[:, None] + self._steps, axis=0, out=out, mode="clip")
        else:
            x = np.take(self.data.reshape((-1,) + self.data.shape[2:]), codes, axis=0, out=out, mode="clip")
        return x, np.take(self.labels.reshape(-1, self.labels.shape[-1]), codes, axis=0), self.day[slot]
