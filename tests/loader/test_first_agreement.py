"""``ShardIter.for_kvstore``'s first agreement (issue 54.4), with a stand-in for worker 1 of a
two-worker kvstore: nothing goes through the kvstore at construction (the model's keys come
first), the first batch agrees, a worker built on another generation is built again on rank 0's,
and a state loaded before the first batch must be of rank 0's generation. The real kvstore:
``test_distributed.py::test_module_fit_with_the_iterator_made_first``,
``test_generations.py::test_dist_sync_workers_agree_when_a_date_lands_mid_race``."""

import re

import numpy as np
import pytest
from conftest import make_store

from loader import ShardIter
from loader.errors import LoaderError

pytestmark = pytest.mark.filterwarnings("ignore")
COUNTS = {"2024-01-02": 50, "2024-01-03": 37}  # 87 windows: generation 1


class RankOne:
    """Worker 1 of 2; rank 0 proposes ``proposal``. ``calls``: the keys broadcast so far."""

    num_workers, rank, type = 2, 1, "dist_sync"

    def __init__(self, proposal: int):
        self.proposal, self.calls = proposal, []

    def broadcast(self, key, value, out):
        self.calls.append(key)
        out[:] = np.array([self.proposal >> 20, self.proposal & 0xFFFFF], dtype=np.float32)


def ids_of(it) -> list:
    out = []
    for batch in it:
        a = batch.label[0].asnumpy()
        out += a[: len(a) - batch.pad].astype(int).tolist()
    return out


@pytest.fixture
def two_generations(tmp_path):
    store = tmp_path / "store"
    make_store(store, COUNTS)
    make_store(store, {**COUNTS, "2024-01-04": 13})  # generation 2: 100 windows
    return store


def test_nothing_goes_through_the_kvstore_before_the_first_batch(two_generations, tmp_path):
    kv = RankOne(2)
    with ShardIter.for_kvstore(kv, two_generations, 8, cache_dir=tmp_path / "c", shuffle=False) as it:
        assert kv.calls == [] and it.generation == 2  # Module's init_optimizer may still put its keys in
        batch = it.next()
        assert len(kv.calls) == 1 and it.generation == 2
        assert batch.label[0].shape == (8,)


def test_a_worker_built_on_another_generation_reads_rank_0s(two_generations, tmp_path):
    """Rank 0 proposed generation 1 (its construction came before the publish of 2)."""
    kv = RankOne(1)
    with ShardIter.for_kvstore(kv, two_generations, 8, cache_dir=tmp_path / "c", shuffle=False) as it:
        assert it.generation == 2 and it.records_per_epoch == 50  # its own view, until the first batch
        it.dates = ("2024-01-03", None)  # from the next reset() on: kept through the rebuild
        ids = ids_of(it)
        assert it.generation == 1 and len(kv.calls) == 1
        assert ids == list(range(43, 87))  # part 1 of generation 1's 87 windows (no 2024-01-04)
        assert it.batches_per_epoch == 6  # ceil(44 / 8)
        it.reset()
        assert len(kv.calls) == 2 and it.generation == 1  # rank 0 still says 1
        assert set(ids_of(it)) <= set(range(50, 87))  # the selection set before the first batch


def test_a_reset_before_the_first_batch_is_the_one_agreement(two_generations, tmp_path):
    kv = RankOne(2)
    with ShardIter.for_kvstore(kv, two_generations, 8, cache_dir=tmp_path / "c") as it:
        it.reset()  # plain_worker.py resets before each epoch, the first one too
        it.next()
        assert len(kv.calls) == 1, "every worker must make the same number of collective calls"


def test_a_state_of_another_generation_than_rank_0s_is_refused_at_the_first_batch(two_generations, tmp_path):
    with ShardIter(two_generations, 8, num_parts=2, part_index=1, generation=1, cache_dir=tmp_path / "a") as old:
        old.next()
        state = old.state_dict()
    kv = RankOne(2)
    with ShardIter.for_kvstore(kv, two_generations, 8, cache_dir=tmp_path / "c") as it:
        it.load_state_dict(state)
        with pytest.raises(LoaderError, match="resumed a state of generation 1, rank 0 one of generation 2: load "
                                              "the same state on every worker"):
            it.next()
    kv = RankOne(1)
    with ShardIter.for_kvstore(kv, two_generations, 8, cache_dir=tmp_path / "d") as it:
        it.load_state_dict(state)
        assert it.generation == 1 and it.next().label[0].shape == (8,)  # the same state everywhere: read on
        assert len(kv.calls) == 1


@pytest.mark.timeout(240)
def test_a_dist_worker_built_on_another_schema_than_rank_0s_generation_is_one_clear_error(tmp_path):
    """A real dist_sync job over loopback (issue 64, contract 3): rank 1 built its iterator on
    generation 1, rank 0 on generation 2, published between them with another schema (time_steps 3
    -> 4). At the first batch rank 1 takes rank 0's generation: its ``provide_data`` (what the model
    was bound to) no longer describes the data, so it is one LoaderError saying what changed, never a
    batch of another shape under the old ``provide_data``. Rank 0 reads on."""
    import json
    import os
    import sys
    import time

    import proctree
    from conftest import ROOT

    store, flags, out = tmp_path / "s", tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    out.mkdir()
    make_store(store, COUNTS)  # generation 1: time_steps 3
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "loader.tools.launch", "-n", "2", "-s", "1", "--timeout", "170", "--", sys.executable,
           str(ROOT / "tests" / "dist_schema_worker.py"), "--store", str(store), "--flags", str(flags), "--out",
           str(out)]
    with proctree.Tagged(cmd, cwd=ROOT, env=env) as job:  # every process it starts is killed at the end
        deadline = time.monotonic() + 120
        while not (flags / "built").exists():
            assert job.proc.poll() is None, job.output
            assert time.monotonic() < deadline, "rank 1 never built its iterator"
            time.sleep(0.02)
        (store / "manifest.json").unlink()  # the store starts over with another schema: generation 2
        make_store(store, {"2024-01-08": 40}, t=4)
        (flags / "published").write_text("2")
        code = job.wait(180)
    assert code == 0, job.output[-3000:]
    rank0, rank1 = (json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert rank0 == {"generation": 2, "provide_data": [4, 4, 2], "batch": [4, 4, 2]}, rank0
    assert rank1["provide_data"] == [4, 3, 2] and "batch" not in rank1, \
        f"rank 1 read batches of rank 0's schema under its old provide_data: {rank1}"
    assert re.search(r"schema changed .* between this worker's generation 1 and rank 0's 2; make the iterators "
                     r"again", rank1["error"]), rank1
