"""Properties of the order and of a resume (issue 56): for any shard sizes, canonical parts, blocks,
phases of parts and batch sizes (the padded last batch and the repeated one of a part that runs out
early included), an epoch reads every window exactly once and a resume reads exactly the rest.

The pure order code (``loader.pipeline.order``, ``parts.split_phase``/``epoch_batches``, the
state's count of consumed samples) is checked on many shapes without MXNet; one property reads
through real ``ShardIter``s on small stores written per example."""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import make_store
from hypothesis import example, given
from hypothesis import strategies as st

from loader import LoaderError
from loader.pipeline.batches import StreamParams
from loader.pipeline.order import EpochOrder, OrderSpec, Phase, count, cut, remainder, slice_of
from loader.pipeline.parts import epoch_batches, split_phase

COUNTS = st.lists(st.integers(1, 60), min_size=1, max_size=8)
SPECS = st.builds(OrderSpec, seed=st.integers(0, 2**32 - 1), shuffle=st.booleans(), canonical_parts=st.integers(1, 9),
                  block=st.integers(1, 100))


def _positions(intervals) -> list:
    return [i for a, z in intervals for i in range(a, z)]


def _samples(order: EpochOrder, intervals) -> list:
    """(shard, sample) held by each position of ``intervals``, in reading order (the visits'
    blocks, each read in its permuted order)."""
    out = []
    for v in order.visits(intervals):
        block = order.block(v.c, v.b)
        seq = [(k, s) for k, lo, hi in block.pieces for s in range(lo, hi)]
        assert len(seq) == block.samples
        out += [seq[int(block.perm[u])] if block.perm is not None else seq[u] for u in range(v.u0, v.u1)]
    return out


def _params(parts: int, part: int, bs: int, last_batch: str) -> StreamParams:
    return StreamParams(schema=None, batch_size=bs, shuffle=True, seed=0, num_parts=parts, part_index=part,
                        last_batch=last_batch, readers=1, native_batch=1, buffer_records=1, preprocess_threads=1,
                        prefetch_buffer=1, label_names=())


@given(counts=COUNTS, spec=SPECS, epoch=st.integers(0, 5), data=st.data())
def test_an_epoch_holds_every_sample_once_in_equal_blocks_and_any_cut_reads_its_own_positions(counts, spec, epoch,
                                                                                             data):
    spec = dataclasses.replace(spec, grain=data.draw(st.integers(1, 8)))  # the layout's pack
    order = EpochOrder(counts, spec, epoch)
    everything = _samples(order, [(0, order.total)])
    assert sorted(everything) == [(k, s) for k, n in enumerate(counts) for s in range(n)]
    if not spec.shuffle:
        assert everything == sorted(everything), "in order: the store's order"
    assert everything == _samples(EpochOrder(counts, spec, epoch), [(0, order.total)]), "a value"
    grain = [spec.grain] * len(counts)
    for c in range(spec.canonical_parts):
        lo, hi = int(order.canon[c]), int(order.canon[c + 1])
        assert hi - lo in (order.total // spec.canonical_parts, -(-order.total // spec.canonical_parts))
        nb = len(order.canonical(c)[2]) - 1
        blocks = [order.block(c, b) for b in range(nb)]
        sizes = [b.samples for b in blocks]
        assert sum(sizes) == hi - lo and nb == max(1, math.ceil((hi - lo) / spec.block)), "as few blocks as hold it"
        if spec.grain == 1:
            assert max(sizes) <= spec.block and max(sizes) - min(sizes) <= 1, "blocks of equal size"
        for b in blocks:
            assert list(b.pieces) == sorted(b.pieces), "a block's pieces are read in store order"
        if spec.shuffle and nb > 1:  # stripes: every block takes whole records of every date that has enough
            pieces = order.canonical(c)[0]
            for k, p0, p1 in pieces:
                units = -(-p1 // grain[k]) - p0 // grain[k]  # records it enters
                held = [sum(hi2 - lo2 for k2, lo2, hi2 in b.pieces if k2 == k and p0 <= lo2 < p1) for b in blocks]
                assert max(held) - min(held) <= 2 * grain[k], f"shard {k}'s piece is spread evenly over the blocks"
                if units >= nb:
                    assert min(held) > 0, f"shard {k} ({units} records) is in every block"
                cuts = [lo2 for b in blocks for k2, lo2, _ in b.pieces if k2 == k and p0 < lo2 < p1]
                assert all(x % grain[k] == 0 for x in cuts), "stripes are cut at whole records"
    a = data.draw(st.integers(0, order.total))
    z = data.draw(st.integers(a, order.total))
    assert _samples(order, [(a, z)]) == everything[a:z], "a stretch of the epoch reads its own positions"


PHASES = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 12), st.floats(0, 1)), max_size=4)


