"""``build``: many dates through the per-date pipeline (``pipeline.produce``) in parallel, the
finished shards published into the store as they come.

The coordinating process alone publishes the manifest, holding the store's writer lock. ``build``
is also the one code path the watcher calls each cycle.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import threading
import time
import warnings
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Optional

from shardgen.clock import utc_stamp
from shardgen.config import Config
from shardgen.fsutil import HOST_TOKEN, clean_dead_joblib_files, clean_temp_files
from shardgen.produce.generator import STOP, abandon_with
from shardgen.produce.pipeline import DateResult, prepare, produce, start_workers
from shardgen.store import Store
from shardgen.store.build_state import record_build
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.publish import publish
from shardgen.store.writer_lock import WriterLockLike

__all__ = ["BuildReport", "build", "wanted", "run_dates"]

log = logging.getLogger(__name__)
PUBLISH_EVERY_S = 5.0  # during a long build, finished shards reach the manifest this often
_SLICE_S = 0.1  # the longest the coordinating thread waits before it looks for a signal (``_waited``)


@dataclass
class BuildReport:
    published: list = field(default_factory=list)
    skipped: int = 0
    empty: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (date, message)
    environment: bool = False  # a date failed for the environment (``shardgen.errors.is_environment``)
    records: int = 0
    windows: int = 0
    bytes: int = 0
    seconds: float = 0.0
    manifest: Optional[Manifest] = None

    def summary(self) -> str:
        mb = self.bytes / 1e6
        rate = self.windows / self.seconds if self.seconds else 0.0
        return (f"published {len(self.published)} dates, skipped {self.skipped}, empty {len(self.empty)}, "
                f"failed {len(self.failed)}; {self.windows} windows in {self.records} records, {mb:.1f} MB "
                f"in {self.seconds:.1f}s ({rate:,.0f} windows/s)")


def wanted(manifest: Manifest, dates: Iterable[dt.date], *, force: bool = False) -> list[dt.date]:
    """The dates still to produce: not published nor retired, and not older than a full window
    (a date that old would be retired at once, and after gc regenerated again and again)."""
    done = {s.date for s in manifest.shards} | {r.date for r in manifest.retired}
    full = manifest.window and len(manifest.shards) >= manifest.window
    oldest = manifest.shards[0].date if manifest.shards else ""
    return [d for d in dates
            if force or (d.isoformat() not in done and not (full and d.isoformat() < oldest))]


def run_dates(cfg: Config, dates: list[dt.date], *, jobs: int, force: bool = False,
              raw_dates: frozenset = frozenset()) -> Iterable[DateResult]:
    """Results of ``produce`` for every date, in completion order."""
    if (jobs == 1 or len(dates) <= 1) and cfg.run.backend != "dask":
        return _pipelined(cfg, dates, force=force, raw_dates=raw_dates)
    from joblib import Parallel, delayed  # here: a jobs=1 build does not pay for its import

    if cfg.run.backend == "loky":
        clean_dead_joblib_files()  # what a build killed with -9 left in /dev/shm
        # the workers block SIGINT, as the watcher's do: a Ctrl-C to the group stops this process
        # alone, not a worker mid-import with a traceback (if this fails, Parallel starts them)
        start_workers(min(jobs, len(dates)))

    me = (HOST_TOKEN, os.getpid())  # a worker whose build is killed with -9 writes nothing (produce)
    tasks = (delayed(produce)(cfg, d, force=force, raw_only=d in raw_dates, coordinator=me) for d in dates)
    if cfg.run.backend == "dask":
        from shardgen.produce.cluster import run_on_cluster

        plugin = cfg.process.plugin_file()  # shipped to a remote cluster's workers
        return run_on_cluster(tasks, cfg.run.scheduler or "local", jobs, plugin=plugin)
    parallel = Parallel(n_jobs=min(jobs, len(dates)), backend=cfg.run.backend,
                        return_as="generator_unordered")
    return parallel(tasks)


def _pipelined(cfg: Config, dates: list[dt.date], *, force: bool, raw_dates: frozenset) -> Iterator[DateResult]:
    """One date at a time, as ``jobs=1`` promises (one generator running at once), but the next
    date's generator runs while this date's windows are cut, packed and written: a build then
    costs little more than its generator alone. Stopped early (a stop asked, the writer lock
    lost, Ctrl-C), the generators still running are abandoned (killed) before it returns."""
    abandon = threading.Event()

    def prepare_one(d: dt.date) -> tuple:
        with abandon_with(abandon):
            return prepare(cfg, d, force=force, raw_only=d in raw_dates)

    pool = ThreadPoolExecutor(1, thread_name_prefix="shardgen-generate")
    # Only this date's task and the next one's are held: a finished one holds a raw array.
    ahead = pool.submit(prepare_one, dates[0]) if dates else None
    current = None
    try:
        for i, d in enumerate(dates):
            current, ahead = ahead, (pool.submit(prepare_one, dates[i + 1]) if i + 1 < len(dates) else None)
            result = produce(cfg, d, force=force, raw_only=d in raw_dates, ahead=functools.partial(_waited, current))
            current = None  # its raw array goes now, not at the next date
            yield result
    finally:
        abandon.set()  # a no-op when every date was produced
        for f in (current, ahead):
            if f is not None:
                f.cancel()
        current = ahead = None
        pool.shutdown(wait=True)  # what runs stops within a poll (~50 ms): killed, Interrupted


def _waited(future: Future) -> object:
    """``future.result()``, waited for in short slices: a signal the kernel hands to another thread
    (it may: any thread that does not block it) only trips a flag that this thread checks once its
    wait returns, and an untimed wait returned only with the generator (Ctrl-C ignored 30 s, issue 62)."""
    while True:
        try:
            return future.result(timeout=_SLICE_S)
        except FutureTimeout:
            continue


class _Pending:
    """Finished shards not yet in the manifest: ``flush`` publishes them (and notes the manifest in
    the report); ``flush_if_due`` does so once ``every_s`` passed since the last flush."""

    def __init__(self, cfg: Config, store: Store, report: BuildReport, every_s: float, lock: WriterLockLike):
        self.cfg, self.store, self.report, self.every_s, self.lock = cfg, store, report, every_s, lock
        self.entries: list[ShardEntry] = []
        self.last = time.monotonic()

    def flush_if_due(self) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self.entries:
            try:
                saved = publish(self.store, self.cfg.schema, self.cfg.store.window, self.entries, lock=self.lock)
            except OSError as exc:  # the disk full: the shards are whole, only the manifest could not follow
                dates = ", ".join(e.date for e in self.entries[:3]) + (", ..." if len(self.entries) > 3 else "")
                raise OSError(exc.errno, f"{exc.strerror or exc}; {len(self.entries)} finished shards ({dates}) are "
                              "complete in the store but not in the manifest: the next build adopts them",
                              exc.filename) from None
            self.report.manifest = saved or self.report.manifest
            self.entries = []
        self.last = time.monotonic()


def _open_store(cfg: Config, store: Store) -> Manifest:
    """Create the (staging) folder, remove dead processes' temp files and the shard files a killed
    run left without a sidecar (older than ``store.grace_s``); the manifest, with the config's window."""
    clean_temp_files(store.stage())
    manifest = store.open_manifest(cfg.schema, cfg.store.window)
    for name in store.discard_incomplete(manifest, min_age_s=cfg.store.grace_s):
        log.info("removed %s: left without its sidecar (a killed run's) for over store.grace_s", name)
    return replace(manifest, window=cfg.store.window)


