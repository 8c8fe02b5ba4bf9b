"""Record layout and writer: byte-identical to MXNet's own writer, golden shard, validation."""

import datetime as dt
import hashlib
import struct
import zlib

import mxnet as mx
import numpy as np
import pytest

from shardgen.errors import ProcessorError, ShardError
from shardgen.format import MAGIC, PNG_1X1, LabelSpec, Schema, day_number, from_day_number
from shardgen.produce.writer import write_shard

SCHEMA = Schema.create(time_steps=3, num_inputs=2, data_name="seq_var",
                       labels=[LabelSpec("a", 1), LabelSpec("b", 2)])
MAGIC_F = np.frombuffer(struct.pack("<I", MAGIC), np.float32)[0]
DATE = dt.date(2024, 1, 2)


def golden_inputs(n=6, magic_rows=(2, 4)):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3, 2)).astype(np.float32)
    x[magic_rows[0], 1, 1] = MAGIC_F  # dmlc splits these records; the writer must too
    x[magic_rows[1], 0, 0] = MAGIC_F
    x[magic_rows[1], 2, 1] = MAGIC_F
    labels = {"a": rng.standard_normal(n).astype(np.float32),
              "b": rng.standard_normal((n, 2)).astype(np.float32)}
    return x, labels


def mxnet_reference(tmp_path, x, labels):
    """The same shard written record by record with MXNet's own writer."""
    day = day_number(DATE)
    w = mx.recordio.MXIndexedRecordIO(str(tmp_path / "ref.idx"), str(tmp_path / "ref.rec"), "w")
    for i in range(len(x)):
        payload = np.concatenate([x[i].ravel(), [labels["a"][i]], labels["b"][i], [day]]).astype(np.float32)
        crc = zlib.crc32(payload.tobytes() + PNG_1X1)  # id2's high word: the payload's CRC32 (issue 43)
        w.write_idx(i, mx.recordio.pack(mx.recordio.IRHeader(0, payload, day, i | crc << 32), PNG_1X1))
    w.close()
    return (tmp_path / "ref.rec").read_bytes(), (tmp_path / "ref.idx").read_text()


@pytest.mark.parametrize("n, magic_rows", [(6, (2, 4)), (700, (10, 600)), (700, (300, 301)), (700, None)])
def test_shard_is_byte_identical_to_mxnet_writer(tmp_path, n, magic_rows):
    """Several packing blocks, magic words in the first or a later block, or none at all."""
    x, labels = golden_inputs(n, magic_rows or (0, 0))
    if magic_rows is None:
        x[0] = 0.5
    sidecar = write_shard(tmp_path, DATE, x, labels, SCHEMA)
    rec, idx = mxnet_reference(tmp_path, x, labels)
    assert (tmp_path / "2024-01-02.rec").read_bytes() == rec
    assert (tmp_path / "2024-01-02.idx").read_text() == idx
    assert sidecar.sha256 == hashlib.sha256(rec).hexdigest()
    assert sidecar.records == n and sidecar.bytes == len(rec)
    assert sidecar.fingerprint == SCHEMA.fingerprint


def test_golden_shard_sha_is_stable(tmp_path):
    """The format is a contract: the same inputs must always give these exact bytes."""
    x, labels = golden_inputs()
    sidecar = write_shard(tmp_path, DATE, x, labels, SCHEMA)
    # 2026-12-06: records carry their payload's CRC32 (issue 43)
    assert sidecar.sha256 == "6d5f2642755a956980560b9694a4e4c1241cce21bd551492c1297ad180d04385"
    assert SCHEMA.fingerprint == "33d876bda78372dc"


def test_stock_reader_round_trip(tmp_path):
    x, labels = golden_inputs()
    write_shard(tmp_path, DATE, x, labels, SCHEMA)
    r = mx.recordio.MXIndexedRecordIO(str(tmp_path / "2024-01-02.idx"), str(tmp_path / "2024-01-02.rec"), "r")
    for i in range(6):
        header, img = mx.recordio.unpack(r.read_idx(i))
        assert header.flag == SCHEMA.record_floats and header.id == day_number(DATE) and header.id2 & 0xFFFFFFFF == i
        assert header.id2 >> 32 == zlib.crc32(header.label.astype("<f4").tobytes() + img)
        np.testing.assert_array_equal(header.label[:6], x[i].ravel())
        assert header.label[6] == labels["a"][i]
        np.testing.assert_array_equal(header.label[7:9], labels["b"][i])
        assert from_day_number(header.label[9]) == DATE
        assert img == PNG_1X1
    r.close()


def test_nan_names_date_field_and_row(tmp_path):
    x, labels = golden_inputs()
    x[3, 0, 1] = np.nan
    with pytest.raises(ProcessorError, match=r"2024-01-02: non-finite value in 'seq_var' at window 3"):
        write_shard(tmp_path, DATE, x, labels, SCHEMA)
    labels["b"][1, 1] = np.inf
    x[3, 0, 1] = 0
    with pytest.raises(ProcessorError, match=r"'b' at window 1"):
        write_shard(tmp_path, DATE, x, labels, SCHEMA)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_nan_in_a_later_block_names_its_window(tmp_path):
    x, labels = golden_inputs(700, (1, 2))
    x[555, 2, 0] = np.nan
    with pytest.raises(ProcessorError, match=r"non-finite value in 'seq_var' at window 555"):
        write_shard(tmp_path, DATE, x, labels, SCHEMA)
    assert not list(tmp_path.iterdir())


def test_empty_shard_is_refused(tmp_path):
    with pytest.raises(ShardError, match="no windows"):
        write_shard(tmp_path, DATE, np.empty((0, 3, 2), np.float32),
                    {"a": np.empty(0, np.float32), "b": np.empty((0, 2), np.float32)}, SCHEMA)


@pytest.mark.parametrize("kwargs, match", [
    (dict(time_steps=1 << 14, num_inputs=1 << 14), "2\\^29"),
    (dict(time_steps=0, num_inputs=3), "time_steps"),
    (dict(time_steps=3, num_inputs=3, labels=[LabelSpec("date", 1)]), "added by shardgen"),
    (dict(time_steps=3, num_inputs=3, labels=[LabelSpec("a", 1), LabelSpec("a", 2)]), "unique"),
])
def test_bad_schemas(kwargs, match):
    kwargs = {"data_name": "seq_var", "labels": [LabelSpec("a", 1)], **kwargs}
    with pytest.raises(ValueError, match=match):
        Schema.create(**kwargs)


def test_day_numbers_exact_in_float32():
    for d in (dt.date(1970, 1, 1), dt.date(2024, 2, 29), dt.date(2199, 12, 31)):
        assert from_day_number(np.float32(day_number(d))) == d
