"""The shuffle permutes every canonical part (issue 64, contract 9), seen through ``ShardIter``
alone: whatever the shard count, the number of parts and the shuffle buffer, each part's epochs
come in different orders, and which of its dates comes first changes from epoch to epoch (its
blocks do not hold the same dates every epoch). A part of exactly two shard pieces used to be
left in store order by a check no test held (the golden and property tests used other counts).
"""

from __future__ import annotations

import numpy as np
from conftest import make_store
from hypothesis import example, given
from hypothesis import strategies as st

from loader import ShardIter

EPOCHS = 16  # a pair of dates keeps its order by chance over all of them once in 2**15


def _epochs(store, cache, parts: int, part: int, buffer: int, seed: int) -> list:
    """The ids part ``part`` of ``parts`` reads in each of ``EPOCHS`` epochs, in reading order."""
    out = []
    with ShardIter(store, 4, num_parts=parts, part_index=part, shuffle_buffer=buffer, seed=seed,
                   cache_dir=cache) as it:
        for epoch in range(EPOCHS):
            if epoch:
                it.reset()
            ids, real = [], -(-it.reader.part_samples // 4)  # batches past it repeat the last (docs: "Parts")
            for i, b in enumerate(it):
                a = b.label[0].asnumpy()
                ids += a[: len(a) - b.pad].astype(int).tolist() if i < real else []
            out.append(ids)
    return out


@example(sizes=[20, 20], parts=1, buffer=8, seed=0)  # one part of two pieces, blocks of 8 windows
@example(sizes=[9, 31], parts=1, buffer=16, seed=3)
@example(sizes=[10, 10, 10, 10], parts=2, buffer=6, seed=1)  # two parts of two pieces each
@example(sizes=[7, 25, 12], parts=3, buffer=5, seed=2)  # a part of two pieces beside parts of one
@example(sizes=[3, 10], parts=3, buffer=4, seed=0)  # parts of 4, 4, 5: the first two repeat a batch
@given(sizes=st.lists(st.integers(3, 30), min_size=1, max_size=5), parts=st.integers(1, 3),
       buffer=st.sampled_from([4, 7, 16, 1000]), seed=st.integers(0, 2**16))
def test_every_part_is_read_in_another_order_each_epoch_and_its_dates_change_places(tmp_path_factory, sizes, parts,
                                                                                      buffer, seed):
    """For every part: each epoch reads its windows once; the epochs are not all in one order (a part
    of 8 windows or more); and for every two dates of the part, the one whose windows come first on
    average is not the same in every epoch (the shard pieces of a part are permuted each epoch,
    not only the windows inside each block)."""
    root = tmp_path_factory.mktemp("shuffle")
    counts = {f"2024-02-{d + 1:02d}": n for d, n in enumerate(sizes)}
    make_store(root / "s", counts)
    date_of = np.repeat(np.arange(len(sizes)), sizes)  # window id -> its date (store order)
    total = sum(sizes)
    for part in range(parts):
        lo, hi = part * total // parts, (part + 1) * total // parts
        if hi - lo < 2:
            continue
        epochs = _epochs(root / "s", root / f"c{part}", parts, part, buffer, seed)
        for ids in epochs:
            assert sorted(ids) == list(range(lo, hi)), "an epoch did not read its part's windows once"
        if hi - lo >= 8:
            assert len({tuple(ids) for ids in epochs}) > 1, f"part {part}: the same order every epoch"
        dates = sorted(set(date_of[lo:hi].tolist()))
        firsts = []  # per epoch: the part's dates ordered by the mean position of their windows
        for ids in epochs:
            where = np.arange(len(ids))
            of = date_of[np.asarray(ids)]
            firsts.append(tuple(sorted(dates, key=lambda d: where[of == d].mean())))
        for i, a in enumerate(dates):
            for b in dates[i + 1:]:
                before = {f.index(a) < f.index(b) for f in firsts}
                assert len(before) == 2, (f"part {part} of {parts} ({len(dates)} dates, buffer {buffer}): date {a} "
                                          f"comes {'before' if before.pop() else 'after'} date {b} in all "
                                          f"{EPOCHS} epochs: its shard pieces are never permuted")
