"""A state loaded where it was not saved (issue 62, item 8): another store's state, or one of a
generation whose files gc deleted, is one LoaderError that says so and names what the state records
and what this iterator reads (was: "saved with seed=1, this iterator has 0", or "altered or damaged");
the epoch in progress goes on. A state of an older generation whose files are still kept loads."""

from __future__ import annotations

import pytest
from conftest import batch_ids, make_store

from loader import LoaderError, ShardIter
from shardgen.store.gc import collect

COUNTS = {f"2024-02-{d:02d}": 12 + d % 3 for d in range(5, 10)}
B = 4


def _state(store, cache, **kw) -> dict:
    with ShardIter(store, B, cache_dir=cache, **kw) as it:
        it.next()
        return it.state_dict()


def _refused(store, cache, state, match, **kw) -> None:
    with ShardIter(store, B, cache_dir=cache, **kw) as it:
        first = batch_ids(it.next())
        with pytest.raises(LoaderError, match=match) as err:
            it.load_state_dict(state)
        assert "altered or damaged" not in str(err.value) and "seed" not in str(err.value)
        second = batch_ids(it.next())  # the epoch in progress goes on
    with ShardIter(store, B, cache_dir=cache, **kw) as it:
        assert [batch_ids(it.next()) for _ in range(2)] == [first, second]


@pytest.mark.parametrize("seed", [1, 0])
def test_another_stores_state_is_refused_as_another_stores(tmp_path, seed):
    """Two stores of the same dates and file names, other windows (a store built twice elsewhere)."""
    make_store(tmp_path / "a", COUNTS)
    make_store(tmp_path / "b", COUNTS, base_id=1000)
    state = _state(tmp_path / "b", tmp_path / "c", seed=seed)
    _refused(tmp_path / "a", tmp_path / "c", state,
             r"state_dict was saved on another store: its shard 2024-02-05 \(2024-02-05.rec\) has sha256 \w{12}, "
             r"this store's file of that name \w{12} \(5 of its 5 shards differ\); the state records generation 1 "
             r"\(5 shards, 2024-02-05 .. 2024-02-09\), this iterator reads generation 1 of .*a/manifest.json "
             r"\(5 shards, 2024-02-05 .. 2024-02-09\)", seed=0)


def test_a_state_of_dates_this_store_never_had_is_refused_as_another_stores(tmp_path):
    make_store(tmp_path / "a", COUNTS)
    make_store(tmp_path / "b", {"2024-03-01": 12, "2024-03-04": 12})
    _refused(tmp_path / "a", tmp_path / "c", _state(tmp_path / "b", tmp_path / "c"),
             r"state_dict's shard 2024-03-01 \(2024-03-01.rec\) is not in this store \(2 of its 2 shards are not\): "
             r"the state was saved on another store, or on a generation whose files gc has deleted; the state "
             r"records generation 1 \(2 shards, 2024-03-01 .. 2024-03-04\), this iterator reads generation 1 of "
             r".*a/manifest.json \(5 shards, 2024-02-05 .. 2024-02-09\)")


def test_a_state_of_a_generation_gc_deleted_is_refused_naming_both_generations(tmp_path):
    """Every date rewritten in generation 2; generation 1's files kept (the state loads and reads its
    windows), then deleted by gc (the state is refused naming generations 1 and 2)."""
    store = tmp_path / "s"
    make_store(store, COUNTS)
    state = _state(store, tmp_path / "c")
    make_store(store, COUNTS, base_id=1000)
    with ShardIter(store, B, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(state)
        assert all(i < 1000 for b in it for i in batch_ids(b))
    collect(store, grace_s=0, lease_ttl_s=60)
    assert not (store / "2024-02-05.rec").exists()
    _refused(store, tmp_path / "c", state,
             r"state_dict's shard 2024-02-05 \(2024-02-05.rec\) is not in this store \(5 of its 5 shards are not\): "
             r"the state was saved on another store, or on a generation whose files gc has deleted; the state "
             r"records generation 1 \(5 shards, 2024-02-05 .. 2024-02-09\), this iterator reads generation 3 of")