def _tally(report: BuildReport, res: DateResult, pending: _Pending) -> None:
    """Log one date's result and count it in the report; a finished shard joins ``pending``."""
    if res.status == "abandoned":
        log.info("%s", res.message)
    elif res.status == "failed":
        report.failed.append((res.date, res.message))
        report.environment |= res.environment
        log.error("%s", res.message)
    elif res.status == "empty":
        report.empty.append((res.date, res.message))
        log.warning("%s: %s", res.date, res.message)
    else:
        pending.entries.append(res.entry)
        report.published.append(res.date)
        report.records += res.entry.records
        report.windows += res.entry.samples
        report.bytes += res.entry.bytes
        log.info("published %s (%s shard, %d windows)", res.date, res.status, res.entry.samples)


def _say_layout(cfg: Config, res: DateResult) -> bool:
    """Say (and return True) when a processor returned a ``RunSpec`` stored in the ``windows`` layout
    only because that is the default for a plug-in: ``runs`` stores each row once (~4x smaller)."""
    if not (res.run_spec and cfg.schema.layout.kind == "windows" and not cfg.store.layout_set):
        return False
    log.warning("%s: %r returned a RunSpec, stored in the layout 'windows' (store.layout is not set: the default "
                "for a plug-in); store.layout = 'runs' stores each row once (about 4x smaller, in a new store.dir), "
                "store.layout = 'windows' keeps this layout", res.date, cfg.process.function)
    return True


