"""The rows of ``python -m benchmarks``'s report that belong to one suite each (S3, CPU per window,
epoch boundaries, mixing): their targets and their lines of the results table (:mod:`benchmarks.report`
puts them together)."""

from __future__ import annotations

STALL_MARGIN = 1.0  # percentage points ShardIter's stall may exceed the floor by


def _object_targets(ob: dict) -> list:
    """Training from S3 on loopback (issue 36)."""
    rows = []
    rows.append(("cold epoch from an S3 store on loopback / from local disk (from ShardIter())", ob["ratio"],
                 ">=", 0.9))
    rows.append(("first batch, cold: S3 / local disk (seconds)", ob["first_batch_ratio"], "<=", 1.5))
    if "x10" in ob:
        rows.append(("first batch from S3, a store 10x larger / this store (seconds)", ob["first_batch_10x_ratio"],
                     "<=", 1.5))
        rows.append(("first batch from S3, a store 10x larger / this store (at least)", ob["first_batch_10x_ratio"],
                     ">=", 0.5))
    if "warm_ratio" in ob:
        rows.append(("warm epoch (all cached), S3 / local disk", ob["warm_ratio"], ">=", 0.95))
    if "parts" in ob:
        rows.append(("bytes a worker of 4 downloads / (store / 4 + its straddling shards)", ob["parts"]["worst"],
                     "<=", 1.0))
    if "resume" in ob:
        rows.append(("S3 resume at 60%: bytes downloaded / (the rest's shards + one feed group)", ob["resume"]["ratio"],
                     "<=", 1.0))
    q = ob.get("quality")
    if q:
        for frac in ("0.1", "0.5", "1"):
            rows.append((f"S3, cache_limit {float(frac):.0%} of the part: dates per batch / exact shuffle "
                         "(reported)", q[frac], ">=", 0.0))
        rows.append(("S3, cache_limit 25% of the part: dates per batch / exact shuffle", q["0.25"], ">=", 0.95))
        if "half_buffer_0.25" in q:
            rows.append(("S3, cache_limit 25%, shuffle buffer half the part: dates per batch / exact shuffle",
                         q["half_buffer_0.25"], ">=", 0.6))
    return rows


def _mixing_targets(mx: dict) -> list[tuple]:
    """Issue 53: dates per batch over the first 200 batches of every epoch / an exact shuffle's."""
    rows = []
    for name, (mean, least) in (("200", (0.95, 0.8)), ("2M", (0.9, 0.8)), ("12.5M", (0.0, 0.0))):
        r = mx.get(name)
        if r:
            what = (f"{r['dates']} dates, {r['windows']:,} windows: dates per batch / exact, first 200 batches "
                    "of each epoch")
            rows += [(f"{what}, mean" + (" (reported)" if not mean else ""), r["mean"], ">=", mean),
                     (f"{what}, least" + (" (reported)" if not least else ""), r["least"], ">=", least)]
    return rows


def _cpu_targets(cp: dict) -> list[tuple]:
    floor = cp["floor"]["gather_us"]
    return [("the trainer's own numpy gather after a ShardIter ran / before", cp["trainer_gather_ratio"], "<=", 1.1),
            ("ShardIter shuffled: process CPU per window / the RAM gather floor", cp["shuffled"]["floor_ratio"], "<=",
             2.0, f"the floor {floor:.2f} us"),
            ("ShardIter in order: process CPU per window / the RAM gather floor", cp["in_order"]["floor_ratio"], "<=",
             1.3, f"the floor {floor:.2f} us"),
            ("ShardIter shuffled: process CPU per window / the memmap loop's (2 epochs from construction)",
             cp["memmap"]["cpu_ratio"], "<=", 1.5),
            ("ShardIter shuffled: samples/s / the memmap loop's (2 epochs from construction)",
             cp["memmap"]["rate_ratio"], ">=", 0.75)]


def _cpu_lines(cp: dict) -> list[str]:
    fl = cp["floor"]
    mm = cp["memmap"]
    out = ["", f"CPU per window (process CPU / windows, fresh processes): RAM gather floor X[idx] "
           f"{fl['gather_us']:.2f} us (np.take into one batch {fl['take_out_gather_us']:.2f} us; with .sum() into a "
           f"new array {fl['fresh_gather_us']:.2f} us)",
           f"  the memmap loop (every row in one memmap, X[starts[idx]] in a thread, zero-copy to MXNet), 2 epochs "
           f"from construction: {mm['memmap']['samples_per_s']:,.0f} samples/s at "
           f"{mm['memmap']['cpu_us_per_window']:.2f} us; ShardIter {mm['shard_iter']['samples_per_s']:,.0f} "
           f"samples/s at {mm['shard_iter']['cpu_us_per_window']:.2f} us ({mm['rate_ratio']:.2f}x the rate, "
           f"{mm['cpu_ratio']:.2f}x the CPU)"]
    for name in ("shuffled", "in_order"):
        r = cp[name]
        out.append(f"  ShardIter {name.replace('_', ' ')}: {r['cpu_us_per_window']:.2f} us ({r['floor_ratio']:.2f}x "
                   f"the floor), {100 * r['producer_share']:.0f}% of it in the loader's two threads (Python, GIL), "
                   f"{r['boundary_cpu_ms']:.1f} CPU-ms from reset() to the next epoch's first batch")
    out.append(f"  the trainer's own gather into a new array: {cp['trainer_gather_before_us']:.2f} us before a "
               f"ShardIter ran in its process, {cp['trainer_gather_after_us']:.2f} us after "
               f"({cp['trainer_gather_ratio']:.2f}x)")
    return out


