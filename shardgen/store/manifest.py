"""The rolling manifest, its immutable per-generation snapshots and the per-shard sidecar.

Shared by the writer (shardgen) and the reader (loader). Format ``shardgen/2``:

``<store>/generations/<N>.json``
    The snapshot of generation ``N``: the full manifest as it was published. Written (temp,
    fsync, rename) *before* ``manifest.json`` names ``N``, and never changed afterwards, so a
    reader can open generation ``N`` exactly for as long as the snapshot is kept. gc removes a
    snapshot once it is not the newest, no live reader lease names it or an older generation,
    and it was superseded more than ``grace_s`` ago. A number is never reused: a snapshot left
    by a writer killed before it renamed ``manifest.json`` is skipped over.
``<store>/manifest.json``
    A copy of the newest snapshot (simple readers only read this file)::

        {"format": "shardgen/2", "generation": 7, "updated": "2026-01-01T00:00:00Z",
         "schema": {...}, "window": 40,
         "shards":  [{"date", "rec", "idx", "records", "bytes", "sha256"}, ...],   # sorted by date
         "retired": [{"date", "rec", "idx", "retired_at", "retired_generation"}, ...]}

    ``retired`` lists every file set that left the live list (window, or replaced by a
    rewrite) and is not deleted yet; it may list a date more than once (one per version).
Shard files are immutable: version 1 of a date is ``<date>.rec|.idx|.json``, a rewrite
(``build --force``) writes version ``k`` as ``<date>.v<k>.rec|.idx|.json`` and publishes it in a
new generation; the old files are retired like any others. Every name read from a manifest,
snapshot or sidecar must be a plain file name inside the store (no ``/``, not starting with
``.``, no NUL or ``;``): anything else is refused before any open or unlink.

Format ``shardgen/1`` (no snapshots, ``retired`` one entry per date) is read as is and
written as ``shardgen/2`` at the next publish. Readers never lock; the single writer (under
the manifest lock) bumps ``generation`` on every change.

The file names (``MANIFEST_NAME``, snapshot paths, shard stems and versions) are built in
``naming`` (``MANIFEST_NAME`` and ``SNAPSHOT_DIR`` are imported from there, their one home).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from shardgen.clock import parse_utc, utc_now
from shardgen.errors import ManifestError
from shardgen.format.framing import CHECKSUM
from shardgen.format.schema import Schema
from shardgen.store.naming import check_date, check_name, sidecar_of

__all__ = ["FORMAT", "CHECKSUMS", "declared_format", "ShardEntry", "RetiredEntry", "Manifest", "utc_now",
           "parse_utc", "check_name"]

FORMAT = "shardgen/2"
READABLE_FORMATS = ("shardgen/1", FORMAT)
CHECKSUMS = ("", CHECKSUM)  # a shard's ``checksum``: none (written before record checksums), or CRC32 per record


def declared_format(data: bytes) -> Optional[str]:
    """The format a manifest's bytes declare (None: not a JSON object naming one)."""
    try:
        found = json.loads(data).get("format")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


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
    distinct: Optional[bool] = None  # written 2026-12-05 only (records told apart by key); read by nothing, kept
    checksum: str = ""  # "crc32": every record carries its payload's CRC32 (shardgen.format.framing); "": older

    def __post_init__(self) -> None:
        check_date(self.date, "shard")
        for name in (self.rec, self.idx):
            check_name(name, f"shard {self.date}")
        if self.records < 1 or self.bytes < 1:
            raise ValueError(f"shard {self.date}: records and bytes must be >= 1")
        if self.windows < 0:
            raise ValueError(f"shard {self.date}: windows must be >= 0, got {self.windows}")
        if self.checksum not in CHECKSUMS:  # an unknown one would read as "no checksums": checked less
            raise ValueError(f"shard {self.date}: checksum {self.checksum!r}, expected {CHECKSUM!r} or none")

    @property
    def samples(self) -> int:
        return self.windows or self.records

    @property
    def sidecar(self) -> Optional[str]:
        """The sidecar's file name (per version, next to the ``.rec``)."""
        return sidecar_of(self.rec)

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        if not self.windows:
            del out["windows"]
        if self.distinct is None:
            del out["distinct"]
        if not self.checksum:
            del out["checksum"]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> ShardEntry:
        try:  # a new generation lists all but a few of the entries parsed before: taken as they were
            key = tuple((k, type(v), v) for k, v in obj.items())
            hit = _PARSED.get(key)
        except (TypeError, AttributeError):  # not a flat dict: parsed (and refused) below
            key = hit = None
        if hit is not None:
            return hit
        entry = cls(str(obj["date"]), str(obj["rec"]), str(obj["idx"]), int(obj["records"]),
                    int(obj["bytes"]), str(obj["sha256"]), int(obj.get("windows", 0)),
                    None if obj.get("distinct") is None else bool(obj["distinct"]), str(obj.get("checksum", "")))
        if key is not None:
            if len(_PARSED) >= 1 << 16:
                _PARSED.clear()
            _PARSED[key] = entry
        return entry


