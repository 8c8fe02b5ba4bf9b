"""Every file name in a store, built and parsed in one place (what the files hold is elsewhere).

``<store>/``
    ``manifest.json`` (``MANIFEST_NAME``), ``generations/<N>.json`` (``SNAPSHOT_DIR``, one snapshot per
    generation), the shard files of version ``k`` of a date: ``<date>.rec|.idx|.json`` for ``k = 1``,
    ``<date>.v<k>.rec|.idx|.json`` after a rewrite (``.json`` is the sidecar), the locks
    ``.manifest.lock`` and ``.watch.lock``, the watcher's ``.watch-state.json`` and
    ``.watch-heartbeat.json``, and ``leases/<host token>-<pid>-<random>.json`` plus ``leases/.clock``.

Every name read from a manifest, snapshot or sidecar must be a plain file name inside the store
(``check_name``). Temp files (``.<name>.tmp-<host token>-<pid>-<random>``) are named in ``fsutil``,
next to the host token they carry.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import uuid
from pathlib import Path
from typing import Optional

from shardgen.fsutil import HOST_TOKEN

__all__ = ["MANIFEST_NAME", "SNAPSHOT_DIR", "MANIFEST_LOCK", "WATCH_LOCK", "WATCH_STATE", "WATCH_HEARTBEAT",
           "LEASE_DIR", "CLOCK_NAME", "check_date", "check_name", "shard_stem", "name_version", "shard_paths",
           "sidecar_of", "sidecar_name", "date_file_names", "dated_sidecars", "snapshot_name", "snapshot_path",
           "snapshot_generations", "new_lease_name", "lease_pid_of_this_host"]

MANIFEST_NAME = "manifest.json"
SNAPSHOT_DIR = "generations"
MANIFEST_LOCK = ".manifest.lock"  # held briefly by whoever publishes a new manifest generation
WATCH_LOCK = ".watch.lock"  # held for its lifetime by the one watcher of a store
WATCH_STATE = ".watch-state.json"
WATCH_HEARTBEAT = ".watch-heartbeat.json"  # kept fresh by a running watcher, removed when it stops
LEASE_DIR = "leases"
CLOCK_NAME = ".clock"  # touched by gc: its mtime is "now" by the store filesystem's clock
_VERSION_RE = re.compile(r"^\d{4}-\d{2}-\d{2}\.v(\d+)\.[a-z]+$")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def check_date(value: object, where: str) -> str:
    """``value`` if it is a date written YYYY-MM-DD; ValueError saying so otherwise."""
    try:
        if not _DATE_RE.match(str(value)):
            raise ValueError
        dt.date.fromisoformat(str(value))
    except ValueError:
        raise ValueError(f"{where}: date {value!r} is not YYYY-MM-DD") from None
    return str(value)


def check_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name inside the store; ValueError saying why not otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: file name {name!r} is empty or not a string")
    if "/" in name or "\\" in name or "\0" in name or ";" in name or name.startswith("."):
        raise ValueError(f"{where}: file name {name!r} is not a plain file name inside the store "
                         "(no '/', '\\', NUL or ';', no leading '.')")
    return name


def shard_stem(date: str, version: int = 1) -> str:
    """File name stem of version ``version`` of a date's shard: ``<date>`` or ``<date>.v<k>``."""
    if version < 1:
        raise ValueError(f"shard {date}: version must be >= 1, got {version}")
    return date if version == 1 else f"{date}.v{version}"


def name_version(name: str) -> int:
    """The version a shard file name carries (1 for ``<date>.<ext>``)."""
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else 1


def shard_paths(store: Path, date: dt.date, version: int = 1) -> dict[str, Path]:
    """The ``rec``, ``idx`` and ``json`` (sidecar) paths of version ``version`` of a date's shard."""
    name = shard_stem(date.isoformat(), version)  # version 1: <date>.<ext>; k > 1: <date>.v<k>.<ext>
    return {ext: Path(store) / f"{name}.{ext}" for ext in ("rec", "idx", "json")}


def sidecar_of(rec: str) -> Optional[str]:
    """The sidecar's file name of a ``.rec`` file name (per version, next to it)."""
    return rec[: -len(".rec")] + ".json" if rec.endswith(".rec") and len(rec) > len(".rec") else None


def date_file_names(store: Path, date: dt.date) -> list[str]:
    """The names of the files on disk of every version of a date's shard."""
    return [p.name for p in Path(store).glob(f"{date.isoformat()}.*")]


def dated_sidecars(store: Path) -> list[tuple[dt.date, Path]]:
    """``(date, path)`` of every version-1 sidecar (``<date>.json``) on disk, by date."""
    found = []
    for path in sorted(Path(store).glob("????-??-??.json")):
        try:
            date = dt.date.fromisoformat(path.stem)
        except ValueError:
            continue
        found.append((date, path))
    return found


def snapshot_name(generation: int) -> str:
    """The store-relative name of the snapshot of ``generation``."""
    return f"{SNAPSHOT_DIR}/{int(generation)}.json"


def sidecar_name(date: dt.date) -> str:
    """The name of version 1 of a date's sidecar (``<date>.json``)."""
    return f"{date.isoformat()}.json"


def snapshot_path(store: Path, generation: int) -> Path:
    """Where the snapshot of ``generation`` lives."""
    return Path(store) / SNAPSHOT_DIR / f"{int(generation)}.json"


def snapshot_generations(store: Path) -> list[int]:
    """The generations whose snapshot is on disk, ascending."""
    folder = Path(store) / SNAPSHOT_DIR
    if not folder.is_dir():
        return []
    return sorted(int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit())


def new_lease_name() -> str:
    """A fresh reader lease's file name (in ``LEASE_DIR``), naming this host, namespace and process."""
    return f"{HOST_TOKEN}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"


_THIS_HOSTS_LEASE = re.compile(rf"^{re.escape(HOST_TOKEN)}-(?P<pid>\d+)-[0-9a-f]{{8}}\.json$")


def lease_pid_of_this_host(name: str) -> Optional[int]:
    """The pid in a lease name ``new_lease_name`` made on this host, pid namespace and boot; None
    for any other name (another host's, an older format's)."""
    m = _THIS_HOSTS_LEASE.match(name)
    return int(m["pid"]) if m else None
