"""A damaged or vanished shard never reaches MXNet's native reader: a LoaderError names the file,
the date and the record, the process survives (no SIGABRT, no core), and close() is safe."""

import datetime as dt
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, write_config

from loader import LoaderError, ShardIter
from shardgen.format import LabelSpec, Layout, Schema
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.publish import publish
from shardgen.store.verify import verify_store

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


def shardgen_verify(store, tmp_path):
    """``shardgen verify`` (the CLI's own entry point, in this process) on a config naming ``store``:
    exit code and stderr."""
    import contextlib
    import io

    from shardgen.cli import main

    folder = tmp_path / "verify-cfg"
    write_config(folder)
    (folder / "shards").symlink_to(store)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["verify", "-c", str(folder / "shardgen.toml")])
    return code, err.getvalue()


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
    code, err = shardgen_verify(store, tmp_path)
    assert code == 1 and [ln.split(": ")[2] for ln in err.splitlines()] == [s.date] and s.rec in err, err


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
    code, err = shardgen_verify(store, tmp_path)
    assert code == 1
    assert [ln.split(": ")[2] for ln in err.splitlines()] == [s.date]  # this shard, and only it
    assert s.rec in err and "sha256" in err


# Mid-epoch faults need an epoch that is still reading when they strike: 40 dates of 7 records,
# one record per native batch, a 16-record shuffle buffer (MXNet has read a few records ahead).
SLOW_READ = dict(seed=3, native_batch=1, shuffle_buffer=16, prefetch_buffer=1)


def rows_of(batch):
    """(label a, date) of every row of a batch, padding included: what a caller sees."""
    return [tuple(r) for r in np.stack([batch.label[0].asnumpy(), batch.label[1].asnumpy()], 1).tolist()]


def reference_epochs(store, cache, epochs=2):
    """What an undisturbed reader reads, epoch by epoch (same order as any reader of this plan)."""
    with ShardIter(store, 8, cache_dir=cache, **SLOW_READ) as it:
        out = []
        for _ in range(epochs):
            out.append([rows_of(b) for b in it])
            it.reset()
        return out


@pytest.fixture
def big(tmp_path):
    make(tmp_path / "big", dates=40)
    return tmp_path / "big"


def test_a_file_replaced_mid_epoch_is_not_read_and_in_place_damage_is_caught(big, tmp_path):
    store = big
    m = Manifest.load(store / "manifest.json")
    ref = reference_epochs(store, tmp_path / "c")
    it = ShardIter(store, 8, cache_dir=tmp_path / "c", **SLOW_READ)
    got = [rows_of(it.next())]
    for s in m.shards:  # every file replaced by a damaged copy: new inodes, published ones unlinked
        data = bytearray((store / s.rec).read_bytes())
        for r in range(s.records):
            data[r * m.schema.record_bytes] ^= 0xFF  # each record's magic
        tmp = store / "tmp.rec"
        tmp.write_bytes(bytes(data))
        os.replace(tmp, store / s.rec)
    got += [rows_of(b) for b in it]
    assert got == ref[0]  # the published bytes, in the same order
    it.reset()  # the same generation: still the files this process holds
    assert [rows_of(b) for b in it] == ref[1]
    it.close()
    with pytest.raises(LoaderError, match=f"record 0 of {m.shards[0].date} is damaged"):  # a new reader checks
        ShardIter(store, 8, cache_dir=tmp_path / "c2")


def test_damage_in_place_between_readers_is_caught(store, tmp_path):
    m = Manifest.load(store / "manifest.json")
    it = ShardIter(store, 8, cache_dir=tmp_path / "c")
    assert sum(8 - b.pad for b in it) == m.samples
    it.close()  # in-place writes while a reader reads cannot be contained (README)
    s = m.shards[2]
    with open(store / s.rec, "r+b") as fh:  # damage in place: the verdict cached for the file is stale
        fh.seek(m.schema.record_bytes * 2)
        fh.write(b"\0\0\0\0")
    os.utime(store / s.rec, ns=(0, os.stat(store / s.rec).st_mtime_ns + 1_000_000))
    with pytest.raises(LoaderError, match=f"record 2 of {s.date} is damaged"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")
    it.close()
    it.close()  # safe, twice, after an error


def test_shard_deleted_mid_epoch_is_still_read_exactly(big, tmp_path):
    """MXNet reads the files this process holds open (/proc/self/fd), so deleting them mid-epoch
    (before: a segmentation fault) changes nothing for this generation; a new reader names the file."""
    store = big
    m = Manifest.load(store / "manifest.json")
    ref = reference_epochs(store, tmp_path / "c")
    it = ShardIter(store, 8, cache_dir=tmp_path / "c", **SLOW_READ)
    got = [rows_of(it.next())]
    for s in m.shards:
        (store / s.rec).unlink()
    got += [rows_of(b) for b in it]
    assert got == ref[0]
    it.reset()  # the same generation: still the files this process holds
    assert [rows_of(b) for b in it] == ref[1]
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


def _set_start(store, m, start):
    """Item 0's window start of record 0 of the first shard; returns that run's rows used."""
    import struct

    s = m.shards[0]
    payload = 8 + 24  # magic, length word, IRHeader
    data = bytearray((store / s.rec).read_bytes())
    rows_used = int(struct.unpack_from("<f", data, payload + 4 * 3)[0])  # head: n, day, first row, rows used
    offset = payload + 4 * m.schema.items_slice.start
    struct.pack_into("<f", data, offset, float(start(rows_used)))
    (store / s.rec).write_bytes(bytes(data))
    return rows_used


@pytest.mark.parametrize("start", [lambda rows: 1e6, lambda rows: rows - T + 1, lambda rows: -1,
                                   lambda rows: 0.5], ids=["far", "one-past-the-last", "negative", "fraction"])
def test_bad_window_start_inside_a_run_is_caught(store, tmp_path, start):
    """A start that would make the gather read outside the run is refused before any read."""
    m = Manifest.load(store / "manifest.json")
    _set_start(store, m, start)
    with pytest.raises(LoaderError, match="window start lies outside the run"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")


def test_the_last_start_inside_a_run_is_read(store, tmp_path):
    """The boundary itself, ``rows_used - T``, is a valid window: the check is not too strict."""
    m = Manifest.load(store / "manifest.json")
    rows_used = _set_start(store, m, lambda rows: rows - T)
    assert rows_used > T
    with ShardIter(store, 8, shuffle=False, cache_dir=tmp_path / "c") as it:
        assert sum(8 - b.pad for b in it) == m.samples
