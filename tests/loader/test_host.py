"""What an iterator leaves in its host process besides its batches: no OpenMP team left behind
by the threads that open MXNet's readers (the allocator: ``test_memory.py``)."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, make_store

# A thread opens readers (open_record_iter), frees them, and counts the threads left behind.
OPENER = """
import os, sys, threading, time
from pathlib import Path
from loader.pipeline.native import free, open_record_iter
from loader.source.plan import ReaderSource
from shardgen.store.manifest import Manifest
store, threads = Path(sys.argv[1]), int(sys.argv[2])
manifest = Manifest.load(store / "manifest.json")
entry = manifest.shards[0]
source = ReaderSource(str(store / entry.rec), store / entry.idx, 1, 0)
def open_one():
    return open_record_iter(source, record_floats=manifest.schema.record_floats, batch_size=8, shuffle=False,
                            seed=0, preprocess_threads=threads, prefetch_buffer=1)
def count():
    return len(os.listdir("/proc/self/task"))
free(open_one())  # MXNet's engine and its threads start here, not in the count below
time.sleep(0.2)
left = []
def opener():
    before = count()
    for _ in range(3):
        free(open_one())
    time.sleep(0.2)
    left.append(count() - before)
t = threading.Thread(target=opener)
t.start()
t.join(60)
print(left[0])
"""


@pytest.fixture(scope="module")
def eight_cores(tmp_path_factory):
    """An LD_PRELOAD library telling OpenMP (and so MXNet) the machine has 8 processors: MXNet
    caps ``preprocess_threads`` at about half of them (1 on 2 cores), so only then do its teams
    of several threads appear here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc) is needed to build the test's preload library"
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text("int omp_get_num_procs(void) { return 8; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "shim.so"), str(d / "shim.c")], check=True)
    return d / "shim.so"


@pytest.mark.parametrize("threads", [1, 4])
def test_threads_that_open_native_readers_keep_no_openmp_team(tmp_path, eight_cores, threads):
    """MXNet's ``ImageRecordIter`` constructor runs a bare ``omp parallel`` (a team of one thread
    per core) and one of ``num_threads(preprocess_threads)`` in the thread that opens it. A thread
    keeps its team, whose idle workers spin-wait after every open (12% of the process's CPU on the
    demo store). A thread that opened and freed three readers has as many threads beside it as
    before. Measured without the fix: 1 thread left (``preprocess_threads=1``), 3 (4, capped at 3
    on 8 processors); with ``omp_set_num_threads(1)`` alone: 0 and 3."""
    make_store(tmp_path / "s", {"2024-01-02": 300})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LD_PRELOAD": str(eight_cores)}
    out = subprocess.run([sys.executable, "-c", OPENER, str(tmp_path / "s"), str(threads)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == 0, f"threads left behind by a thread that opened readers: {out.stdout}"


def test_opening_a_native_reader_writes_nothing_to_stderr(tmp_path, capfd):
    """MXNet logs an INFO line per ``ImageRecordIter`` (its files and decode threads): the loader
    opens them with ``verbose=False``. (It used to catch the line by pointing the process's fd 2 at
    a file during each open, swallowing for that moment what any other thread wrote there.)"""
    from loader.pipeline.native import free, open_record_iter
    from loader.source.plan import ReaderSource
    from shardgen.store.manifest import Manifest

    make_store(tmp_path / "s", {"2024-01-02": 300})
    manifest = Manifest.load(tmp_path / "s" / "manifest.json")
    entry = manifest.shards[0]
    capfd.readouterr()
    free(open_record_iter(ReaderSource(str(tmp_path / "s" / entry.rec), tmp_path / "s" / entry.idx, 1, 0),
                          record_floats=manifest.schema.record_floats, batch_size=8, shuffle=False, seed=0,
                          preprocess_threads=1, prefetch_buffer=1))
    out, err = capfd.readouterr()
    assert "ImageRecordIOParser2" not in err and not err.strip(), err