@given(total=st.integers(0, 300), phases=PHASES, over=st.booleans())
def test_the_phases_read_and_what_is_left_are_every_position_once(total, phases, over):
    """Any phases a job can read (each part the same number of batches, at most its largest slice's,
    the padded last one counted): the positions each part consumed and the remainder are the epoch,
    each position once; the state's 'samples' is the consumed count; one batch more than the
    largest slice holds is refused."""
    done, consumed = [], []
    for parts, bs, frac in phases:
        rest = remainder(total, done)
        slices = [slice_of(rest, parts, q) for q in range(parts)]
        sizes = [count(s) for s in slices]
        assert sum(sizes) == count(rest) and max(sizes) - min(sizes) <= 1
        assert _positions(rest) == sorted(i for s in slices for i in _positions(s)), "contiguous slices, in order"
        most = math.ceil(max(sizes) / bs)
        k = round(frac * most)
        for s in slices:
            consumed += _positions(cut(s, 0, k * bs))
        done.append(Phase(parts, bs, k))
    rest = remainder(total, done)
    assert sorted(consumed + _positions(rest)) == list(range(total))
    assert total - count(rest) == len(consumed)
    if done and over:
        *before, (parts, bs, _) = done
        rest = remainder(total, before)
        most = math.ceil(max(count(slice_of(rest, parts, q)) for q in range(parts)) / bs)
        with pytest.raises(ValueError, match="their slices hold at most"):
            remainder(total, [*before, Phase(parts, bs, most + 1)])


@given(total=st.integers(1, 300), phases=PHASES, parts=st.integers(1, 6), bs=st.integers(1, 12),
       last_batch=st.sampled_from(["pad", "discard"]))
