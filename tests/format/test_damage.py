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


def shardgen_verify(store, tmp_path, stdout=None):
    """``shardgen verify`` (the CLI's own entry point, in this process) on a config naming ``store``:
    exit code and stderr (stdout into ``stdout``, a list, if given)."""
    import contextlib
    import io

    from shardgen.cli import main

    folder = tmp_path / "verify-cfg"
    write_config(folder)
    (folder / "shards").symlink_to(store)
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["verify", "-c", str(folder / "shardgen.toml")])
    if stdout is not None:
        stdout.append(out.getvalue())
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


def _record_offsets(store, entry):
    text = (store / entry.idx).read_text().split()
    return [int(v) for v in text[1::2]] + [entry.bytes]


@pytest.mark.parametrize("layout", [RUNS, Layout("windows", 4), Layout()], ids=["runs", "windows", "samples"])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_flipped_payload_bit_is_a_loader_error_naming_the_record_before_any_batch(tmp_path, layout, where):
    """The default check (issue 43): every record's CRC32 of its payload; one bit (the lowest of a
    float's mantissa) at the start, middle or end of the payload of the middle record of a shard."""
    m = make(tmp_path / "s", layout)
    s = m.shards[1]
    offsets = _record_offsets(tmp_path / "s", s)
    r = len(offsets) // 2 - 1
    a, z = m.schema.data_slice.start, m.schema.data_slice.stop  # the window values (codec words are framing)
    end = z - 2 if layout.kind == "samples" else z - 1  # a sample's last word is its date: framing
    word = {"start": a, "middle": (a + z) // 2, "end": end}[where]
    flip(tmp_path / "s" / s.rec, offsets[r] + 8 + 24 + 4 * word, (tmp_path / "s" / s.rec).read_bytes()[
        offsets[r] + 8 + 24 + 4 * word] ^ 0x01)
    with pytest.raises(LoaderError, match=f"{s.rec}: record {r} of {s.date} is damaged \\(payload checksum differs"):
        ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c", verify="frame") as it:  # frame only: reads it
        assert sum(8 - b.pad for b in it) == m.samples
    code, err = shardgen_verify(tmp_path / "s", tmp_path)
    assert code == 1 and f"record {r} of {s.date} is damaged (payload checksum differs" in err


def test_a_split_record_is_checked_too(tmp_path):
    """A payload word equal to dmlc's magic splits the record on disk; its CRC is checked on the
    reassembled record."""
    from shardgen.format.framing import MAGIC

    m = make(tmp_path / "s")
    schema, s = m.schema, m.shards[0]
    raw = np.random.default_rng(9).standard_normal((60, C + 1)).astype(np.float32)
    raw[30, 1] = np.uint32(MAGIC).view(np.float32)
    d = dt.date.fromisoformat(s.date)
    entry = write_shard(tmp_path / "s", d, sliding_windows(raw, d, time_steps=T, num_inputs=C, labels=LABELS), None,
                        schema, fsync=False, version=2).entry()
    publish(tmp_path / "s", schema, 0, [entry] + list(m.shards[1:]))
    offsets = _record_offsets(tmp_path / "s", entry)
    split = [i for i in range(entry.records) if offsets[i + 1] - offsets[i] != schema.record_bytes]
    assert split, "the magic word split a record"
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:  # sound: reads
        assert sum(8 - b.pad for b in it) == Manifest.load(tmp_path / "s" / "manifest.json").samples
    at = offsets[split[0]] + 8 + 24 + 4 * schema.data_slice.start  # before the split (the magic is further on)
    flip(tmp_path / "s" / entry.rec, at, (tmp_path / "s" / entry.rec).read_bytes()[at] ^ 0x01)
    with pytest.raises(LoaderError, match=f"record {split[0]} of {s.date} is damaged \\(payload checksum differs"):
        ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")


def test_a_shard_damaged_between_two_epochs_is_refused_at_reset_and_read_again_once_rebuilt(store, tmp_path):
    m = Manifest.load(store / "manifest.json")
    s = m.shards[2]
    good = (store / s.rec).read_bytes()
    with ShardIter(store, 8, cache_dir=tmp_path / "c") as it:
        first = sum(8 - b.pad for b in it)
        at = m.schema.record_bytes + 8 + 24 + 4 * (m.schema.data_slice.start + 3)  # a value of record 1
        flip(store / s.rec, at, good[at] ^ 1)
        with pytest.raises(LoaderError, match=f"{s.rec}: record 1 of {s.date} is damaged \\(payload checksum"):
            it.reset()
        (store / s.rec).write_bytes(good)  # rebuilt
        it.reset()
        assert sum(8 - b.pad for b in it) == first == m.samples


def test_shards_without_checksums_still_read_with_one_notice_and_verify_lists_them(store, tmp_path, caplog):
    """Shards written before record checksums: no ``checksum`` key in their entries. They read
    (frame checked), one warning per store says so, and ``shardgen verify`` lists them."""
    import json
    import logging

    path = store / "manifest.json"
    obj = json.loads(path.read_text())
    for e in obj["shards"][:2]:
        del e["checksum"]
        sidecar = json.loads((store / e["rec"]).with_suffix(".json").read_text())
        del sidecar["checksum"]
        (store / e["rec"]).with_suffix(".json").write_text(json.dumps(sidecar))  # as such a shard was published
    path.write_text(json.dumps(obj))
    (store / "generations" / f"{obj['generation']}.json").write_text(json.dumps(obj))  # the newest snapshot too
    with caplog.at_level(logging.WARNING, logger="loader"):
        for _ in range(2):
            with ShardIter(store, 8, cache_dir=tmp_path / "c") as it:
                assert sum(8 - b.pad for b in it) == Manifest.load(path).samples
    notes = [r.getMessage() for r in caplog.records if "before record checksums" in r.getMessage()]
    assert len(notes) == 1 and "2 shard(s) (2024-01-02, 2024-01-03)" in notes[0]
    out: list = []
    assert shardgen_verify(store, tmp_path, out)[0] == 0
    assert "2 shard(s) written before record checksums (2024-01-02, 2024-01-03)" in out[0]


def test_a_wrong_sha256_in_the_manifest_is_said_to_be_the_manifests(store, tmp_path):
    import json

    path = store / "manifest.json"
    obj = json.loads(path.read_text())
    obj["shards"][1]["sha256"] = "0" * 64
    path.write_text(json.dumps(obj))
    s = Manifest.load(path).shards[1]
    with ShardIter(store, 8, cache_dir=tmp_path / "c") as it:  # the default checks records, not the hash
        assert sum(8 - b.pad for b in it) == Manifest.load(path).samples
    with pytest.raises(LoaderError, match=f"{s.rec}: sha256 differs from the manifest \\({s.date}\\), yet every "
                                          "record's frame, header and payload checksum hold: the manifest's "
                                          "sha256 is most likely wrong"):
        ShardIter(store, 8, cache_dir=tmp_path / "c", verify="sha256")
    code, err = shardgen_verify(store, tmp_path)
    assert code == 1 and "sha256 is most likely wrong, not the file" in err and s.date in err


# Mid-epoch faults need an epoch that is still reading when they strike: 40 dates of 7 records,
# a 16-record shuffle buffer (blocks of 16 records, read no more than a block ahead).
SLOW_READ = dict(seed=3, shuffle_buffer=16, prefetch_buffer=1)


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
    reseal(data, 0, m.schema)  # a writer's mistake, not a flipped bit: the record's checksum agrees
    (store / s.rec).write_bytes(bytes(data))
    return rows_used


def reseal(data: bytearray, offset: int, schema) -> None:
    """Store the CRC32 of the (edited) whole record at ``offset``, as a writer would have."""
    import struct
    import zlib

    from shardgen.format.framing import CRC_WORD, data_bytes

    length = data_bytes(schema.record_floats, schema.image)
    struct.pack_into("<I", data, offset + 4 * CRC_WORD, zlib.crc32(data[offset + 32:offset + 8 + length]))


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


@pytest.mark.parametrize("damaged", [False, True])
def test_a_frame_held_by_a_sampling_profiler_never_fails_the_check(store, damaged):
    """Issue 44 item 6: Dask's worker profiler holds frames from ``sys._current_frames()``; a
    ``_scan`` frame it holds past its return keeps its locals (views of the map) alive, and closing
    the map raised BufferError ("cannot close exported pointers exist"), losing the worker. The same
    here, deterministically: a profile hook keeps every returning check frame, as that thread would."""
    from shardgen.format.check import _CACHE, check_shard

    m = Manifest.load(store / "manifest.json")
    entry = m.shards[0]
    rec = store / entry.rec
    if damaged:
        flip(rec, len(rec.read_bytes()) // 2)
    held = []

    def hook(frame, event, arg):
        if event == "return" and frame.f_code.co_filename.endswith("check.py"):
            held.append(frame)

    _CACHE.clear()
    fd = os.open(rec, os.O_RDONLY)
    sys.setprofile(hook)
    try:
        if damaged:
            with pytest.raises(Exception, match="damaged") as info:
                check_shard(fd, str(rec), str(store / entry.idx), entry, m.schema)
            assert type(info.value).__name__ == "ShardError"
        else:
            assert check_shard(fd, str(rec), str(store / entry.idx), entry, m.schema).samples == entry.windows
    finally:
        sys.setprofile(None)
        os.close(fd)
    assert any(f.f_code.co_name == "_scan" for f in held)  # the frames were held: the case is real
    held.clear()
    with open("/proc/self/maps") as maps:
        assert str(rec) not in maps.read(), "the map goes with the last frame holding a view of it"
    assert not [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(rec)]


@pytest.mark.parametrize("verify", ["crc", "frame", "sha256", "none"])
def test_no_unmap_is_deferred_without_a_profiler(tmp_path, verify):
    """No view of a checked map outlives the check (sound and damaged shards, two layouts): a deferred
    unmap without a profiler would be a view our own code keeps, i.e. a map and an fd leaked."""
    from shardgen.format import check, filemap

    before = filemap.DEFERRED_UNMAPS
    for layout in (RUNS, Layout("samples")):
        store = tmp_path / f"{layout.kind}-{verify}"
        m = make(store, layout=layout, dates=2)
        flip(store / m.shards[1].rec, len((store / m.shards[1].rec).read_bytes()) // 2)
        for entry in m.shards:
            check._CACHE.clear()
            fd = os.open(store / entry.rec, os.O_RDONLY)
            try:
                check.check_shard(fd, str(store / entry.rec), str(store / entry.idx), entry, m.schema, verify=verify)
            except Exception as exc:
                assert type(exc).__name__ == "ShardError"
            finally:
                os.close(fd)
    assert filemap.DEFERRED_UNMAPS == before


def test_a_shard_rewritten_in_place_between_epochs_is_not_read_from_the_next_epochs_early_reads(store, tmp_path,
                                                                                               monkeypatch):
    """The loader fills the next epoch's first block once this one's are filled. A shard rewritten in place
    meanwhile (same bytes here: truncated, then written, as `write_bytes` does) may have been read by
    it mid-rewrite: at reset() the changed file is checked again and that stream goes; the epoch is
    read from the file as it is (found when this damage test ran first in a shuffled run: the early
    reads returned a record of day -996695015424)."""
    import time

    m = Manifest.load(store / "manifest.json")
    s = m.shards[2]
    good = (store / s.rec).read_bytes()
    with ShardIter(store, 8, cache_dir=tmp_path / "c") as it:
        assert sum(8 - b.pad for b in it) == m.samples
        deadline = time.monotonic() + 10
        while (ahead := it.reader.pipeline.ahead) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ahead is not None, "the next epoch's job is not being read yet"
        (store / s.rec).write_bytes(good[:100])  # what a reader may see mid-rewrite
        (store / s.rec).write_bytes(good)
        it.reset()
        assert ahead.halt.is_set() and it.reader.pipeline.current is not ahead, "the early job was kept"
        assert sum(8 - b.pad for b in it) == m.samples
