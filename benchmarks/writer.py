"""The write side: what ``shardgen build`` costs beside the generator it runs (windows/s against
the generator's own), and shard payload MB/s against ``np.save`` of the same arrays (shown, not
a target: a runs store writes each row once, so bytes say little)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import ROOT, generator_config, weekdays
from benchmarks.stores import LAYOUTS, PER_DATE, schema_for
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["writer_bandwidth", "build_cost"]

SCHEMA = schema_for(LAYOUTS["samples"])


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


def _generator_alone(folder: Path, dates: list, work_ms: int) -> float:
    """Seconds the reference generator takes for ``dates`` on its own, one after another."""
    raw = folder / "raw_alone"
    raw.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for d in dates:
        subprocess.run([str(ROOT / "build" / "seqgen"), "--date", d.isoformat(), "--out", str(raw / f"{d}.npy"),
                        "--cols", "37", "--work-ms", str(work_ms)], check=True, capture_output=True, timeout=60)
    return time.perf_counter() - t0


def build_cost(workdir: Path, n_dates: int, work_ms: int = 100) -> dict:
    """``shardgen build`` as users run it (a fresh process each time, the generator costing
    ``work_ms`` of CPU per date), jobs=1 and jobs=2, against the generator's own rate: windows/s
    of the build over windows/s of running the generator alone, serially."""
    if not (ROOT / "build" / "seqgen").exists():
        return {"skipped": "build/seqgen is missing (run `make install`)"}
    dates = weekdays(n_dates)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out: dict = {"dates": n_dates, "generator_work_ms": work_ms}
    for jobs in (1, 2):
        folder = workdir / f"build_jobs{jobs}"
        shutil.rmtree(folder, ignore_errors=True)
        cfg = generator_config(folder, dates, jobs, work_ms=work_ms)
        cmd = [sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg), "--jobs", str(jobs)]
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)  # warm: page cache
        best = float("inf")
        for _ in range(2):
            shutil.rmtree(folder / "shards")
            t0 = time.perf_counter()
            subprocess.run(cmd + ["--force"], check=True, capture_output=True, env=env, timeout=600)
            best = min(best, time.perf_counter() - t0)
        out[f"jobs{jobs}_s"] = best
        out["windows"] = Manifest.load(folder / "shards" / MANIFEST_NAME).samples
        out[f"jobs{jobs}_windows_per_s"] = out["windows"] / best
    out["generator_alone_s"] = min(_generator_alone(workdir / "build_jobs1", dates, work_ms) for _ in range(2))
    out["generator_windows_per_s"] = out["windows"] / out["generator_alone_s"]
    out["jobs1_vs_generator"] = out["jobs1_windows_per_s"] / out["generator_windows_per_s"]
    out["jobs2_vs_generator"] = out["jobs2_windows_per_s"] / out["generator_windows_per_s"]
    out["speedup"] = out["jobs1_s"] / out["jobs2_s"]
    return out