_PARSED: dict = {}  # ShardEntry.from_json's: an entry's JSON items (with their types) -> the entry


@dataclass(frozen=True)
class RetiredEntry:
    """A shard that left the window; its files stay until garbage collection deletes them."""

    date: str
    rec: str
    idx: str
    retired_at: str
    retired_generation: int = 0  # the first generation that no longer lists the shard

    def __post_init__(self) -> None:
        check_date(self.date, "retired shard")
        for name in (self.rec, self.idx):
            check_name(name, f"retired shard {self.date}")
        try:
            parse_utc(self.retired_at)
        except ValueError:
            raise ValueError(f"retired shard {self.date}: retired_at {self.retired_at!r} is not "
                             "YYYY-MM-DDTHH:MM:SSZ") from None

    @property
    def sidecar(self) -> Optional[str]:
        return sidecar_of(self.rec)

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

    def files(self) -> set[str]:
        """Every file name the live shards use (``.rec``, ``.idx`` and sidecar)."""
        return {n for s in self.shards for n in (s.rec, s.idx, s.sidecar) if n}

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
        if obj.get("format") not in READABLE_FORMATS:
            raise ManifestError(f"{where}: format {obj.get('format')!r}, expected one of {READABLE_FORMATS}")
        try:
            manifest = cls(
                schema=Schema.from_json(obj["schema"]),
                window=int(obj["window"]),
                generation=int(obj["generation"]),
                updated=str(obj.get("updated", "")),
                shards=tuple(ShardEntry.from_json(s) for s in obj["shards"]),
                retired=tuple(RetiredEntry.from_json(r) for r in obj.get("retired", ())),
            )
        except ValueError as exc:
            raise ManifestError(f"{where}: refused: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None
        manifest.check_counts(where)
        return manifest

    def check_counts(self, where: str) -> None:
        """ManifestError unless every shard states how many windows it holds: a packed layout's entry
        must carry ``windows`` (>= 1; a reader cannot count them from ``records``), a one-sample-per-record
        entry may leave it out but not contradict ``records``."""
        packed = self.schema.layout.kind != "samples"
        for s in self.shards:
            if packed and s.windows < 1:
                raise ManifestError(f"{where}: refused: shard {s.date} ({s.rec}) gives no window count "
                                    f"(\"windows\": {s.windows or 'missing'}); the {self.schema.layout.kind!r} "
                                    "layout packs several windows in a record, so it must be >= 1")
            if not packed and s.windows and s.windows != s.records:
                raise ManifestError(f"{where}: refused: shard {s.date} ({s.rec}) says {s.windows} windows in "
                                    f"{s.records} records; the 'samples' layout holds one window per record")

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """Read a manifest; ManifestError names the file and what is wrong."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ManifestError(f"{path}: no manifest (run `shardgen build` first)") from None
        except OSError as exc:
            raise ManifestError(f"{path}: cannot read ({exc.strerror})") from None
        return cls.parse(data, str(path))  # a byte that is not UTF-8 is "not valid JSON", naming the file

    def dumps(self) -> bytes:
        """The bytes of ``manifest.json`` and of a snapshot."""
        return (json.dumps(self.to_json(), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, text: bytes, where: str) -> Manifest:
        """A manifest from its bytes; ManifestError naming ``where`` if they are not one."""
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from None
        return cls.from_json(obj, where=where)
