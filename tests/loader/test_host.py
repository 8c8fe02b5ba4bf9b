"""What an iterator leaves in its host process besides its batches: no OpenMP workers spinning.

(The allocator: ``test_memory.py``.)"""

import os
import threading

from conftest import make_store

from loader.pipeline.native import free, open_record_iter
from loader.source.plan import ReaderSource
from shardgen.store.manifest import Manifest


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_opening_native_readers_leaves_no_openmp_team_behind(tmp_path):
    """MXNet's ``ImageRecordIter`` runs a bare ``omp parallel`` in the thread that opens it: a team
    of one thread per core, whose idle workers spin-wait after every open (12% of the process's CPU
    on the demo store). The loader's opening threads run such regions alone: a thread that opens
    readers gains, for each, only the threads the reader itself holds. (Without: the first open
    also leaves the opener's OpenMP worker(s), so the first open adds more threads than the second.)"""
    make_store(tmp_path / "s", {"2024-01-02": 300})
    manifest = Manifest.load(tmp_path / "s" / "manifest.json")
    entry = manifest.shards[0]
    source = ReaderSource(str(tmp_path / "s" / entry.rec), tmp_path / "s" / entry.idx, 1, 0)

    def open_one():
        return open_record_iter(source, record_floats=manifest.schema.record_floats, batch_size=8, shuffle=False,
                                seed=0, preprocess_threads=1, prefetch_buffer=1)

    free(open_one())  # MXNet's engine and its threads start here, not in the counts below
    added, natives = [], []

    def opener():
        for _ in range(2):
            before = _threads()
            natives.append(open_one())
            added.append(_threads() - before)

    t = threading.Thread(target=opener)
    t.start()
    t.join(60)
    for native in natives:
        free(native)
    assert len(added) == 2 and added[0] == added[1], f"threads added by a first and a second open: {added}"
