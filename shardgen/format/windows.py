"""Layout ``windows``: K = ``pack`` windows per record, a BMP image (58 bytes)::

    head   4: n (windows used, 1..K), day, 0, 0
    items  K x (1 + W): the window's number within the date, its labels (W = user label floats)
    data   K x T*C: the windows, row-major

A date's windows are packed in a fixed pseudo-random order seeded by the date; unused slots are
zero. The key words are the first item's window number and its first label.
"""

from __future__ import annotations

import numpy as np

from shardgen.format.codec import Columns, Decoded, Packed, date_rng
from shardgen.format.framing import BMP_1X1

__all__ = ["Windows"]


class Windows(Packed):
    kind = "windows"
    image = BMP_1X1
    default_pack = 8

    def data_floats(self, schema) -> int:
        return schema.pack * schema.x_floats

    def slot_shape(self, schema) -> tuple[int, ...]:
        return (schema.pack, schema.time_steps, schema.num_inputs)

    def encode(self, ws, schema, day: int):
        k = schema.pack
        order = date_rng(day).permutation(ws.n)
        items = self.item_rows(ws, schema)
        items[:, 0] = np.arange(ws.n)
        isl, dsl = schema.items_slice, schema.data_slice
        shape = (k, schema.time_steps, schema.num_inputs)

        def fill(fl: np.ndarray, b0: int, b1: int) -> None:
            fl[:] = 0
            for r in range(b0, b1):
                sel = order[r * k:(r + 1) * k]
                row = fl[r - b0]
                row[0], row[1] = len(sel), day
                row[isl].reshape(k, -1)[:len(sel)] = items[sel]
                row[dsl].reshape(shape)[:len(sel)] = ws.windows(sel)

        return -(-ws.n // k), fill

    def check(self, cols: Columns, n_rec: int, schema, day: int) -> np.ndarray:
        return self.check_head(cols, schema, day)[1]

    def decode(self, payload: np.ndarray, schema) -> Decoded:
        counts, items, data = self.split(payload, schema)
        return Decoded(counts, payload[:, 1], items[:, :, 1:], data.reshape((len(payload),) + self.slot_shape(schema)),
                       None)

    def unpack(self, payload: np.ndarray, schema):
        d = self.decode(payload[None], schema)
        n = int(d.counts[0])
        items = self.split(payload[None], schema)[1][0, :n]
        return d.data[0, :n], d.labels[0, :n], np.full(n, d.day[0], np.float32), items[:, 0]
