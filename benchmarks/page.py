"""``docs/performance.md``, written by ``make bench`` from the run's own results: the machine, the
date and commit, the targets, every figure, the chart. Nothing on that page is typed by hand; the
prose here says only what each figure measures, never what it came to."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Optional

from benchmarks.report import STALL_MARGIN, results_table, targets_block
from shardgen.fsutil import atomic_write

__all__ = ["write_markdown", "render"]

WIDTH = 100  # prose lines of the page

HOW_TO_READ = """\
## How to read it

* **samples/s** is each loader's maximum rate (every array waited on). NDArrayIter over arrays
  already in RAM is the upper bound, not a competitor. The Python iterator from the question is fast
  *in isolation* when its samples are already cut and in memory (two `memcpy`s per batch); its
  problem is the stall columns.
* **stall** is what the GPU sees: a consumer spends a fixed time per batch sleeping outside the GIL
  (like a GPU step), set to 50% / 90% of each loader's maximum rate, and the share of wall time it
  spends waiting for data is counted across epoch boundaries (each `reset()` counts). **next() p99**
  is the 99th percentile of one `next()` (its arrays waited on) in that run. Synchronous loaders
  (NDArrayIter, the question's iterator, the Gluon DataLoader, whose main process unpickles every
  batch) stall about a third of the time at 50% load, by construction.
* **floor**: the same sleeping consumer, at ShardIter's step times, over batches built beforehand
  and popped from a list (`next()` builds nothing). On a shared VM a thread that slept a few ms runs
  its first work slowly (idle vCPU wake-up, cold caches), so even this stalls, and by a different
  amount in every run. ShardIter's stall targets are therefore the floor of the same run plus one
  point (the targets above name the floor they used).
* **cold epoch**: the page cache evicted (`posix_fadvise`) before the epoch. **S3 store**: a cold
  epoch from `s3://` on loopback (`rclone serve s3`; streamed into an empty cache block by block,
  each block's shards fetched, checked and read) against a cold epoch from local disk, both timed
  from `ShardIter(...)` to the last batch, and the time to the first batch; the same from a store
  10x larger; the bytes each of 4 workers downloads; distinct dates per batch with `cache_limit` at
  10-100% of the part (400 dates; docs/s3.md). On 2 cores the downloads (boto3 and sha256 in this
  process, rclone in another) take CPU the reading needs: 28 MB alone download in about 0.2 s.
* **end to end**: one pass over fresh dates from the reference generator. The question's design
  generates, loads and cuts each date inside the loop, in series with training; the other runs
  `shardgen watch` beside a ShardIter that trains on each date as soon as it is published. The run
  whose generator costs CPU time per date reports its **floor**: the first batch cannot come before
  the first date is generated, cut, written and published, and each later epoch (one per batch of
  arrivals) first fills its shuffle buffer.
* **layouts / shards**: bytes per window, build time and warm and cold rates of each record
  layout; shuffled rates from 4 to 400 per-date shards against stock `ImageRecordIter` shuffling one
  file of one-sample records (each rate the mean of two passes, the second in reverse order, so a
  drift of the machine's speed does not tilt the ratios); how many dates a
  batch spans against an exact per-window shuffle.
* **resume / open**: resuming from a `state_dict` saved at 90% of an epoch against reading to there;
  opening and resetting a `ShardIter` over 2M records against stock MXNet's open of the same files.
* **soak**: one `ShardIter`, `reset()` every epoch while a new date is published every few epochs, in
  a process of its own: RSS, file descriptors and threads must stay flat.
* **writer**: payload MB/s of writing a shard (pack, sha256, `.rec`/`.idx`/sidecar, atomic renames)
  against `np.save` of the same arrays. **build**: `shardgen build` in a fresh process against running
  the reference generator alone, serially, for the same dates, with jobs=1 and jobs=2.
* **Gluon LSTM loop**: the same imperative training loop (a small LSTM on the CPU) from batches
  already in RAM and from ShardIter, in alternating rounds; the ratio is the median of the rounds'.
* **ten years** and **larger than memory** (issue 65, `benchmarks/tenyear.py`, `benchmarks/bigmem.py`):
  synthetic stores in the default layout (kept on disk between runs, `benchmarks/bigstores.py`) read by
  ShardIter at its defaults and by the memmap loop over the same rows and labels, each in a fresh process,
  timed from before construction. The exact shuffle's dates per batch is the expected value for the
  store's windows per date. Larger than memory: each process in a 2 GiB cgroup v1 memory limit (page
  cache included), the files' pages dropped before each, read for a bounded time.
"""


def _run_facts(res: dict) -> list[str]:
    m, s = res["machine"], res.get("settings", {})
    commit = f"`{m.get('commit', 'unknown')}`" + (" with uncommitted changes to the code"
                                                  if m.get("uncommitted_changes") else "")
    lines = [f"- run: {m['date']}, at commit {commit}",
             f"- machine: {m['nproc']} cores ({m.get('cpu') or 'CPU unknown'}), {m['platform']}; Python "
             f"{m['python']}, MXNet {m['mxnet']}, numpy {m['numpy']}"]
    if s:
        lines.append(f"- settings: {s['samples']:,} samples of {s['time_steps']} x {s['num_inputs']}, batch "
                     f"{s['batch_size']}, {s['seconds']:g} s per measurement")
    if s.get("quick"):
        lines.append("- **a `--quick` smoke run**: sizes and times too small for its figures to mean anything")
    return lines


def _floor_text(res: dict) -> str:
    fl = res["stall_floor"]
    return textwrap.fill(
        f"The floor of this run (the same sleeping consumer over batches built beforehand): "
        f"{fl['stall_50']['stall_pct']:.2f}% of wall time at 50% load, {fl['stall_90']['stall_pct']:.2f}% at 90%. "
        f"ShardIter's stall is judged against it: at most the floor + {STALL_MARGIN:g} point at each load.", WIDTH)


def render(res: dict, chart: Optional[Path] = None, page: Optional[Path] = None) -> str:
    """The page's text; ``chart`` (if written) is linked relative to ``page``'s folder."""
    out = ["# Performance", "", textwrap.fill(
        "Written by `make bench` (`python -m benchmarks`, `benchmarks/page.py`) from the results of its run; "
        "do not edit it by hand. The machine is shared and noisy: compare the ratios within this run "
        "(the targets), not absolute rates between runs. `make bench` also writes every figure to "
        "`bench/results.json`.", WIDTH), ""]
    out += _run_facts(res) + [""]
    if chart is not None and page is not None:
        out += [f"![throughput and stall per loader]({os.path.relpath(chart, page.parent)})", ""]
    out += ["## Targets", "", _floor_text(res), "", "```text", targets_block(res), "```", "",
            "## Results", "", "```text", results_table(res), "```", "", HOW_TO_READ]
    return "\n".join(out)


def write_markdown(res: dict, path: Path, chart: Optional[Path] = None) -> None:
    """Write the page for ``res`` at ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, render(res, chart, path).encode())
