"""A stateful model of the object cache under a ``cache_limit`` (issue 56, "what to build" 1c): random
fetches by several readers, pins (a file held open) and unpins, releases, damaged copies dropped and
new generations, against the real ``CachedStore`` over an object store served from a local folder
(``LocalObjects``: the cache's own download path, without a server). Whatever the steps, the cache
never holds more than its limit on disk (a new manifest written beside the old one included), never
evicts a file held open or one a reader's fetch still wants, refuses only a fetch that cannot fit
beside the files in use, and a feed group (a third of what the manifest leaves) fits three times."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from conftest import make_store
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from shardgen.errors import (
    ShardgenError as LoaderError,  # what the cached store raises (the loader says it as a LoaderError)
)
from shardgen.store import S3Store
from shardgen.store.cached import CachedStore
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME
from shardgen.store.objstore import ObjectStore
from shardgen.store.objurl import StoreUnreachable

__all__ = ["LocalObjects", "generations"]


class LocalObjects(ObjectStore):
    """An object store whose objects are the files of a local store folder; ``manifests`` (one per
    generation, ``current`` the one served) stand in for ``manifest.json``; ``down``: unreachable."""

    def __init__(self, root: Path, manifests: Optional[list] = None, url: str = "s3://local/store"):
        super().__init__(url)
        self.root, self.manifests, self.current, self.down = Path(root), manifests, 0, False
        self.requests = 0

    @property
    def endpoint(self) -> str:
        return "local"

    @property
    def attempts(self) -> int:
        return 1

    def check(self) -> None:
        pass

    def _reach(self, name: str) -> None:
        self.requests += 1
        if self.down:
            raise StoreUnreachable(f"{self.where(name)}: cannot reach {self.endpoint} (down on purpose)")

    def get(self, name: str) -> Optional[bytes]:
        self._reach(name)
        if name == MANIFEST_NAME and self.manifests:
            return self.manifests[self.current]
        path = self.root / name
        return path.read_bytes() if path.is_file() else None

    def chunks(self, name: str) -> Iterator[bytes]:
        self._reach(name)
        yield (self.root / name).read_bytes()


def generations(local: Path, n: int) -> list[bytes]:
    """``n`` generations of one store folder, each a date more than the last (shards of varied
    sizes): their manifests' bytes."""
    out = []
    for g in range(n):
        make_store(local, {f"2024-04-{d:02d}": 12 + (d * 7) % 19 for d in range(1, 13 + g)})
        out.append((local / MANIFEST_NAME).read_bytes())
    return out


