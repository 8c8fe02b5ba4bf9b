"""Raw retention (issue 56): the watcher removes a raw file only once its date can never be
produced again (gc deleted its shard, or the window is full and the date is older than its oldest
shard); never a date the manifest lists, never with ``store.keep_raw``, and never a late raw file
whose date the rolling window still wants."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest
from conftest import make_store, write_config

from shardgen.config import load_config
from shardgen.store.manifest import Manifest
from shardgen.watch.raw import prune_raw


def _setup(tmp_path, window, shard_dates, raw_dates, keep_raw=False):
    cfg_path = write_config(tmp_path / "p", window=window, extra="")
    if keep_raw:
        cfg_path.write_text(cfg_path.read_text().replace("grace_s =", "keep_raw = true\ngrace_s ="))
    cfg = load_config(cfg_path)
    make_store(cfg.store.dir, {d: 4 for d in shard_dates}, window=window)
    files = {}
    for d in raw_dates:
        path = cfg.raw_path(dt.date.fromisoformat(d))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.zeros((3, 3), np.float32))
        files[dt.date.fromisoformat(d)] = path
    return cfg, Manifest.load(cfg.store.dir / "manifest.json"), files


def test_a_late_raw_file_the_window_still_wants_is_kept(tmp_path):
    """Window 5, 3 shards: a raw file of a date older than the oldest shard may still become a shard."""
    cfg, manifest, files = _setup(tmp_path, 5, ["2024-01-08", "2024-01-09", "2024-01-10"], ["2024-01-03"])
    left, removed = prune_raw(cfg, manifest, set(), files)
    assert removed == [] and files[dt.date(2024, 1, 3)].exists()


def test_with_the_window_full_an_older_raw_file_goes_and_listed_ones_stay(tmp_path):
    dates = ["2024-01-08", "2024-01-09", "2024-01-10"]
    cfg, manifest, files = _setup(tmp_path, 3, dates, ["2024-01-03", *dates])
    left, removed = prune_raw(cfg, manifest, set(), files)
    assert removed == ["2024-01-03"] and not files[dt.date(2024, 1, 3)].exists()
    assert all(files[dt.date.fromisoformat(d)].exists() for d in dates)  # listed: never removed


@pytest.mark.parametrize("keep_raw", [False, True])
def test_a_date_gc_deleted_loses_its_raw_file_unless_keep_raw(tmp_path, keep_raw):
    cfg, manifest, files = _setup(tmp_path, 0, ["2024-01-08"], ["2024-01-05", "2024-01-08"], keep_raw=keep_raw)
    left, removed = prune_raw(cfg, manifest, {"2024-01-05", "2024-01-08"}, files)
    assert removed == ([] if keep_raw else ["2024-01-05"])
    assert files[dt.date(2024, 1, 5)].exists() == keep_raw and files[dt.date(2024, 1, 8)].exists()
    assert left == ({"2024-01-05", "2024-01-08"} if keep_raw else {"2024-01-08"})  # listed: pruned once gc deletes


def test_with_the_window_full_a_late_raw_file_between_its_shards_is_kept(tmp_path):
    """Window 3 full (01-08, 01-10, 01-11): a late raw file of 01-09 is inside the window, not older
    than it (the review of issue 56: measured against the newest shard instead of the oldest, it went)."""
    dates = ["2024-01-08", "2024-01-10", "2024-01-11"]
    cfg, manifest, files = _setup(tmp_path, 3, dates, ["2024-01-09"])
    assert prune_raw(cfg, manifest, set(), files)[1] == [] and files[dt.date(2024, 1, 9)].exists()
