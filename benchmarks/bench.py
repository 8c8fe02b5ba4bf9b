"""``python -m benchmarks`` (``make bench``): the loader and the writer beside the alternatives
users actually try, all measured in one run on the same data so that ratios are fair on a noisy
machine. Writes a table to stdout, ``bench/results.json``, (with matplotlib) a PNG chart and, for a
full run, the page ``docs/performance.md`` (:mod:`benchmarks.page`).

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
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import mxnet as mx
import numpy as np

from benchmarks.baselines import ListBatchIter, PoppedBatches, samples_from_arrays
from benchmarks.bigmem import larger_than_memory as bigmem_row
from benchmarks.boundaries import boundary_suite
from benchmarks.content import content_check, writer_checksums
from benchmarks.cpu import cpu_suite
from benchmarks.e2e import end_to_end
from benchmarks.measure import Loader, stall, throughput
from benchmarks.objects import object_store_suite
from benchmarks.page import write_markdown
from benchmarks.report import chart, machine_info, table, targets
from benchmarks.scale import scale_suite
from benchmarks.soak import soak_in_subprocess
from benchmarks.stores import LAYOUTS, PER_DATE, bench_cache, build, evict, schema_for, touch
from benchmarks.tenyear import ten_year
from benchmarks.training import loop_cost
from benchmarks.writer import build_cost, writer_bandwidth
from loader.shard_iter import ShardIter
from shardgen.format import day_number
from shardgen.process import sliding_windows

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = schema_for(LAYOUTS["samples"])
RUNS_SCHEMA = schema_for(LAYOUTS["runs"])


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
        # ShardIter with its defaults, as users get it
        Loader("ShardIter", lambda: ShardIter(store, batch_size, shuffle=True, cache_dir=cache),
               "global shuffle, from disk"),
        Loader("ShardIter (no shuffle)", lambda: ShardIter(store, batch_size, shuffle=False, cache_dir=cache)),
    ]


def stall_floor(x: np.ndarray, labels: list[np.ndarray], batch_size: int, like: dict, seconds: float) -> dict:
    """The same consumer, at the same step times as ``like`` (ShardIter's run), over batches
    built before the run (``PoppedBatches``): what waking the consumer costs on this machine."""
    arrays = [[mx.nd.array(x[i * batch_size:(i + 1) * batch_size])] +
              [mx.nd.array(lab[i * batch_size:(i + 1) * batch_size]) for lab in labels] for i in range(8)]
    loader = Loader("batches popped from a list", lambda: PoppedBatches(arrays, 200, batch_size))
    return {k: stall(loader, like[k]["step_ms"] / 1000, seconds) for k in ("stall_50", "stall_90")}


def cold_epoch(store: Path, batch_size: int, cache: Path) -> dict:
    evicted = evict(store)
    it = ShardIter(store, batch_size, shuffle=True, cache_dir=cache)
    t0, n = time.perf_counter(), 0
    for b in it:
        touch(list(b.data) + list(b.label))
        n += batch_size - b.pad
    wall = time.perf_counter() - t0
    it.close()
    rate = n / wall
    return {"samples_per_s": rate, "payload_gb_per_s": rate * SCHEMA.record_floats * 4 / 1e9,
            "page_cache_evicted": evicted}


def _arguments(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small and short (for CI): checks it runs, not speed")
    p.add_argument("--samples", type=int, help="samples in the loader comparison (default 100000; quick 6000)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seconds", type=float, help="seconds per measurement (default 4; quick 0.4)")
    p.add_argument("--dates", type=int, help="dates in the end-to-end run (default 40; quick 3)")
    p.add_argument("--step-ms", type=float, default=None, help="end-to-end consumer time per batch (default 30)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    p.add_argument("--docs", type=Path, help="write the results page here (default for a full run: "
                   "docs/performance.md; a --quick run writes none unless given)")
    p.add_argument("--no-docs", action="store_true", help="write no results page")
    p.add_argument("--chart", type=Path, help="the PNG chart (default: next to the results page, else "
                   "bench/chart.png)")
    p.add_argument("--only", choices=["boundaries", "objects", "cpu", "ten-years", "larger-than-memory"],
                   help="run only these rows (objects: S3 on loopback, issue 36; boundaries: epoch boundaries "
                   "at 400 shards, issue 37; cpu: CPU per window, issue 46; ten-years and larger-than-memory: "
                   "issue 65's stores beside the memmap loop); writes no results page")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder, removed after)")
    args = p.parse_args(argv)
    if args.no_docs or args.only:
        args.docs = None
    elif args.docs is None and not args.quick:
        args.docs = ROOT / "docs" / "performance.md"
    if args.chart is None:
        args.chart = args.docs.with_suffix(".png") if args.docs else ROOT / "bench" / "chart.png"
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)  # progress to stderr


def issue65_rows(args: argparse.Namespace, workdir: Path, res: dict, *, ten_years: bool,
                 larger_than_memory: bool) -> None:
    """Issue 65's stores, each read by ShardIter and the memmap loop in fresh processes; ``--quick``
    at a toy scale in the workdir (the real stores are kept under ``bigstores.store_cache()``)."""
    small = {"root": workdir / "issue65"} if args.quick else {}
    if ten_years:
        res["ten_year"] = ten_year(bench_cache(), batch_size=args.batch_size, log=log, **small,
                                   **({"n_dates": 12, "rows": 200} if args.quick else {}))
    if larger_than_memory:
        res["larger_than_memory"] = bigmem_row(
            bench_cache(), batch_size=args.batch_size, log=log, **small,
            **({"n_dates": 4, "rows": 2000, "seconds": 2.0, "loop_seconds": 1.0} if args.quick else {}))


def run(args: argparse.Namespace, workdir: Path, res: dict) -> None:
    """Every measurement, into ``res``."""
    n = args.samples or (6000 if args.quick else 100_000)
    seconds = args.seconds or (0.4 if args.quick else 4.0)
    n_dates = args.dates or (3 if args.quick else 40)
    step_s = (args.step_ms if args.step_ms is not None else (5.0 if args.quick else 30.0)) / 1000
    bs = args.batch_size
    cache = bench_cache()
    res["settings"] = {"samples": n, "batch_size": bs, "seconds": seconds, "quick": args.quick, "time_steps": 60,
                       "num_inputs": 32}
    if args.only == "boundaries":
        res["boundaries"] = boundary_suite(workdir, cache, quick=args.quick, seconds=seconds, batch_size=bs, log=log)
        res["targets"] = targets(res)
        return
    if args.only in ("ten-years", "larger-than-memory"):
        issue65_rows(args, workdir, res, ten_years=args.only == "ten-years",
                     larger_than_memory=args.only == "larger-than-memory")
        res["targets"] = targets(res)
        return
    if args.only == "cpu":
        _, _, specs = make_data(n)
        build(workdir / "store", RUNS_SCHEMA, specs, fsync=True)
        res["cpu"] = cpu_suite(workdir / "store", cache, 60, 32, epochs=1 if args.quick else 4, workdir=workdir)
        res["targets"] = targets(res)
        return
    if args.only == "objects":
        _, _, specs = make_data(n)
        build(workdir / "store", RUNS_SCHEMA, specs, fsync=True)
        res["object_store"] = object_store_suite(workdir / "store", workdir, bs, cache, quick=args.quick, log=log)
        res["targets"] = targets(res)
        return
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
    res["stall_floor"] = stall_floor(x, labels, bs, res["loaders"]["ShardIter"], seconds)
    res["shardier_cold_epoch"] = cold_epoch(store, bs, cache)
    log("bench: CPU per window (fresh processes: the RAM gather floor, ShardIter, the trainer's own gather)")
    res["cpu"] = cpu_suite(store, cache, 60, 32, epochs=1 if args.quick else 4, workdir=workdir)
    log("bench: the default content check (verify='crc') against verify='none'; the writer's CRCs")
    res["content"] = content_check(store, cache, repeats=1 if args.quick else 5, epochs=1 if args.quick else 5)
    res["content"]["writer"] = writer_checksums(workdir / "crc_store", RUNS_SCHEMA, list(make_data(n)[2]),
                                                repeats=1 if args.quick else 3)
    log("bench: a cold epoch from an S3 store on loopback")
    res["object_store"] = object_store_suite(store, workdir, bs, cache, quick=args.quick, log=log)
    log("bench: end to end")
    res["end_to_end"] = end_to_end(workdir, n_dates, bs, step_s, cache)
    log("bench: end to end, a generator that costs time")
    # Long enough that the first date's latency is not the whole story (issue 20).
    res["end_to_end_costly"] = end_to_end(workdir, n_dates if args.quick else 100, bs, step_s, cache,
                                          work_ms=20 if args.quick else 100)
    log("bench: writer")
    wn = min(n, 20 * PER_DATE)
    res["writer"] = writer_bandwidth(workdir, x[:wn], [a[:wn] for a in labels], repeats=1 if args.quick else 3)
    res["build"] = build_cost(workdir, 3 if args.quick else 30, work_ms=20 if args.quick else 100)
    log("bench: a Gluon training loop")
    res["training_loop"] = loop_cost(store, bs, cache, steps=4 if args.quick else 30)
    res["scale"] = scale_suite(workdir, quick=args.quick, seconds=seconds, log=log)
    res["boundaries"] = boundary_suite(workdir, cache, quick=args.quick, seconds=seconds, batch_size=bs, log=log)
    if not args.quick:  # about 2 minutes with the stores kept, 4 the first time (10 GB written to disk);
        # a quick run leaves them to ``--quick --only ten-years`` / ``larger-than-memory`` (tests/test_bench.py)
        issue65_rows(args, workdir, res, ten_years=True, larger_than_memory=True)
    log("bench: soak")
    res["soak"] = soak_in_subprocess(workdir, cache, epochs=12 if args.quick else 300,
                                     publish_every=3 if args.quick else 10,
                                     windows=5000 if args.quick else 50_000, batch_size=bs)
    res["targets"] = targets(res)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _arguments(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardgen-bench-"))
    res: dict = {"machine": machine_info()}
    try:
        run(args, workdir, res)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(table(res))
    note = chart(res, args.chart)
    written = [str(args.out)] + ([f"chart: {args.chart}"] if note is None else [f"({note})"])
    if args.docs:
        write_markdown(res, args.docs, args.chart if note is None else None)
        written.append(f"page: {args.docs}")
    print("\nresults: " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
