"""A shard's sidecar ``<date>.json`` (per version ``<date>.v<k>.json``): written last, its presence
marks the shard complete; it says what the ``.rec`` and ``.idx`` hold, and which schema made them.
A date with no windows gets an empty marker (``records`` 0, no files named)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Optional

from shardgen.errors import ShardError
from shardgen.store.manifest import CHECKSUMS, ShardEntry
from shardgen.store.naming import check_date, check_name

__all__ = ["Sidecar"]

_OPTIONAL = ("windows", "distinct", "checksum")  # keys sidecars of older versions do not have
_TYPES = {"records": (Integral,), "bytes": (Integral,), "idx_bytes": (Integral,), "windows": (Integral,),
          "sha256": (str,), "fingerprint": (str,), "rec": (str,), "idx": (str,), "checksum": (str,),
          "distinct": (bool, type(None))}


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
        for key, kinds in _TYPES.items():
            value = getattr(self, key)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ValueError(f"sidecar {self.date}: {key} {value!r} is not {kinds[0].__name__}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"sidecar {self.date}: checksum {self.checksum!r}, expected one of {CHECKSUMS}")

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if (k != "distinct" or v is not None) and (k != "checksum" or v)}

    def entry(self) -> ShardEntry:
        return ShardEntry(self.date, self.rec, self.idx, self.records, self.bytes, self.sha256, self.windows,
                          self.distinct, self.checksum)

    def differences(self, entry: ShardEntry, fingerprint: str) -> list[str]:
        """What this sidecar says otherwise than the manifest's ``entry`` of its shard and the
        manifest's schema ``fingerprint`` (empty: it is the one published with the shard)."""
        out = [f"fingerprint {self.fingerprint!r}, the manifest's schema has {fingerprint!r}"] \
            if self.fingerprint != fingerprint else []
        for key in ShardEntry.__dataclass_fields__:
            mine, theirs = getattr(self, key), getattr(entry, key)
            if mine != theirs:
                out.append(f"{key} {mine!r}, the manifest says {theirs!r}")
        return out

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
