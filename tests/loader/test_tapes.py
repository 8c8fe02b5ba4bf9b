"""Reads are tapes and opens are lazy (issue 65): a read's records are copied by the kernel from
the checked shards into a private memory file that MXNet reads, any pieces of any shards in one
read; nothing is opened or checked before the block that reads it."""

from __future__ import annotations

import os

import pytest
from conftest import batch_ids, make_store
from test_damage import flip, make

from loader import LoaderError, ShardIter
from shardgen.store.manifest import Manifest


def _tapes() -> int:
    """Memory files this process holds open that are read tapes."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "shardgen-tape" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _shards_open(store) -> int:
    """Descriptors of this process open on ``store``'s .rec files."""
    n, where = 0, str(store.resolve())
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(where) and target.endswith(".rec")
    return n


def _checked(it) -> int:
    """Shards of the iterator's plan checked so far."""
    return sum(f is not None for f in it.reader.plan.files.frames)


def test_a_tape_joins_pieces_of_every_shard_and_every_tape_is_closed(tmp_path):
    counts = {f"2024-03-{d:02d}": 20 + 3 * d for d in range(1, 13)}
    make_store(tmp_path / "s", counts, pack=4)
    total = sum(counts.values())
    before = _tapes()
    with ShardIter(tmp_path / "s", 8, seed=5, shuffle_buffer=12, cache_dir=tmp_path / "c") as it:
        for epoch in range(3):
            if epoch:
                it.reset()
            ids = [i for b in it for i in batch_ids(b)[:8 - b.pad]]
            assert sorted(ids) == list(range(total)), "every window once, read through tapes of stripes"
            blocks = -(-total // it.reader.params.block)
            assert blocks > 3 and it.stats["dates_per_block"] >= sum(-(-n // 4) >= blocks for n in counts.values())
        assert _tapes() - before <= 2 * it.reader.params.readers + 2, "tapes are let go once read"
    assert _tapes() == before, "close() closes every tape"


def test_a_damaged_shard_of_a_later_block_is_named_when_its_block_comes(tmp_path):
    """Only the first read's files are checked before ``ShardIter()`` returns (what stops the epoch
    is said there); a shard of a later block is checked when that block comes."""
    make(tmp_path / "s", dates=8)
    m = Manifest.load(tmp_path / "s" / "manifest.json")
    flip(tmp_path / "s" / m.shards[6].rec, m.schema.record_bytes * 3 + 1)
    per = m.shards[0].records
    it = ShardIter(tmp_path / "s", 8, shuffle=False, shuffle_buffer=per, cache_dir=tmp_path / "c")
    try:
        assert _checked(it) < 6, "the later blocks' shards are not checked yet"
        assert _shards_open(tmp_path / "s") == 8, "but held open: a shard replaced now is not the one read"
        with pytest.raises(LoaderError, match=f"record 3 of {m.shards[6].date} is damaged"):
            for _ in it:
                pass
    finally:
        it.close()


def test_a_shard_is_checked_when_a_block_that_reads_it_comes(tmp_path):
    counts = {f"2024-03-{d:02d}": 40 for d in range(1, 13)}
    make_store(tmp_path / "s", counts)
    with ShardIter(tmp_path / "s", 8, shuffle=False, shuffle_buffer=40, cache_dir=tmp_path / "c") as it:
        it.next()
        assert _checked(it) <= 4, "the first blocks' shards are checked, not the store's 12"
        ids = [i for b in it for i in batch_ids(b)]
    assert ids == list(range(8, 480))


@pytest.mark.parametrize("saved, loading", [(False, None), (True, False)])
def test_a_state_resumes_in_its_own_blocks_whatever_the_loading_iterator_would_use(tmp_path, saved, loading):
    """``stripes`` shapes the order (an object store's default is whole files, a folder's stripes):
    the state records it, and an iterator of the other kind resumes exactly the rest."""
    counts = {f"2024-03-{d:02d}": 30 + d for d in range(1, 9)}
    make_store(tmp_path / "s", counts, pack=4)
    with ShardIter(tmp_path / "s", 8, seed=2, shuffle_buffer=10, stripes=saved, cache_dir=tmp_path / "c") as it:
        for _ in range(5):
            it.next()
        state = it.state_dict()
        rest = [batch_ids(b) for b in it]
    assert state["stripes"] is saved
    with ShardIter(tmp_path / "s", 8, seed=2, shuffle_buffer=10, stripes=loading, cache_dir=tmp_path / "d") as it:
        it.load_state_dict(state)
        assert [batch_ids(b) for b in it] == rest
