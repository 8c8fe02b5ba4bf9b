"""A shard's sidecar ``<date>.json`` (per version ``<date>.v<k>.json``): written last, its presence
marks the shard complete; it says what the ``.rec`` and ``.idx`` hold, and which schema made them.
A date with no windows gets an empty marker (``records`` 0, no files named)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from shardgen.errors import ShardError
from shardgen.store.manifest import ShardEntry
from shardgen.store.naming import check_date, check_name

__all__ = ["Sidecar"]

_OPTIONAL = ("windows", "distinct", "checksum")  # keys sidecars of older versions do not have


@dataclass(frozen=True)
class Sidecar:
    """``<date>.json``: written last, its presence marks a shard complete."""

    date: str
    records: int
    bytes: int
    sha256: str
    idx_bytes: int
    fingerprint: str
    rec: str
    idx: str
    windows: int = 0
    distinct: Optional[bool] = None  # every record told apart by key words and window count (None: not said)
    checksum: str = ""  # "crc32": every record carries the CRC32 of its payload ("": written before 2026-12-06)

    def __post_init__(self) -> None:
        check_date(self.date, "sidecar")
        if self.records:  # an empty-date marker (records 0) names no files
            for name in (self.rec, self.idx):
                check_name(name, f"sidecar {self.date}")

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if (k != "distinct" or v is not None) and (k != "checksum" or v)}

    def entry(self) -> ShardEntry:
        return ShardEntry(self.date, self.rec, self.idx, self.records, self.bytes, self.sha256, self.windows,
                          self.distinct, self.checksum)

    @classmethod
    def load(cls, path: Path) -> Optional[Sidecar]:
        """The sidecar at ``path``, or None if there is none; ShardError if it is malformed."""
        try:
            text = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ShardError(f"{path}: malformed sidecar ({exc})") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: bytes, where: str) -> Sidecar:
        """A sidecar from its bytes; ShardError naming ``where`` if they are not one."""
        try:
            obj = json.loads(text)
            return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj or k not in _OPTIONAL})
        except (ValueError, KeyError, TypeError) as exc:
            raise ShardError(f"{where}: malformed sidecar ({exc})") from None
