"""Scale-out on real engines: MXNet dist_sync over loopback, and sharding on a Dask LocalCluster."""

import json
import os
import signal
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import pytest
from conftest import ROOT, make_store, write_config

from shardgen.build import build
from shardgen.config import load_config
from shardgen.manifest import Manifest

pytestmark = pytest.mark.slow
COUNTS = {"2024-01-02": 50, "2024-01-03": 37, "2024-01-04": 44}  # 131 records: parts of 66 and 65


def launch(*args, timeout=240, **kw):
    return subprocess.run([sys.executable, "-m", "loader.launch", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kw)


def train_cmd(store, tmp_path, epochs=2, extra=()):
    return [sys.executable, "-m", "loader.train", "--manifest", store / "manifest.json", "--kvstore", "dist_sync",
            "--epochs", epochs, "--batch-size", 8, "--target", "a", "--hidden", 4, "--lr", "1e-4",
            "--params-out", tmp_path / "params-{rank}.params", "--record-log", tmp_path / "records-{rank}.json",
            "--history-out", tmp_path / "history-{rank}.json", *extra]


def test_dist_sync_two_workers_exact_epochs_same_params(tmp_path):
    store = tmp_path / "store"
    make_store(store, COUNTS)
    r = launch("-n", 2, "-s", 1, "--", *train_cmd(store, tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("epoch 1: train mse") == 2 and "[rank 0]" in r.stdout and "[rank 1]" in r.stdout
    records = [json.loads((tmp_path / f"records-{k}.json").read_text()) for k in (0, 1)]
    history = [json.loads((tmp_path / f"history-{k}.json").read_text()) for k in (0, 1)]
    for epoch in range(2):
        union = sorted(int(v) for v in records[0][epoch] + records[1][epoch])
        assert union == list(range(131)), "every record exactly once per epoch across the workers"
        assert history[0][epoch]["batches"] == history[1][epoch]["batches"] == 9  # ceil(66 / 8)
    p0, p1 = (mx.nd.load(str(tmp_path / f"params-{k}.params")) for k in (0, 1))
    assert p0.keys() == p1.keys() and p0
    for key in p0:
        np.testing.assert_array_equal(p0[key].asnumpy(), p1[key].asnumpy())


def _descendants(pid):
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            children = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            continue
        for c in map(int, children):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_a_killed_worker_stops_the_job(tmp_path):
    store = tmp_path / "store"
    make_store(store, COUNTS)
    marker = tmp_path / "records-{rank}.json"
    proc = subprocess.Popen([sys.executable, "-m", "loader.launch", "-n", "2", "-s", "1", "--",
                             *map(str, train_cmd(store, tmp_path, epochs=10_000))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "epoch 0:" not in line:  # training is under way
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
        family = _descendants(proc.pid)
        workers = [p for p in family if str(marker) in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
        assert len(workers) == 2 and len(family) >= 4  # scheduler, server, two workers
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "was killed by signal 9; stopping the job" in err
    time.sleep(0.2)
    assert not [p for p in family if _alive(p)], "the launcher left processes behind"


def test_launch_usage_errors():
    r = launch("-n", "2")
    assert r.returncode == 2 and "give the worker command after --" in r.stderr


def shard_hashes(store):
    return {s.date: s.sha256 for s in Manifest.load(store / "manifest.json").shards}


def test_dask_build_gives_the_same_shards_as_local_builds(tmp_path):
    local = load_config(write_config(tmp_path / "local", end="2024-01-09", jobs=1))
    assert not build(local).failed
    loky = load_config(write_config(tmp_path / "loky", end="2024-01-09", jobs=2))
    assert not build(loky).failed
    dask = write_config(tmp_path / "dask", end="2024-01-09", jobs=2)
    dask.write_text(dask.read_text().replace('backend = "loky"', 'backend = "dask"\nscheduler = "local"'))
    report = build(load_config(dask))
    assert not report.failed and len(report.published) == 6
    ref = shard_hashes(local.store.dir)
    assert len(ref) == 6
    assert shard_hashes(loky.store.dir) == ref  # byte-identical, whichever backend or job count
    assert shard_hashes(tmp_path / "dask" / "shards") == ref
    for date in ref:
        assert (tmp_path / "dask" / "shards" / f"{date}.idx").read_bytes() == \
            (local.store.dir / f"{date}.idx").read_bytes()
