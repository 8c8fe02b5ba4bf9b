"""Where a ShardIter reads from and writes to: the one size parser, the store's location (a
manifest file, its folder), and cache_dir, the one root of what the loader writes locally."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import batch_ids, make_store

from loader import LoaderError, ShardIter
from loader.sizes import parse_size
from loader.source.plan import cache_root
from shardgen.fsutil import HOST_TOKEN
from shardgen.store import FolderStore, open_reading

EXPECTED = "a size such as '20GB'"


@pytest.mark.parametrize("text, size", [("256MB", 256 * 10**6), ("1GiB", 2**30), ("1.5 KiB", 1536),
                                        (" 20 gb ", 20 * 10**9), ("3B", 3), ("2TiB", 2 * 2**40), (7, 7)])
def test_sizes_read_as_bytes(text, size):
    assert parse_size(text, "cache_limit", EXPECTED) == size


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, None, "16", "lots", "-1MB", "0MB", "1 XB", "MB"])
def test_a_bad_size_names_the_argument_and_what_is_expected(bad):
    with pytest.raises(LoaderError, match=r"cache_limit (must be a size such as '20GB', got|'0MB' is empty)"):
        parse_size(bad, "cache_limit", EXPECTED)


@pytest.mark.parametrize("text, size", [("20000000000", 20 * 10**9), ("2e10", 2 * 10**10), ("1e+3", 1000)])
def test_a_bare_number_is_bytes_only_where_the_argument_is_bytes(text, size):
    """``cache_limit`` (bytes, e.g. ``--cache-limit 20000000000``) takes a bare number; ``shuffle_buffer``,
    whose int counts records, refuses a string without a unit."""
    assert parse_size(text, "cache_limit", EXPECTED, bare_bytes=True) == size
    with pytest.raises(LoaderError, match="shuffle_buffer must be"):
        parse_size(text, "shuffle_buffer", EXPECTED)


def test_a_missing_store_is_named_with_its_manifest(tmp_path):
    for given in (tmp_path / "nope", tmp_path / "nope" / "manifest.json"):
        with pytest.raises(LoaderError, match=f"{tmp_path / 'nope' / 'manifest.json'}"):
            ShardIter(given, 4, cache_dir=tmp_path / "c")


def test_cache_limit_is_refused_for_a_folder_store(tmp_path):
    make_store(tmp_path / "s", {"2024-01-02": 20})
    with pytest.raises(LoaderError, match=r"cache_limit is only used for stores on an object store \(s3://\)"):
        ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", cache_limit="1GB")


def test_a_manifest_file_its_folder_and_its_default_name_are_one_store(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 30, "2024-01-03": 20})
    shutil.copy(store / "manifest.json", store / "pinned.json")  # a copy under another name, in the store
    with pytest.raises(LoaderError, match="pinned.json: a store is read from its folder or its manifest.json"):
        ShardIter(store / "pinned.json", 5, cache_dir=tmp_path / "c")
    for given in (store, store / "manifest.json", str(store / "manifest.json")):
        assert open_reading(given, tmp_path / "c") == FolderStore(store), given
        with ShardIter(given, 5, shuffle=False, cache_dir=tmp_path / "c") as it:
            assert len(list((store / "leases").glob("*.json"))) == 1, "the reader lease is in the store"
            assert sorted(i for b in it for i in batch_ids(b)) == list(range(50)), given


def test_cache_dir_is_one_root_with_plans_below_it(tmp_path, monkeypatch):
    """Plan folders go to <cache_dir>/plans; without cache_dir the root is $XDG_CACHE_HOME/shardgen,
    else ~/.cache/shardgen."""
    make_store(tmp_path / "s", {"2024-01-02": 20})
    mine = f"{HOST_TOKEN}-{os.getpid()}"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for folder in (tmp_path / "c" / "plans", tmp_path / "c"):  # the latter: where older versions put them
        (folder / f"{HOST_TOKEN}-{dead.pid}" / "00000-abc").mkdir(parents=True)
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c") as it:
        assert it.cache_dir == tmp_path / "c"
        assert it.plan.folder.parent == (tmp_path / "c" / "plans" / mine).resolve()
        assert not list((tmp_path / "c").glob(f"{HOST_TOKEN}-{dead.pid}")), "a dead process's plans are removed"
        assert not list((tmp_path / "c" / "plans").glob(f"{HOST_TOKEN}-{dead.pid}"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "shardgen"
    with ShardIter(tmp_path / "s", 4) as it:
        assert it.plan.folder.parent == (tmp_path / "xdg" / "shardgen" / "plans" / mine).resolve()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "shardgen"
    with ShardIter(tmp_path / "s", 4) as it:
        assert it.plan.folder.parent == (tmp_path / "home" / ".cache" / "shardgen" / "plans" / mine).resolve()