def _close(results: Iterable) -> None:
    """Stop the dates still running now (not when the generator is collected), without joblib's
    warning that finished tasks were "not used" or were "cancelled": a stop asked for exactly that
    (the shards that finished were published; the rest are tried again)."""
    close = getattr(results, "close", None)
    if close is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(executed +but not used|still being processed)")
            close()


def _workers_died(report: BuildReport, todo: list[dt.date], exc: BaseException, *, stopping: bool) -> None:
    """A worker process died (SIGTERM to the group, OOM killer, SIGKILL): unless we are stopping,
    every date not finished is failed, to be tried again on the next run."""
    if stopping:
        log.info("stopping: the worker processes ended (%s)", type(exc).__name__)
        return
    done = set(report.published) | {d for d, _ in report.failed} | {d for d, _ in report.empty}
    for date in todo:
        if date not in done:
            report.failed.append((date, f"{date}: a worker process died before this date was finished "
                                        f"({type(exc).__name__}); it is tried again on the next run"))
            log.error("%s", report.failed[-1][1])


def build(cfg: Config, *, start: Optional[dt.date] = None, end: Optional[dt.date] = None,
          jobs: Optional[int] = None, force: bool = False, today: Optional[dt.date] = None,
          dates: Optional[list[dt.date]] = None, raw_dates: Iterable[dt.date] = (),
          progress: Optional[Callable[[int], object]] = None,
          should_stop: Callable[[], bool] = lambda: False,
          publish_every_s: float = PUBLISH_EVERY_S, lock: Optional[WriterLockLike] = None) -> BuildReport:
    """Produce every due date and publish the finished shards; failures are collected, not raised.

    ``raw_dates`` are processed from their raw file only (never generated). ``progress(total)``
    returns a tqdm-like bar (``update``, ``set_postfix``, ``close``) or None. Once
    ``should_stop()`` is true no further result is waited for; what finished is published.
    Finished shards are published at least every ``publish_every_s`` (0: each one at once).
    ``lock`` is the store's writer lock if the caller holds it (else build takes it for its duration).
    """
    store = cfg.store.open()
    if lock is None:
        with store.writer_lock("build", ttl_s=cfg.store.lease_ttl_s) as held:
            report = build(cfg, start=start, end=end, jobs=jobs, force=force, today=today, dates=dates,
                           raw_dates=raw_dates, progress=progress, should_stop=should_stop,
                           publish_every_s=publish_every_s, lock=held)
            # a build on its own says what it could not publish, for ``shardgen status`` (a watcher's
            # cycles pass their lock and keep their own state)
            record_build(store, updated=utc_stamp(time.time()), published=report.published, failed=report.failed,
                         empty=report.empty)
            return report
    t0 = time.perf_counter()
    manifest = _open_store(cfg, store)
    raw_dates = frozenset(raw_dates)
    if dates is None:
        dates = cfg.dates_between(start, end, today)
    dates = sorted(set(dates) | raw_dates)
    todo = wanted(manifest, dates, force=force)
    report = BuildReport(skipped=len(dates) - len(todo))
    bar = progress(len(todo)) if progress and todo else None
    pending = _Pending(cfg, store, report, publish_every_s, lock)
    said = False  # the layout note, once a build
    results = run_dates(cfg, todo, jobs=jobs or cfg.run.jobs, force=force, raw_dates=raw_dates)
    try:
        for res in results:
            _tally(report, res, pending)
            said = said or _say_layout(cfg, res)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(done=len(report.published), failed=len(report.failed), refresh=False)
            pending.flush_if_due()
            if lock.lost:  # another writer has the store: publish nothing more
                break
            if should_stop():
                log.info("stopping: not waiting for the remaining dates")
                break
    except BrokenExecutor as exc:  # a worker process died: SIGTERM to the group, OOM killer, SIGKILL
        _workers_died(report, todo, exc, stopping=should_stop() or STOP.is_set())
    finally:
        _close(results)
        pending.flush()
        if bar is not None:
            bar.close()
    clean_temp_files(store.staging)  # again: a killed run's worker may still have been exiting when this run began
    if report.manifest is None:
        report.manifest = store.load_manifest()
    report.seconds = time.perf_counter() - t0
    return report
