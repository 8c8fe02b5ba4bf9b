"""``shardgen build|watch|status|verify|gc|demo``: parses arguments and delegates to the library.

Exit codes (docs/config.md's table): 0 all went well, 1 some work or check failed (the rest is kept
and published), 2 usage or config error, 3 the environment failed (the store cannot be reached or
its bucket does not exist, the credentials are refused, the disk is full or read-only). Errors are one line each
on stderr; results go to stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import select
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from shardgen.cli_demo import add_demo_parser, run_demo
from shardgen.config import load_config, parse_date
from shardgen.errors import EXIT_ENVIRONMENT, ConfigError, LockError, ShardgenError, is_environment
from shardgen.format.check import has_checksums
from shardgen.produce.build import build
from shardgen.stopping import Terminated, with_stop_handlers
from shardgen.store.gc import collect
from shardgen.store.publish import published_here
from shardgen.store.status import dumps, print_text, settle, status, watch_fields
from shardgen.store.verify import verify_store
from shardgen.watch.alive import watcher_status
from shardgen.watch.raw import prune_raw
from shardgen.watch.state import load_state
from shardgen.watch.watcher import Watcher

__all__ = ["main"]

log = logging.getLogger("shardgen")


class _TqdmHandler(logging.StreamHandler):
    """Log lines that do not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm  # on first use: a CLI start costs its import otherwise (~50 ms)

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never raise
            self.handleError(record)


