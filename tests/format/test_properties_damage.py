"""Random shards, random damage (issue 56, "what to build" 1d): shards of a few hundred to a few
thousand records (past the writer's 256-record blocks), some records split by dmlc's magic word,
in each record layout; any run of bytes of the ``.rec`` overwritten. Either a LoaderError names
the file, the date and a record the damage touched, or the bytes never reach training: every
window reads back as it was written."""

import datetime as dt

import numpy as np
from hypothesis import event, given
from hypothesis import strategies as st
from test_damage import shardgen_verify

from loader import LoaderError, ShardIter
from shardgen.format import LabelSpec, Layout, Schema
from shardgen.format.framing import MAGIC, data_bytes
from shardgen.format.index import parse_index
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_shard
from shardgen.store.publish import publish

T, C = 4, 3  # a payload of 14 words: most of a record's bytes (the image is 58)
LABELS = [LabelSpec("a", 1)]
LAYOUTS = {"samples": Layout(), "windows": Layout("windows", 4), "runs": Layout("runs", 8, T + 7)}
DAY = dt.date(2024, 3, 4)


def _write(store, layout: str, rows: int, magic_rows: list, seed: int):
    schema = Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS, layout=LAYOUTS[layout])
    raw = np.random.default_rng(seed).standard_normal((rows, C + 1)).astype(np.float32)
    for r in magic_rows:  # dmlc splits the record holding this word
        raw[r % rows, r % (C + 1)] = np.uint32(MAGIC).view(np.float32)
    store.mkdir(parents=True, exist_ok=True)
    entry = write_shard(store, DAY, sliding_windows(raw, DAY, time_steps=T, num_inputs=C, labels=LABELS), None,
                        schema, fsync=False, version=2).entry()
    publish(store, schema, 0, [entry])
    return entry, schema


def _windows(store, cache) -> np.ndarray:
    """Every window's values, in store order."""
    with ShardIter(store, 64, shuffle=False, cache_dir=cache) as it:
        return np.concatenate([b.data[0].asnumpy()[: 64 - b.pad] for b in it])


@given(layout=st.sampled_from(sorted(LAYOUTS)), rows=st.integers(300, 3000),
       magic_rows=st.lists(st.integers(0, 10**6), max_size=3), seed=st.integers(0, 2**16),
       where=st.floats(0, 1, exclude_max=True), header=st.none() | st.sampled_from(range(32)),
       new=st.binary(min_size=1, max_size=8))
def test_damage_anywhere_in_a_shard_is_named_or_never_read(tmp_path_factory, layout, rows, magic_rows, seed, where,
                                                           header, new):
    """``where``: anywhere in the file, or (``header``) that byte of the frame and IRHeader of the
    record there (32 bytes of each record that no checksum covers)."""
    tmp = tmp_path_factory.mktemp("damage")
    store = tmp / "s"
    entry, schema = _write(store, layout, rows, magic_rows, seed)
    rec = store / entry.rec
    data = bytearray(rec.read_bytes())
    assert entry.records > 256 or layout != "samples"
    offsets = parse_index((store / entry.idx).read_bytes())[1]
    at = int(where * len(data))
    if header is not None:
        at = min(len(data) - 1, int(offsets[np.searchsorted(offsets, at, "right") - 1]) + header)
    new = new[: len(data) - at]
    if bytes(data[at:at + len(new)]) == new:
        new = bytes([new[0] ^ 0x5A]) + new[1:]
    touched = [at + i for i in range(len(new)) if data[at + i] != new[i]]
    want = _windows(store, tmp / "c0")
    data[at:at + len(new)] = new
    rec.write_bytes(bytes(data))
    records = sorted({int(np.searchsorted(offsets, p, "right")) - 1 for p in touched})
    event(f"{layout}, {'some' if len(np.unique(np.diff(offsets))) > 1 else 'no'} split record")
    try:
        got = _windows(store, tmp / "c1")
    except LoaderError as exc:
        text = str(exc)
        assert text.startswith(f"{rec}: record ") and f" of {entry.date} is damaged (" in text, text
        named = int(text.split(": record ")[1].split(" ")[0])
        assert named in records, f"{text}: the damage is in record(s) {records}"
        code, err = shardgen_verify(store, tmp)  # the CLI's verify names the same record
        assert code == 1 and f"record {named} of {entry.date} is damaged" in err, err
        event("named")
    else:  # only bytes no reader uses (a split record's padding after its last part): every window as written
        ends = np.append(offsets[1:], entry.bytes)
        pad = -data_bytes(schema.record_floats, schema.image) % 4
        split = np.flatnonzero(ends - offsets != schema.record_bytes)
        unread = {p for r in split for p in range(ends[r] - pad, ends[r])}
        assert set(touched) <= unread, f"bytes {sorted(set(touched) - unread)} of records {records} changed unseen"
        np.testing.assert_array_equal(got, want)
        event("never read")
