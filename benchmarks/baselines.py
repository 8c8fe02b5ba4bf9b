"""What users try before this project, implemented correctly, for ``python -m benchmarks`` to compare.

* ``ListBatchIter``: the pattern from the question -- a Python ``mx.io.DataIter`` that keeps a
  list of samples and builds each batch from it (``np.stack`` + ``mx.nd.array``) in ``next()``.
  It overrides ``next()`` (not just ``__next__``), so ``mx.io.PrefetchingIter`` can wrap it.
* ``question_design_epoch``: the question's whole design -- inside the training loop, for each
  date run the generator, ``np.load`` its output, cut windows in Python, then batch them.
"""

from __future__ import annotations

import datetime as dt
import subprocess
from typing import Callable, Sequence

import mxnet as mx
import numpy as np

from shardgen.format import Schema, day_number

__all__ = ["ListBatchIter", "PoppedBatches", "samples_from_arrays", "question_design_epoch"]

Sample = tuple  # (x (T, C), label_1, ..., date)


def samples_from_arrays(x: np.ndarray, labels: Sequence[np.ndarray]) -> list[Sample]:
    """One tuple per sample, as the question's ``processData`` returns (``zip`` of the fields)."""
    return list(zip(x, *labels))


class ListBatchIter(mx.io.DataIter):
    """Batches built in Python from a list of samples (last partial batch dropped)."""

    def __init__(self, samples: list[Sample], batch_size: int, schema: Schema):
        super().__init__(batch_size)
        self.samples, self.schema, self.cursor = samples, schema, 0

    @property
    def provide_data(self) -> list:
        s = self.schema
        return [mx.io.DataDesc(s.data_name, (self.batch_size, s.time_steps, s.num_inputs), layout="NTC")]

    @property
    def provide_label(self) -> list:
        return [mx.io.DataDesc(lab.name, (self.batch_size,) if lab.width == 1 else (self.batch_size, lab.width))
                for lab in self.schema.labels]

    def reset(self) -> None:
        self.cursor = 0

    def next(self) -> mx.io.DataBatch:
        if self.cursor + self.batch_size > len(self.samples):
            raise StopIteration
        chunk = self.samples[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        fields = [mx.nd.array(np.stack(f), dtype=np.float32) for f in zip(*chunk)]
        return mx.io.DataBatch(data=fields[:1], label=fields[1:], pad=0)


class PoppedBatches(mx.io.DataIter):
    """The floor of the stall measurement: batches built once, before the run, handed out from a
    list (``next()`` makes a DataBatch and nothing else). What a consumer waits with it is the
    cost of its own thread waking and calling ``next()`` on this machine, not a loader's."""

    def __init__(self, arrays: list, batches: int, batch_size: int):
        super().__init__(batch_size)
        self.arrays, self.batches, self.i = arrays, batches, 0

    def reset(self) -> None:
        self.i = 0

    def next(self) -> mx.io.DataBatch:
        if self.i >= self.batches:
            raise StopIteration
        a = self.arrays[self.i % len(self.arrays)]
        self.i += 1
        return mx.io.DataBatch(data=a[:1], label=a[1:], pad=0)


def _windows_python(raw: np.ndarray, date: dt.date, schema: Schema) -> list[Sample]:
    """The question's processData: a Python loop over windows."""
    t, c = schema.time_steps, schema.num_inputs
    widths = [lab.width for lab in schema.labels[:-1]]
    out, day = [], np.float32(day_number(date))
    for i in range(raw.shape[0] - t + 1):
        last, col, labels = raw[i + t - 1], c, []
        for w in widths:
            labels.append(last[col:col + w].copy() if w > 1 else np.float32(last[col]))
            col += w
        out.append((raw[i:i + t, :c].copy(), *labels, day))
    return out


def question_design_epoch(argv_for: Callable[[dt.date], list[str]], output_for: Callable[[dt.date], str],
                          dates: Sequence[dt.date], schema: Schema, batch_size: int,
                          consume: Callable[[mx.io.DataBatch], None]) -> int:
    """Generate, load, cut and batch each date inside the loop; returns samples consumed."""
    done = 0
    for date in dates:
        subprocess.run(argv_for(date), check=True, stdout=subprocess.DEVNULL)
        raw = np.load(output_for(date), allow_pickle=False)
        it = ListBatchIter(_windows_python(raw, date, schema), batch_size, schema)
        for batch in it:
            consume(batch)
            done += batch_size
    return done
