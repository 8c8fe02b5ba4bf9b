"""``shardgen watch``: keep the rolling manifest fed, every ``interval`` seconds (or ``--once``).

Each cycle:
1. due dates (``[dates] start`` up to ``end`` or today, not yet published) are generated and
   sharded, and raw files dropped at the ``output`` location by others are sharded without
   running the generator -- both through ``build``, the one code path;
2. complete shards written into the store by other producers are checked and published;
3. the window is applied (older dates move to ``retired``);
4. garbage collection deletes retired shards past ``grace_s`` that no live reader uses, and the
   raw files of their dates go with them (unless ``store.keep_raw``).

A dropped raw file is read once its mtime is ``settle_s`` old (write it under another name and
rename it into place to make that instant). A due date that fails -- including one whose raw file
(say, a generator's truncated output) does not load -- is generated again on later cycles with
exponential backoff; it never holds up other dates. A bad raw file dropped for a date that is not
due is reported once and read again when it changes; one for a date after today, off the
calendar or older than a full window is never published (one warning per file). Every failing
date, with its last error, attempts and next retry, is written to ``<store>/.watch-state.json``
after each cycle (``shardgen status`` shows it), and ``<store>/.watch-heartbeat.json`` says that
it runs (:mod:`shardgen.watch.alive`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from shardgen.backoff import retry_delay
from shardgen.clock import utc_stamp
from shardgen.config import Config
from shardgen.errors import LockError, ShardgenError
from shardgen.fsutil import file_version
from shardgen.produce import generator
from shardgen.produce.build import BuildReport, build, wanted
from shardgen.store.gc import collect
from shardgen.store.manifest import Manifest
from shardgen.store.publish import publish
from shardgen.watch.adopt import adoptable
from shardgen.watch.alive import WatcherHeartbeat
from shardgen.watch.raw import prune_raw, settled
from shardgen.watch.state import Failing, save_state

__all__ = ["Watcher", "CycleReport"]

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 3600.0


@dataclass
class _Failure:
    attempts: int
    error: str
    retry_at: Optional[float]  # time.monotonic(); None: a dropped file, retried when it changes

    @property
    def kind(self) -> str:
        return "dropped" if self.retry_at is None else "due"


@dataclass
class CycleReport:
    build: Optional[BuildReport] = None
    adopted: list = field(default_factory=list)
    deleted: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (date, message) new this cycle

    @property
    def ok(self) -> bool:
        return not self.failed


class Watcher:
    """One store's watcher. ``run()`` loops until ``stop()``; ``cycle()`` does one pass."""

    def __init__(self, cfg: Config, *, interval: float = 60.0, jobs: Optional[int] = None,
                 today: Callable[[], dt.date] = dt.date.today):
        self.cfg, self.interval, self.jobs, self.today = cfg, interval, jobs, today
        self._stop = False
        self._failures: dict[dt.date, _Failure] = {}
        self._bad_files: set[Optional[tuple]] = set()  # reported once per file version (file_version)
        self._warned: set[Optional[tuple]] = set()  # raw files never published, warned about once
        self._left: set[str] = set()  # dates seen leaving the window: their raw files go with their shards
        self._cycle_error: Optional[str] = None  # why the last cycle failed as a whole (for status)
        self.store = cfg.store.open()
        self._lock = self.store.watch_lock()
        self._writer = self.store.writer_lock("watch", ttl_s=cfg.store.lease_ttl_s)
        self._alive = WatcherHeartbeat(self.store, ttl_s=cfg.store.lease_ttl_s)

    @property
    def lock_path(self) -> Path:
        return self._lock.path

    def stop(self) -> None:
        """Stop after this cycle; running generators (in worker processes too) are abandoned."""
        self._stop = True
        generator.request_stop()

    @property
    def stopping(self) -> bool:
        return self._stop

    def __enter__(self) -> Watcher:
        self.store.stage()
        self._lock.acquire()
        try:
            self.store.check()
            self._writer.acquire()
        except BaseException:
            self._lock.release()
            raise
        self._alive.start()
        self._warm_workers()
        return self

    def _warm_workers(self) -> None:
        """Start the worker processes now, so the first date that falls due does not wait for them."""
        jobs = self.jobs or self.cfg.run.jobs
        if jobs > 1 and self.cfg.run.backend == "loky":
            from shardgen.produce.pipeline import start_workers

            # Each worker imports what producing a date needs (numpy, the writer: ~0.1 s) now too,
            # with SIGINT blocked (see start_workers). Only a head start: if it fails, the first
            # date starts its workers itself.
            failed = start_workers(jobs)
            if failed and not self._stop:  # stopped: a signal to the whole group may have ended them
                log.warning("could not start the %d worker processes ahead (%s); the first due date will", jobs,
                            failed)

    def __exit__(self, *exc: object) -> None:
        self._alive.stop()
        generator.clear_stop()
        self._writer.release()
        self._lock.release()

    def run(self, sleep: Callable[[float], bool]) -> None:
        """Cycle until stopped; ``sleep(seconds)`` returns True when woken to stop."""
        failures = 0
        while not self._stop:
            try:
                self.cycle()
                failures = 0
            except LockError:  # another writer has the store now: stop, never write beside it
                raise
            except (ShardgenError, OSError) as exc:  # disk full, an unreadable snapshot ...: never give up
                failures += 1
                delay = retry_delay(failures, base=self.interval, cap=MAX_BACKOFF_S)
                log.error("cycle failed (%s); trying again in %.0fs", self._cycle_error or exc, delay)
                if self._stop or sleep(delay):
                    break
                continue
            if self._stop or sleep(self.interval):
                break

    # -- one cycle ------------------------------------------------------------------------------

    def cycle(self) -> CycleReport:
        cfg, store, report = self.cfg, self.store, CycleReport()
        self._writer.check()  # a writer that lost the store's lock generates and uploads nothing more
        self._cycle_error = None
        try:
            manifest = store.open_manifest(cfg.schema, cfg.store.window)
            now = time.monotonic()
            scheduled = cfg.dates_between(today=self.today())
            files = cfg.raw_files()
            raw = settled(files, cfg.generator.settle_s)
            # A due date is generated (again) whatever its raw file holds, unless someone is still
            # writing that file, or the date is waiting for its retry.
            due = [d for d in scheduled if (d in raw or d not in files) and self._retry_at(d) <= now]
            arrivals = self._arrivals(manifest, raw, scheduled)
            if due or arrivals:
                report.build = build(cfg, dates=due, raw_dates=arrivals, jobs=self.jobs, publish_every_s=0.0,
                                     should_stop=lambda: self._stop,  # readers see each date at once
                                     lock=self._writer)
                self._note_results(report, arrivals, raw)
            if self._stop:
                return report
            st = cfg.store
            report.adopted = adoptable(store, store.open_manifest(cfg.schema, st.window), cfg.schema, self._bad_files)
            saved = publish(store, cfg.schema, st.window, report.adopted, lock=self._writer)  # applies the window
            report.deleted = collect(store, grace_s=st.grace_s, lease_ttl_s=st.lease_ttl_s, lock=self._writer)
            self._prune_raw(report.deleted, files)
            done = {s.date for s in (saved or manifest).shards} | {a.date for a in report.adopted}
            for date in [d for d in self._failures if d.isoformat() in done]:
                del self._failures[date]  # published meanwhile (e.g. adopted)
            return report
        except (ShardgenError, OSError) as exc:  # a refused schema, the store gone: status says so
            where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
            self._cycle_error = f"{where}{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
            raise
        finally:
            self._save_state()

    def _retry_at(self, date: dt.date) -> float:
        failure = self._failures.get(date)
        return failure.retry_at if failure is not None and failure.retry_at is not None else 0.0

    def _arrivals(self, manifest: Manifest, raw: dict[dt.date, Path], scheduled: list[dt.date]) -> list[dt.date]:
        """The dates whose dropped raw file is read now. A file for a date after today, off the
        calendar, or older than a full window is never published: one warning per file (version)."""
        today, fresh, skip = self.today(), set(wanted(manifest, raw)), set(scheduled)
        listed = {e.date for e in (*manifest.shards, *manifest.retired)} | self._left  # no news
        arrivals = []
        for date, path in sorted(raw.items()):
            version = file_version(path)
            if date in skip or date.isoformat() in listed or version in self._bad_files:
                continue
            if date > today:
                why = f"is for a date after today ({today})"
            elif self.cfg.dates.calendar == "weekdays" and date.weekday() >= 5:
                why = f"is for a {date:%A}, not on the weekdays calendar"
            elif date not in fresh:
                why = f"is older than the {manifest.window}-date window (from {manifest.shards[0].date})"
            else:
                arrivals.append(date)
                continue
            if version not in self._warned:
                self._warned.add(version)
                log.warning("%s: %s %s; not published", date, path, why)
        return arrivals

    def _prune_raw(self, deleted: list[str], files: dict[dt.date, Path]) -> None:
        """Remove the raw files of the dates that left the window (:func:`prune_raw`)."""
        manifest = self.store.load_manifest()
        if manifest is not None:
            self._left |= {r.date for r in manifest.retired} | set(deleted)
            self._left = prune_raw(self.cfg, manifest, self._left, files)[0]

    def _save_state(self) -> None:
        """Failing dates, for ``shardgen status``; a store we cannot write to is logged, not fatal."""
        mono, wall = time.monotonic(), time.time()
        failing = []
        for date, f in self._failures.items():
            retry = None
            if f.retry_at is not None:
                retry = utc_stamp(wall + max(0.0, f.retry_at - mono))
            failing.append(Failing(date.isoformat(), f.kind, f.attempts, f.error, retry))
        if self._writer.lost is not None:
            return  # the store has another writer now: its state is that writer's
        try:
            gen = None
            if self._cycle_error:  # which manifest it was refused against: a later one supersedes the error
                with contextlib.suppress(OSError, ShardgenError):
                    gen = getattr(self.store.load_manifest(), "generation", None)
            save_state(self.store, updated=utc_stamp(wall), pid=os.getpid(), failing=failing, error=self._cycle_error,
                       generation=gen)
        except (OSError, ShardgenError) as exc:
            log.warning("%s: cannot write the watcher state (%s)", self.cfg.store.where, exc)

    def _note_results(self, report: CycleReport, arrivals: list, raw: dict) -> None:
        built = report.build
        for date in built.published:
            self._failures.pop(date, None)
        for date, message in built.failed:
            report.failed.append((date, message))
            previous = self._failures.get(date)
            count = (previous.attempts if previous else 0) + 1
            if date in arrivals:  # a bad dropped file: report once, retry when it changes
                self._bad_files.add(file_version(raw[date]))
                self._failures[date] = _Failure(count, message, None)
                log.warning("%s: %s is not generated here; will read it again when it changes", date, raw[date])
                continue
            delay = retry_delay(count, base=self.interval, cap=MAX_BACKOFF_S)
            self._failures[date] = _Failure(count, message, time.monotonic() + delay)
            log.warning("%s: will retry in %.0fs (failure %d)", date, delay, count)

