"""What the default content check costs (issue 43): ``verify="crc"`` (every record's CRC32, once
per file version and process) against ``verify="none"``, each in fresh processes (the check's
memory is per process), alternated; and the writer with and without computing the CRCs."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

from benchmarks.e2e import ROOT
from benchmarks.stores import build

__all__ = ["content_check", "writer_checksums"]

CHILD = """
import json, sys, time
from loader import ShardIter
store, cache, mode, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
it = ShardIter(store, 512, verify=mode, cache_dir=cache)
for b in it:
    b.data[0].wait_to_read()
first, later = time.perf_counter() - t0, []
for _ in range(epochs):
    it.reset()
    t = time.perf_counter()
    for b in it:
        b.data[0].wait_to_read()
    later.append(time.perf_counter() - t)
it.close()
print(json.dumps({"first": first, "later": sorted(later)[len(later) // 2]}))
"""


def _run(store: Path, cache: Path, mode: str, epochs: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(store), str(cache), mode, str(epochs)], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def content_check(store: Path, cache: Path, repeats: int = 5, epochs: int = 5) -> dict:
    """First epoch of a fresh process (from ``ShardIter()``, where a folder's shards are checked)
    and the median later epoch, ``verify="crc"`` over ``verify="none"``: medians of ``repeats``
    alternated pairs of processes."""
    runs: dict = {"none": [], "crc": []}
    for i in range(repeats):
        for mode in (("none", "crc") if i % 2 == 0 else ("crc", "none")):
            runs[mode].append(_run(store, cache, mode, epochs))

    def median(mode: str, key: str) -> float:
        values = sorted(r[key] for r in runs[mode])
        return values[len(values) // 2]

    out = {f"{m}_{k}_s": median(m, k) for m in runs for k in ("first", "later")}
    out["first_ratio"] = out["crc_first_s"] / out["none_first_s"]
    out["later_ratio"] = out["crc_later_s"] / out["none_later_s"]
    return out


def writer_checksums(folder: Path, schema, specs: list, repeats: int = 3) -> dict:
    """Seconds to write a store (no fsync) with each record's CRC32 computed, against the same
    writer with the CRC call replaced by zeros; best of ``repeats`` each, alternated."""
    import numpy as np

    from shardgen.format import framing

    def zeros(buf, starts, length):
        return np.zeros(len(starts), np.uint32)

    best = {"with": float("inf"), "without": float("inf")}
    for i in range(repeats):
        for key in (("with", "without") if i % 2 == 0 else ("without", "with")):
            with mock.patch.object(framing, "payload_crcs", zeros) if key == "without" else contextlib.nullcontext():
                t0 = time.perf_counter()
                build(folder, schema, specs)
                best[key] = min(best[key], time.perf_counter() - t0)
    return {"with_s": best["with"], "without_s": best["without"], "ratio": best["without"] / best["with"]}
