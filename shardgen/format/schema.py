"""What one sample holds (:class:`Schema`) and how samples become records (:class:`Layout`);
both are part of the store's identity (``fingerprint``), written into the manifest.

Dates are stored as day numbers (days since 1970-01-01), exact in float32.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from shardgen.format.codec import HEAD_FLOATS, Codec, positive
from shardgen.format.framing import MAX_RECORD_BYTES, record_bytes
from shardgen.format.registry import KINDS, codec_for

__all__ = ["LabelSpec", "Layout", "Schema", "day_number", "from_day_number", "schema_changes"]

_EPOCH = dt.date(1970, 1, 1)


def day_number(date: dt.date) -> int:
    """Days since 1970-01-01."""
    return (date - _EPOCH).days


def from_day_number(day: int) -> dt.date:
    return _EPOCH + dt.timedelta(days=int(day))


@dataclass(frozen=True)
class LabelSpec:
    """One label of a sample: a name and how many float32 values it has."""

    name: str
    width: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"label name {self.name!r} must be a Python identifier")
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 1:
            raise ValueError(f"label {self.name!r}: width must be an integer >= 1, got {self.width!r}")


@dataclass(frozen=True)
class Layout:
    """How samples become records: ``samples`` (one per record), ``windows`` (``pack`` per
    record) or ``runs`` (``run_rows`` consecutive rows and up to ``pack`` windows in them);
    each is specified by its codec module."""

    kind: str = "samples"
    pack: int = 1
    run_rows: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout must be one of {', '.join(KINDS)}, got {self.kind!r}")
        self.codec.validate(self)

    @property
    def codec(self) -> Codec:
        return codec_for(self.kind)

    def to_json(self) -> dict:
        return {"kind": self.kind, "pack": self.pack, "run_rows": self.run_rows}

    @classmethod
    def from_json(cls, obj: object) -> Layout:
        if obj is None:  # format shardgen/1: one sample per record
            return cls()
        return cls(str(obj["kind"]), obj["pack"], obj["run_rows"])


@dataclass(frozen=True)
class Schema:
    """What one sample holds; ``labels`` always ends with ``date`` (width 1)."""

    time_steps: int
    num_inputs: int
    data_name: str
    labels: tuple[LabelSpec, ...]
    layout: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        for key in ("time_steps", "num_inputs"):
            positive(getattr(self, key), f"schema.{key}")
        if not isinstance(self.data_name, str) or not self.data_name.isidentifier():
            raise ValueError(f"schema.data_name {self.data_name!r} must be a Python identifier")
        names = [lab.name for lab in self.labels]
        if not names or names[-1] != "date" or self.labels[-1].width != 1:
            raise ValueError("schema labels must end with 'date' of width 1")
        dupes = {n for n in names if names.count(n) > 1} | ({self.data_name} & set(names))
        if dupes:
            raise ValueError(f"schema names must be unique, repeated: {sorted(dupes)}")
        self.codec.check_schema(self)
        if self.record_bytes > MAX_RECORD_BYTES:
            raise ValueError(
                f"a record would be {self.record_bytes} bytes; RecordIO records must stay under 2^29"
            )

    @classmethod
    def create(cls, *, time_steps: int, num_inputs: int, data_name: str,
               labels: Sequence[LabelSpec], layout: Layout = Layout()) -> Schema:
        """A schema from the user's labels, with ``date`` appended."""
        if any(lab.name == "date" for lab in labels):
            raise ValueError("the label 'date' is added by shardgen; leave it out of schema.labels")
        return cls(time_steps, num_inputs, data_name, tuple(labels) + (LabelSpec("date", 1),), layout)

    @property
    def codec(self) -> Codec:
        return self.layout.codec

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def x_floats(self) -> int:
        return self.time_steps * self.num_inputs

    @property
    def label_floats(self) -> int:
        """W: the user labels' floats (``date`` excluded)."""
        return sum(lab.width for lab in self.labels[:-1])

    @property
    def pack(self) -> int:
        """K: samples (windows) a record holds at most."""
        return self.layout.pack

    @property
    def item_floats(self) -> int:
        """Packed layouts: one item slot (the item's index, then its user labels)."""
        return 1 + self.label_floats

    @property
    def record_floats(self) -> int:
        """F: the number of float32 values in a record's header label."""
        return self.codec.record_floats(self)

    @property
    def image(self) -> bytes:
        return self.codec.image

    @property
    def record_bytes(self) -> int:
        """Bytes of one framed record on disk (when no magic word forces a split)."""
        return record_bytes(self.record_floats, self.image)

    @property
    def items_slice(self) -> slice:
        """Packed layouts: where the K item slots sit in the payload."""
        return slice(HEAD_FLOATS, HEAD_FLOATS + self.pack * self.item_floats)

    @property
    def data_slice(self) -> slice:
        """Packed layouts: where the windows (or the run's rows) sit in the payload."""
        return slice(self.items_slice.stop, self.record_floats)

    @property
    def key_words(self) -> tuple[int, ...]:
        """The payload words that tell a record apart within its date (see the codec); empty when
        records are never shared between parts."""
        return self.codec.key_words(self)

    # -- identity -------------------------------------------------------------------------------

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of everything that decides how a record is laid out (computed once: every
        shard check of every epoch compares it)."""
        core = self._core()
        if self.codec.format == 1:  # format 1's digest, unchanged: old stores still match
            blob = {"layout": 1, **core}
        else:
            blob = {"layout": 2, **core, "record": self.layout.to_json()}
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]

    def _core(self) -> dict:
        return {
            "time_steps": self.time_steps,
            "num_inputs": self.num_inputs,
            "data_name": self.data_name,
            "labels": [{"name": lab.name, "width": lab.width} for lab in self.labels],
        }

    def to_json(self) -> dict:
        out = {**self._core(), "record_floats": self.record_floats, "fingerprint": self.fingerprint}
        if self.codec.format != 1:
            out["layout"] = self.layout.to_json()
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Schema:
        """Parse the manifest's ``schema`` object; raises ValueError/KeyError/TypeError if off."""
        labels = tuple(LabelSpec(str(lab["name"]), lab["width"]) for lab in obj["labels"])
        schema = cls(obj["time_steps"], obj["num_inputs"], obj["data_name"], labels,
                     Layout.from_json(obj.get("layout")))
        if obj.get("record_floats") != schema.record_floats:
            raise ValueError(f"record_floats {obj.get('record_floats')} != {schema.record_floats}")
        if obj.get("fingerprint") != schema.fingerprint:
            raise ValueError(f"fingerprint {obj.get('fingerprint')} != {schema.fingerprint}")
        return schema


