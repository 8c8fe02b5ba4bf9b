"""The rolling manifest ``<store>/manifest.json`` and the per-shard sidecar, as dataclasses.

Shared by the writer (shardgen) and the reader (loader). Readers never lock; the single writer
replaces the file atomically and bumps ``generation`` on every change.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from .errors import ManifestError, ShardError
from .fsutil import atomic_write
from .layout import Schema

__all__ = ["FORMAT", "MANIFEST_NAME", "ShardEntry", "RetiredEntry", "Manifest", "Sidecar", "utc_now",
           "parse_utc"]

FORMAT = "shardgen/1"
MANIFEST_NAME = "manifest.json"


_STAMP = "%Y-%m-%dT%H:%M:%SZ"


def utc_now() -> str:
    """Now, as the manifest writes times."""
    return dt.datetime.now(dt.timezone.utc).strftime(_STAMP)


def parse_utc(stamp: str) -> dt.datetime:
    """A time the manifest wrote, back as an aware datetime."""
    return dt.datetime.strptime(stamp, _STAMP).replace(tzinfo=dt.timezone.utc)


def _check_date(value: object, where: str) -> str:
    try:
        dt.date.fromisoformat(str(value))
    except ValueError:
        raise ValueError(f"{where}: date {value!r} is not YYYY-MM-DD") from None
    return str(value)


@dataclass(frozen=True)
class ShardEntry:
    """One published shard; paths are relative to the store."""

    date: str
    rec: str
    idx: str
    records: int
    bytes: int
    sha256: str
    windows: int = 0  # samples in the shard (0 in format 1 manifests: one per record)

    def __post_init__(self) -> None:
        _check_date(self.date, "shard")
        for name in (self.rec, self.idx):
            if not name or "/" in name or name.startswith(".") or ";" in name:
                raise ValueError(f"shard {self.date}: bad file name {name!r}")
        if self.records < 1 or self.bytes < 1:
            raise ValueError(f"shard {self.date}: records and bytes must be >= 1")

    @property
    def samples(self) -> int:
        return self.windows or self.records

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        if not self.windows:
            del out["windows"]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> ShardEntry:
        return cls(str(obj["date"]), str(obj["rec"]), str(obj["idx"]), int(obj["records"]),
                   int(obj["bytes"]), str(obj["sha256"]), int(obj.get("windows", 0)))


@dataclass(frozen=True)
class RetiredEntry:
    """A shard that left the window; its files stay until garbage collection deletes them."""

    date: str
    rec: str
    idx: str
    retired_at: str
    retired_generation: int = 0  # the first generation that no longer lists the shard

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, obj: dict) -> RetiredEntry:
        return cls(str(obj["date"]), str(obj["rec"]), str(obj["idx"]), str(obj["retired_at"]),
                   int(obj.get("retired_generation", 0)))


@dataclass(frozen=True)
class Manifest:
    """The store's list of live shards (sorted by date) and of retired ones."""

    schema: Schema
    window: int
    generation: int = 0
    updated: str = ""
    shards: tuple[ShardEntry, ...] = ()
    retired: tuple[RetiredEntry, ...] = field(default=())

    def __post_init__(self) -> None:
        dates = [s.date for s in self.shards]
        if dates != sorted(set(dates)):
            raise ValueError("manifest shards must be sorted by date without repeats")

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "generation": self.generation,
            "updated": self.updated,
            "schema": self.schema.to_json(),
            "window": self.window,
            "shards": [s.to_json() for s in self.shards],
            "retired": [r.to_json() for r in self.retired],
        }

    @classmethod
    def from_json(cls, obj: object, *, where: str = "manifest") -> Manifest:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected a JSON object")
        if obj.get("format") != FORMAT:
            raise ManifestError(f"{where}: format {obj.get('format')!r}, expected {FORMAT!r}")
        try:
            return cls(
                schema=Schema.from_json(obj["schema"]),
                window=int(obj["window"]),
                generation=int(obj["generation"]),
                updated=str(obj.get("updated", "")),
                shards=tuple(ShardEntry.from_json(s) for s in obj["shards"]),
                retired=tuple(RetiredEntry.from_json(r) for r in obj.get("retired", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """Read a manifest; ManifestError names the file and what is wrong."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ManifestError(f"{path}: no manifest (run `shardgen build` first)") from None
        except OSError as exc:
            raise ManifestError(f"{path}: cannot read ({exc.strerror})") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_json(obj, where=str(path))

    def save(self, path: Path) -> Manifest:
        """Write as the next generation, atomically; returns what was written."""
        new = replace(self, generation=self.generation + 1, updated=utc_now())
        atomic_write(Path(path), (json.dumps(new.to_json(), sort_keys=True, indent=1) + "\n").encode())
        return new


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

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def entry(self) -> ShardEntry:
        return ShardEntry(self.date, self.rec, self.idx, self.records, self.bytes, self.sha256, self.windows)

    @classmethod
    def load(cls, path: Path) -> Optional[Sidecar]:
        """The sidecar at ``path``, or None if there is none; ShardError if it is malformed."""
        try:
            obj = json.loads(Path(path).read_text())
            return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj or k != "windows"})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ShardError(f"{path}: malformed sidecar ({exc})") from None
