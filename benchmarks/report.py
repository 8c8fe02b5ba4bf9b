"""The report side of ``python -m benchmarks``: machine facts, the targets from the issue, the table and
the chart (matplotlib is optional: without it there is no chart)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import mxnet as mx
import numpy as np

from benchmarks.bigmem import bigmem_lines, bigmem_targets
from benchmarks.report_rows import (
    STALL_MARGIN,
    _boundary_lines,
    _boundary_targets,
    _cpu_lines,
    _cpu_targets,
    _mixing_targets,
    _object_lines,
    _object_targets,
    _stall_cells,
)
from benchmarks.tenyear import ten_year_lines, ten_year_targets
from shardgen.store.manifest import utc_now

__all__ = ["machine_info", "targets", "results_table", "targets_block", "table", "chart"]

ROOT = Path(__file__).resolve().parent.parent


def machine_info() -> dict:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "mxnet": mx.__version__,
            "numpy": np.__version__, "platform": platform.platform(),
            "date": utc_now(), **git_state()}


def git_state() -> dict:
    """The commit measured, and whether the code it ran (not the docs) differed from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short=7", "HEAD")
    changed = bool(git("status", "--porcelain", "--", "shardgen", "loader", "benchmarks"))
    return {"commit": commit or "unknown", "uncommitted_changes": changed}


