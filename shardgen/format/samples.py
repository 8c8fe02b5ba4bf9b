"""Layout ``samples`` (format 1): one sample per record, a PNG image (67 bytes)::

    payload  x (T*C, row-major), each user label in schema order, date (days since 1970-01-01)

``id2`` is the window's row within its date. Readable by any MXNet ``ImageRecordIter`` user.
"""

from __future__ import annotations

import numpy as np

from shardgen.format.codec import Codec, Columns, Decoded, fail_where, payload_words
from shardgen.format.framing import PNG_1X1

__all__ = ["Samples"]


class Samples(Codec):
    kind = "samples"
    format = 1
    image = PNG_1X1

    def validate(self, layout) -> None:
        if layout.pack != 1 or layout.run_rows:
            raise ValueError("layout 'samples' holds one sample per record (no pack, no run_rows)")

    def record_floats(self, schema) -> int:
        return schema.x_floats + schema.label_floats + 1

    def slot_shape(self, schema) -> tuple[int, ...]:
        return (1, schema.time_steps, schema.num_inputs)

    def encode(self, ws, schema, day: int):
        x_floats, shape = schema.x_floats, (schema.time_steps, schema.num_inputs)

        def fill(fl: np.ndarray, b0: int, b1: int) -> None:
            fl[:, :x_floats].reshape((b1 - b0,) + shape)[...] = ws.windows(slice(b0, b1))
            col = x_floats
            for lab in schema.labels[:-1]:
                fl[:, col:col + lab.width] = ws.labels[lab.name][b0:b1]
                col += lab.width
            fl[:, -1] = day

        return ws.n, fill

    def check(self, cols: Columns, n_rec: int, schema, day: int) -> np.ndarray:
        f = self.record_floats(schema)
        fail_where(payload_words(cols, f - 1, f)[:, 0] != day, f"date field is not day {day}")
        return np.ones(n_rec, np.int64)

    def counts(self, cols: Columns, n_rec: int, schema) -> np.ndarray:
        return np.ones(n_rec, np.int64)

    def decode(self, payload: np.ndarray, schema) -> Decoded:
        m, xf, w = len(payload), schema.x_floats, schema.label_floats
        return Decoded(np.ones(m, np.int64), payload[:, -1], payload[:, None, xf:xf + w],
                       payload[:, :xf].reshape((m,) + self.slot_shape(schema)), None)

    def unpack(self, payload: np.ndarray, schema):
        xf, w = schema.x_floats, schema.label_floats
        x = payload[:xf].reshape(1, schema.time_steps, schema.num_inputs)
        return x, payload[xf:xf + w][None], payload[-1:], np.zeros(1)
