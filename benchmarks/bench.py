"""``python -m benchmarks`` (``make bench``): the loader and the writer beside the alternatives
users actually try, all measured in one run on the same data so that ratios are fair on a noisy
machine. Writes a table to stdout, ``bench/results.json`` and (with matplotlib) a PNG chart.

1. Loader throughput (samples/s, payload GB/s) over the same samples.
2. Data stall: a consumer that spends a fixed time per batch outside the GIL (as a GPU step
   does), set to 50% and 90% of each loader's measured max rate; % of wall time spent waiting.
3. End to end from raw data: the question's design (generate, load, cut windows inside the
   training loop) against ``shardgen watch`` running ahead while ``ShardIter`` trains.
4. Writer: shard payload MB/s against ``np.save`` of the same arrays; ``build`` jobs=1 -> 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mxnet as mx
import numpy as np

from loader.plan import default_cache_dir
from loader.shard_iter import ShardIter
from shardgen.format import day_number
from shardgen.manifest import MANIFEST_NAME, Manifest
from shardgen.process import sliding_windows
from shardgen.writer import write_shard

from .baselines import ListBatchIter, question_design_epoch, samples_from_arrays
from .report import chart, machine_info, table, targets
from .scale import scale_suite
from .soak import soak_in_subprocess
from .stores import LAYOUTS, build, evict, schema_for

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = schema_for(LAYOUTS["samples"])
RUNS_SCHEMA = schema_for(LAYOUTS["runs"])
PER_DATE = 2000  # samples per synthetic date


# -- data ------------------------------------------------------------------------------------


def _date_specs(n: int, seed: int) -> list:
    """Stride-1 windows over random rows, PER_DATE windows per date: (date, RunSpec)."""
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n, PER_DATE):
        date = dt.date(2024, 1, 1) + dt.timedelta(days=start // PER_DATE)
        k = min(PER_DATE, n - start)
        raw = rng.standard_normal((k + SCHEMA.time_steps - 1, SCHEMA.num_inputs + 5), dtype=np.float32)
        out.append((date, sliding_windows(raw, date, time_steps=SCHEMA.time_steps, num_inputs=SCHEMA.num_inputs,
                                          labels=SCHEMA.labels[:-1])))
    return out


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray], list]:
    """The same windows as arrays in RAM (for the in-memory loaders) and as rows (for the store)."""
    specs = _date_specs(n, seed)
    parts = [spec.as_windows(SCHEMA.time_steps) for _, spec in specs]
    x = np.concatenate([p[0] for p in parts])
    days = np.concatenate([np.full(len(p[0]), day_number(d), np.float32) for (d, _), p in zip(specs, parts)])
    labels = [np.concatenate([p[1]["bd_return"][:, 0] for p in parts]),
              np.concatenate([p[1]["eval_y"] for p in parts]), days]
    return x, labels, specs


# -- loaders: each a factory of an object with .batches() -> iterator of lists of NDArrays ----


class Loader:
    """A uniform face over DataIters and DataLoaders: endless batches, epoch after epoch."""

    def __init__(self, name: str, make: Callable[[], object], note: str = ""):
        self.name, self.make, self.note = name, make, note

    def batches(self) -> Iterator[list]:
        obj = self.make()
        try:
            while True:
                if isinstance(obj, mx.io.DataIter):
                    for b in obj:
                        yield list(b.data) + list(b.label)
                    obj.reset()
                else:
                    for b in obj:
                        yield list(b)
        finally:
            if hasattr(obj, "close"):
                obj.close()


def _touch(arrays: list) -> None:
    for a in arrays:
        a.wait_to_read()


def throughput(loader: Loader, batch_size: int, seconds: float, warmup: int = 3) -> dict:
    """Max rate: take batches as fast as they come (each array waited on) for ``seconds``."""
    gen = loader.batches()
    for _ in range(warmup):
        _touch(next(gen))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _touch(next(gen))
        n += 1
    wall = time.perf_counter() - t0
    gen.close()
    rate = n * batch_size / wall
    return {"samples_per_s": rate, "payload_gb_per_s": rate * SCHEMA.record_floats * 4 / 1e9, "batches": n}


def stall(loader: Loader, step_s: float, seconds: float, warmup: int = 3) -> dict:
    """A consumer spending ``step_s`` per batch outside the GIL: fraction of wall time waiting."""
    gen = loader.batches()
    for _ in range(warmup):
        _touch(next(gen))
    waited, n, t0 = 0.0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t1 = time.perf_counter()
        _touch(next(gen))
        waited += time.perf_counter() - t1
        time.sleep(step_s)  # the GPU step: no GIL held
        n += 1
    wall = time.perf_counter() - t0
    gen.close()
    return {"stall_pct": 100 * waited / wall, "step_ms": 1000 * step_s, "batches": n}


def loaders(x: np.ndarray, labels: list[np.ndarray], store: Path, batch_size: int, cache: Path) -> list[Loader]:
    from mxnet import gluon

    names = [lab.name for lab in SCHEMA.labels]
    samples = samples_from_arrays(x, labels)
    return [
        Loader("NDArrayIter (RAM)", lambda: mx.io.NDArrayIter(
            data={"seq_var": x}, label=dict(zip(names, labels)), batch_size=batch_size,
            last_batch_handle="discard"), "upper bound: arrays already in RAM"),
        Loader("Python DataIter", lambda: ListBatchIter(samples, batch_size, SCHEMA), "the question's pattern"),
        Loader("PrefetchingIter(Python)", lambda: mx.io.PrefetchingIter(ListBatchIter(samples, batch_size, SCHEMA))),
        Loader("Gluon DataLoader (2 workers)", lambda: gluon.data.DataLoader(
            gluon.data.ArrayDataset(x, *labels), batch_size=batch_size, shuffle=True, num_workers=2,
            last_batch="discard"), "the usual advice; shuffled, like ShardIter"),
        Loader("ShardIter", lambda: ShardIter(store, batch_size, shuffle=True, preprocess_threads=4,
                                              prefetch_buffer=4, cache_dir=cache), "global shuffle, from disk"),
        Loader("ShardIter (no shuffle)", lambda: ShardIter(store, batch_size, shuffle=False, preprocess_threads=4,
                                                           prefetch_buffer=4, cache_dir=cache)),
    ]


def cold_epoch(store: Path, batch_size: int, cache: Path) -> dict:
    evicted = evict(store)
    it = ShardIter(store, batch_size, shuffle=True, cache_dir=cache)
    t0, n = time.perf_counter(), 0
    for b in it:
        _touch(list(b.data) + list(b.label))
        n += batch_size - b.pad
    wall = time.perf_counter() - t0
    it.close()
    rate = n / wall
    return {"samples_per_s": rate, "payload_gb_per_s": rate * SCHEMA.record_floats * 4 / 1e9,
            "page_cache_evicted": evicted}


# -- end to end ------------------------------------------------------------------------------


def _e2e_config(folder: Path, dates: Sequence[dt.date], jobs: int, open_end: bool = False, work_ms: int = 0) -> Path:
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


def _weekdays(n: int) -> list[dt.date]:
    out, d = [], dt.date(2024, 3, 1)
    while len(out) < n:
        if d.weekday() < 5:
            out.append(d)
        d += dt.timedelta(days=1)
    return out


def end_to_end(workdir: Path, n_dates: int, batch_size: int, step_s: float, cache: Path, work_ms: int = 0) -> dict:
    """Wall time of one pass over ``n_dates`` fresh dates, relative to the pure consumer time."""
    seqgen = ROOT / "build" / "seqgen"
    if not seqgen.exists():
        return {"skipped": f"{seqgen} is missing (run `make install`)"}
    dates = _weekdays(n_dates)

    def consume(arrays: list) -> None:
        _touch(arrays)
        time.sleep(step_s)

    # (a) the question's design: everything inside the training loop, in series
    qdir = workdir / f"e2e_question_{work_ms}"
    (qdir / "raw").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    samples = question_design_epoch(
        lambda d: [str(seqgen), "--date", d.isoformat(), "--out", str(qdir / "raw" / f"{d}.npy"), "--cols", "37",
                   "--work-ms", str(work_ms)],
        lambda d: str(qdir / "raw" / f"{d}.npy"), dates, SCHEMA, batch_size,
        lambda b: consume(list(b.data) + list(b.label)))
    q_wall = time.perf_counter() - t0
    q_batches = samples // batch_size

    # (b) shardgen watch already running in another process (as it does next to training); at t0
    # the dates become due (its clock moves) and ShardIter trains on each as soon as it is published.
    cfg = _e2e_config(workdir / f"e2e_shardgen_{work_ms}", dates, jobs=2, open_end=True, work_ms=work_ms)
    store = cfg.parent / "shards"
    clock = cfg.parent / "today.txt"
    clock.write_text((dates[0] - dt.timedelta(days=1)).isoformat())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    watcher = subprocess.Popen([sys.executable, "-m", "shardgen.cli", "watch", "-c", str(cfg), "--interval", "0.05",
                                "--today", str(clock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    lock = store / ".watch.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip() == str(watcher.pid)):
        if time.monotonic() > deadline or watcher.poll() is not None:
            raise RuntimeError("the watcher did not start")
        time.sleep(0.05)
    time.sleep(0.5)  # a few idle cycles: nothing is due yet
    t0 = time.perf_counter()
    clock.write_text(dates[-1].isoformat())
    consumed: set[str] = set()
    batches = real = expected = 0
    waited = 0.0
    it = None
    try:
        while len(consumed) < len(dates):
            t1 = time.perf_counter()
            fresh = []
            while not fresh:
                if watcher.poll() is not None:
                    raise RuntimeError("the watcher exited early")
                try:
                    fresh = [s.date for s in Manifest.load(store / MANIFEST_NAME).shards if s.date not in consumed]
                except Exception:  # not there yet
                    fresh = []
                if not fresh:
                    time.sleep(0.01)
            waited += time.perf_counter() - t1
            if it is None:
                it = ShardIter(store, batch_size, dates=(min(fresh), None), last_batch="pad", cache_dir=cache)
            else:  # the next epoch: the dates published since the last one
                it.dates = (min(fresh), None)
                it.reset()
            for b in it:
                t2 = time.perf_counter()
                _touch(list(b.data) + list(b.label))
                waited += time.perf_counter() - t2
                time.sleep(step_s)
                batches += 1
                real += batch_size - b.pad
            consumed.update(s.date for s in it.plan.shards)
            expected += it.plan.samples
    finally:
        if it is not None:
            it.close()
        watcher.send_signal(signal.SIGTERM)
        try:
            watcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(watcher.pid, signal.SIGKILL)
    s_wall = time.perf_counter() - t0
    return {
        "dates": n_dates, "step_ms": 1000 * step_s, "batch_size": batch_size, "generator_work_ms": work_ms,
        "question_design": {"wall_s": q_wall, "batches": q_batches, "consumer_s": q_batches * step_s,
                            "ratio": q_wall / (q_batches * step_s), "busy_pct": 100 * q_batches * step_s / q_wall},
        "shardgen_watch_shardier": {"wall_s": s_wall, "batches": batches, "samples": real, "expected_samples": expected,
                                    "consumer_s": batches * step_s, "ratio": s_wall / (batches * step_s),
                                    "busy_pct": 100 * batches * step_s / s_wall, "waiting_for_data_s": waited},
    }


# -- writer -------------------------------------------------------------------------------------


def writer_bandwidth(workdir: Path, x: np.ndarray, labels: list[np.ndarray], repeats: int = 3) -> dict:
    """Shard payload MB/s (fsync'd, as shipped) against np.save of the same arrays (no fsync)."""
    out = workdir / "writer"
    payload = x.nbytes + sum(a.nbytes for a in labels)
    best = {"shard": float("inf"), "shard_no_fsync": float("inf"), "np_save": float("inf")}
    lab = {"bd_return": labels[0], "eval_y": labels[1]}
    for _ in range(repeats):
        for key in best:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            t0 = time.perf_counter()
            for start in range(0, len(x), PER_DATE):
                sl = slice(start, start + PER_DATE)
                date = dt.date(2024, 1, 1) + dt.timedelta(days=start // PER_DATE)
                if key == "np_save":
                    for i, arr in enumerate((x[sl], *(a[sl] for a in labels))):
                        np.save(out / f"{date}-{i}.npy", arr)
                else:
                    write_shard(out, date, x[sl], {k: v[sl] for k, v in lab.items()}, SCHEMA,
                                fsync=key == "shard")
            best[key] = min(best[key], time.perf_counter() - t0)
    shutil.rmtree(out, ignore_errors=True)
    mbs = {k: payload / v / 1e6 for k, v in best.items()}
    return {"payload_mb": payload / 1e6, "shard_mb_per_s": mbs["shard"],
            "shard_no_fsync_mb_per_s": mbs["shard_no_fsync"], "np_save_mb_per_s": mbs["np_save"],
            "ratio": mbs["shard"] / mbs["np_save"], "ratio_no_fsync": mbs["shard_no_fsync"] / mbs["np_save"]}


def build_speedup(workdir: Path, n_dates: int) -> dict:
    """``shardgen build`` as users run it (a fresh process each time), jobs=1 against jobs=2."""
    if not (ROOT / "build" / "seqgen").exists():
        return {"skipped": "build/seqgen is missing (run `make install`)"}
    dates = _weekdays(n_dates)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {}
    for jobs in (1, 2):
        folder = workdir / f"build_jobs{jobs}"
        shutil.rmtree(folder, ignore_errors=True)
        cfg = _e2e_config(folder, dates, jobs)
        cmd = [sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg), "--jobs", str(jobs)]
        subprocess.run(cmd, check=True, capture_output=True, env=env)  # warm: raw files, page cache
        best = float("inf")
        for _ in range(2):
            shutil.rmtree(folder / "shards")
            t0 = time.perf_counter()
            subprocess.run(cmd + ["--force"], check=True, capture_output=True, env=env)
            best = min(best, time.perf_counter() - t0)
        out[f"jobs{jobs}_s"] = best
        records = Manifest.load(folder / "shards" / MANIFEST_NAME).records
        out[f"jobs{jobs}_records_per_s"] = records / best
    out["speedup"] = out["jobs1_s"] / out["jobs2_s"]
    out["dates"] = n_dates
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small and short (for CI): checks it runs, not speed")
    p.add_argument("--samples", type=int, help="samples in the loader comparison (default 100000; quick 6000)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seconds", type=float, help="seconds per measurement (default 4; quick 0.4)")
    p.add_argument("--dates", type=int, help="dates in the end-to-end run (default 40; quick 3)")
    p.add_argument("--step-ms", type=float, default=None, help="end-to-end consumer time per batch (default 30)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    p.add_argument("--chart", type=Path, default=ROOT / "bench" / "chart.png")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder, removed after)")
    args = p.parse_args(argv)
    n = args.samples or (6000 if args.quick else 100_000)
    seconds = args.seconds or (0.4 if args.quick else 4.0)
    n_dates = args.dates or (3 if args.quick else 40)
    step_s = (args.step_ms if args.step_ms is not None else (5.0 if args.quick else 30.0)) / 1000
    bs = args.batch_size
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardgen-bench-"))
    cache = default_cache_dir() / "bench"
    res: dict = {"machine": machine_info(), "settings": {"samples": n, "batch_size": bs, "seconds": seconds,
                                                         "quick": args.quick, "time_steps": 60, "num_inputs": 32}}
    try:
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress to stderr
        log(f"bench: {n} samples of 60x32 ({n * SCHEMA.record_floats * 4 / 1e9:.2f} GB payload) ...")
        x, labels, specs = make_data(n)
        store = workdir / "store"
        build(store, RUNS_SCHEMA, specs, fsync=True)
        del specs
        res["loaders"] = {}
        for loader in loaders(x, labels, store, bs, cache):
            log(f"bench: {loader.name}")
            r = throughput(loader, bs, seconds)
            rate_batches = r["samples_per_s"] / bs
            r["stall_50"] = stall(loader, 1 / (0.5 * rate_batches), seconds)
            r["stall_90"] = stall(loader, 1 / (0.9 * rate_batches), seconds)
            r["note"] = loader.note
            res["loaders"][loader.name] = r
        res["shardier_cold_epoch"] = cold_epoch(store, bs, cache)
        log("bench: end to end")
        res["end_to_end"] = end_to_end(workdir, n_dates, bs, step_s, cache)
        log("bench: end to end, a generator that costs time")
        res["end_to_end_costly"] = end_to_end(workdir, n_dates, bs, step_s, cache, work_ms=20 if args.quick else 100)
        log("bench: writer")
        wn = min(n, 20 * PER_DATE)
        res["writer"] = writer_bandwidth(workdir, x[:wn], [a[:wn] for a in labels], repeats=1 if args.quick else 3)
        res["build"] = build_speedup(workdir, 3 if args.quick else 60)
        res["scale"] = scale_suite(workdir, quick=args.quick, seconds=seconds, log=log)
        log("bench: soak")
        res["soak"] = soak_in_subprocess(workdir, cache, epochs=12 if args.quick else 300,
                                         publish_every=3 if args.quick else 10,
                                         windows=5000 if args.quick else 50_000, batch_size=bs)
        res["targets"] = targets(res)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(table(res))
    note = chart(res, args.chart)
    print(f"\nresults: {args.out}" + (f", chart: {args.chart}" if note is None else f" ({note})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