def targets(res: dict) -> list[dict]:
    """Each target: name, value, the limit and how it is judged (``target``), met. ShardIter's stall
    is judged against the floor measured in the same run (``res["stall_floor"]``): the shared
    machine's own cost of waking a sleeping consumer, which moves from run to run."""
    if "loaders" not in res:  # --only boundaries / objects / cpu / ten-years / larger-than-memory
        return _judge((_boundary_targets(res["boundaries"]) if "boundaries" in res else [])
                      + (_object_targets(res["object_store"]) if "object_store" in res else [])
                      + (_cpu_targets(res["cpu"]) if "cpu" in res else []) + _issue65_targets(res))
    lo = res["loaders"]
    si = lo["ShardIter"]
    floor = {load: res["stall_floor"][load]["stall_pct"] for load in ("stall_50", "stall_90")}

    def ratio(a, b):
        return a["samples_per_s"] / b["samples_per_s"]

    rows = [
        ("ShardIter / Gluon DataLoader samples/s", ratio(si, lo["Gluon DataLoader (2 workers)"]), ">=", 3.0),
        ("ShardIter / Python DataIter samples/s", ratio(si, lo["Python DataIter"]), ">=", 1.5),
        ("ShardIter / NDArrayIter (RAM) samples/s", ratio(si, lo["NDArrayIter (RAM)"]), ">=", 0.3),
        ("ShardIter stall % at 50% load (across epochs)", si["stall_50"]["stall_pct"], "<=",
         floor["stall_50"] + STALL_MARGIN, f"the floor {floor['stall_50']:.2f} + {STALL_MARGIN:g}"),
        ("ShardIter stall % at 90% load (across epochs)", si["stall_90"]["stall_pct"], "<=",
         floor["stall_90"] + STALL_MARGIN, f"the floor {floor['stall_90']:.2f} + {STALL_MARGIN:g}"),
        ("ShardIter next() p99 ms at 50% load", si["stall_50"]["next_p99_ms"], "<=", 0.5),
        ("ShardIter next() p99 ms at 90% load", si["stall_90"]["next_p99_ms"], "<=", 0.5),
    ]
    if res.get("cpu"):
        rows += _cpu_targets(res["cpu"])
    ct = res.get("content")
    if ct:
        rows += [("first epoch of a fresh process: verify='crc' (default) / 'none'", ct["first_ratio"], "<=", 1.10),
                 ("later epochs: verify='crc' (default) / 'none'", ct["later_ratio"], "<=", 1.03),
                 ("writer windows/s: with record CRCs / without", ct["writer"]["ratio"], ">=", 0.95)]
    b = res.get("build", {})
    if "jobs1_vs_generator" in b:
        rows.append((f"build jobs=1 windows/s / the generator's own ({b['generator_work_ms']} ms/date)",
                     b["jobs1_vs_generator"], ">=", 0.8))
    tl = res.get("training_loop")
    if tl:
        rows.append(("Gluon LSTM loop time: ShardIter / batches in RAM", tl["thread_ratio"], "<=", 1.05))
    if res.get("object_store"):
        rows += _object_targets(res["object_store"])
    e2e = res.get("end_to_end", {})
    if "shardgen_watch_shardier" in e2e:
        rows.append(("End to end wall / consumer time (watch + ShardIter)",
                     e2e["shardgen_watch_shardier"]["ratio"], "<=", 1.1))
    costly = res.get("end_to_end_costly", {})
    if "shardgen_watch_shardier" in costly:
        rows.append((f"consumer busy % end to end, generator {costly['generator_work_ms']} ms/date (watch + ShardIter)",
                     costly["shardgen_watch_shardier"]["busy_pct"], ">=", 95.0))
    sc = res.get("scale")
    if sc:
        lay, sh, rnd = sc["layouts"], sc["shards"], sc["randomness"]
        rows += [
            ("ShardIter 200 shards / stock ImageRecordIter one file (shuffled)",
             sh["200"] / sc["stock_one_file"]["samples_per_s"], ">=", 1.0),
            ("ShardIter 400 shards / stock ImageRecordIter one file (shuffled)",
             sh["400"] / sc["stock_one_file"]["samples_per_s"], ">=", 2.0),
            ("ShardIter 400 shards / 4 shards", sh["400"] / sh["4"], ">=", 0.8),
            ("distinct dates per batch / exact shuffle",
             rnd["dates_per_batch"] / rnd["exact_dates_per_batch"], ">=", 0.95),
            ("windows per run per batch / exact shuffle",
             rnd["windows_per_run_per_batch"] / rnd["exact_windows_per_run_per_batch"], "<=", 1.5),
            *_mixing_targets(sc.get("mixing", {})),
            ("resume at 90%, 2M windows over 500 shards / (opening + reading to there)", sc["resume"]["ratio"], "<=",
             0.25),
            ("open at 2M records / stock open", sc["open_reset"]["open_ratio"], "<=", 2.0),
            ("reset at 2M records / stock open", sc["open_reset"]["reset_ratio"], "<=", 2.0),
            ("bytes per window: runs / one-sample records", lay["runs"]["bytes_per_window"]
             / lay["samples"]["bytes_per_window"], "<=", 0.05),
            ("warm samples/s: runs / one-sample records", lay["runs"]["warm_samples_per_s"]
             / lay["samples"]["warm_samples_per_s"], ">=", 2.0),
            ("cold samples/s: runs / one-sample records", lay["runs"]["cold_samples_per_s"]
             / lay["samples"]["cold_samples_per_s"], ">=", 5.0),
        ]
    so = res.get("soak")
    if so:
        rows += [(f"soak: RSS growth % epochs 5 -> {so['epochs']} (reset every epoch, new date every "
                  f"{so['publish_every']})", so["rss_growth_pct"], "<=", 5.0),
                 ("soak: file descriptors added, epochs 100 -> 300", so["fds_delta"], "<=", 0),
                 ("soak: threads added, epochs 100 -> 300", so["threads_delta"], "<=", 0)]
    if "boundaries" in res:
        rows += _boundary_targets(res["boundaries"])
    return _judge(rows + _issue65_targets(res))


def _issue65_targets(res: dict) -> list[tuple]:
    """Ten years, and a store larger than memory, beside the memmap loop (issue 65)."""
    return ((ten_year_targets(res["ten_year"]) if "ten_year" in res else [])
            + (bigmem_targets(res["larger_than_memory"]) if "larger_than_memory" in res else []))


def _issue65_lines(res: dict) -> list[str]:
    return ((ten_year_lines(res["ten_year"]) if "ten_year" in res else [])
            + (bigmem_lines(res["larger_than_memory"]) if "larger_than_memory" in res else []))


def _judge(rows: list[tuple]) -> list[dict]:
    out = []
    for name, value, op, limit, *basis in rows:  # basis: how a limit measured in this run was set
        target = f"{op} {limit:.2f}: {basis[0]}" if basis else f"{op} {limit}"
        out.append({"name": name, "value": value, "limit": limit, "target": target,
                    "met": value >= limit if op == ">=" else value <= limit})
    return out


