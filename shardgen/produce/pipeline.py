"""One date's pipeline: generate -> process -> shard -> into the store (``produce``).

``produce`` runs in joblib workers (or Dask workers on other machines) and only writes its own
shard files, into the store's staging folder, then moves them into the store (a store folder:
written in place already); the coordinating process alone publishes the manifest (``build``).
"""

from __future__ import annotations

import datetime as dt
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from shardgen.config import Config
from shardgen.errors import Interrupted, ProcessorError, ShardgenError, is_environment
from shardgen.process import WindowSet, run_processor
from shardgen.produce.generator import coordinator_gone, obtain_raw, working_for
from shardgen.produce.writer import write_marker, write_shard
from shardgen.store.manifest import ShardEntry
from shardgen.store.naming import sidecar_of
from shardgen.store.sidecar import Sidecar

__all__ = ["DateResult", "produce", "prepare", "warm"]

log = logging.getLogger(__name__)
# An empty date's marker (a sidecar of 0 records) makes later builds skip it, even if its data changes.
_AGAIN = ("later builds skip this date; once its data changes, run: shardgen build --force --start {date} "
          "--end {date}")


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
    """``(sidecar, None, False)`` for a shard already complete (adopted), else ``(None, raw array,
    generated)`` (``generated``: the generator made it just now): what comes before the windows are
    cut. Raises as ``obtain_raw`` does."""
    if not force:
        sidecar = cfg.store.open().complete_shard(date, cfg.schema.fingerprint)
        if sidecar is not None:
            return sidecar, None, False
    return (None, *obtain_raw(cfg, date, force=force, generate=not raw_only))


def _windows(cfg: Config, date: dt.date, raw, *, generated: bool, raw_only: bool) -> WindowSet:
    """The processor's checked windows of ``raw``. A raw file already there that fails (a NaN, a
    processor raising on it) is regenerated once and processed again: a fixed generator's output
    then replaces it. A failure names the raw file and what to do."""
    path = cfg.raw_path(date)
    fn, options = cfg.process.load(), dict(cfg.process.options)
    try:
        return run_processor(fn, raw, date, cfg.schema, options)
    except ProcessorError as exc:
        if raw_only:
            raise ProcessorError(f"{exc}; raw file {path}: replace it with one that passes (or regenerate it: "
                                 f"shardgen build --force --start {date} --end {date})") from None
        if generated:
            raise ProcessorError(f"{exc}; raw file {path}, written by the generator just now: fix the generator "
                                 "(every build runs it again for this date)") from None
        log.warning("%s; raw file %s: running the generator again for it", exc, path)
    raw, _ = obtain_raw(cfg, date, force=True)
    try:
        return run_processor(fn, raw, date, cfg.schema, options)
    except ProcessorError as exc:
        raise ProcessorError(f"{exc}; raw file {path}, written again by the generator after the file there failed "
                             "too: fix the generator (every build runs it again for this date)") from None


def produce(cfg: Config, date: dt.date, *, force: bool = False, raw_only: bool = False,
            ahead: Optional[Callable[[], tuple]] = None, coordinator: Optional[tuple[str, int]] = None) -> DateResult:
    """Make the shard of one date. Never raises: failures come back as a result naming the date.

    ``raw_only``: use the raw file already there and never run the generator (watched drop-ins).
    ``ahead``: returns what ``prepare`` returned for this date, started earlier (``build``).
    ``coordinator``: the build's (host token, pid) when this runs in a worker process: a worker
    whose build is gone (killed with -9) stops its generator and writes nothing.
    """
    with working_for(coordinator):
        return _produce(cfg, date, force=force, raw_only=raw_only, ahead=ahead)


def _unless_orphaned(date: dt.date) -> None:
    gone = coordinator_gone()
    if gone is not None:
        raise Interrupted(f"{date}: the build that started this worker (pid {gone}) is gone; nothing written")


