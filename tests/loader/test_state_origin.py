"""A state loaded where it was not saved (issue 62, item 8): another store's state, or one of a
generation whose files gc deleted, is one LoaderError that says so and names what the state records
and what this iterator reads (was: "saved with seed=1, this iterator has 0", or "altered or damaged");
the epoch in progress goes on. A state of an older generation whose files are still kept loads."""

from __future__ import annotations

import pytest
from conftest import batch_ids, make_store

from loader import LoaderError, ShardIter
from loader.checkpoint import _digest
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
             r"this store's generation 1 lists that name with \w{12} \(5 of its 5 shards differ\); the state records "
             r"generation 1 "
             r"\(5 shards, 2024-02-05 .. 2024-02-09\), this iterator reads generation 1 of .*a/manifest.json "
             r"\(5 shards, 2024-02-05 .. 2024-02-09\)", seed=0)


def test_a_state_of_dates_this_store_never_had_is_refused_as_another_stores(tmp_path):
    make_store(tmp_path / "a", COUNTS)
    make_store(tmp_path / "b", {"2024-03-01": 12, "2024-03-04": 12})
    _refused(tmp_path / "a", tmp_path / "c", _state(tmp_path / "b", tmp_path / "c"),
             r"state_dict was saved on another store: its shard 2024-03-01 \(2024-03-01.rec\) is not in this "
             r"store's generation 1 \(2 of its 2 shards differ, 5 of the generation's are not in the state\); the "
             r"state records generation 1 \(2 shards, 2024-03-01 .. 2024-03-04\), this iterator reads generation 1 of "
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


def _rewritten_elsewhere(root, *, keep_snapshot: bool = True):
    """Store "b" whose generation 1 used the dates' plain names (now retired, kept: every date was
    rewritten in generation 2); and store "a"'s state of the same dates and names, other bytes."""
    make_store(root / "a", COUNTS)
    make_store(root / "b", COUNTS, base_id=1000)
    make_store(root / "b", COUNTS, base_id=2000)  # every date rewritten: 2024-02-05.v2.rec, ...
    if not keep_snapshot:
        (root / "b" / "generations" / "1.json").unlink()  # gc removed the snapshot, the files are in grace
    return _state(root / "a", root / "c")


def test_another_stores_state_of_names_retired_here_is_refused_against_the_kept_snapshot(tmp_path):
    """Found by review: the state's names were only in this store's retired list (no sha256), so the
    state was taken and the epoch read this store's old bytes. Generation 1's snapshot lists them."""
    state = _rewritten_elsewhere(tmp_path)
    _refused(tmp_path / "b", tmp_path / "c", state,
             r"state_dict was saved on another store: its shard 2024-02-05 \(2024-02-05.rec\) has sha256 \w{12}, "
             r"this store's generation 1 lists that name with \w{12} \(5 of its 5 shards differ\); the state "
             r"records generation 1 \(5 shards, 2024-02-05 .. 2024-02-09\), this iterator reads generation 2 of "
             r".*b/manifest.json")


def test_names_only_retired_here_with_no_snapshot_recording_them_are_refused_unread(tmp_path):
    """Generation 1's snapshot gone, its files still kept: nothing here records their sha256, so the
    state cannot be told from one of this store; it is refused rather than read."""
    state = _rewritten_elsewhere(tmp_path, keep_snapshot=False)
    _refused(tmp_path / "b", tmp_path / "c", state,
             r"state_dict's shard 2024-02-05 \(2024-02-05.rec\) cannot be checked: this store lists that file only "
             r"as retired and keeps no snapshot that records its sha256 \(5 of its 5 shards\); the state was "
             r"saved on another store, or on a generation of this one whose snapshot gc has deleted")


def test_names_only_retired_here_are_checked_against_a_later_kept_snapshot(tmp_path):
    """Generation 1's snapshot gone, generation 2 (one date added) still lists its files with their
    sha256: this store's state of generation 1 loads and reads its own windows; another store's is
    refused, naming both ways such a file could differ."""
    make_store(tmp_path / "a", COUNTS)
    store = tmp_path / "b"
    make_store(store, COUNTS, base_id=1000)
    mine = _state(store, tmp_path / "c")
    make_store(store, {"2024-02-10": 12}, base_id=1500)  # generation 2: lists generation 1's files too
    make_store(store, COUNTS, base_id=2000)  # generation 3 rewrites the dates: their plain names are retired
    (store / "generations" / "1.json").unlink()
    with ShardIter(store, B, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(mine)
        assert all(1000 <= i < 1100 for b in it for i in batch_ids(b))
    _refused(store, tmp_path / "c", _state(tmp_path / "a", tmp_path / "c"),
             r"state_dict was saved on another store, or on this store's generation 1 \(its snapshot is gone\), "
             r"whose file 2024-02-05.rec gc deleted and a later build wrote again with other bytes: its shard "
             r"2024-02-05 \(2024-02-05.rec\) has sha256 \w{12}, this store's file of that name \w{12} \(5 of its 5 "
             r"shards differ\)")


def test_a_backfilled_date_whose_old_file_gc_deleted_is_named_so(tmp_path):
    """Found by review: a date left the window, gc deleted it, a backfill wrote it again under the same
    name with other bytes: this store's own state of generation 1 was called another store's."""
    store = tmp_path / "s"
    make_store(store, {"2024-02-05": 12, "2024-02-06": 12, "2024-02-07": 12})
    state = _state(store, tmp_path / "c")
    snapshot = (store / "generations" / "1.json").read_bytes()
    make_store(store, {"2024-02-08": 12}, window=3, base_id=500)  # 2024-02-05 leaves the window
    collect(store, grace_s=0, lease_ttl_s=60)  # and gc deletes its files and generation 1's snapshot
    assert not (store / "2024-02-05.rec").exists() and not (store / "generations" / "1.json").exists()
    make_store(store, {"2024-02-05": 12}, window=0, base_id=1000)  # backfilled: the same name, other bytes
    _refused(store, tmp_path / "c", state,
             r"state_dict was saved on another store, or on this store's generation 1 \(its snapshot is gone\), "
             r"whose file 2024-02-05.rec gc deleted and a later build wrote again with other bytes: its shard "
             r"2024-02-05 \(2024-02-05.rec\) has sha256 \w{12}, this store's file of that name \w{12} \(1 of its 3 "
             r"shards differ\); the state records generation 1 \(3 shards, 2024-02-05 .. 2024-02-07\), this "
             r"iterator reads generation 4 of .*Load a state of a kept generation")
    (store / "generations" / "1.json").write_bytes(snapshot)  # a store that kept generation 1's snapshot
    _refused(store, tmp_path / "c", state,
             r"state_dict was saved on this store's generation 1, whose file 2024-02-05.rec gc deleted and a later "
             r"build wrote again with other bytes: its shard 2024-02-05 \(2024-02-05.rec\) has sha256 \w{12}, "
             r"this store's file of that name \w{12} \(1 of its 3 shards differ\)")


def test_a_state_of_a_generation_this_store_never_reached_is_another_stores(tmp_path):
    """The state's generation 2 is newer than any of this store's: it can only be another store's."""
    make_store(tmp_path / "a", COUNTS)
    make_store(tmp_path / "b", COUNTS, base_id=1000)
    make_store(tmp_path / "b", {"2024-02-10": 12}, base_id=1500)
    _refused(tmp_path / "a", tmp_path / "c", _state(tmp_path / "b", tmp_path / "c"),
             r"state_dict was saved on another store: its shard 2024-02-05 \(2024-02-05.rec\) has sha256 \w{12}, "
             r"this store's file of that name \w{12} \(5 of its 6 shards differ\).*Load a state saved on this store")


def test_a_state_of_a_kept_generation_with_a_date_selection_loads(tmp_path):
    """The state's shards are its generation's for its dates: compared with the snapshot's selection."""
    store = tmp_path / "s"
    make_store(store, COUNTS)
    state = _state(store, tmp_path / "c", dates=("2024-02-06", "2024-02-08"))
    make_store(store, {"2024-02-10": 12}, base_id=1000)  # generation 2
    with ShardIter(store, B, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(state)
        assert sorted(i for b in it for i in batch_ids(b))[-1] < 1000


def test_a_state_missing_a_shard_its_generation_selects_is_another_stores(tmp_path):
    """A state listing fewer shards than its generation selects for its dates (re-signed) is refused."""
    store = tmp_path / "s"
    make_store(store, COUNTS)
    state = _state(store, tmp_path / "c")
    body = {k: v for k, v in state.items() if k != "sha256"}
    body["shards"] = body["shards"][:-1]
    make_store(store, {"2024-02-10": 12}, base_id=1000)
    _refused(store, tmp_path / "c", {**body, "sha256": _digest(body)},
             r"state_dict was saved on another store: this store's generation 1 also selects 2024-02-09 "
             r"\(2024-02-09.rec\), the state does not \(0 of its 4 shards differ, 1 of the generation's are not in "
             r"the state\)")
