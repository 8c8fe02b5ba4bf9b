"""The producer process (``producer="process"``): what the trainer sees when it stalls, dies, or
when the trainer itself is dropped, interrupted or killed."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import ROOT, batch_ids, consume_in_thread, make_store

from loader import LoaderError, ShardIter
from loader.remote import ProcessShardIter
from loader.session import Producer

COUNTS = {"2024-01-02": 70, "2024-01-03": 13}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds}s: {what}")


def test_a_producer_process_reads_and_holding_every_batch_is_exact(tmp_path):
    make_store(tmp_path / "s", COUNTS)
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process") as it:
        assert isinstance(it, ProcessShardIter) and it.readers >= 1
        for _ in range(2):
            batches = list(it)  # every batch held: the producer opens slots, never reuses a held one
            assert sorted(i for b in batches for i in batch_ids(b)) == list(range(83))
            it.reset()
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="thread") as local:
        assert not isinstance(local, ProcessShardIter)
    with pytest.raises(LoaderError, match="producer must be"):
        ShardIter(tmp_path / "s", 4, producer="fork")


def test_close_from_another_thread_wakes_a_next_waiting_on_a_stopped_producer(tmp_path):
    make_store(tmp_path / "s", {"2024-01-02": 300})
    it = ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", prefetch_buffer=1, producer="process")
    pid = Producer.get().proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t, outcome = consume_in_thread(it)
        time.sleep(0.5)
        assert t.is_alive() and not outcome, "next() returned while the producer was stopped"
        closer = threading.Thread(target=it.close, daemon=True)
        closer.start()
        t.join(timeout=10)
        assert not t.is_alive(), "next() stayed blocked after close()"
        assert len(outcome) == 1 and isinstance(outcome[0], LoaderError) and "closed" in str(outcome[0])
        closer.join(timeout=10)
        assert not closer.is_alive(), "close() hung on a stopped producer"
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_killed_producer_is_a_clear_error_and_the_next_iterator_starts_a_new_one(tmp_path):
    make_store(tmp_path / "s", COUNTS)
    it = ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process")
    it.next()
    pid = Producer.get().proc.pid
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: not _alive(pid), 10, "the producer died")
    with pytest.raises(LoaderError, match=f"producer process \\(pid {pid}\\)"):
        for _ in range(100):
            it.next()
    it.close()
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process") as again:
        assert Producer.get().proc.pid != pid
        assert len([i for b in again for i in batch_ids(b)]) == 83


def test_an_iterator_dropped_without_close_releases_its_lease_and_plan(tmp_path):
    import gc

    make_store(tmp_path / "s", COUNTS)
    it = ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process")
    it.next()
    assert list((tmp_path / "s" / "leases").glob("*.json"))
    del it
    gc.collect()
    _wait(lambda: not list((tmp_path / "s" / "leases").glob("*.json")), 10, "the lease is gone")
    _wait(lambda: not [p for p in (tmp_path / "c").glob("*/*") if p.is_dir()], 10, "the plan folder is gone")


_TRAINER = """
    import os, sys, time
    from loader import ShardIter
    from loader.session import Producer
    it = ShardIter(sys.argv[1], 4, cache_dir=sys.argv[2], producer="process")
    print(Producer.get().proc.pid, flush=True)
    while True:
        for b in it:
            time.sleep(0.01)
        it.reset()
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_a_killed_or_interrupted_trainer_leaves_nothing_running(tmp_path, how):
    make_store(tmp_path / "s", COUNTS)
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(_TRAINER))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "s"), str(tmp_path / "c")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        producer = int(proc.stdout.readline())
        time.sleep(1.0)
        # Ctrl-C reaches the whole foreground process group: the producer ignores it.
        os.killpg(proc.pid, getattr(signal, how))
        proc.wait(timeout=60)
        _wait(lambda: not _alive(producer), 15, "the producer exited with its trainer")
        if how == "SIGINT":
            assert "KeyboardInterrupt" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.parametrize("prefetch_buffer", [4, 8])
def test_the_slots_of_full_epochs_stay_within_the_memory_planned(tmp_path, prefetch_buffer):
    """Found in review: with prefetch_buffer=8 the producer held 27 batch slots where it.memory
    planned 24 (its own queue, the window sent to the trainer and the batches not acknowledged)."""
    make_store(tmp_path / "s", {"2024-01-02": 2000})
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process",
                   prefetch_buffer=prefetch_buffer) as it:
        for _ in range(3):
            for _b in it:
                pass
            it.reset()
        session = it._session
        slot_bytes = next(iter(session.slots.arrays.values())).nbytes
        assert len(session.slots.arrays) * slot_bytes <= it.memory["batch buffers"], len(session.slots.arrays)


@pytest.mark.parametrize("prefetch_buffer, taken", [(None, 3), (4, 1), (8, 3)])
def test_epochs_cut_short_reuse_their_slots(tmp_path, prefetch_buffer, taken):
    """Batches queued in the producer or in flight when reset() cuts an epoch short give their
    slots back: the slots stay bounded over many short epochs (Module.score(num_batch=...) does this).
    Found with prefetch_buffer=8: epochs shorter than an ack (4 batches) gave no slot back (324 after
    40 epochs; 179 with prefetch_buffer=4 and 1 batch an epoch)."""
    make_store(tmp_path / "s", {"2024-01-02": 400})
    kw = {} if prefetch_buffer is None else {"prefetch_buffer": prefetch_buffer}
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process", **kw) as it:
        for _ in range(40):
            for _, _b in zip(range(taken), it):
                pass
            it.reset()
        slots = len(it._session.slots.arrays)
        assert slots <= 2 * (it.prefetch_buffer + 4), slots
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(400))


def test_a_fork_that_closes_its_copy_leaves_the_parents_iterator_alone(tmp_path):
    make_store(tmp_path / "s", COUNTS)
    with ShardIter(tmp_path / "s", 4, cache_dir=tmp_path / "c", producer="process") as it:
        first = batch_ids(it.next())
        pid = os.fork()
        if pid == 0:  # the child: leaving the with block closes its copy
            try:
                it.close()
                with pytest.raises(LoaderError, match="belongs to process"):
                    it.reset()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        rest = [i for b in it for i in batch_ids(b)]
        assert sorted(first + rest) == list(range(83))


def test_the_same_seed_reads_the_same_batches_in_both_modes(tmp_path):
    make_store(tmp_path / "s", COUNTS)

    def epochs(producer: str, part: int) -> list:
        with ShardIter(tmp_path / "s", 5, seed=7, num_parts=2, part_index=part, cache_dir=tmp_path / "c",
                       producer=producer) as it:
            out = []
            for _ in range(2):
                out.append([(b.data[0].asnumpy().tobytes(), b.pad) for b in it])
                it.reset()
            return out

    for part in (0, 1):
        assert epochs("process", part) == epochs("thread", part)
