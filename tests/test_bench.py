"""`python -m benchmarks --quick` runs and writes well-formed results (not timings: `make bench` does those)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

LOADERS = ["NDArrayIter (RAM)", "Python DataIter", "PrefetchingIter(Python)", "Gluon DataLoader (2 workers)",
           "ShardIter", "ShardIter (no shuffle)"]


def test_quick_bench_writes_results(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out),
                        "--chart", str(tmp_path / "chart.png"), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["machine"]["nproc"] >= 1 and res["machine"]["mxnet"] == "1.9.1"
    assert sorted(res["loaders"]) == sorted(LOADERS)
    for name, row in res["loaders"].items():
        assert row["samples_per_s"] > 0 and row["payload_gb_per_s"] > 0, name
        for load in ("stall_50", "stall_90"):
            assert 0 <= row[load]["stall_pct"] <= 100 and row[load]["batches"] > 0, name
    assert res["shardier_cold_epoch"]["samples_per_s"] > 0
    e2e = res["end_to_end"]
    for design in ("question_design", "shardgen_watch_shardier"):
        assert e2e[design]["wall_s"] > 0 and e2e[design]["ratio"] > 0
    # the shardgen side consumed every window of every date, once
    side = e2e["shardgen_watch_shardier"]
    assert side["samples"] == side["expected_samples"] > 0
    assert res["writer"]["shard_mb_per_s"] > 0 and res["writer"]["np_save_mb_per_s"] > 0
    assert res["build"]["speedup"] > 0 and res["build"]["jobs1_vs_generator"] > 0
    loop = res["training_loop"]
    assert loop["ram_s"] > 0 and loop["thread_ratio"] > 0
    names = {t["name"] for t in res["targets"]}
    assert {"ShardIter stall % at 90% load (across epochs)", "ShardIter next() p99 ms at 50% load",
            "Gluon LSTM loop time: ShardIter / batches in RAM",
            "ShardIter 400 shards / stock ImageRecordIter one file (shuffled)"} <= names
    assert all(isinstance(t["met"], bool) for t in res["targets"])
    assert "targets:" in r.stdout and "ShardIter" in r.stdout
