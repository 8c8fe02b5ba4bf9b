"""Record checksums at the edges of the framing (issue 43): a CRC32 equal to dmlc's magic word
splits its record as a payload word would, and the whole records of a shard that also holds a
split record are still checked."""

import datetime as dt
import subprocess
import sys
import zlib
from unittest import mock

import mxnet as mx
import numpy as np
import pytest
from conftest import ROOT
from test_damage import LABELS, C, T, flip, make

from loader import LoaderError, ShardIter
from shardgen.format import framing
from shardgen.format.framing import CRC_WORD, MAGIC
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_shard
from shardgen.store.manifest import Manifest
from shardgen.store.publish import publish


def test_a_crc_equal_to_the_magic_word_splits_its_record_and_reads_back(tmp_path):
    real = framing.payload_crcs

    def magic_for_row_3(buf, starts, length):
        crcs = real(buf, starts, length)
        if len(starts) > 3:
            crcs[3] = MAGIC
        return crcs

    m = make(tmp_path / "s", dates=1)
    schema, s = m.schema, m.shards[0]
    raw = np.random.default_rng(4).standard_normal((60, C + 1)).astype(np.float32)
    d = dt.date.fromisoformat(s.date)
    with mock.patch.object(framing, "payload_crcs", magic_for_row_3):
        entry = write_shard(tmp_path / "s", d, sliding_windows(raw, d, time_steps=T, num_inputs=C, labels=LABELS),
                            None, schema, fsync=False, version=2).entry()
    publish(tmp_path / "s", schema, 0, [entry])
    r = mx.recordio.MXIndexedRecordIO(str(tmp_path / "s" / entry.idx), str(tmp_path / "s" / entry.rec), "r")
    for i in range(entry.records):  # every record reads back whole, its CRC the real one
        header, img = mx.recordio.unpack(r.read_idx(i))
        assert header.id2 & 0xFFFFFFFF == i
        assert header.id2 >> 32 == zlib.crc32(header.label.astype("<f4").tobytes() + img)
    r.close()
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:
        assert sum(8 - b.pad for b in it) == entry.windows


def test_a_whole_record_beside_a_split_one_is_checked(tmp_path):
    entry, offsets, split = _split_store(tmp_path, row=50)  # splits a late record
    schema = Manifest.load(tmp_path / "s" / "manifest.json").schema
    assert split and 0 not in split
    at = offsets[0] + 8 + 24 + 4 * schema.data_slice.start
    data = (tmp_path / "s" / entry.rec).read_bytes()
    flip(tmp_path / "s" / entry.rec, at, data[at] ^ 0x01)
    with pytest.raises(LoaderError, match=f"record 0 of {entry.date} is damaged \\(payload checksum differs"):
        ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
    assert Manifest.load(tmp_path / "s" / "manifest.json").shards[0].checksum == "crc32"
    assert CRC_WORD == 7


def _split_store(tmp_path, row=30, magic_rows=1):
    """A store whose first date's shard has a record dmlc split (a magic word in raw ``row``, and in
    the ``magic_rows - 1`` rows after it: records split in more parts): its entry, its records'
    offsets (and the file's end) and the split records."""
    m = make(tmp_path / "s")
    schema, s = m.schema, m.shards[0]
    raw = np.random.default_rng(9).standard_normal((60, C + 1)).astype(np.float32)
    for k in range(magic_rows):
        raw[row + k, 1] = np.uint32(MAGIC).view(np.float32)
    d = dt.date.fromisoformat(s.date)
    entry = write_shard(tmp_path / "s", d, sliding_windows(raw, d, time_steps=T, num_inputs=C, labels=LABELS), None,
                        schema, fsync=False, version=2).entry()
    publish(tmp_path / "s", schema, 0, [entry] + list(m.shards[1:]))
    text = (tmp_path / "s" / entry.idx).read_text().split()
    offsets = [int(v) for v in text[1::2]] + [entry.bytes]
    split = [i for i in range(entry.records) if offsets[i + 1] - offsets[i] != schema.record_bytes]
    return entry, offsets, split


