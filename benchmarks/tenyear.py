"""Issue 65, item 7: ten years of data (2,500 weekdays x 2,000 rows, T=60, C=32, the default store
layout) read by ShardIter at its defaults beside the memmap loop, each in a fresh process, two epochs
from construction: construction, first batch, dates per batch (first 200 batches of epochs 0 and 1)
against an exact shuffle's, samples/s, peak RSS, and the store's bytes per window against the raw
rows and labels the memmap holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from benchmarks.bigstores import synthetic_store
from benchmarks.loops import exact_dates_per_batch, run_fresh
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["ten_year", "dates_summary", "ten_year_targets", "ten_year_lines", "knob_effects", "KNOBS"]


def dates_summary(run: dict, exact: float) -> dict:
    """Mean and least distinct dates per batch of each measured epoch, and their ratios to ``exact``."""
    out = {}
    for e, seen in enumerate(run.get("dates_per_batch", [])):
        out[str(e)] = {"mean": float(np.mean(seen)), "least": int(np.min(seen)), "batches": len(seen),
                       "mean_ratio": float(np.mean(seen)) / exact, "least_ratio": float(np.min(seen)) / exact}
    return out


def ten_year(cache: Path, *, n_dates: int = 2500, rows: int = 2000, batch_size: int = 512, epochs: int = 2,
             root: Optional[Path] = None, log: Callable[[str], None] = lambda m: None) -> dict:
    st = synthetic_store(n_dates, rows, root=root, log=log)
    built = "reused" if st["cached"] else f"built in {st['build_s']:.1f} s"
    log(f"bench: ten years ({n_dates} dates x {rows} rows, {st['windows']:,} windows; store {built}): "
        "the memmap loop, then ShardIter")
    counts = [s.samples for s in Manifest.load(Path(st["store"]) / MANIFEST_NAME).shards]
    exact = exact_dates_per_batch(counts, batch_size)
    res = {"store": {k: st[k] for k in ("build_s", "cached", "windows", "store_bytes", "raw_bytes", "dates",
                                        "rows_per_date", "layout")},
           "batch_size": batch_size, "epochs": epochs, "exact_dates_per_batch": exact}
    res["store"]["bytes_per_window"] = st["store_bytes"] / st["windows"]
    res["store"]["raw_bytes_per_window"] = st["raw_bytes"] / st["windows"]
    res["bytes_ratio"] = st["store_bytes"] / st["raw_bytes"]
    for kind, source, c in (("memmap", st["memmap"], None), ("shard_iter", st["store"], str(cache))):
        r = run_fresh(kind, source, c, batch_size, epochs)
        if "failed" not in r:
            r["dates"] = dates_summary(r, exact)
            del r["dates_per_batch"]
        res[kind] = r
    res["knobs"] = knob_effects(st["store"], str(cache), batch_size)
    si, mm = res["shard_iter"], res["memmap"]
    if "failed" not in si and "failed" not in mm:
        res["ratios"] = {"first_batch": si["first_batch_s"] / mm["first_batch_s"],
                         "samples_per_s": si["samples_per_s"] / mm["samples_per_s"],
                         "peak_rss": si["peak_rss"] / mm["peak_rss"]}
    return res


# The settings a user has, each off its default (readers and native_batch went: issue 65, item 6).
KNOBS = {"prefetch_buffer=1": {"prefetch_buffer": 1}, "preprocess_threads=1": {"preprocess_threads": 1}}


def knob_effects(store: str, cache: str, batch_size: int) -> dict:
    """Samples/s of one epoch from construction with each knob set off its default, against the
    defaults' (the median of two runs), each in a fresh process: what the knob does here."""
    base = [run_fresh("shard_iter", store, cache, batch_size, 1) for _ in range(2)]
    rate = float(np.median([r.get("samples_per_s", np.nan) for r in base]))
    out = {}
    for name, kw in KNOBS.items():
        r = run_fresh("shard_iter:" + json.dumps(kw), store, cache, batch_size, 1)
        out[name] = r.get("samples_per_s", np.nan) / rate
    return out


def ten_year_targets(ty: dict) -> list[tuple]:
    """The issue's targets for the row, as (name, value, op, limit) for ``report._judge``."""
    what = f"ten years ({ty['store']['dates']} dates, {ty['store']['windows']:,} windows)"
    rows = [(f"{what}: store bytes per window / the raw rows and labels'", ty["bytes_ratio"], "<=", 1.3)]
    si = ty["shard_iter"]
    if "failed" in si or "failed" in ty["memmap"]:
        return rows + [(f"{what}: ShardIter and the memmap loop ran (not measured: "
                        f"{si.get('failed') or ty['memmap'].get('failed')})", float("nan"), ">=", 0.0)]
    rows += [(f"{what}: ShardIter first batch (s, from before construction)", si["first_batch_s"], "<=", 1.5),
             (f"{what}: first batch, ShardIter / the memmap loop", ty["ratios"]["first_batch"], "<=", 4.0),
             (f"{what}: ShardIter construction (s)", si["construct_s"], "<=", 0.5)]
    for e, d in sorted(si["dates"].items()):
        rows += [(f"{what}: dates per batch / exact shuffle, first 200 batches of epoch {e}, mean",
                  d["mean_ratio"], ">=", 0.9),
                 (f"{what}: dates per batch / exact shuffle, first 200 batches of epoch {e}, least",
                  d["least_ratio"], ">=", 0.8)]
    rows += [(f"{what}: knob effect, one epoch's samples/s with {name} / with the defaults (reported)", v, ">=", 0.0)
             for name, v in ty.get("knobs", {}).items()]
    return rows + [
        (f"{what}: samples/s over {ty['epochs']} epochs from construction, ShardIter / the memmap loop",
         ty["ratios"]["samples_per_s"], ">=", 1.2),
        (f"{what}: peak RSS, ShardIter / the memmap loop", ty["ratios"]["peak_rss"], "<=", 1.3)]


def _loop_line(name: str, r: dict) -> str:
    if "failed" in r:
        return f"  {name:22} failed: {r['failed']}"
    dates = "; ".join(f"epoch {e} {d['mean']:.0f} (least {d['least']})" for e, d in sorted(r["dates"].items()))
    return (f"  {name:22} construction {r['construct_s']:.2f}s, first batch {r['first_batch_s']:.2f}s, "
            f"{r['samples_per_s']:,.0f} samples/s over {r['epochs_done']} epochs, peak RSS "
            f"{r['peak_rss'] / 1e9:.2f} GB; dates per batch {dates}")


def ten_year_lines(ty: dict) -> list[str]:
    st = ty["store"]
    return ["", f"ten years: {st['dates']} weekdays x {st['rows_per_date']} rows, T=60, C=32, {st['windows']:,} "
            f"windows; store ({st['layout']}) {st['store_bytes'] / 1e9:.2f} GB, {st['bytes_per_window']:.1f} bytes "
            f"per window against {st['raw_bytes_per_window']:.1f} raw ({ty['bytes_ratio']:.2f}x); "
            + ("reused" if st["cached"] else f"built in {st['build_s']:.1f}s")
            + f"; exact shuffle {ty['exact_dates_per_batch']:.1f} dates per batch of {ty['batch_size']}",
            _loop_line("the memmap loop", ty["memmap"]), _loop_line("ShardIter (defaults)", ty["shard_iter"])]