def results_table(res: dict) -> str:
    """Every figure of a run, as plain text (the targets apart)."""
    if "loaders" not in res:  # --only boundaries / objects / cpu / ten-years / larger-than-memory
        return "\n".join((_boundary_lines(res["boundaries"])[1:] if "boundaries" in res else [])
                         + (_object_lines(res["object_store"]) if "object_store" in res else [])
                         + (_cpu_lines(res["cpu"])[1:] if "cpu" in res else []) + _issue65_lines(res)[1:])
    lines = [f"{'loader':32} {'samples/s':>11} {'GB/s':>6} {'stall@50%':>10} {'stall@90%':>10} "
             f"{'next() p99 ms @50%/@90%':>24}"]
    for name, r in res["loaders"].items():
        lines.append(f"{name:32} {r['samples_per_s']:>11,.0f} {r['payload_gb_per_s']:>6.2f} {_stall_cells(r)}")
    fl = res.get("stall_floor")
    if fl:
        lines.append(f"{'floor: batches popped from a list':32} {'':>11} {'':>6} {_stall_cells(fl)}"
                     "   (ShardIter's steps; next() builds nothing)")
    c = res["shardier_cold_epoch"]
    lines.append(f"{'ShardIter, first (cold) epoch':32} {c['samples_per_s']:>11,.0f} {c['payload_gb_per_s']:>6.2f}")
    if res.get("cpu"):
        lines += _cpu_lines(res["cpu"])
    if res.get("object_store"):
        lines += _object_lines(res["object_store"])
    e2e = res.get("end_to_end", {})
    if "question_design" in e2e:
        q, s = e2e["question_design"], e2e["shardgen_watch_shardier"]
        lines += ["", f"end to end, {e2e['dates']} dates, {e2e['step_ms']:.0f} ms per batch of {e2e['batch_size']}:",
                  f"  question's design (all in the loop)  wall {q['wall_s']:.2f}s = {q['ratio']:.2f}x consumer time",
                  f"  shardgen watch + ShardIter           wall {s['wall_s']:.2f}s = {s['ratio']:.2f}x consumer time"]
    costly = res.get("end_to_end_costly", {})
    if "question_design" in costly:
        q, s = costly["question_design"], costly["shardgen_watch_shardier"]
        lines += [f"end to end, {costly['dates']} dates, generator {costly['generator_work_ms']} ms of CPU per date: "
                  f"consumer busy {q['busy_pct']:.1f}% (question's design) vs {s['busy_pct']:.1f}% (shardgen watch + "
                  f"ShardIter)"]
        if "first_batch_s" in s:
            lines += [f"  floor: first batch after {s['first_batch_s']:.2f}s (the first date generated, cut, written, "
                      f"published); busy from then on {s['busy_after_first_batch_pct']:.1f}%; {s['epochs']} epochs "
                      f"(one per batch of arrivals), the later ones' set-up (plan, shuffle buffer filled) "
                      f"{s['later_epochs_start_s']:.2f}s"]
    sc = res.get("scale")
    if sc:
        lines += ["", f"{'layout':10} {'bytes/window':>13} {'build s':>8} {'warm samples/s':>15} "
                  f"{'cold samples/s':>15}"]
        for name, r in sc["layouts"].items():
            lines.append(f"{name:10} {r['bytes_per_window']:>13,.0f} {r['build_s']:>8.2f} "
                         f"{r['warm_samples_per_s']:>15,.0f} {r['cold_samples_per_s']:>15,.0f}")
        lines.append("shuffled samples/s by shards (runs): " + ", ".join(
            f"{n}: {v:,.0f}" for n, v in sc["shards"].items())
            + f"; stock ImageRecordIter, one file: {sc['stock_one_file']['samples_per_s']:,.0f}")
        r = sc["randomness"]
        for m in sc.get("mixing", {}).values():
            lines.append(f"mixing, {m['dates']} dates / {m['windows']:,} windows: dates per batch / exact "
                         f"({m['exact_dates_per_batch']:.1f}) over the first 200 batches of each epoch: mean "
                         f"{m['mean']:.2f}, least {m['least']:.2f}; a block spans {m['dates_per_block']} dates")
        lines.append(f"dates per batch {r['dates_per_batch']:.1f} (exact shuffle {r['exact_dates_per_batch']:.1f}); "
                     f"windows per run per batch {r['windows_per_run_per_batch']:.2f} "
                     f"(exact {r['exact_windows_per_run_per_batch']:.2f})")
        o, rs = sc["open_reset"], sc["resume"]
        lines.append(f"resume at 90%: {rs['resume_s']:.2f}s vs reading there {rs['read_to_s']:.2f}s; "
                     f"{o['records']:,} records: open {o['open_s']:.2f}s, reset {o['reset_s']:.2f}s, "
                     f"stock open {o['stock_open_s']:.2f}s")
    so = res.get("soak")
    if so:
        head = f"soak, {so['epochs']} epochs in {so['seconds']:.0f}s (planned {so['planned_mb']:.0f} MB): "
        lines += ["", head + "; ".join(
            f"epoch {x['epoch']}: {x['rss_mb']:.0f} MB RSS, {x['in_use_mb']:.0f} MB in use, {x['fds']} fds, "
            f"{x['threads']} threads, generation "
            f"{x['generation']}" for x in so["samples"]) + " (in use, fds, threads: the least of the last 30 epochs)"]
    w = res["writer"]
    lines += ["", f"writer: shards {w['shard_no_fsync_mb_per_s']:,.0f} MB/s ({w['shard_mb_per_s']:,.0f} fsync'd, as "
              f"shipped), np.save {w['np_save_mb_per_s']:,.0f} MB/s (no fsync) -> {w['ratio_no_fsync']:.2f}x "
              f"({w['ratio']:.2f}x fsync'd)"]
    b = res.get("build", {})
    if "speedup" in b:
        lines.append(f"build: {b['dates']} dates, generator {b['generator_work_ms']} ms/date: jobs=1 "
                     f"{b['jobs1_s']:.2f}s, jobs=2 {b['jobs2_s']:.2f}s ({b['speedup']:.2f}x); the generator alone, "
                     f"serially "
                     f"{b['generator_alone_s']:.2f}s: build jobs=1 runs at {b['jobs1_vs_generator']:.2f}x its "
                     f"windows/s, jobs=2 at {b['jobs2_vs_generator']:.2f}x")
    tl = res.get("training_loop")
    if tl:
        lines.append(f"Gluon LSTM loop, {tl['steps']} steps of {tl['batch_size']}, medians of {tl.get('rounds', 1)} "
                     f"rounds: from RAM {tl['ram_s']:.2f}s, ShardIter {tl['thread_s']:.2f}s "
                     f"({tl['thread_ratio']:.3f}x); "
                     f"{res['machine'].get('nproc', '?')} cores")
    if "boundaries" in res:
        lines += _boundary_lines(res["boundaries"])
    return "\n".join(lines + _issue65_lines(res))


