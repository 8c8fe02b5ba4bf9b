"""The training example as a user runs it: Gluon over two contexts, and Module.fit."""

import json
import subprocess
import sys
from pathlib import Path

import mxnet as mx
import numpy as np
from conftest import ROOT, make_store

from loader.shard_iter import ShardIter
from loader.tools.train import batch_losses, build_net


def run_train(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "loader.tools.train", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def initial_params(store, hidden, path, seed=0) -> dict:
    """The parameters the example starts from: its net, built with the same seed, before any update."""
    with ShardIter(store / "manifest.json", 4) as it:
        shape = it.provide_data[0].shape[1:]
    net = build_net(hidden, [mx.cpu()], seed)
    net(mx.nd.zeros((1, *shape)))  # the LSTM's input size is known at the first call
    net.save_parameters(str(path))
    return mx.nd.load(str(path))


def assert_params_moved(before: dict, after: dict) -> None:
    assert before.keys() == after.keys() and before
    for key in before:
        assert not np.array_equal(before[key].asnumpy(), after[key].asnumpy()), f"{key} was never updated"


def test_gluon_two_contexts_with_validation(tmp_path):
    make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 30, "2024-01-04": 25})
    r = run_train("--manifest", tmp_path / "s/manifest.json", "--epochs", "2", "--batch-size", "16",
                  "--cpu-devices", "2", "--val-from", "2024-01-04", "--target", "a", "--hidden", "8",
                  "--history-out", tmp_path / "h.json", "--params-out", tmp_path / "trained.params")
    assert r.returncode == 0, r.stderr
    hist = json.loads((tmp_path / "h.json").read_text())
    assert [h["epoch"] for h in hist] == [0, 1]
    assert all(h["batches"] == 5 and h["samples"] == 70 for h in hist)  # ceil(70/16), pad masked
    assert all(np.isfinite(h["train_mse"]) and np.isfinite(h["val_mse"]) for h in hist)
    assert "epoch 1: train mse" in r.stdout and "data stall" in r.stdout
    assert_params_moved(initial_params(tmp_path / "s", 8, tmp_path / "init.params"),
                        mx.nd.load(str(tmp_path / "trained.params")))


def test_padded_rows_weigh_nothing_in_the_loss():
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = build_net(4, ctx, seed=0)
    rng = np.random.default_rng(0)
    data, labels = rng.normal(size=(8, 5, 3)).astype(np.float32), rng.normal(size=(2, 8)).astype(np.float32)

    def loss(data, labels) -> float:
        batch = mx.io.DataBatch([mx.nd.array(data)], [mx.nd.array(v) for v in labels], pad=3)
        return sum(float(part.sum().asscalar()) for part in batch_losses(net, batch, ctx, target=1))

    base = loss(data, labels)
    junk_data, junk_labels = data.copy(), labels.copy()
    junk_data[5:], junk_labels[:, 5:] = 100.0, -100.0  # the 3 padded rows
    assert loss(junk_data, junk_labels) == base
    real_row = labels.copy()
    real_row[1, 4] += 10.0  # the last real row does count
    assert loss(data, real_row) > base


def test_module_fit_example(tmp_path):
    make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 3})
    r = run_train("--manifest", tmp_path / "s/manifest.json", "--epochs", "2", "--batch-size", "8",
                  "--module", "--target", "a", "--history-out", tmp_path / "h.json")
    assert r.returncode == 0, r.stderr
    hist = json.loads((tmp_path / "h.json").read_text())
    assert [h["epoch"] for h in hist] == [0, 1]
    assert all(h["batches"] == 6 and h["samples"] == 43 for h in hist), hist  # ceil(43/8), pad not counted
    assert all(np.isfinite(h["train_mse"]) and h["train_mse"] > 0 for h in hist), hist
    assert "epoch 1: train mse" in r.stdout and "6 batches, 43 samples" in r.stdout


def test_bad_manifest_is_one_line(tmp_path):
    r = run_train("--manifest", tmp_path / "nope.json")
    assert r.returncode == 2 and "no manifest" in r.stderr and "Traceback" not in r.stderr


VAL_COUNTS = {"2024-01-02": 20, "2024-01-03": 18, "2024-01-04": 15, "2024-01-05": 11}  # ids 0-37 precede 01-04


def _dates_of(ids: list) -> list:
    """The dates of window ids (make_store numbers them in date order)."""
    bounds = np.cumsum(list(VAL_COUNTS.values()))
    return sorted({list(VAL_COUNTS)[int(np.searchsorted(bounds, i, side="right"))] for i in ids})


def test_both_paths_train_on_the_dates_before_val_from_and_honour_max_batches(tmp_path):
    """Gluon and ``--module`` with ``--val-from 2024-01-04``: every epoch trains each window of the
    dates before it once, and reports a validation figure; with ``--max-batches 2``, two batches of
    those dates an epoch (the issue: ``--module`` trained on every date, 68 batches, no val figure)."""
    make_store(tmp_path / "s", VAL_COUNTS)
    for path in ("gluon", "module"):
        for limit in (0, 2):
            out = tmp_path / f"{path}-{limit}"
            r = run_train("--manifest", tmp_path / "s/manifest.json", "--epochs", "2", "--batch-size", "8",
                          "--val-from", "2024-01-04", "--target", "a", "--hidden", "4", "--max-batches", limit,
                          "--record-log", f"{out}-seen.json", "--history-out", f"{out}-h.json",
                          *(["--module"] if path == "module" else []))
            assert r.returncode == 0, r.stderr
            seen = json.loads(Path(f"{out}-seen.json").read_text())
            hist = json.loads(Path(f"{out}-h.json").read_text())
            assert len(seen) == 2 and [h["epoch"] for h in hist] == [0, 1], (path, limit)
            for ids, h in zip(seen, hist):
                ids = [int(i) for i in ids]
                assert _dates_of(ids) == ["2024-01-02", "2024-01-03"], (path, limit)
                assert len(set(ids)) == len(ids) == (16 if limit else 38), (path, limit)
                assert h["batches"] == (2 if limit else 5) and np.isfinite(h["val_mse"]), (path, limit, h)
            assert "val mse" in r.stdout, (path, limit)
