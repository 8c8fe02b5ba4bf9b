"""A worker reading an object store fetches only the shards its part reads (issue 36), worked out
from the manifest's window counts alone, and reads exactly the batches a worker reading a folder
reads: the order is a value (loader.pipeline.order), the same for every store. Shown on a store
folder made to be read as a cache is (files made local as reads need them) (the S3 path itself: test_s3_loader)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_store

from loader import ShardIter
from shardgen.store import FolderStore

# 240 windows: of 8 parts, most bounds fall on a shard's edge (30, 90, 120, ...), one inside (60);
# of 5 parts, all inside a shard (48, 96, ...) and, packed by 4, inside a record.
COUNTS = {f"2024-03-{d:02d}": n for d, n in zip(range(1, 11), (30, 20, 30, 10, 30, 30, 10, 20, 30, 30))}


def arrays(batches) -> list:
    """Every batch's arrays and pad, in order."""
    return [([a.asnumpy().tobytes() for a in b.data + b.label], b.pad) for b in batches]


def expected(manifest: dict, parts: int, part: int) -> set:
    """The dates part ``part`` fetches, worked out independently: the shards its samples
    ``[part * N // parts, (part + 1) * N // parts)`` (store order) live in."""
    shards = manifest["shards"]
    cum = np.cumsum([0] + [s["windows"] for s in shards])
    lo, hi = part * int(cum[-1]) // parts, (part + 1) * int(cum[-1]) // parts
    return {s["date"] for s, a, z in zip(shards, cum[:-1], cum[1:]) if a < hi and z > lo}


@pytest.mark.parametrize("pack,older", [(1, False), (4, False), (4, True)])
def test_a_part_fetches_only_its_own_shards_and_reads_the_folder_s_batches(tmp_path, monkeypatch, pack, older):
    store = tmp_path / "s"
    make_store(store, COUNTS, pack=pack)
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    if older:  # a manifest of 2026-12-05 says whether records are told apart ("distinct"): read as any other
        for s in manifest["shards"]:
            s["distinct"] = True
        path.write_text(json.dumps(manifest))
    kw = dict(seed=3, cache_dir=tmp_path / "cache", shuffle_buffer=16, stripes=False)
    fetched: set = set()
    real_fetch = FolderStore.make_local

    def fetch(self, shards, **kw):
        fetched.update(s.date for s in shards)
        return real_fetch(self, shards, **kw)

    for parts in (5, 8):
        for part in range(parts):
            with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                want = arrays(it)
            with monkeypatch.context() as m:
                m.setattr(FolderStore, "in_place", False)
                m.setattr(FolderStore, "make_local", fetch)
                fetched.clear()
                with ShardIter(store, 5, num_parts=parts, part_index=part, **kw) as it:
                    got = arrays(it)
                    ahead = {s.date for s in it.reader._part_of(it.reader.manifest)}  # fetched ahead of a new one
            assert fetched == expected(manifest, parts, part), (parts, part)
            assert ahead == fetched
            assert len(fetched) < len(COUNTS)
            assert got == want, (parts, part)
