"""Record numbers (issue 64 contract 4): every record's header carries its number in its shard
(``id2``'s low word), which stock MXNet readers see. Records are framed 256 at a time, so a shard of
more than 256 records is where a number taken from the block instead of the shard would show: a
stock reader sees every number equal to its place, and ``shardgen verify`` and the loader refuse a
record past the 256th whose number is not its place, naming the file and the record."""

from __future__ import annotations

import datetime as dt
import struct

import mxnet as mx
import pytest
from conftest import T, shardgen_cli, write_config

from loader import LoaderError, ShardIter
from shardgen.format.framing import BLOCK_ROWS, MAGIC, NUMBER_WORD
from shardgen.format.schema import day_number
from shardgen.store.manifest import Manifest

DATE = "2024-01-02"
ROWS = 3 * BLOCK_ROWS + 20  # one window per record: 3 blocks and some

SPLIT_PROC = f'''
import numpy as np

from shardgen.process import sliding_windows


def windows(raw, date, **kw):
    x, labels = sliding_windows(raw, date, **kw)
    x[5, 0, 1] = np.uint32({MAGIC}).view(np.float32)  # dmlc splits record 5 at this word
    return x, labels
'''


def one_window_per_record(tmp_path, *, split: bool):
    """A store of one date whose shard holds more than 3 blocks of records (one window each),
    built by the real CLI; with ``split``, record 5 holds dmlc's magic word (split on disk)."""
    cfg = write_config(tmp_path / "p", start=DATE, end=DATE, rows=ROWS,
                       process="splitproc:windows" if split else "shardgen.process:sliding_windows",
                       stride=None if split else 1)
    cfg.write_text(cfg.read_text().replace("[store]\n", '[store]\nlayout = "windows"\npack = 1\n'))
    if split:
        (tmp_path / "p" / "splitproc.py").write_text(SPLIT_PROC)
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 0, r.stderr
    store = tmp_path / "p" / "shards"
    entry = Manifest.load(store / "manifest.json").shards[0]
    assert entry.records == ROWS - T + 1 > 3 * BLOCK_ROWS
    offsets = [int(v) for v in (store / entry.idx).read_text().split()[1::2]]
    sizes = {b - a for a, b in zip(offsets, offsets[1:] + [entry.bytes])}
    assert (len(sizes) > 1) == split  # a split record is longer than the others
    return cfg, store, entry, offsets


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_a_stock_reader_sees_every_record_numbered_by_its_place(tmp_path, split):
    _cfg, store, entry, _offsets = one_window_per_record(tmp_path, split=split)
    r = mx.recordio.MXIndexedRecordIO(str(store / entry.idx), str(store / entry.rec), "r")
    try:
        seen = []
        for i in range(entry.records):
            header, _img = mx.recordio.unpack(r.read_idx(i))
            assert header.id == day_number(dt.date.fromisoformat(DATE))
            seen.append(header.id2 & 0xFFFFFFFF)
    finally:
        r.close()
    assert seen == list(range(entry.records))


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("record", [BLOCK_ROWS + 44, 2 * BLOCK_ROWS + 1, 3 * BLOCK_ROWS + 7])
def test_a_wrong_number_past_the_256th_record_is_refused_naming_file_and_record(tmp_path, split, record):
    """The wrong number written is the record's place within its block of 256 (what a writer that
    numbered blocks instead of the shard would write): every other check of the record holds."""
    cfg, store, entry, offsets = one_window_per_record(tmp_path, split=split)
    rec = store / entry.rec
    data = bytearray(rec.read_bytes())
    at = offsets[record] + 4 * NUMBER_WORD
    assert struct.unpack_from("<I", data, at)[0] == record
    struct.pack_into("<I", data, at, record % BLOCK_ROWS)
    rec.write_bytes(bytes(data))

    r = shardgen_cli("verify", "-c", cfg)
    assert r.returncode == 1, r.stdout + r.stderr
    said = r.stdout + r.stderr
    assert f"{entry.rec}: record {record} of {DATE} is damaged (record number (id2) is {record % BLOCK_ROWS})" in said
    for verify in ("crc", "frame", "sha256"):
        with pytest.raises(LoaderError, match=rf"{entry.rec}: record {record} of {DATE} is damaged \(record "
                                              rf"number \(id2\) is {record % BLOCK_ROWS}\)"):
            ShardIter(store, 8, cache_dir=tmp_path / f"c-{verify}", verify=verify)