def _setup_logging(verbose: int) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("shardgen: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    handler.setLevel(root.level)  # libraries that set their own loggers' level (Dask: INFO) too
    logging.addLevelName(logging.ERROR, "error")
    logging.addLevelName(logging.WARNING, "warning")
    logging.addLevelName(logging.INFO, "info")
    for chatty in ("botocore", "boto3", "urllib3", "s3transfer"):  # their INFO lines are about credentials
        logging.getLogger(chatty).setLevel(max(root.level, logging.WARNING) if verbose < 3 else logging.DEBUG)


def _bar(total: int) -> Any:
    """A progress bar on a terminal; None (no bar) otherwise, as tqdm's ``disable=None`` would
    decide, but without importing tqdm (40-70 ms before a build's first generator starts)."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="date", desc="build", dynamic_ncols=True, file=sys.stderr,
                disable=None)  # None: no bar when stderr is not a terminal


def _date_arg(text: str):
    try:
        return parse_date(text, "date")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", type=Path, default=Path("shardgen.toml"),
                        help="config file (default: ./shardgen.toml)")
    common.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    p = argparse.ArgumentParser(
        prog="shardgen",
        description="Run a data generator per date and publish its windows as MXNet RecordIO shards "
                    "listed in a rolling manifest, for loader.ShardIter.",
        epilog="Exit codes: 0 success; 1 some dates or shards failed (verify, status: a published file is "
               "damaged; status: the watcher reports failing dates); 2 usage or config error; 3 the environment "
               "failed (the store cannot be reached or its bucket does not exist, the credentials are refused, "
               "the disk is full or read-only); 130/143 a build interrupted by SIGINT/SIGTERM, 0 a watcher "
               "stopped by either.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser("build", parents=[common], help="generate, process and publish a range of dates",
                       description="Generate, process and shard every configured date not yet published, "
                                   "in parallel, then publish them into the manifest.")
    b.add_argument("--start", type=_date_arg, help="first date (default: [dates] start)")
    b.add_argument("--end", type=_date_arg, help="last date (default: [dates] end, else today)")
    b.add_argument("--jobs", type=int, help="parallel dates (default: [run] jobs)")
    b.add_argument("--force", action="store_true",
                   help="regenerate and rewrite dates even if published or their raw output exists")
    w = sub.add_parser("watch", parents=[common], help="keep the manifest fed, forever (or --once)",
                       description="Every --interval seconds: generate and shard due dates, shard raw files "
                                   "dropped at the output location, adopt complete shards, apply the window, "
                                   "garbage-collect retired shards no reader uses. SIGINT/SIGTERM stop it "
                                   "cleanly.")
    w.add_argument("--interval", type=float, default=60.0, help="seconds between cycles (default 60)")
    w.add_argument("--once", action="store_true", help="one cycle, then exit (for cron)")
    w.add_argument("--jobs", type=int, help="parallel dates (default: [run] jobs)")
    w.add_argument("--today", help=argparse.SUPPRESS)  # tests: a date, or a file holding one (read each cycle)
    sub.add_parser("gc", parents=[common], help="delete retired shards and snapshots no reader uses",
                   description="Delete retired shards and superseded generation snapshots older than "
                               "store.grace_s that no live reader lease uses.")
    s = sub.add_parser("status", parents=[common], help="summarise the manifest",
                       description="Generation, shards, windows, bytes per window, date range, window, age, "
                                   "the generation snapshots kept, whether a watcher is alive (pid, host, "
                                   "heartbeat age), and every date it is failing on (last error, attempts, "
                                   "next retry). Exit 1 while dates fail, or when the newest generation "
                                   "snapshot is damaged.")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    sub.add_parser("verify", parents=[common], help="check every published file",
                   description="Check every file the store publishes: manifest.json, the kept generation "
                               "snapshots (the newest must hold what manifest.json holds), and the .rec "
                               "(size, sha256, record framing), .idx (byte for byte) and sidecar of every "
                               "shard they list: no published file may have changed since publication. "
                               "Exit 1 naming each damaged file.")
    add_demo_parser(sub)
    return p


def _check_range(cfg, args: argparse.Namespace) -> None:
    """A reversed range is a usage error, refused before anything is created (as in the config)."""
    start, end = args.start or cfg.dates.start, args.end or cfg.dates.end
    if end is not None and end < start:
        raise ConfigError(f"{'--end' if args.end else 'dates.end'} {end} is before "
                          f"{'--start' if args.start else 'dates.start'} {start}")


def _cmd_build(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("--jobs must be >= 1")
    _check_range(cfg, args)
    # Python's default SIGTERM ends this process at once: its joblib workers (jobs > 1) and their
    # generators went on running (review). Now stopped as Ctrl-C stops them (main's handlers).
    report = build(cfg, start=args.start, end=args.end, jobs=args.jobs, force=args.force, progress=_bar)
    print(report.summary())
    return EXIT_ENVIRONMENT if report.environment else 1 if report.failed else 0


def _today_source(value):
    if not value:
        return dt.date.today
    if len(value) == 10 and value[4] == "-":
        day = parse_date(value, "--today")
        return lambda: day
    return lambda: parse_date(Path(value).read_text().strip(), f"--today file {value}")


def _cmd_watch(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.interval <= 0:
        raise ConfigError("--interval must be > 0")
    wake = threading.Event()
    watcher = Watcher(cfg, interval=args.interval, jobs=args.jobs, today=_today_source(args.today))

    def on_signal(signum, _frame):
        log.warning("%s: finishing up (running dates are abandoned, nothing partial is published)",
                    signal.Signals(signum).name)
        watcher.stop()  # also abandons the generators running in worker processes
        wake.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    with watcher:
        log.info("watching %s %s (pid lock %s)", cfg.store.where, "once" if args.once else f"every {args.interval:g}s",
                 watcher.lock_path)
        if args.once:
            report = watcher.cycle()
            return 0 if report.ok else 1
        watcher.run(sleep=wake.wait)
    log.info("stopped")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    st = cfg.store
    store = st.open()
    deleted = collect(store, grace_s=st.grace_s, lease_ttl_s=st.lease_ttl_s)
    print(f"deleted {len(deleted)} retired shards" + (f": {', '.join(deleted)}" if deleted else ""))
    manifest = store.load_manifest()
    if manifest is not None:  # the raw files of dates that left the window go too, as the watcher's do
        gone = prune_raw(cfg, manifest, set(deleted), cfg.raw_files())[1]
        if gone:
            print(f"removed {len(gone)} raw files of dates that left the window: {', '.join(gone)}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    store = cfg.store.open()
    info = status(store)
    info.update(watch_fields(load_state(store)))  # read once the manifest was, as before
    info["watcher"] = watcher_status(store, cfg.store.lease_ttl_s)
    today = dt.date.today()
    raw = [d for d in cfg.raw_files() if d <= today]  # a file for a later date is no input yet (watch warns)
    info["newest_raw"] = max(raw).isoformat() if raw else None
    info["raw_lag_days"] = (today - max(raw)).days if raw else None
    # a cron monitor: 1 while dates of the configured range fail (a watcher's or a build's), the watcher's
    # last cycle failed as a whole (a refused schema) and nothing was published since, or a snapshot is damaged
    code = settle(info, cfg.dates.start, cfg.dates.end or today)
    if info["snapshot_problem"]:
        print(f"shardgen: error: {info['snapshot_problem']}", file=sys.stderr)
    if args.json:
        print(dumps(info))
        return code
    print_text(info)
    return code


def _cmd_verify(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    manifest, problems = verify_store(cfg.store.open())
    for date, problem in problems:
        print(f"shardgen: error: {problem}" if date == "-" else f"shardgen: error: {date}: {problem}", file=sys.stderr)
    print(f"verified {len(manifest.shards)} shards of generation {manifest.generation}: "
          f"{len(problems)} bad")
    old = [e.date for e in manifest.shards if not has_checksums(e)]
    if old:
        some = ", ".join(old[:3]) + (", ..." if len(old) > 3 else "")
        print(f"{len(old)} shard(s) written before record checksums ({some}): checked by frame and sha256 only; "
              "loaders check their frames only until `shardgen build --force` rewrites them")
    return 1 if problems else 0


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (``shardgen status | head -0``)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


COMMANDS = {"build": _cmd_build, "watch": _cmd_watch, "gc": _cmd_gc, "status": _cmd_status,
            "verify": _cmd_verify, "demo": run_demo}


def main(argv: Optional[Sequence[str]] = None, *, early: Sequence[int] = ()) -> int:
    """``early``: signals that came before ``main`` ran (:mod:`shardgen.entry`), acted on once the command is known."""
    return with_stop_handlers(_main, sys.argv[1:] if argv is None else list(argv), early)


def _main(argv: list, early: Sequence[int]) -> int:
    command = next((a for a in argv if a in COMMANDS), None)  # until parsed: what a signal stops
    try:
        args = _parser().parse_args(argv)
        command = args.command
        _setup_logging(args.verbose + (args.command == "watch"))  # the watcher logs what it does
        if early:
            raise Terminated() if early[0] == signal.SIGTERM else KeyboardInterrupt()
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader gone from the pipe shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE  # quietly, as a Unix tool killed by SIGPIPE
    except ShardgenError as exc:  # usage, config, the lock (2); a manifest, a date (1); the store or the disk (3)
        print(f"shardgen: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (ConfigError, LockError)) else EXIT_ENVIRONMENT if is_environment(exc) else 1
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        done = "finished shards were published" if published_here() else "nothing was published"
        if command == "watch":  # a watcher stopped by a signal, however sent (to it, to its group): 0
            print(f"shardgen: watch stopped ({'SIGTERM' if terminated else 'SIGINT'}); {done}", file=sys.stderr)
            return 0
        print(f"shardgen: {'terminated (SIGTERM)' if terminated else 'interrupted'}; {done}", file=sys.stderr)
        return 143 if terminated else 130
    except OSError as exc:  # disk full, permissions, a file where a folder should be: one line, no traceback
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"shardgen: error: {where}{exc.strerror or exc} (what was published before stays intact)",
              file=sys.stderr)
        return EXIT_ENVIRONMENT if is_environment(exc) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