def targets_block(res: dict) -> str:
    return "\n".join(["targets:"] + [f"  [{'met' if t['met'] else 'MISSED'}] {t['name']}: {t['value']:.2f} "
                                     f"(target {t['target']})" for t in res["targets"]])


def table(res: dict) -> str:
    """What ``python -m benchmarks`` prints: the figures, then the targets."""
    return results_table(res) + "\n\n" + targets_block(res)


def chart(res: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install '.[bench]'): no chart"
    if "loaders" not in res:
        return "only some rows were run: no chart"
    names = list(res["loaders"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    a1.barh(names, [res["loaders"][n]["samples_per_s"] / 1e3 for n in names], color="tab:blue")
    a1.set_xlabel("thousand samples/s (T=60, C=32)")
    a1.set_title("throughput")
    a1.invert_yaxis()
    y = np.arange(len(names))
    a2.barh(y - 0.2, [res["loaders"][n]["stall_50"]["stall_pct"] for n in names], 0.4, label="50% load")
    a2.barh(y + 0.2, [res["loaders"][n]["stall_90"]["stall_pct"] for n in names], 0.4, label="90% load")
    a2.set_yticks(y, [""] * len(names))
    a2.invert_yaxis()
    a2.set_xlabel("% of wall time waiting for data")
    a2.set_title("data stall (consumer at 50% / 90% of each loader's max rate)")
    a2.legend()
    fig.suptitle(f"benchmarks on {res['machine']['nproc']} cores, {res['machine']['date']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