def _produce(cfg: Config, date: dt.date, *, force: bool, raw_only: bool,
             ahead: Optional[Callable[[], tuple]]) -> DateResult:
    t0 = time.perf_counter()
    store = cfg.store.open()
    try:
        sidecar, raw, generated = ahead() if ahead is not None else prepare(cfg, date, force=force,
                                                                             raw_only=raw_only)
        if sidecar is not None:
            store.discard_staged(date)  # in the store already: a copy a killed run left in staging goes
            if sidecar.records == 0:
                return DateResult(date, "empty", None, f"no windows (found empty before: its marker is in the store); "
                                  f"{_AGAIN.format(date=date)}", time.perf_counter() - t0)
            return DateResult(date, "adopted", sidecar.entry(), "", time.perf_counter() - t0)
        schema = cfg.schema
        # A forced rewrite gets new file names, and no file is ever written over (``exclusive``: a
        # name taken by another writer, or by what a killed run left, moves the shard to the next
        # version): the bytes under a published manifest entry never change.
        version = store.next_version(date) if force else 1
        folder = store.stage()
        store.discard_staged(date)  # a private staging folder (s3://): what a killed run left of this date goes
        windows = _windows(cfg, date, raw, generated=generated, raw_only=raw_only)
        _unless_orphaned(date)
        if windows.n == 0:
            name = write_marker(folder, date, schema, version=version, exclusive=True)
            store.put_shard(Sidecar(date.isoformat(), 0, 0, "", 0, schema.fingerprint, "", ""), name)
            return DateResult(date, "empty", None,
                              f"{raw.shape[0]} rows, fewer than time_steps={schema.time_steps}: no windows; "
                              f"{_AGAIN.format(date=date)}",
                              time.perf_counter() - t0)
        sidecar = write_shard(folder, date, windows, None, schema, version=version, exclusive=True)
        _unless_orphaned(date)
        sidecar = store.put_shard(sidecar, sidecar_of(sidecar.rec))
        return DateResult(date, "written", sidecar.entry(), seconds=time.perf_counter() - t0, run_spec=windows.is_runs)
    except Interrupted as exc:
        return DateResult(date, "abandoned", message=str(exc), seconds=time.perf_counter() - t0)
    except ShardgenError as exc:
        return DateResult(date, "failed", message=str(exc), seconds=time.perf_counter() - t0,
                          environment=is_environment(exc))
    except OSError as exc:  # the disk full, permissions: the file and what the system said
        where = f"{exc.filename}: " if exc.filename else ""
        return DateResult(date, "failed", message=f"{date}: {where}{exc.strerror or exc}",
                          seconds=time.perf_counter() - t0, environment=is_environment(exc))
    except MemoryError as exc:
        return DateResult(date, "failed", message=f"{date}: {type(exc).__name__}: {exc}",
                          seconds=time.perf_counter() - t0, environment=is_environment(exc))


def warm() -> None:
    """Nothing; a worker process that runs it has imported this module (``watch`` warms its
    workers so before any date is due)."""


def start_workers(jobs: int) -> Optional[Exception]:
    """Start ``jobs`` loky worker processes (each importing this module) from a thread that blocks
    SIGINT; what failed, or None. The workers (and loky's manager thread) inherit that mask: a Ctrl-C
    in the terminal (SIGINT to the whole process group) reaches this process alone, which stops their
    generators, instead of breaking each worker off mid-import with a traceback. (The resource
    trackers are started first: starting one unblocks SIGINT in the thread that starts it. The
    generators run in sessions of their own, stopped with SIGKILL, never SIGINT.) A later
    ``Parallel(n_jobs=jobs, backend="loky")`` reuses them."""
    failed: list[Exception] = []

    def start() -> None:
        from multiprocessing import resource_tracker

        from joblib import Parallel, delayed
        from joblib.externals.loky.backend import resource_tracker as loky_tracker

        resource_tracker.ensure_running()
        loky_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            Parallel(n_jobs=jobs, backend="loky")(delayed(warm)() for _ in range(jobs))
        except Exception as exc:  # noqa: BLE001
            failed.append(exc)

    thread = threading.Thread(target=start, name="shardgen-start-workers", daemon=True)
    thread.start()
    thread.join()  # a signal meanwhile runs its handler here (a join is interruptible)
    return failed[0] if failed else None