def test_every_part_of_a_resumed_phase_yields_as_many_batches_covering_its_slice(total, phases, parts, bs,
                                                                                 last_batch):
    """``split_phase``: after any phases, every part yields the same number of batches; with 'pad'
    they hold every remaining sample (the largest part's last batch padded, a shorter part's
    repeated), with 'discard' only full batches; an empty part is a LoaderError, never a batch."""
    done = []
    for p_, b_, frac in phases:
        rest = remainder(total, done)
        most = math.ceil(max(count(slice_of(rest, p_, q)) for q in range(p_)) / b_)
        done.append(Phase(p_, b_, round(frac * most)))
    left = count(remainder(total, done))
    try:
        rest, sizes, batches = split_phase(_params(parts, 0, bs, last_batch), total, done, 1)
    except LoaderError as exc:
        assert "would be empty" in str(exc) or "leaves no batch" in str(exc)
        assert left < parts or (last_batch == "discard" and left // parts < bs and not done)
        return
    assert sum(sizes) == count(rest) == left
    for q in range(parts):  # every part agrees on the count, whichever part asks
        assert epoch_batches(_params(parts, q, bs, last_batch), sizes, 1, left, bool(done)) == batches
    if last_batch == "pad":
        assert batches == (math.ceil(max(sizes) / bs) if left else 0)
        assert not left or max(sizes) > (batches - 1) * bs, "no batch without a sample of the largest part"
        assert all(batches - 1 <= math.ceil(n / bs) <= batches for n in sizes), "at most one repeated batch"
    else:
        assert batches == (min(sizes) // bs if left else 0)


# -- through real ShardIters ----------------------------------------------------------------------

def _rows(b) -> tuple:
    return b.label[0].asnumpy().astype(int).tolist(), b.pad


def _real_ids(batches: list, bs: int, keep: int) -> list:
    """The windows a part's batches carry: pads dropped, its batches after the ``keep`` real ones
    (a part that ran out early repeats its last real batch) left out."""
    return [i for rows, pad in batches[:keep] for i in rows[:bs - pad]]


@given(counts=st.lists(st.integers(1, 30), min_size=1, max_size=4), pack=st.sampled_from([1, 4]),
       shuffle=st.booleans(), parts=st.integers(1, 3), bs=st.integers(1, 9),
       last_batch=st.sampled_from(["pad", "discard"]), back=st.one_of(st.integers(0, 2), st.integers(0, 40)),
       new_parts=st.integers(1, 3), new_bs=st.integers(1, 9))
@example(counts=[100, 143, 100], pack=4, shuffle=True, parts=2, bs=9, last_batch="pad", back=1, new_parts=2,
         new_bs=9)  # part 0 (171 = 19 x 9) repeats its last batch: resumed there (found by the round-4 audit)
@example(counts=[7, 9], pack=1, shuffle=False, parts=3, bs=2, last_batch="pad", back=1, new_parts=1, new_bs=4)
def test_a_shard_iter_resumed_at_any_batch_reads_exactly_the_rest(counts, pack, shuffle, parts, bs, last_batch,
                                                                  back, new_parts, new_bs):
    """A small store; every part of a job saves its state at batch k (any, the last included) and
    loads it again: it reads exactly the batches the uninterrupted epoch had from k on (the same
    rows and pads, the padded and the repeated batch too; ``back``: batches before the end). A new
    job on another number of parts and batch size loads the state and reads every window the old
    one had not, once."""
    total = sum(counts)
    if total < parts or (last_batch == "discard" and total // parts < bs):
        return  # the iterator refuses such a part (tests/loader/test_sizes.py)
    root = Path(tempfile.mkdtemp(prefix="props-order-"))
    try:
        make_store(root / "s", {f"2024-03-{d + 1:02d}": n for d, n in enumerate(counts)}, pack=pack)
        from loader import ShardIter

        kw = dict(shuffle=shuffle, seed=5, shuffle_buffer=8, last_batch=last_batch, cache_dir=root / "c")
        k, old, state = None, [], None
        for q in range(parts):
            with ShardIter(root / "s", bs, num_parts=parts, part_index=q, **kw) as it:
                n = it.batches_per_epoch
                k = max(0, n - back) if k is None else k
                want, at = [], None
                for i in range(n):
                    if i == k:
                        at = it.state_dict()
                    want.append(_rows(it.next()))
                at = at or it.state_dict()
                it.load_state_dict(at)
                assert [_rows(b) for b in it] == want[k:], (q, k)
                state = state or at
                keep = math.ceil((total * (q + 1) // parts - total * q // parts) / bs)
                old += _real_ids(want[:k], bs, keep if last_batch == "pad" else n)
        new_parts = min(new_parts, total)  # a new job of that many parts opens
        new_bs = new_bs if last_batch == "pad" else min(new_bs, total // new_parts)
        left = total - len(old)
        new = []
        for q in range(new_parts):
            with ShardIter(root / "s", new_bs, num_parts=new_parts, part_index=q, **kw) as it:
                try:
                    it.load_state_dict(state)
                except LoaderError as exc:
                    assert left < new_parts and "would be empty" in str(exc)
                    return
                got = [_rows(b) for b in it]
                mine = [(left * (q + 1) // new_parts - left * q // new_parts)] if (new_parts, new_bs) != (
                    parts, bs) else None
                if mine is not None:
                    new += _real_ids(got, new_bs, math.ceil(mine[0] / new_bs) if last_batch == "pad" else len(got))
                else:  # the same phase goes on: its own batches (the repeated one left out)
                    keep = math.ceil((total * (q + 1) // parts - total * q // parts) / bs)
                    new += _real_ids(got, bs, max(0, keep - k) if last_batch == "pad" else len(got))
        if last_batch == "pad":
            assert sorted(old + new) == list(range(total)), "every window once over the old and the new job"
        else:
            assert len(set(old + new)) == len(old + new), "no window twice (discard leaves the rest out)"
    finally:
        shutil.rmtree(root, ignore_errors=True)
