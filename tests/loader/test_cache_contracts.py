"""Contracts of the object cache and of ``ShardIter()`` over an object store, through the public
interface only (issue 64: tests that hold what is promised, not lines): they stand whatever the
pipeline inside looks like."""

import contextlib
import time

import pytest
from conftest import batch_ids, make_store
from fake_objects import FakeObjects, FakeServer
from test_s3_loader import upload_store

from loader import LoaderError, ShardIter
from shardgen.store import open_store
from shardgen.store.manifest import Manifest


def test_an_iterator_whose_first_files_cannot_be_fetched_fails_when_it_is_made(s3, tmp_path):
    """``ShardIter()`` returns once its first read is open (from an object store: its first files
    are in the cache): a store whose manifest is there but whose shard files are not fails the
    constructor, naming the file, never a later next()."""
    local = tmp_path / "local"
    make_store(local, {f"2024-01-{d:02d}": 30 for d in range(2, 6)})
    url = upload_store(s3, local)
    remote = open_store(url).objects
    for name in [n for n in remote.list() if n.endswith(".rec")]:
        remote.delete(name)
    with pytest.raises(LoaderError, match=r"\.rec"):
        ShardIter(url, 8, cache_dir=tmp_path / "cache", seed=1, shuffle_buffer=16)


@pytest.mark.timeout(120)
def test_files_read_and_closed_make_room_for_the_next_under_a_limit(s3, tmp_path, monkeypatch):
    """Under ``cache_limit`` a third of the part, a file the reads opened and closed again is
    evicted for the next: epochs after epochs read every record, and the cache stays under its
    limit. (A file once held open and never evictable again fills the cache: the next fetch waits
    for room that never comes, then fails 'cache_limit ... is full'.)"""
    from shardgen.store import room

    monkeypatch.setattr(room, "ROOM_WAIT_S", 5.0)  # a wait that cannot end fails in seconds, not 10 minutes
    local = tmp_path / "local"
    counts = {f"2024-02-{d:02d}": 30 + d % 7 for d in range(1, 25)}
    make_store(local, counts)
    url = upload_store(s3, local)
    limit = sum(s.bytes for s in Manifest.load(local / "manifest.json").shards) // 3
    cache = tmp_path / "cache"
    with ShardIter(url, 8, cache_dir=cache, cache_limit=limit, seed=4,
                   shuffle_buffer=16) as it:
        for _ in range(2):
            assert sorted(i for b in it for i in batch_ids(b)) == list(range(sum(counts.values())))
            it.reset()
    assert sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) <= limit


class _Watched(FakeObjects):
    """A ``fake://`` store whose downloads come in small pieces, each one measuring the object cache
    of ``WATCH["cache"]`` on disk (partial downloads included) into ``WATCH["peak"]``; a download in
    place returns a little later (as a store that checks what it wrote would)."""

    def chunks(self, name):
        for chunk in super().chunks(name):
            for i in range(0, len(chunk), 1024):
                _measure()
                time.sleep(0.001)
                yield chunk[i:i + 1024]

    def download(self, name, dest, **kw):
        super().download(name, dest, **kw)
        _measure()
        time.sleep(0.005)


WATCH: dict = {"cache": None, "peak": 0}


def _measure() -> None:
    """Bytes of the object cache's files on disk: every regular file beside its manifest.json."""
    folders = [p.parent for p in WATCH["cache"].rglob("manifest.json")]
    total = 0
    for folder in folders:
        for p in folder.rglob("*"):
            with contextlib.suppress(OSError):
                if ".locks" not in p.parts and p.is_file() and not p.is_symlink():
                    total += p.stat().st_size
    WATCH["peak"] = max(WATCH["peak"], total)


@pytest.mark.timeout(180)
def test_the_cache_never_holds_more_than_its_limit_while_two_fetches_run(tmp_path, monkeypatch):
    """``cache_limit`` bounds what the cache holds on disk at every moment, downloads under way
    included: with a read and the one opened ahead fetching side by side, one fetch makes room
    while the other's downloads are still coming in, and must count them. Measured by the store
    itself, at every piece it hands out, over epochs of a part 3 times the limit."""
    from shardgen.store import objstore

    server = FakeServer(tmp_path / "objects").start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SHARDGEN_OBJECT_STORES", f"fake={__name__}:_Watched")
    objstore.forget_clients()
    local = tmp_path / "local"
    make_store(local, {f"2024-03-{d:02d}": 40 for d in range(1, 21)})
    url = upload_store(server, local)
    limit = 40_000
    WATCH.update(cache=tmp_path / "cache", peak=0)
    try:
        with ShardIter(url, 8, cache_dir=tmp_path / "cache", seed=1, shuffle_buffer=16,
                       cache_limit=limit) as it:
            for _ in range(3):
                assert sum(len(batch_ids(b)) for b in it) == 800
                it.reset()
    finally:
        server.stop()
        objstore.forget_clients()
    assert 0 < WATCH["peak"] <= limit, f"the cache held {WATCH['peak']:,} bytes under cache_limit {limit:,}"
