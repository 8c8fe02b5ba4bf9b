"""The training example as a user runs it: Gluon over two contexts, and Module.fit."""

import json
import subprocess
import sys

import numpy as np
from conftest import ROOT, make_store


def run_train(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "loader.tools.train", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_gluon_two_contexts_with_validation(tmp_path):
    make_store(tmp_path / "s", {"2024-01-02": 40, "2024-01-03": 30, "2024-01-04": 25})
    r = run_train("--manifest", tmp_path / "s/manifest.json", "--epochs", "2", "--batch-size", "16",
                  "--cpu-devices", "2", "--val-from", "2024-01-04", "--target", "a", "--hidden", "8",
                  "--history-out", tmp_path / "h.json")
    assert r.returncode == 0, r.stderr
    hist = json.loads((tmp_path / "h.json").read_text())
    assert [h["epoch"] for h in hist] == [0, 1]
    assert all(h["batches"] == 5 and h["samples"] == 70 for h in hist)  # ceil(70/16), pad masked
    assert all(np.isfinite(h["train_mse"]) and np.isfinite(h["val_mse"]) for h in hist)
    assert "epoch 1: train mse" in r.stdout and "data stall" in r.stdout


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
