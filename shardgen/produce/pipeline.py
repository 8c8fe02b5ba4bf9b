"""One date's pipeline: generate -> process -> shard -> into the store (``produce``).

``produce`` runs in joblib workers (or Dask workers on other machines) and only writes its own
shard files, into the store's staging folder, then moves them into the store (a store folder:
written in place already); the coordinating process alone publishes the manifest (``build``).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass
from typing import Callable, Optional

from shardgen.config import Config
from shardgen.errors import Interrupted, ShardgenError, is_environment
from shardgen.fsutil import atomic_write
from shardgen.process import run_processor
from shardgen.produce.generator import obtain_raw
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import ShardEntry
from shardgen.store.naming import shard_paths
from shardgen.store.sidecar import Sidecar

__all__ = ["DateResult", "produce", "prepare", "warm"]


@dataclass(frozen=True)
class DateResult:
    """What happened to one date: written, adopted (complete in the store already), empty or failed.
    ``run_spec``: the processor returned a ``RunSpec`` (a written date)."""

    date: dt.date
    status: str
    entry: Optional[ShardEntry] = None
    message: str = ""
    seconds: float = 0.0
    run_spec: bool = False
    environment: bool = False  # failed for the environment (store unreachable, credentials, disk full)


def prepare(cfg: Config, date: dt.date, *, force: bool, raw_only: bool) -> tuple:
    """``(sidecar, None)`` for a shard already complete (adopted), else ``(None, raw array)``:
    what comes before the windows are cut. Raises as ``obtain_raw`` does."""
    if not force:
        sidecar = cfg.store.open().complete_shard(date, cfg.schema.fingerprint)
        if sidecar is not None:
            return sidecar, None
    return None, obtain_raw(cfg, date, force=force, generate=not raw_only)


def produce(cfg: Config, date: dt.date, *, force: bool = False, raw_only: bool = False,
            ahead: Optional[Callable[[], tuple]] = None) -> DateResult:
    """Make the shard of one date. Never raises: failures come back as a result naming the date.

    ``raw_only``: use the raw file already there and never run the generator (watched drop-ins).
    ``ahead``: returns what ``prepare`` returned for this date, started earlier (``build``).
    """
    t0 = time.perf_counter()
    store = cfg.store.open()
    try:
        sidecar, raw = ahead() if ahead is not None else prepare(cfg, date, force=force, raw_only=raw_only)
        if sidecar is not None:
            store.discard_staged(date)  # in the store already: a copy a killed run left in staging goes
            status = "empty" if sidecar.records == 0 else "adopted"
            entry = sidecar.entry() if sidecar.records else None
            return DateResult(date, status, entry, "no windows", time.perf_counter() - t0)
        schema = cfg.schema
        # A forced rewrite gets new file names: published files are never written over.
        version = store.next_version(date) if force else 1
        folder = store.stage()
        windows = run_processor(cfg.process.load(), raw, date, schema, dict(cfg.process.options))
        if windows.n == 0:
            marker = Sidecar(date.isoformat(), 0, 0, "", 0, schema.fingerprint, "", "")
            path = shard_paths(folder, date, version)["json"]
            atomic_write(path, json.dumps(marker.to_json()).encode())
            store.put_shard(marker, path.name)
            return DateResult(date, "empty", None,
                              f"{raw.shape[0]} rows, fewer than time_steps={schema.time_steps}: no windows",
                              time.perf_counter() - t0)
        sidecar = write_shard(folder, date, windows, None, schema, version=version)
        store.put_shard(sidecar, shard_paths(folder, date, version)["json"].name)
        return DateResult(date, "written", sidecar.entry(), seconds=time.perf_counter() - t0, run_spec=windows.is_runs)
    except Interrupted as exc:
        return DateResult(date, "abandoned", message=str(exc), seconds=time.perf_counter() - t0)
    except ShardgenError as exc:
        return DateResult(date, "failed", message=str(exc), seconds=time.perf_counter() - t0,
                          environment=is_environment(exc))
    except (OSError, MemoryError) as exc:
        return DateResult(date, "failed", message=f"{date}: {type(exc).__name__}: {exc}",
                          seconds=time.perf_counter() - t0, environment=is_environment(exc))


def warm() -> None:
    """Nothing; a worker process that runs it has imported this module (``watch`` warms its
    workers so before any date is due)."""
