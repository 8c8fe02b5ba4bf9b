"""End to end from raw data, with the reference C++ generator: the question's design (generate, load,
cut windows inside the training loop) against ``shardgen watch`` running ahead while ``ShardIter``
trains; and ``shardgen build`` as users run it, jobs=1 against jobs=2."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from benchmarks.baselines import question_design_epoch
from benchmarks.stores import LAYOUTS, schema_for, touch
from loader.shard_iter import ShardIter
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["ROOT", "generator_config", "weekdays", "end_to_end"]

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = schema_for(LAYOUTS["samples"])


def generator_config(folder: Path, dates: Sequence[dt.date], jobs: int, open_end: bool = False,
                     work_ms: int = 0) -> Path:
    """A config running the reference generator over ``dates`` (no end date: ``open_end``)."""
    folder.mkdir(parents=True, exist_ok=True)
    end = "" if open_end else f'end = "{dates[-1]}"'
    text = f"""
[generator]
command = ["{ROOT / 'build' / 'seqgen'}", "--date", "{{date}}", "--out", "{{output}}", "--cols", "37",
           "--work-ms", "{work_ms}"]
output = "raw/{{date}}.npy"
timeout_s = 60
settle_s = 0.0
[dates]
start = "{dates[0]}"
{end}
calendar = "weekdays"
[schema]
time_steps = 60
num_inputs = 32
data_name = "seq_var"
labels = [{{name = "bd_return", width = 1}}, {{name = "eval_y", width = 4}}]
[store]
dir = "shards"
[run]
jobs = {jobs}
"""
    (folder / "shardgen.toml").write_text(text)
    return folder / "shardgen.toml"


def weekdays(n: int) -> list[dt.date]:
    out, d = [], dt.date(2024, 3, 1)
    while len(out) < n:
        if d.weekday() < 5:
            out.append(d)
        d += dt.timedelta(days=1)
    return out


def _question_design(workdir: Path, seqgen: Path, dates: list, batch_size: int, step_s: float,
                     work_ms: int) -> dict:
    """(a) The question's design: generate, load and cut windows inside the training loop, in series."""
    qdir = workdir / f"e2e_question_{work_ms}"
    (qdir / "raw").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    samples = question_design_epoch(
        lambda d: [str(seqgen), "--date", d.isoformat(), "--out", str(qdir / "raw" / f"{d}.npy"), "--cols", "37",
                   "--work-ms", str(work_ms)],
        lambda d: str(qdir / "raw" / f"{d}.npy"), dates, SCHEMA, batch_size,
        lambda b: (touch(list(b.data) + list(b.label)), time.sleep(step_s)))
    wall, batches = time.perf_counter() - t0, samples // batch_size
    return {"wall_s": wall, "batches": batches, "consumer_s": batches * step_s,
            "ratio": wall / (batches * step_s), "busy_pct": 100 * batches * step_s / wall}