def _open_in_a_child(tmp_path) -> str:
    """What a ShardIter on the store says when made in a child process (dmlc may abort on a bad
    flag the check misses: the child dies, not pytest); it must exit 0."""
    script = f"""
from loader import LoaderError, ShardIter
try:
    ShardIter({str(tmp_path / 's')!r}, 8, cache_dir={str(tmp_path / 'c')!r})
except LoaderError as exc:
    print("LoaderError:", exc)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_a_bad_continuation_flag_of_a_split_record_is_a_loader_error_not_an_abort(tmp_path):
    """cflag 5 (the top bit of a split record's first length word flipped): dmlc aborted the
    process (SIGABRT) before the check refused cflags 4-7 (review)."""
    entry, offsets, split = _split_store(tmp_path)
    flip(tmp_path / "s" / entry.rec, offsets[split[0]] + 7, (tmp_path / "s" / entry.rec).read_bytes()[
        offsets[split[0]] + 7] ^ 0x80)
    assert f"record {split[0]} of {entry.date} is damaged (bad continuation flag 5" in _open_in_a_child(tmp_path)


def test_a_middle_part_marked_as_a_record_start_is_a_loader_error(tmp_path):
    """A record dmlc split in three parts (flags 1, 2, 3) whose middle part's flag became 1 (a record
    start): dmlc would take it for a new record (the review of issue 56: the check accepted it)."""
    entry, offsets, split = _split_store(tmp_path, magic_rows=2)
    data = (tmp_path / "s" / entry.rec).read_bytes()
    magic = np.uint32(MAGIC).tobytes()
    three = [r for r in split if data.count(magic, offsets[r], offsets[r + 1]) >= 3]
    assert three, "no record split in three parts"
    r = three[0]
    middle = data.find(magic, offsets[r] + 4, offsets[r + 1])
    assert data[middle + 7] >> 5 == 2  # the middle part's flag (the length word's top 3 bits)
    flip(tmp_path / "s" / entry.rec, middle + 7, data[middle + 7] ^ 0x60)  # 2 -> 1
    out = _open_in_a_child(tmp_path)
    assert f"record {r} of {entry.date} is damaged (bad continuation flag 1" in out, out


@pytest.mark.parametrize("where", ["whole", "split"])
def test_a_record_number_that_changed_is_named(tmp_path, where):
    """id2's low word (the record's number) is checked too: no header byte of a new shard is unchecked."""
    entry, offsets, split = _split_store(tmp_path)
    r = split[0] if where == "split" else 0
    at = offsets[r] + 8 + 16  # id2's low word
    flip(tmp_path / "s" / entry.rec, at, (tmp_path / "s" / entry.rec).read_bytes()[at] ^ 0x04)
    with pytest.raises(LoaderError, match=f"record {r} of {entry.date} is damaged \\(record number \\(id2\\) is"):
        ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")


def _bump(path, at, bit=0x01):
    flip(path, at, path.read_bytes()[at] ^ bit)


@pytest.mark.parametrize("what, at, match", [
    ("flag", 8, "header flag is not"),  # IRHeader flag: the frame check (``_whole_records``)
    ("payload", None, "payload checksum differs"),  # the CRC32 check (a data float)
    ("day", 8 + 24 + 4, "day field is not"),  # the codec's check (a runs record's second payload word)
    ("number", 8 + 16, r"record number \(id2\) is"),
])
def test_a_damaged_whole_record_after_a_split_one_is_named_by_its_own_number(tmp_path, what, at, match):
    """Issue 56: with a split record in the shard, the whole records are checked as a gathered
    column; a damaged one after the split record was named by its place among the whole records
    (one less) when the check did not map it back. Record 0 (the test above) cannot tell."""
    entry, offsets, split = _split_store(tmp_path, row=30)
    schema = Manifest.load(tmp_path / "s" / "manifest.json").schema
    r = split[-1] + 3
    assert r < entry.records and offsets[r + 1] - offsets[r] == schema.record_bytes
    at = 8 + 24 + 4 * schema.data_slice.start if at is None else at
    _bump(tmp_path / "s" / entry.rec, offsets[r] + at)
    with pytest.raises(LoaderError, match=f"record {r} of {entry.date} is damaged \\({match}"):
        ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")


def test_a_split_records_image_is_checked_by_frame_alone(tmp_path):
    """Under ``verify="frame"`` no CRC covers the image: a split record's image bytes are compared
    with the constant image (a flipped one passed, and MXNet decoded what it found)."""
    entry, offsets, split = _split_store(tmp_path)
    r = split[0]
    image = Manifest.load(tmp_path / "s" / "manifest.json").schema.image
    at = (tmp_path / "s" / entry.rec).read_bytes().rfind(image, offsets[r], offsets[r + 1])
    assert at > offsets[r]
    _bump(tmp_path / "s" / entry.rec, at + len(image) // 2, 0x10)
    for verify in ("frame", "crc"):
        with pytest.raises(LoaderError, match=f"record {r} of {entry.date} is damaged \\(image bytes differ"):
            ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / f"c-{verify}", verify=verify)


@pytest.mark.parametrize("where", ["whole", "split"])
def test_the_high_word_of_the_id_is_checked(tmp_path, where):
    """``id`` is a uint64 day number: its high word must be 0 (no CRC covers the header; MXNet reads
    ``id`` whole). Issue 56: an unchecked high word passed every check."""
    entry, offsets, split = _split_store(tmp_path)
    r = split[0] if where == "split" else split[0] + 1
    _bump(tmp_path / "s" / entry.rec, offsets[r] + 8 + 12)  # IRHeader: flag, label, id (low, high), id2
    with pytest.raises(LoaderError, match=f"record {r} of {entry.date} is damaged \\(.*id is not day"):
        ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c")
