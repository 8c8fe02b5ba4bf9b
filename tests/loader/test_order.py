"""The order as a value (loader.pipeline.order) and how the feed cuts it into reads
(loader.pipeline.fill): pure functions, checked on many shapes."""

from __future__ import annotations

import numpy as np
import pytest

from loader import LoaderError
from loader.pipeline.fill import _cut_reads, _group
from loader.pipeline.order import EpochOrder, OrderSpec


def _samples(order: EpochOrder, intervals) -> list:
    """(shard, sample) of every position of ``intervals``, in reading order."""
    out = []
    for v in order.visits(intervals):
        block = order.block(v.c, v.b)
        seq = [(k, s) for k, lo, hi in block.pieces for s in range(lo, hi)]
        perm = block.perm if block.perm is not None else np.arange(len(seq))
        out += [seq[int(perm[u])] for u in range(v.u0, v.u1)]
    return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_epoch_is_every_sample_once_the_same_every_time_and_new_every_epoch(shuffle):
    rng = np.random.default_rng(1)
    for _ in range(40):
        counts = rng.integers(1, 40, size=int(rng.integers(1, 12))).tolist()
        spec = OrderSpec(int(rng.integers(0, 99)), shuffle, int(rng.integers(1, 5)), int(rng.integers(1, 70)))
        order = EpochOrder(counts, spec, 3)
        got = _samples(order, [(0, order.total)])
        want = [(k, s) for k, n in enumerate(counts) for s in range(n)]
        assert sorted(got) == want
        assert got == _samples(EpochOrder(counts, spec, 3), [(0, order.total)])  # a value
        if not shuffle:
            assert got == want  # in order: the store's order
    counts, spec = [30] * 8, OrderSpec(5, True, 1, 64)
    assert _samples(EpochOrder(counts, spec, 0), [(0, 240)]) != _samples(EpochOrder(counts, spec, 1), [(0, 240)])


def test_a_canonical_part_reads_only_its_own_shards_in_equal_blocks_read_in_store_order():
    counts = [25] * 16
    order = EpochOrder(counts, OrderSpec(0, True, 4, 4096), 0)
    for c in range(4):
        lo, hi = int(order.canon[c]), int(order.canon[c + 1])
        assert order.shards_of([(lo, hi)]) == set(range(4 * c, 4 * c + 4))
    for n, block, want in ((10_000, 4096, [3334, 3333, 3333]), (10_000, 10_000, [10_000]), (10_001, 10_000,
                                                                                               [5001, 5000])):
        sizes = np.diff(EpochOrder([n], OrderSpec(0, True, 1, block), 0).canonical(0)[2]).tolist()
        assert sizes == want, "as few blocks as hold the part, of equal size (no short last block)"
        sizes = np.diff(EpochOrder([n], OrderSpec(0, False, 1, block), 0).canonical(0)[2]).tolist()
        assert sorted(sizes) == sorted(want), "in order too"
    order = EpochOrder([7, 30, 12, 50, 9], OrderSpec(3, True, 1, 40), 2)
    for b in range(len(order.canonical(0)[2]) - 1):
        pieces = order.block(0, b).pieces
        assert list(pieces) == sorted(pieces), "a block's pieces are read in store order"
    # a part that is one block reads the same pieces every epoch (its native reads are reused)
    assert EpochOrder([7, 30, 12], OrderSpec(3, True, 1, 49), 0).block(0, 0).pieces == \
        EpochOrder([7, 30, 12], OrderSpec(3, True, 1, 49), 5).block(0, 0).pieces == ((0, 0, 7), (1, 0, 30), (2, 0, 12))


def _dates_of_batches(order: EpochOrder, batch: int = 512) -> np.ndarray:
    days = np.array([k for k, _ in _samples(order, [(0, order.total)])])
    return np.array([len(np.unique(days[i:i + batch])) for i in range(0, len(days) - batch + 1, batch)])


@pytest.mark.parametrize("shards, per", [(200, 500), (400, 400)])
def test_a_part_that_fits_a_block_mixes_like_an_exact_shuffle_from_its_first_batch(shards, per):
    """A block larger than the canonical part (the default wherever the part fits): the epoch is
    one block, an exact shuffle, and its first batches mix as many dates as any (they came from
    one date while the first blocks ramped up from 1/256 of a block)."""
    order = EpochOrder([per] * shards, OrderSpec(0, True, 1, 524_288), 0)
    assert len(order.canonical(0)[2]) == 2
    days = np.repeat(np.arange(shards), per)[np.random.default_rng(0).permutation(shards * per)]
    exact = np.array([len(np.unique(days[i:i + 512])) for i in range(0, len(days) - 511, 512)])
    got = _dates_of_batches(order)
    assert got.mean() >= 0.95 * exact.mean()
    assert got[:20].min() >= 0.9 * exact.mean(), "the epoch's first batches mix every date too"