def _start_watcher(cfg: Path, clock: Path) -> subprocess.Popen:
    """``shardgen watch`` in its own process, idle until ``clock`` moves; returns once it holds the lock."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    watcher = subprocess.Popen([sys.executable, "-m", "shardgen.cli", "watch", "-c", str(cfg), "--interval", "0.05",
                                "--today", str(clock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    lock = cfg.parent / "shards" / ".watch.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip().endswith(f"pid {watcher.pid}")):  # "watch on H, pid N"
        if time.monotonic() > deadline or watcher.poll() is not None:
            _stop(watcher)
            raise RuntimeError("the watcher did not start")
        time.sleep(0.05)
    time.sleep(0.5)  # a few idle cycles: nothing is due yet
    return watcher


def _stop(watcher: subprocess.Popen) -> None:
    watcher.send_signal(signal.SIGTERM)
    try:
        watcher.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(watcher.pid, signal.SIGKILL)


def _fresh_dates(store: Path, watcher: subprocess.Popen, consumed: set) -> list:
    """The published dates not consumed yet, waiting until there is one."""
    while True:
        if watcher.poll() is not None:
            raise RuntimeError("the watcher exited early")
        try:
            fresh = [s.date for s in Manifest.load(store / MANIFEST_NAME).shards if s.date not in consumed]
        except Exception:  # not there yet
            fresh = []
        if fresh:
            return fresh
        time.sleep(0.01)


def _train_on_arrivals(store: Path, watcher: subprocess.Popen, n_dates: int, batch_size: int, step_s: float,
                       cache: Path) -> dict:
    """ShardIter trains on each date as soon as it is published, an epoch per batch of arrivals."""
    consumed: set[str] = set()
    batches = real = expected = epochs = 0
    waited, it, t0 = 0.0, None, time.perf_counter()
    first_batch_s, epoch_start_s = None, 0.0
    try:
        while len(consumed) < n_dates:
            t1 = time.perf_counter()
            fresh = _fresh_dates(store, watcher, consumed)
            t_epoch = time.perf_counter()
            waited += t_epoch - t1
            if it is None:
                it = ShardIter(store, batch_size, dates=(min(fresh), None), last_batch="pad", cache_dir=cache)
            else:  # the next epoch: the dates published since the last one
                it.dates = (min(fresh), None)
                it.reset()
            epochs += 1
            for b in it:
                t2 = time.perf_counter()
                touch(list(b.data) + list(b.label))
                waited += time.perf_counter() - t2
                if first_batch_s is None:
                    first_batch_s = time.perf_counter() - t0
                elif t_epoch:  # a later epoch's set-up: reset() (its plan), its shuffle buffer filled
                    epoch_start_s += time.perf_counter() - t_epoch
                t_epoch = 0.0
                time.sleep(step_s)
                batches += 1
                real += batch_size - b.pad
            consumed.update(s.date for s in it.plan.shards)
            expected += it.plan.samples
    finally:
        if it is not None:
            it.close()
    return {"batches": batches, "samples": real, "expected_samples": expected, "waiting_for_data_s": waited,
            "epochs": epochs, "first_batch_s": first_batch_s, "later_epochs_start_s": epoch_start_s}


def end_to_end(workdir: Path, n_dates: int, batch_size: int, step_s: float, cache: Path, work_ms: int = 0) -> dict:
    """Wall time of one pass over ``n_dates`` fresh dates, relative to the pure consumer time:
    (a) the question's design against (b) ``shardgen watch`` already running in another process (as
    it does next to training); at t0 the dates become due (its clock moves)."""
    seqgen = ROOT / "build" / "seqgen"
    if not seqgen.exists():
        return {"skipped": f"{seqgen} is missing (run `make install`)"}
    dates = weekdays(n_dates)
    question = _question_design(workdir, seqgen, dates, batch_size, step_s, work_ms)
    cfg = generator_config(workdir / f"e2e_shardgen_{work_ms}", dates, jobs=2, open_end=True, work_ms=work_ms)
    clock = cfg.parent / "today.txt"
    clock.write_text((dates[0] - dt.timedelta(days=1)).isoformat())
    watcher = _start_watcher(cfg, clock)
    try:
        t0 = time.perf_counter()
        clock.write_text(dates[-1].isoformat())
        ours = _train_on_arrivals(cfg.parent / "shards", watcher, n_dates, batch_size, step_s, cache)
        wall = time.perf_counter() - t0
    finally:
        _stop(watcher)
    consumer = ours["batches"] * step_s
    # The floor: nothing can train before the first date is generated, cut, written and published.
    ours["busy_after_first_batch_pct"] = 100 * consumer / (wall - ours["first_batch_s"])
    return {
        "dates": n_dates, "step_ms": 1000 * step_s, "batch_size": batch_size, "generator_work_ms": work_ms,
        "question_design": question,
        "shardgen_watch_shardier": {"wall_s": wall, **ours, "consumer_s": consumer, "ratio": wall / consumer,
                                    "busy_pct": 100 * consumer / wall},
    }
