"""A damaged or vanished shard never reaches MXNet's native reader: a LoaderError names the file,
the date and the record, the process survives (no SIGABRT, no core), and close() is safe."""

import datetime as dt
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from loader import LoaderError, ShardIter
from shardgen.layout import LabelSpec, Layout, Schema
from shardgen.manifest import Manifest
from shardgen.process import sliding_windows
from shardgen.store import publish, verify_store
from shardgen.writer import write_shard

T, C = 5, 3
LABELS = [LabelSpec("a", 1)]


RUNS = Layout("runs", 8, T + 7)


def make(store, layout=RUNS, dates=4):
    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=layout)
    store.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(dates):
        d = dt.date(2024, 1, 2) + dt.timedelta(days=i)
        raw = np.random.default_rng(i).standard_normal((60, C + 1)).astype(np.float32)
        entries.append(write_shard(store, d, sliding_windows(raw, d, time_steps=T, num_inputs=C, labels=LABELS),
                                   None, schema, fsync=False).entry())
    publish(store, schema, 0, entries)
    return Manifest.load(store / "manifest.json")


def flip(path, offset, value=None):
    data = bytearray(path.read_bytes())
    data[offset] = value if value is not None else data[offset] ^ 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def store(tmp_path):
    make(tmp_path / "s")
    return tmp_path / "s"


@pytest.mark.parametrize("where, what", [
    (0, "bad magic word"),  # magic of record 0
    (5, "bad length word"),  # lrec
    (8, "header flag is not"),  # IRHeader flag
    (-20, "image bytes differ"),  # inside the BMP of the last record
])
def test_flipped_framing_byte_is_a_loader_error_naming_file_date_record(store, tmp_path, where, what):
    m = Manifest.load(store / "manifest.json")
    s = m.shards[1]
    rb = m.schema.record_bytes
    record = 2 if where >= 0 else s.records - 1
    flip(store / s.rec, record * rb + where if where >= 0 else (record + 1) * rb + where)
    with pytest.raises(LoaderError, match=f"{s.rec}: record {record} of {s.date} is damaged \\({what}"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")
    assert [d for d, _ in verify_store(store)[1]] == [s.date]


def test_flipped_byte_in_a_subprocess_never_aborts(store, tmp_path):
    """Before the frame check this was SIGABRT (dmlc::Error thrown in a native thread)."""
    m = Manifest.load(store / "manifest.json")
    flip(store / m.shards[2].rec, m.schema.record_bytes * 3 + 1)
    script = f"""
from loader import LoaderError, ShardIter
try:
    ShardIter({str(store)!r}, 8, cache_dir={str(tmp_path / 'c')!r})
except LoaderError as exc:
    print("LoaderError:", exc)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LoaderError:" in r.stdout and m.shards[2].date in r.stdout and "record 3" in r.stdout


def test_payload_flip_needs_sha256_mode(store, tmp_path):
    m = Manifest.load(store / "manifest.json")
    s = m.shards[0]
    offset = m.schema.record_bytes + 8 + 24 + 4 * (m.schema.data_slice.start + 2)  # a row value of record 1
    flip(store / s.rec, offset)
    with ShardIter(store, 8, cache_dir=tmp_path / "c") as it:  # framing is intact: reads
        assert sum(8 - b.pad for b in it) == m.samples
    with pytest.raises(LoaderError, match=f"{s.rec}: sha256 differs from the manifest \\({s.date}\\)"):
        ShardIter(store, 8, cache_dir=tmp_path / "c", verify="sha256")


def test_a_file_replaced_mid_epoch_is_not_read_and_in_place_damage_is_caught(store, tmp_path):
    m = Manifest.load(store / "manifest.json")
    it = ShardIter(store, 8, cache_dir=tmp_path / "c")
    it.next()
    s = m.shards[3]
    data = bytearray((store / s.rec).read_bytes())
    data[0] ^= 0xFF
    tmp = store / "tmp.rec"
    tmp.write_bytes(bytes(data))
    os.replace(tmp, store / s.rec)  # a new inode: the published one is still what this plan reads
    assert sum(8 - b.pad for b in it) + 8 == m.samples
    it.reset()
    assert sum(8 - b.pad for b in it) == m.samples
    it.close()
    s = m.shards[2]
    with open(store / s.rec, "r+b") as fh:  # damage in place: the verdict cached for the file is stale
        fh.seek(m.schema.record_bytes * 2)
        fh.write(b"\0\0\0\0")
    os.utime(store / s.rec, ns=(0, os.stat(store / s.rec).st_mtime_ns + 1_000_000))
    with pytest.raises(LoaderError, match=f"record 2 of {s.date} is damaged"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")
    it.close()
    it.close()  # safe, twice, after an error


def test_shard_deleted_mid_epoch_is_still_read_exactly(store, tmp_path):
    """MXNet reads the files this process holds open (/proc/self/fd), so deleting them mid-epoch
    (before: a segmentation fault) changes nothing for this generation; a new reader names the file."""
    m = Manifest.load(store / "manifest.json")
    it = ShardIter(store, 8, cache_dir=tmp_path / "c", prefetch_buffer=1)
    got = [8 - it.next().pad]
    for s in m.shards:
        (store / s.rec).unlink()
    got += [8 - b.pad for b in it]
    assert sum(got) == m.samples
    it.reset()  # the same generation: still the files this process holds
    assert sum(8 - b.pad for b in it) == m.samples
    it.close()
    with pytest.raises(LoaderError, match=f"{m.shards[0].rec}: shard file is missing"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")


def test_truncated_shard_is_named(store, tmp_path):
    m = Manifest.load(store / "manifest.json")
    s = m.shards[1]
    with open(store / s.rec, "r+b") as fh:
        fh.truncate(s.bytes - 10)
    with pytest.raises(LoaderError, match=f"{s.rec}: {s.bytes - 10} bytes, the manifest says {s.bytes} for {s.date}"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")


def test_bad_window_start_inside_a_run_is_caught(store, tmp_path):
    """A start that would make the gather read outside the run is refused before any read."""
    import struct

    m = Manifest.load(store / "manifest.json")
    s = m.shards[0]
    offset = 8 + 24 + 4 * m.schema.items_slice.start  # item 0's start, record 0
    data = bytearray((store / s.rec).read_bytes())
    data[offset:offset + 4] = struct.pack("<f", 1e6)
    (store / s.rec).write_bytes(bytes(data))
    with pytest.raises(LoaderError, match="window start lies outside the run"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")


def test_no_core_files_left(store, tmp_path):
    shutil.rmtree(tmp_path / "c", ignore_errors=True)
    assert not list(ROOT.glob("core*"))