def _labels_text(labels) -> str:
    return "[" + ", ".join(f"{lab.name}:{lab.width}" for lab in labels if lab.name != "date") + "]"


def schema_changes(old: Schema, new: Schema) -> list[str]:
    """Each field that differs between ``old`` and ``new``, named as the config names it, ``old -> new``
    (``store.run_rows`` follows ``time_steps``, ``store.pack`` and ``[process] stride``)."""
    pairs = [("schema.time_steps", old.time_steps, new.time_steps),
             ("schema.num_inputs", old.num_inputs, new.num_inputs),
             ("schema.data_name", old.data_name, new.data_name),
             ("schema.labels", _labels_text(old.labels), _labels_text(new.labels)),
             ("store.layout", old.layout.kind, new.layout.kind),
             ("store.pack", old.layout.pack, new.layout.pack),
             ("store.run_rows (time_steps + (pack - 1) * [process] stride)", old.layout.run_rows,
              new.layout.run_rows)]
    changes = [f"{name} {a} -> {b}" for name, a, b in pairs if a != b]
    if not changes and old.fingerprint != new.fingerprint:  # the record format itself (format 1 -> 2)
        changes.append(f"record format {old.codec.format} -> {new.codec.format}")
    return changes


def unpack_samples(payload, schema: Schema):
    """The samples of one record's payload (``header.label`` from ``mx.recordio.unpack``), for any
    layout: ``x (n, T, C)``, user labels ``(n, W)``, days ``(n,)`` and each sample's position in its
    date (``samples``: 0; ``windows``: the window's number; ``runs``: its start row)."""
    return schema.codec.unpack(np.asarray(payload, np.float32), schema)
