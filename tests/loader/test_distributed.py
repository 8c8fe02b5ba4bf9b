"""Scale-out on real engines: MXNet dist_sync over loopback, and sharding on a Dask LocalCluster."""

import json
import os
import re
import signal
import sys
import time

import mxnet as mx
import numpy as np
import proctree
import pytest
from conftest import ROOT, make_store, write_config
from proctree import alive, member_pids
from test_train import assert_params_moved, initial_params

from shardgen.config import load_config
from shardgen.produce.build import build
from shardgen.store.manifest import Manifest

pytestmark = pytest.mark.slow
COUNTS = {"2024-01-02": 50, "2024-01-03": 37, "2024-01-04": 44}  # 131 records: parts of 66 and 65


def launch(*args, timeout=240, **kw):
    """The launcher, its ``--timeout`` below the test's own; every process it started is killed at the end."""
    # A worker script in tests/ has tests/ first on its path, where tests/loader/ (no package) would hide ours.
    kw.setdefault("env", {**os.environ, "PYTHONPATH": str(ROOT)})
    return proctree.run([sys.executable, "-m", "loader.tools.launch", "--timeout", timeout - 10, *args],
                        timeout=timeout,
                        cwd=ROOT, **kw)


def train_cmd(store, tmp_path, epochs=2, extra=()):
    return [sys.executable, "-m", "loader.tools.train", "--manifest", store / "manifest.json", "--kvstore", "dist_sync",
            "--epochs", epochs, "--batch-size", 8, "--target", "a", "--hidden", 4, "--lr", "1e-4",
            "--params-out", tmp_path / "params-{rank}.params", "--record-log", tmp_path / "records-{rank}.json",
            "--history-out", tmp_path / "history-{rank}.json", *extra]


