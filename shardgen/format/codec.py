"""What a codec is: one per record layout (``[store] layout``), the only place that knows what a
payload holds. The writer encodes with it, the shard check and the loader's shuffle buffer
decode with it; :mod:`.registry` maps a layout's name to its codec.

A codec is a stateless object with these members (the schema is passed in; codecs import no
schema, so a layout is one module):

``kind``, ``image``, ``format``
    the layout's name, the constant 1x1 image its records carry, and the manifest format
    (1: one sample per record, readable by old loaders; 2: packed).
``validate(layout)`` / ``check_schema(schema)``
    raise ValueError if the layout's knobs (``pack``, ``run_rows``) or the schema do not fit.
``record_floats(schema)``
    F, the payload's length in float32 words.
``key_words(schema)``
    payload words that tell a record apart within its date (empty: never shared by two parts).
``encode(windows, schema, day)``
    ``(records, fill)``: how many records a date's windows make, and ``fill(block, first, stop)``
    that writes their payloads into ``block`` (``(stop - first, F)`` float32).
``check(cols, records, schema, day)``
    the windows in each record, checked from the payload words the reader relies on;
    ``cols(a, b)`` gives words ``a..b-1`` of every record as uint32; raises :class:`Damage`.
``counts(cols, records, schema)``
    the windows in each record, unchecked (``verify = "none"``).
``slot_shape(schema)`` / ``rows``
    the shape one record's data takes in the shuffle buffer; ``rows`` is True when it holds a
    run of rows (window ``j`` is ``rows[start_j : start_j + T]``), else K whole windows.
``decode(payload, schema)``
    a :class:`Decoded` from records ``(m, F)`` as MXNet returns them.
``unpack(payload, schema)``
    one record's windows ``x (n, T, C)``, user labels ``(n, W)``, days ``(n,)`` and positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from shardgen.format.framing import PAYLOAD_WORD

__all__ = ["Codec", "Damage", "Decoded", "Columns", "HEAD_FLOATS", "positive", "date_rng"]

HEAD_FLOATS = 4  # packed records: n, day, first row, rows used
Columns = Callable[[int, int], np.ndarray]  # cols(a, b): words a..b-1 of every record, (n, b - a) uint32


class Damage(Exception):
    """Record ``record`` (of the records checked) is not what its layout allows."""

    def __init__(self, record: object, what: str):
        super().__init__(what)
        self.record, self.what = record, what


def fail_where(mask: np.ndarray, what: str) -> None:
    if mask.any():
        raise Damage(int(np.flatnonzero(mask)[0]), what)


def positive(value: object, what: str, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")


def date_rng(day: int) -> np.random.Generator:
    """The fixed pseudo-random order of a date's windows and runs in its records: seeded by the
    date alone, so a rebuild writes the same bytes."""
    return np.random.default_rng(day + 0x5EED)


def payload_words(cols: Columns, a: int, b: int) -> np.ndarray:
    """Payload words ``a..b-1`` of every record, as float32."""
    return cols(PAYLOAD_WORD + a, PAYLOAD_WORD + b).view("<f4")


@dataclass
class Decoded:
    """Records as the shuffle buffer keeps them."""

    counts: np.ndarray  # (m,) windows used
    day: np.ndarray  # (m,) float32
    labels: np.ndarray  # (m, K, W) user labels per item slot
    data: np.ndarray  # (m, *slot_shape)
    starts: Optional[np.ndarray]  # (m, K) window starts within the rows (``rows`` codecs)


class Codec:
    """Defaults shared by every layout; see the module docstring for the contract."""

    kind = ""
    format = 2
    rows = False
    default_pack = 1

    def validate(self, layout) -> None:
        positive(layout.pack, "store.pack")
        if layout.run_rows:
            raise ValueError(f"store.run_rows is only used with layout 'runs', not {layout.kind!r}")

    def check_schema(self, schema) -> None:
        pass

    def key_words(self, schema) -> tuple[int, ...]:
        return ()


class Packed(Codec):
    """Layouts of K items per record: a head of 4 words, K item slots (the item's index, then its
    user labels: ``schema.items_slice``), then the data (``schema.data_slice``)."""

    def data_floats(self, schema) -> int:
        raise NotImplementedError

    def record_floats(self, schema) -> int:
        return schema.items_slice.stop + self.data_floats(schema)

    def key_words(self, schema) -> tuple[int, ...]:
        """The item index of the first slot's (or the run's first row), then the first label."""
        return (HEAD_FLOATS, HEAD_FLOATS + 1)

    @staticmethod
    def item_rows(ws, schema) -> np.ndarray:
        """(n, 1 + W): a slot for the item's index, then every user label, in schema order."""
        out = np.zeros((ws.n, 1 + schema.label_floats), np.float32)
        col = 1
        for lab in schema.labels[:-1]:
            out[:, col:col + lab.width] = ws.labels[lab.name]
            col += lab.width
        return out

    def counts(self, cols: Columns, n_rec: int, schema) -> np.ndarray:
        return np.clip(payload_words(cols, 0, 1)[:, 0].astype(np.int64), 0, schema.pack)

    def check_head(self, cols: Columns, schema, day: int) -> tuple[np.ndarray, np.ndarray]:
        """The head words of every record, checked; (head (m, 4), counts (m,))."""
        k = schema.pack
        head = payload_words(cols, 0, HEAD_FLOATS)
        n = head[:, 0]
        fail_where((n != np.floor(n)) | (n < 1) | (n > k), f"items used is not an integer in [1, {k}]")
        fail_where(head[:, 1] != day, f"day field is not {day}")
        return head, n.astype(np.int64)

    def split(self, payload: np.ndarray, schema) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Records ``(m, F)``: counts, items ``(m, K, 1 + W)`` and data ``(m, data floats)``."""
        m = len(payload)
        items = payload[:, schema.items_slice].reshape(m, schema.pack, schema.item_floats)
        return payload[:, 0].astype(np.int64), items, payload[:, schema.data_slice]
