"""What a saved state carries through resumes (issue 64, contracts 1 and 2), through the public
interface alone (``ShardIter``, ``state_dict``/``load_state_dict``, ``reset``): whatever reads the
order underneath, these must hold.

1. **Chains of resumes across shapes.** A job saved, resumed on another ``num_parts`` or
   ``batch_size``, saved again and resumed again (any number of times) reads every window of the
   epoch exactly once over all its stretches: a state saved after a resume still says what the
   stretches before the resume read.
2. **A state pins what it read.** A state records the generation whose shards its epoch reads and
   the iterator's pin (``generation=N``). Loaded anywhere, the epoch goes on on that generation and
   the next ``state_dict()`` records it again (not the newest one the loading iterator saw); a
   pinned state pins the loading iterator from then on (every later ``reset()`` reads generation
   N); an unpinned state leaves the loading iterator's own choice (its pin, or the newest at the
   next ``reset()``).
"""

from __future__ import annotations

from typing import Optional

import pytest
from conftest import batch_ids, make_store
from hypothesis import example, given
from hypothesis import strategies as st

from loader import LoaderError, ShardIter
from shardgen.store.lease import live_lease_generations

COUNTS = {f"2024-05-{d:02d}": 11 + 6 * (d % 3) for d in range(1, 10)}  # 9 dates, 150 windows
TOTAL = sum(COUNTS.values())
KW = dict(seed=7, shuffle_buffer=12)  # blocks of 48 windows (packed by 4): several blocks a part


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("chains") / "s"
    make_store(path, COUNTS, pack=4)
    return path


def _real(batches: list, bs: int, last: list) -> list:
    """Ids of the real windows of one part's consecutive batches ``(ids, pad)``: pads dropped, and a
    batch that only repeats the last real one (a part that ran out a batch early) left out.
    ``last``: the first id of the part's batch before these (kept up to date)."""
    ids = []
    for rows, pad in batches:
        if pad == bs - 1 and rows[0] == last[0]:
            continue
        ids += rows[:bs - pad]
        last[0] = rows[0]
    return ids


def _stretch(store, cache, state, parts: int, bs: int, k, lasts: dict) -> tuple[list, int, dict]:
    """Every part of a job of ``parts`` workers loads ``state`` (None: the epoch's start) and reads
    ``k`` batches (None: to the end; all the same number, as dist_sync workers do): the windows
    read, the batches each part read, and the state part 0 saved. ``lasts``: each part's last
    batch's first id (a part that goes on with its phase may repeat it)."""
    iters = [ShardIter(store, bs, num_parts=parts, part_index=p, cache_dir=cache, **KW) for p in range(parts)]
    try:
        ids, read = [], set()
        for p, it in enumerate(iters):
            if state is not None:
                it.load_state_dict(state)
            batches = it if k is None else (b for _, b in zip(range(k), it))
            rows = [[b.label[0].asnumpy().astype(int).tolist(), b.pad] for b in batches]
            read.add(len(rows))
            ids += _real(rows, bs, lasts.setdefault(p, [None]))
        assert len(read) == 1, f"the parts of one job read {sorted(read)} batches: they must read as many"
        return ids, read.pop(), (iters[0].state_dict() if k is not None else None)
    finally:
        for it in iters:
            it.close()


def _left(store, cache, state, parts: int, bs: int) -> Optional[int]:
    """Batches a job of ``parts`` workers of batch ``bs`` reads after loading ``state``; None when
    it refuses to (fewer windows are left than parts: a LoaderError saying so, as it should)."""
    with ShardIter(store, bs, num_parts=parts, cache_dir=cache, **KW) as probe:
        if state is not None:
            try:
                probe.load_state_dict(state)
            except LoaderError as exc:
                assert "would be empty" in str(exc), exc
                return None
        return probe.batches_per_epoch


SHAPE = st.tuples(st.integers(1, 3), st.sampled_from([3, 4, 7, 9]))