def test_dist_sync_two_workers_exact_epochs_same_params(tmp_path):
    store = tmp_path / "store"
    make_store(store, COUNTS)
    r = launch("-n", 2, "-s", 1, "--", *train_cmd(store, tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("epoch 1: train mse") == 2 and "[rank 0]" in r.stdout and "[rank 1]" in r.stdout
    assert "[rank 0] [rank 0]" not in r.stdout and "[rank 1] [rank 1]" not in r.stdout  # one prefix a line
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
    assert_params_moved(initial_params(store, 4, tmp_path / "init.params"), p0)  # equal because both trained


def test_a_killed_worker_stops_the_job(tmp_path):
    store = tmp_path / "store"
    make_store(store, COUNTS)
    with proctree.Tagged([sys.executable, "-m", "loader.tools.launch", "-n", "2", "-s", "1", "--timeout", 110, "--",
                          *train_cmd(store, tmp_path, epochs=10_000)], cwd=ROOT) as job:
        job.wait_line("epoch 0:", time.monotonic() + 90)  # training is under way
        members = member_pids(job.stderr)
        assert len(members) == 4  # scheduler, server, two workers
        os.kill(members["worker 0"], signal.SIGKILL)
        t0 = time.monotonic()
        code = job.wait(60)
        assert time.monotonic() - t0 < 30
        left = [name for name, pid in members.items() if alive(pid)] + proctree.tagged_pids(job.tag)
    assert code != 0
    assert re.search(r"^launch: worker 0 \(rank [01]\) was killed by signal 9; stopping the job$", job.stderr, re.M)
    assert not left, f"the launcher left {left} behind"


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


# -- Module.fit under dist_sync (issue 54.4, 54.5) -----------------------------------------------


def assert_exact_epochs(records: list, total: int, epochs: int) -> None:
    """Every window once per epoch across the workers' record logs (a list per worker, a list per epoch)."""
    for epoch in range(epochs):
        union = sorted(int(v) for worker in records for v in worker[epoch])
        assert union == list(range(total)), f"epoch {epoch}: every record exactly once across the workers"


def assert_same_params(paths) -> dict:
    first, *others = (mx.nd.load(str(p)) for p in paths)
    assert first
    for other in others:
        assert other.keys() == first.keys()
        for key in first:
            np.testing.assert_array_equal(first[key].asnumpy(), other[key].asnumpy())
    return first


def test_module_fit_with_the_iterator_made_first(tmp_path):
    """for_kvstore, then Module.fit(it, kvstore=kv), as a user writes it: the iterator's agreement
    used integer keys before Module's string keys ("Mixed key types are not allowed" on both ranks)."""
    store, out = tmp_path / "store", tmp_path / "out"
    make_store(store, COUNTS)
    out.mkdir()
    r = launch("-n", 2, "-s", 1, "--", sys.executable, ROOT / "tests" / "dist_module_worker.py", "--store", store,
               "--out", out, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [json.loads((out / f"rank-{k}.json").read_text()) for k in (0, 1)]
    assert [len(e) for e in ranks[0]["epochs"]] != [len(e) for e in ranks[1]["epochs"]]  # 65 and 66: own parts
    assert_exact_epochs([rank["epochs"] for rank in ranks], 131, 2)
    assert_same_params(out / f"params-{k}.params" for k in (0, 1))


def test_a_second_dist_kvstore_in_a_worker_fails_at_once(tmp_path):
    """Module.fit(it, kvstore="dist_sync") while the iterator holds a kvstore: MXNet's second
    KVStoreDist waits forever in its constructor (a ps-lite barrier no server joins); it is a
    LoaderError saying to pass the kvstore object, and the launcher stops the job."""
    store, out = tmp_path / "store", tmp_path / "out"
    make_store(store, COUNTS)
    out.mkdir()
    t0 = time.monotonic()
    r = launch("-n", 2, "-s", 1, "--", sys.executable, ROOT / "tests" / "dist_module_worker.py", "--store", store,
               "--out", out, "--fit-kvstore", "dist_sync", timeout=90)
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - t0 < 60, "a hang that only --timeout ended"
    assert "this worker has a 'dist_sync' kvstore already" in r.stdout and "kvstore=kv" in r.stdout
    assert re.search(r"^launch: worker [01] \(rank [01]\) exited with code 1; stopping the job$", r.stderr, re.M)


def test_train_tool_module_splits_the_epoch_between_workers(tmp_path):
    """python -m loader.tools.train --module --kvstore dist_sync: each worker reads its own part
    (it read the whole epoch and trained alone: the same mse on both ranks)."""
    store = tmp_path / "store"
    make_store(store, COUNTS)
    r = launch("-n", 2, "-s", 1, "--", *train_cmd(store, tmp_path, extra=("--module",)), timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    history = [json.loads((tmp_path / f"history-{k}.json").read_text()) for k in (0, 1)]
    for epoch in range(2):
        assert history[0][epoch]["batches"] == history[1][epoch]["batches"] == 9  # ceil(66 / 8), not 17
        assert sorted(h[epoch]["samples"] for h in history) == [65, 66]
    records = [json.loads((tmp_path / f"records-{k}.json").read_text()) for k in (0, 1)]
    assert_exact_epochs(records, 131, 2)
    assert re.search(r"^\[rank 0\] epoch 1: train mse", r.stdout, re.M) and "[rank 1] epoch 1" in r.stdout
    assert_same_params(tmp_path / f"params-{k}.params" for k in (0, 1))


# -- stop a dist_sync job and resume it on another number of workers (issue 54.6) ----------------

EVEN = {"2024-01-02": 50, "2024-01-03": 38, "2024-01-04": 44}  # 132: no repeated window on 1, 2 or 4 parts of 8


@pytest.mark.parametrize("workers, lr", [(4, "0"), (1, "1e-3")])
def test_stop_and_resume_on_another_number_of_workers(tmp_path, workers, lr):
    """2 -> 4 and 2 -> 1 workers. With lr 0 the resumed job's parameters stay the checkpoint's
    exactly (Adam's step is lr * ...): they were loaded."""
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    make_store(store, EVEN)
    common = ["--manifest", store / "manifest.json", "--kvstore", "dist_sync", "--epochs", 2, "--batch-size", 8,
              "--target", "a", "--hidden", 4, "--lr", "1e-3"]
    cmd = [sys.executable, "-m", "loader.tools.train", *common]
    r = launch("-n", 2, "-s", 1, "--", *cmd, "--stop-after", 5, "--checkpoint", ckpt,
               "--record-log", tmp_path / "first-{rank}.json", timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] stopped after 5 batches, in epoch 0; checkpoint" in r.stdout
    assert "[rank 1] stopped after 5 batches, in epoch 0\n" in r.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["net.params", "state.json"]
    first = [json.loads((tmp_path / f"first-{k}.json").read_text()) for k in (0, 1)]
    assert [len(f) for f in first] == [1, 1] and [len(f[0]) for f in first] == [40, 40]  # 5 batches of 8
    saved = mx.nd.load(str(ckpt / "net.params"))

    cmd[cmd.index("--lr") + 1] = lr
    r = launch("-n", workers, "-s", 1, "--", *cmd, "--resume", ckpt, "--record-log", tmp_path / "then-{rank}.json",
               "--history-out", tmp_path / "history-{rank}.json", "--params-out", tmp_path / "params-{rank}.params",
               timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    then = [json.loads((tmp_path / f"then-{k}.json").read_text()) for k in range(workers)]
    history = [json.loads((tmp_path / f"history-{k}.json").read_text()) for k in range(workers)]
    # Epoch 0: the 80 windows read before the stop and the 52 left, split among the new workers, each once.
    rest = [v for t in then for v in t[0]]
    assert len(rest) == 52
    assert sorted(int(v) for v in [*first[0][0], *first[1][0], *rest]) == list(range(132))
    assert_exact_epochs([t[1:] for t in then], 132, 1)  # epoch 1: whole, on the new workers
    assert [h["epoch"] for h in history[0]] == [0, 1]
    for epoch in range(2):
        assert len({h[epoch]["batches"] for h in history}) == 1  # dist_sync: the same batches on every worker
    params = assert_same_params(tmp_path / f"params-{k}.params" for k in range(workers))
    if lr == "0":
        assert_same_params([ckpt / "net.params", tmp_path / "params-0.params"])
    else:
        assert_params_moved(saved, params)  # it trained on from the checkpoint
