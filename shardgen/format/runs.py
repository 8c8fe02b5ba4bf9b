"""Layout ``runs``: a run of up to L = ``run_rows`` consecutive processed rows and up to K = ``pack``
windows in it, a BMP image (58 bytes)::

    head   4: n (windows used, 1..K), day, first row (the run's row 0 within the date), rows used
    items  K x (1 + W): the window's start row within the run, its labels
    data   L x C: the rows

Window ``j`` of a record is ``data[start_j : start_j + T]``; a record repeats only the rows its
last window shares with the next record's first (T - 1 at stride 1). By default (``shardgen.config``)
K = ``default_pack`` / stride, rounded up, and L = T + (K - 1) * stride: at T = 60, C = 32 a record
of 512 windows stores each row about 1.1 times (64 windows: 1.9 times). Runs are cut
greedily over the sorted window starts and written in a pseudo-random order seeded by the date;
unused item and row slots are zero. The key words are the run's first row and the first item's
first label.
"""

from __future__ import annotations

import numpy as np

from shardgen.format.codec import HEAD_FLOATS, Columns, Decoded, Packed, date_rng, fail_where, payload_words, positive
from shardgen.format.framing import BMP_1X1

__all__ = ["Runs", "cut_runs"]


def cut_runs(starts: np.ndarray, k: int, run_rows: int, t: int) -> list[tuple[int, int]]:
    """Greedy runs over sorted starts: ``[j0, j1)`` windows whose rows fit in ``run_rows``."""
    out, j0, n = [], 0, len(starts)
    while j0 < n:
        fit = int(np.searchsorted(starts, starts[j0] + run_rows - t, side="right"))
        j1 = min(j0 + k, fit, n)
        out.append((j0, j1))
        j0 = j1
    return out


class Runs(Packed):
    kind = "runs"
    image = BMP_1X1
    rows = True
    default_pack = 512  # windows per record at stride 1 (``shardgen.config`` divides it by the stride)

    def validate(self, layout) -> None:
        positive(layout.pack, "store.pack")
        positive(layout.run_rows, "store.run_rows")

    def check_schema(self, schema) -> None:
        if schema.layout.run_rows < schema.time_steps:
            raise ValueError(f"store.run_rows {schema.layout.run_rows} must be >= time_steps {schema.time_steps}")

    def key_words(self, schema) -> tuple[int, ...]:
        return (2, HEAD_FLOATS + 1)  # the run's first row, the first item's first label

    def data_floats(self, schema) -> int:
        return schema.layout.run_rows * schema.num_inputs

    def slot_shape(self, schema) -> tuple[int, ...]:
        return (schema.layout.run_rows, schema.num_inputs)

    def encode(self, ws, schema, day: int):
        if not ws.is_runs:
            raise ValueError("layout 'runs' needs rows and starts (a RunSpec), got windows")
        k, t, shape = schema.pack, schema.time_steps, self.slot_shape(schema)
        order = np.argsort(ws.starts, kind="stable")
        starts = ws.starts[order]
        items = self.item_rows(ws, schema)[order]
        runs = cut_runs(starts, k, schema.layout.run_rows, t)
        runs = [runs[i] for i in date_rng(day).permutation(len(runs))]
        isl, dsl = schema.items_slice, schema.data_slice

        def fill(fl: np.ndarray, b0: int, b1: int) -> None:
            fl[:] = 0
            for r in range(b0, b1):
                j0, j1 = runs[r]
                base = int(starts[j0])
                used = int(starts[j1 - 1]) + t - base
                row = fl[r - b0]
                row[:HEAD_FLOATS] = (j1 - j0, day, base, used)
                slots = row[isl].reshape(k, -1)
                slots[:j1 - j0] = items[j0:j1]
                slots[:j1 - j0, 0] = starts[j0:j1] - base
                row[dsl].reshape(shape)[:used] = ws.rows[base:base + used]

        return len(runs), fill

    def check(self, cols: Columns, n_rec: int, schema, day: int) -> np.ndarray:
        head, counts = self.check_head(cols, schema, day)
        k, t, run_rows = schema.pack, schema.time_steps, schema.layout.run_rows
        rows = head[:, 3]
        fail_where((rows != np.floor(rows)) | (rows < t) | (rows > run_rows),
                   f"rows used is not an integer in [{t}, {run_rows}]")
        isl = schema.items_slice
        starts = payload_words(cols, isl.start, isl.stop).reshape(n_rec, k, schema.item_floats)[:, :, 0]
        used = np.arange(k)[None, :] < counts[:, None]
        bad = used & ((starts != np.floor(starts)) | (starts < 0) | (starts + t > rows[:, None]))
        fail_where(bad.any(axis=1), "a window start lies outside the run's rows")
        return counts

    def decode(self, payload: np.ndarray, schema) -> Decoded:
        counts, items, data = self.split(payload, schema)
        return Decoded(counts, payload[:, 1], items[:, :, 1:], data.reshape((len(payload),) + self.slot_shape(schema)),
                       items[:, :, 0].astype(np.int64))

    def unpack(self, payload: np.ndarray, schema):
        d = self.decode(payload[None], schema)
        n, base = int(d.counts[0]), int(payload[2])
        starts = d.starts[0, :n]
        x = d.data[0][starts[:, None] + np.arange(schema.time_steps)]
        return x, d.labels[0, :n], np.full(n, d.day[0], np.float32), base + starts