@example(chain=[((2, 4), 0.5), ((1, 4), 0.5), ((3, 7), 0.3)], last=(2, 4))
@example(chain=[((1, 7), 0.4), ((1, 4), 0.6), ((1, 7), 0.5)], last=(1, 4))
@example(chain=[((2, 4), 0.3), ((2, 4), 0.3), ((3, 4), 0.5)], last=(2, 9))
@given(chain=st.lists(st.tuples(SHAPE, st.floats(0.0, 0.9)), min_size=1, max_size=4), last=SHAPE)
def test_any_chain_of_resumes_across_parts_and_batch_sizes_reads_every_window_once(store, tmp_path_factory,
                                                                                  chain, last):
    """Each stretch of the chain: a job of ``parts`` workers of batch ``bs`` loads the state the
    stretch before saved, reads a fraction of what is left, and saves; the last one reads to the
    end. Over all stretches every window of the epoch is read exactly once (a second resume used
    to be free to forget what the stretches before the first resume read)."""
    cache = tmp_path_factory.mktemp("c")
    state, seen, shape, in_phase, lasts = None, [], None, 0, {}
    for (parts, bs), frac in [*chain, (last, None)]:
        total = _left(store, cache, state, parts, bs)
        if total is None:  # too few windows left for these parts: go on with one
            parts = 1
            total = _left(store, cache, state, parts, bs)
        if (parts, bs) != shape:
            in_phase, lasts = 0, {}  # the same shape goes on with its phase's batches
        k = None if frac is None else int(frac * (total - in_phase))
        ids, read, state = _stretch(store, cache, state, parts, bs, k, lasts)
        assert k is None or read == k
        seen += ids
        shape, in_phase = (parts, bs), in_phase + read
    assert sorted(seen) == list(range(TOTAL)), (f"{len(seen) - len(set(seen))} windows read twice, "
                                                f"{TOTAL - len(set(seen))} never")


# -- 2. a state pins what it read -----------------------------------------------------------------

GEN1 = {"2024-01-02": 20, "2024-01-03": 13}  # generation 1: windows 0..32


def _ids(batches) -> list:
    return [i for b in batches for i in batch_ids(b)]


def test_a_pinned_state_pins_the_iterator_that_loads_it(tmp_path):
    """A state saved with ``generation=1`` loaded into an unpinned iterator (the newest is 2): the
    epoch goes on on generation 1, and so does every later one; its states say so."""
    store = tmp_path / "s"
    make_store(store, GEN1)
    make_store(store, {"2024-01-04": 9}, base_id=33)  # generation 2: 42 windows
    with ShardIter(store, 4, generation=1, seed=1, cache_dir=tmp_path / "c") as old:
        first = _ids(old.next() for _ in range(3))
        state = old.state_dict()
    assert (state["generation"], state["pinned"]) == (1, 1)
    with ShardIter(store, 4, seed=1, cache_dir=tmp_path / "c") as it:
        assert it.generation == 2
        it.load_state_dict(state)
        assert it.generation == 1 and sorted(first + _ids(it)) == list(range(33))
        make_store(store, {"2024-01-05": 5}, base_id=42)  # generation 3
        for _ in range(2):
            it.reset()
            assert it.generation == 1, "a pinned state's pin was not carried: reset() moved to the newest"
            assert sorted(_ids(it)) == list(range(33))
            assert (it.state_dict()["generation"], it.state_dict()["pinned"]) == (1, 1)


def test_a_state_of_an_older_generation_records_that_generation_until_the_epoch_ends(tmp_path):
    """An unpinned state of generation 1, loaded where the newest is 2: the epoch goes on on 1, a
    state saved in it says 1 (and the reader lease keeps 1 from gc), and a third process goes on
    from that state; the next reset() moves to the newest."""
    store = tmp_path / "s"
    make_store(store, GEN1)
    with ShardIter(store, 4, seed=1, cache_dir=tmp_path / "c") as old:
        make_store(store, {"2024-01-04": 9}, base_id=33)  # generation 2, published mid-epoch
        first = _ids(old.next() for _ in range(3))
        state = old.state_dict()
    assert (state["generation"], state["pinned"]) == (1, None)
    with ShardIter(store, 4, seed=1, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(state)
        assert it.generation == 1 and 1 in live_lease_generations(store, 60)
        second = _ids(it.next() for _ in range(2))
        mid = it.state_dict()
    assert mid["generation"] == 1, "the state records the newest generation, not the one its epoch reads"
    with ShardIter(store, 4, seed=1, cache_dir=tmp_path / "c") as again:
        again.load_state_dict(mid)
        assert again.generation == 1
        assert sorted(first + second + _ids(again)) == list(range(33))
        again.reset()
        assert again.generation == 2 and sorted(_ids(again)) == list(range(42))
        assert (again.state_dict()["generation"], again.state_dict()["pinned"]) == (2, None)


def test_an_unpinned_state_leaves_a_pinned_iterator_its_own_pin(tmp_path):
    """The iterator's own pin stays when the state has none: the state's epoch is read, then the pin's."""
    store = tmp_path / "s"
    make_store(store, GEN1)
    with ShardIter(store, 4, seed=1, cache_dir=tmp_path / "c") as old:
        first = _ids(old.next() for _ in range(2))
        state = old.state_dict()
    make_store(store, {"2024-01-04": 9}, base_id=33)  # generation 2
    make_store(store, {"2024-01-05": 5}, base_id=42)  # generation 3
    with ShardIter(store, 4, seed=1, generation=2, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(state)
        assert it.generation == 1 and sorted(first + _ids(it)) == list(range(33))
        it.reset()
        assert it.generation == 2 and sorted(_ids(it)) == list(range(42))
        assert it.state_dict()["pinned"] == 2