def test_reads_join_any_pieces_and_are_cut_by_records_alone():
    """A read is a tape (``reader_source``): pieces that start or end inside their files join."""
    recs = [(3, 5, 9, 9), (1, 0, 4, 4), (7, 0, 6, 10), (2, 0, 3, 3)]  # (shard, lo, hi, records in its file)
    reads = _cut_reads(recs, 100, 1000)
    assert [r.pieces for r in reads] == [((3, 5, 9), (1, 0, 4), (7, 0, 6), (2, 0, 3))]
    assert [r.slot for r in reads] == [100]
    reads = _cut_reads(recs, 100, 8)
    assert [r.pieces for r in reads] == [((3, 5, 9), (1, 0, 4)), ((7, 0, 6), (2, 0, 2)), ((2, 2, 3),)]
    assert [r.slot for r in reads] == [100, 108, 116]
    small = _cut_reads(recs, 0, 3)
    assert sum(r.records for r in small) == 17 and max(r.records for r in small) <= 3
    slots = [s for r in small for s in range(r.slot, r.slot + r.records)]
    assert slots == list(range(17))


def test_groups_hold_at_most_the_cap_of_files():
    pieces = tuple((k, 0, 1) for k in range(10))
    sizes = [5, 3, 9, 1, 1, 7, 2, 2, 2, 8]
    groups = _group(pieces, sizes, 10)
    assert [p for g in groups for p in g] == list(pieces)
    assert all(sum(sizes[k] for k, _, _ in g) <= 10 for g in groups)
    assert _group(pieces, sizes, sum(sizes)) == [list(pieces)]


def test_a_record_of_another_date_than_the_order_expects_is_refused():
    import tempfile
    from pathlib import Path

    from conftest import make_store

    from loader.pipeline.shuffle_buffer import ShuffleBuffer
    from shardgen.store.manifest import Manifest

    store = Path(tempfile.mkdtemp()) / "s"
    make_store(store, {"2024-01-02": 3})
    schema = Manifest.load(store / "manifest.json").schema
    buffer = ShuffleBuffer(schema, 8)
    payload = np.zeros((2, schema.record_floats), np.float32)
    payload[:, -1] = 19724
    buffer.put(0, payload, np.full(2, 19724, np.float32))
    with pytest.raises(LoaderError, match="changed under the reader"):
        buffer.put(2, payload, np.full(2, 19725, np.float32))


def _items_one_piece_at_a_time(pieces, counts_of, slot, pack):
    """The feed's mapping walked piece by piece, record by record (the definition)."""
    codes, recs = [], []
    for (k, lo, hi), counts in zip(pieces, counts_of):
        r, first = 0, 0
        while first + counts[r] <= lo:  # the record holding the piece's first sample
            first += counts[r]
            r += 1
        r0 = r
        while r < len(counts) and first < hi:
            for item in range(max(lo - first, 0), min(hi - first, counts[r])):
                codes.append(slot * pack + item)
            first += counts[r]
            r += 1
            slot += 1
        recs.append((k, r0, r, len(counts)))
    return np.array(codes, np.int64), recs


def test_the_feeds_one_pass_mapping_matches_a_record_by_record_walk():
    """``group_items`` (one numpy pass over a group's pieces) gives every record its slot and
    every item its code exactly as walking the pieces record by record does: random shards of
    packed records (full, partial, some with no samples), random pieces (a shard twice in a group
    too), packs of 1, 4 and 64; and an empty group is empty."""
    from loader.pipeline.fill import group_items

    rng = np.random.default_rng(0)
    for _ in range(2000):
        pack = int(rng.choice([1, 4, 64]))
        shards = [rng.integers(0 if rng.random() < 0.3 else 1, pack + 1, rng.integers(1, 12)) if rng.random() < 0.7
                  else np.full(rng.integers(1, 12), pack) for _ in range(rng.integers(1, 8))]
        shards = [c if c.sum() else np.append(c, 1) for c in shards]  # records with no samples, never a shard
        pieces = []
        for k in rng.integers(0, len(shards), rng.integers(1, len(shards) + 1)):  # a shard may come twice
            total = int(shards[k].sum())
            lo = int(rng.integers(0, total))
            pieces.append((int(k), lo, int(rng.integers(lo + 1, total + 1))))
        counts_of = [shards[k] for k, _, _ in pieces]
        slot = int(rng.integers(0, 50))
        want_codes, want_recs = _items_one_piece_at_a_time(pieces, counts_of, slot, pack)
        codes, recs = group_items(pieces, counts_of, slot, pack)
        assert np.array_equal(codes, want_codes) and recs == want_recs, (pieces, slot, pack)
    codes, recs = group_items([], [], 7, 64)
    assert len(codes) == 0 and recs == []


@pytest.mark.parametrize("seed", range(6))
def test_stripes_spread_each_pieces_extra_records_so_blocks_stay_equal(seed):
    """Ten pieces of 7 records over 4 blocks: each gives 1 or 2 records to a block (3 blocks get the
    extra one); the extras of each piece start where the last piece's ended, so the blocks hold 17
    or 18 records, never 16 beside 19."""
    order = EpochOrder([7] * 10, OrderSpec(seed, True, 1, 18), 0)
    sizes = np.diff(order.canonical(0)[2])
    assert len(sizes) == 4 and sorted(set(sizes.tolist())) == [17, 18], sizes