def _boundary_targets(bo: dict) -> list[tuple]:
    """Issue 37: epoch boundaries at 400 shards, each stall against the floor of the same run."""
    si, fl, n = bo["ShardIter"], bo["floor"], bo["shards"]
    rows = []
    for load in ("50", "90"):
        f = fl[f"stall_{load}"]["stall_pct"]
        rows += [(f"{n} shards, reset() every epoch: stall % at {load}% load", si[f"stall_{load}"]["stall_pct"],
                  "<=", f + STALL_MARGIN, f"the floor {f:.2f} + {STALL_MARGIN:g}"),
                 (f"{n} shards, reset() every epoch: next() p99 ms at {load}% load",
                  si[f"stall_{load}"]["next_p99_ms"], "<=", 0.5)]
    rate, rnd, rs = bo["rate"], bo["randomness"], bo["reset"]
    return rows + [
        (f"{n} shards x {bo['windows_per_shard']}, reset() every epoch / stock ImageRecordIter one file",
         rate["samples_per_s"] / rate["stock_samples_per_s"], ">=", 2.5),
        (f"{n} shards: distinct dates per batch / exact shuffle", rnd["dates_per_batch"]
         / rnd["exact_dates_per_batch"], ">=", 0.9),
        (f"{n} shards: ms in reset(), files unchanged (median)", rs["unchanged_ms"], "<=", 1.0),
        (f"{n} shards: ms in reset() after a new generation (median)", rs["new_generation_ms"], "<=", 5.0)]


def _stall_cells(r: dict) -> str:
    """The stall and next() p99 columns of a loader row."""
    s50, s90 = r["stall_50"], r["stall_90"]
    return (f"{s50['stall_pct']:>9.1f}% {s90['stall_pct']:>9.1f}% {s50['next_p99_ms']:>12.2f} / "
            f"{s90['next_p99_ms']:<9.2f}")


def _boundary_lines(bo: dict) -> list[str]:
    si, fl, rate, rs = bo["ShardIter"], bo["floor"], bo["rate"], bo["reset"]
    return ["", f"epoch boundaries: {bo['shards']} shards x {bo['windows_per_shard']} windows, "
            f"{bo['batches_per_epoch']} "
            f"batches per epoch, reset() at each end ({si['stall_50']['batches']} / {si['stall_90']['batches']} "
            "batches at 50% / 90% load):",
            f"  {'ShardIter':30} {si['samples_per_s']:>11,.0f} {'':>6} {_stall_cells(si)}",
            f"  {'floor: batches popped from a list':30} {'':>11} {'':>6} {_stall_cells(fl)}",
            f"  read with reset() every epoch: {rate['samples_per_s']:,.0f}/s over {rate['epochs']} epochs; stock "
            f"ImageRecordIter, one file, reset every epoch: {rate['stock_samples_per_s']:,.0f}/s -> "
            f"{rate['samples_per_s'] / rate['stock_samples_per_s']:.2f}x",
            f"  dates per batch {bo['randomness']['dates_per_batch']:.1f} (exact shuffle "
            f"{bo['randomness']['exact_dates_per_batch']:.1f})",
            f"  reset(), files unchanged: median {rs['unchanged_ms']:.2f} ms (max {rs['unchanged_max_ms']:.2f}); after "
            f"a new generation: median {rs['new_generation_ms']:.2f} ms (max {rs['new_generation_max_ms']:.2f})"]


def _object_lines(ob: dict) -> list[str]:
    lines = []
    s3, loc = ob["s3_cold"], ob["local_cold"]
    lines.append(f"S3 store on loopback ({ob['bytes'] / 1e6:.0f} MB, rclone serve s3), from ShardIter(): cold "
                 f"epoch {s3['samples_per_s']:,.0f}/s, first batch after {s3['first_batch_s']:.2f}s; local disk, "
                 f"cold {loc['samples_per_s']:,.0f}/s, first batch after {loc['first_batch_s']:.2f}s -> "
                 f"{ob['ratio']:.2f}x; S3 again from the cache {ob['s3_cached']['samples_per_s']:,.0f}/s")
    if "x10" in ob:
        b = ob["x10"]
        lines.append(f"S3, a store 10x larger ({b['bytes'] / 1e6:.0f} MB): cold epoch "
                     f"{b['s3_cold']['samples_per_s']:,.0f}/s "
                     f"({b['ratio']:.2f}x local cold), first batch after {b['s3_cold']['first_batch_s']:.2f}s "
                     f"(local {b['local_cold']['first_batch_s']:.2f}s)")
    if "parts" in ob:
        pt = ob["parts"]
        lines.append("S3, 4 workers: MB downloaded each " + ", ".join(f"{o['bytes'] / 1e6:.1f}" for o in pt["parts"])
                     + f" of a {pt['store_bytes'] / 1e6:.1f} MB store")
    q = ob.get("quality")
    if q:
        lines.append("S3, dates per batch by cache_limit (of the part): " + ", ".join(
            f"{float(f):.0%} {q['dates_per_batch_' + f]:.1f}" for f in ("0.1", "0.25", "0.5", "1"))
            + f"; exact shuffle {q['exact_dates_per_batch']:.1f}")
    return lines
