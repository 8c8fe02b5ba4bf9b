"""``readers`` and ``native_batch`` are gone (issue 65, item 6): ``make bench`` measured neither doing
anything (ten years: readers=1 read 1.06x the defaults' samples/s, native_batch=64 1.11x, within
noise). Code that still passes one is told so, why, and what to do, before anything starts; code
that forwarded an unset option (None, what asked for the default) reads as before."""

from __future__ import annotations

import mxnet as mx
import pytest
from conftest import batch_ids, make_store

from loader import LoaderError, ShardIter


@pytest.fixture
def store(tmp_path):
    make_store(tmp_path / "s", {"2024-01-02": 30, "2024-01-03": 20}, pack=4)
    return tmp_path / "s"


@pytest.mark.parametrize("name", ["readers", "native_batch"])
@pytest.mark.parametrize("value", [1, 2, 64, 0, "2"])
def test_a_removed_knob_is_a_loader_error_saying_why_and_what_to_do(store, tmp_path, name, value):
    with pytest.raises(LoaderError) as caught:
        ShardIter(store, 8, cache_dir=tmp_path / "c", **{name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r}: ShardIter no longer takes {name} (removed in issue 65): "), message
    assert "make bench measured no effect of it" in message and message.endswith("Drop the argument"), message
    why = "one native read at a time, sized by bytes" if name == "readers" else "follow the layout's pack"
    assert why in message, message
    assert not (tmp_path / "c").exists(), "refused before anything was opened or made"


def test_both_removed_knobs_through_for_kvstore_are_refused_as_well(store, tmp_path):
    with pytest.raises(LoaderError, match="native_batch=4: ShardIter no longer takes native_batch"):
        ShardIter.for_kvstore(mx.kv.create("local"), store, 8, cache_dir=tmp_path / "c", native_batch=4)
    with pytest.raises(LoaderError, match="readers=1: ShardIter no longer takes readers"):
        ShardIter.for_kvstore(mx.kv.create("local"), store, 8, cache_dir=tmp_path / "c", readers=1, native_batch=None)


def test_none_asks_for_the_default_and_reads_the_same_batches(store, tmp_path):
    with ShardIter(store, 8, seed=3, cache_dir=tmp_path / "a") as it:
        plain = [batch_ids(b) for b in it]
    with ShardIter(store, 8, seed=3, cache_dir=tmp_path / "b", readers=None, native_batch=None) as it:
        assert [batch_ids(b) for b in it] == plain
    assert sorted(i for ids in plain for i in ids) == list(range(50))


def test_a_keyword_shard_iter_never_took_is_still_a_type_error(store, tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'reader'"):
        ShardIter(store, 8, cache_dir=tmp_path / "c", reader=2)