def _on_disk(folder: Path) -> int:
    """Bytes of every file the cache keeps in ``folder`` (its .locks hold markers and locks only)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and ".locks" not in p.parts)


class CacheModel(RuleBasedStateMachine):
    local: Path
    folder: Path
    manifests: list

    def __init__(self):
        super().__init__()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.remote = LocalObjects(self.local, self.manifests)
        sizes = [s.bytes for s in Manifest.parse(self.manifests[-1], "m").shards]
        m = len(self.manifests[-1])
        self.least = 3 * max(sizes) + 2 * m + m // 8
        self.limit: Optional[int] = None
        self.cache: Optional[CachedStore] = None
        self.wanted: dict = {}  # who -> names its last fetch wants (until released)
        self.pins: dict = {}  # name -> times held open
        self.fetched_since_publish = True

    @property
    def manifest(self) -> Manifest:
        return Manifest.parse(self.manifests[self.remote.current], "m")

    def _meta(self) -> int:
        """What the cache must leave for metadata: the manifest twice (the next one is written beside
        it) and an eighth more (it may list a shard more)."""
        m = self.cache.room.manifest_path.stat().st_size
        return 2 * m + m // 8

    def _size(self, name: str) -> int:
        return (self.folder / name).stat().st_size

    @rule(extra=st.integers(0, 6), scale=st.floats(0, 1))
    @precondition(lambda self: self.cache is None)
    def start(self, extra, scale):
        total = sum(s.bytes for s in Manifest.parse(self.manifests[-1], "m").shards)
        self.limit = self.least + extra + int(scale * total / 2)
        self.cache = CachedStore(S3Store(self.remote), self.folder, self.limit)
        self.cache.newest_manifest_file()

    @rule(data=st.data(), who=st.sampled_from(["r0", "r1", "r2"]))
    @precondition(lambda self: self.cache is not None)
    def fetch(self, data, who):
        shards = self.manifest.shards
        picked = data.draw(st.lists(st.sampled_from(shards), min_size=1, max_size=3, unique_by=lambda s: s.rec))
        names = {s.rec for s in picked}
        others = set().union(*(w for k, w in self.wanted.items() if k != who), self.pins)
        kept = {n for n in others if (self.folder / n).is_file()} | names
        sizes = {s.rec: s.bytes for s in shards}
        need = self._meta() + sum(sizes.get(n) or self._size(n) for n in kept)
        self.wanted[who] = names
        try:
            self.cache.make_local(picked, who=who, schema=self.manifest.schema)
        except LoaderError as exc:
            assert need > self.limit, f"refused though {need} bytes fit the limit {self.limit}: {exc}"
            assert "is full of files" in str(exc), exc
            self.cache.let_go(who)  # as a plan's fetch does when it fails
            self.wanted.pop(who)
            return
        assert need <= self.limit, f"fetched {sorted(names)}: {need} bytes in use under a limit of {self.limit}"
        self.fetched_since_publish = True

    @rule(data=st.data())
    @precondition(lambda self: self.cache is not None)
    def pin(self, data):
        there = sorted(s.rec for s in self.manifest.shards if (self.folder / s.rec).is_file())
        if there:
            name = data.draw(st.sampled_from(there))
            self.cache.pin(name, +1)
            self.pins[name] = self.pins.get(name, 0) + 1

    @rule(data=st.data())
    @precondition(lambda self: self.pins)
    def unpin(self, data):
        name = data.draw(st.sampled_from(sorted(self.pins)))
        self.cache.pin(name, -1)
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]

    @rule(who=st.sampled_from(["r0", "r1", "r2"]))
    @precondition(lambda self: self.cache is not None)
    def release(self, who):
        self.cache.let_go(who)
        self.wanted.pop(who, None)

    @rule(data=st.data())
    @precondition(lambda self: self.cache is not None)
    def drop_damaged(self, data):
        """A cached copy found damaged goes: the next fetch downloads it again."""
        shard = data.draw(st.sampled_from(self.manifest.shards))
        if shard.rec not in self.pins and not any(shard.rec in w for w in self.wanted.values()):
            self.cache.forget_local(shard)
            assert not (self.folder / shard.rec).exists()

    @rule()
    @precondition(lambda self: self.cache is not None and self.fetched_since_publish
                  and self.remote.current + 1 < len(self.manifests))
    def new_generation(self):
        """A publish (a date more); the reader pulls it, as at reset(), and fetches before the next."""
        before = _on_disk(self.folder)
        self.remote.current += 1
        self.cache.newest_manifest_file()
        new = self.cache.room.manifest_path.stat().st_size
        assert before + new <= self.limit, (f"the new manifest ({new} bytes) beside the {before} bytes held "
                                            f"exceeds the limit {self.limit}")
        self.fetched_since_publish = False

    @invariant()
    def within_the_limit(self):
        if self.cache is not None:
            assert _on_disk(self.folder) <= self.limit

    @invariant()
    def nothing_in_use_is_evicted(self):
        for name in set(self.pins).union(*self.wanted.values()):
            assert (self.folder / name).is_file(), f"{name} is in use ({self.pins.get(name, 0)} open) yet evicted"

    @invariant()
    def three_feed_groups_fit_beside_the_manifest(self):
        if self.cache is not None:
            assert 3 * self.cache.group_bytes() + self.cache.room.meta_bytes() <= self.limit

    def teardown(self):
        if self.cache is not None:
            for who in list(self.wanted):
                self.cache.let_go(who)


def test_the_cache_never_exceeds_its_limit_nor_evicts_a_file_in_use(tmp_path):
    """In the ``ci`` profile a failing run is reported as found, not shrunk (shrinking a run of the
    cache can take hypothesis' 5 minutes); ``SHARDGEN_HYPOTHESIS=deep`` shrinks it."""
    local = tmp_path / "local"
    CacheModel.local, CacheModel.folder, CacheModel.manifests = local, tmp_path / "cache", generations(local, 4)
    deep = os.environ.get("SHARDGEN_HYPOTHESIS") == "deep"
    run_state_machine_as_test(CacheModel, settings=settings(
        settings.default, phases=[p for p in settings.default.phases if deep or p != Phase.shrink]))
