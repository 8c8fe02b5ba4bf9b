"""What a user asks is what they get, or a LoaderError saying why not (issue 54): a manifest entry
without its window count, the labels in the order asked, a manifest that is not UTF-8, dates the
wrong way round, the part a message names, and close() under MXNet's PrefetchingIter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest
from conftest import ROOT, batch_ids, make_store

from loader import LoaderError, ShardIter


def _edit_manifest(store, edit):
    """Apply ``edit`` to the parsed manifest.json and its newest snapshot (a reader may read either)."""
    path = store / "manifest.json"
    obj = json.loads(path.read_text())
    edit(obj)
    text = json.dumps(obj)
    path.write_text(text)
    (store / "generations" / f"{obj['generation']}.json").write_text(text)


@pytest.mark.parametrize("windows", [None, 0, -3])
def test_a_packed_entry_without_its_window_count_is_refused_naming_it(tmp_path, windows):
    """1,834 windows in 29 records read as 29 before: ``samples = windows or records``."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 40, "2024-01-03": 30}, pack=8)

    def edit(obj):
        entry = obj["shards"][1]
        if windows is None:
            del entry["windows"]
        else:
            entry["windows"] = windows

    _edit_manifest(store, edit)
    with pytest.raises(LoaderError, match=r"manifest.json: refused: shard 2024-01-03.*windows"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")


def test_a_window_count_that_differs_from_the_records_is_refused(tmp_path):
    """One window per record (the samples layout) with ``windows`` saying otherwise: refused at parse;
    a packed shard whose count is wrong: a LoaderError naming the file (the count is always compared)."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 40})
    _edit_manifest(store, lambda obj: obj["shards"][0].update(windows=39))
    with pytest.raises(LoaderError, match="2024-01-02.*39 windows in 40 records"):
        ShardIter(store, 8, cache_dir=tmp_path / "c")
    packed = tmp_path / "p"
    make_store(packed, {"2024-01-02": 40}, pack=8)
    _edit_manifest(packed, lambda obj: obj["shards"][0].update(windows=37))
    with pytest.raises(LoaderError, match=r"2024-01-02.rec: 40 windows in the records, the manifest says 37"):
        ShardIter(packed, 8, cache_dir=tmp_path / "c2")


def test_an_entry_without_windows_in_the_samples_layout_still_reads_every_window(tmp_path):
    """Format 1 entries carry no count: one window per record, every one read."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 23})
    _edit_manifest(store, lambda obj: obj["shards"][0].pop("windows", None))
    with ShardIter(store, 5, shuffle=False, cache_dir=tmp_path / "c") as it:
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(23))


@pytest.mark.parametrize("order", [["date", "b", "a"], ["b", "a"], ["a", "date"], ["date"], ["b"], ["b", "date"]])
def test_labels_come_in_the_order_asked(tmp_path, order):
    """``label_names=["date", "a"]`` gave ``[a, date]`` before: a loop unpacking in its own order got
    them swapped. Both provide_label and batch.label follow the order asked, with the right values."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 9, "2024-01-03": 8})
    days = {"2024-01-02": 19724, "2024-01-03": 19725}  # days since 1970-01-01
    with ShardIter(store, 6, shuffle=True, seed=3, label_names=order, cache_dir=tmp_path / "c") as it:
        assert [d.name for d in it.provide_label] == order
        seen = 0
        for batch in it:
            got = dict(zip(order, (lab.asnumpy() for lab in batch.label)))
            assert [lab.shape for lab in batch.label] == [d.shape for d in it.provide_label]
            x = batch.data[0].asnumpy()
            ids = x[:, 0, 0].round().astype(int)  # make_store fills window k's x with k
            if "a" in got:
                np.testing.assert_array_equal(got["a"], ids)
            if "b" in got:
                np.testing.assert_array_equal(got["b"], np.stack([ids * 2, -ids], axis=1))
            if "date" in got:
                np.testing.assert_array_equal(got["date"], np.where(ids < 9, days["2024-01-02"], days["2024-01-03"]))
            seen += 6 - batch.pad
        assert seen == 17


@pytest.mark.parametrize("names, match", [
    ("a", r"must be a list of names, got the string 'a' \(write \['a'\]\)"),
    (["a", "a"], "'a' asked more than once"),
    ([], "choose among"),
    (["a", "nope"], "choose among"),
    (7, "must be a list of names"),
])
def test_label_names_that_are_not_a_list_of_known_names_are_refused(tmp_path, names, match):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 9})
    with pytest.raises(LoaderError, match=match):
        ShardIter(store, 4, label_names=names, cache_dir=tmp_path / "c")


def test_a_manifest_that_is_not_utf8_is_a_loader_error_naming_it(tmp_path):
    """At construction and at reset() mid-training: a bare UnicodeDecodeError before."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 9, "2024-01-03": 9})
    good = (store / "manifest.json").read_bytes()
    bad = good.replace(b'"window"', b'"wind\xffow"', 1)
    (store / "manifest.json").write_bytes(bad)
    with pytest.raises(LoaderError, match=r"manifest.json: not valid JSON"):
        ShardIter(store, 4, cache_dir=tmp_path / "c")
    (store / "manifest.json").write_bytes(good)
    with ShardIter(store, 4, shuffle=False, cache_dir=tmp_path / "c") as it:
        assert sum(4 - b.pad for b in it) == 18
        (store / "manifest.json").write_bytes(bad)
        with pytest.raises(LoaderError, match=r"manifest.json: not valid JSON"):
            it.reset()
        (store / "manifest.json").write_bytes(good)
        it.reset()
        assert sum(4 - b.pad for b in it) == 18


def test_dates_the_wrong_way_round_and_dates_that_select_nothing_say_so(tmp_path):
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 9, "2024-01-03": 9})
    with pytest.raises(LoaderError, match=r"dates \(2024-01-03, 2024-01-02\): the start is after the end"):
        ShardIter(store, 4, dates=("2024-01-03", "2024-01-02"), cache_dir=tmp_path / "c")
    with pytest.raises(LoaderError, match=r"no shards selected .*its 2 dates run from 2024-01-02 to 2024-01-03"):
        ShardIter(store, 4, dates=("2025-01-01", None), cache_dir=tmp_path / "c")
    with ShardIter(store, 4, dates=("2024-01-03", "2024-01-03"), shuffle=False, cache_dir=tmp_path / "c") as it:
        assert sorted(i for b in it for i in batch_ids(b)) == list(range(9, 18))


def test_an_empty_part_message_names_the_part_asked_for(tmp_path):
    """``num_parts=1075, part_index=1074`` on 1,074 samples named part 0 and nothing else: a worker whose
    own part is not empty is told so; a worker whose part is empty is named."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 1074})
    with pytest.raises(LoaderError, match=r"^part 0 of 1075 would be empty \(1 of the 1075 parts; this one, "
                                          r"part_index 1074, is not\)"):
        ShardIter(store, 1, num_parts=1075, part_index=1074, cache_dir=tmp_path / "c")
    with pytest.raises(LoaderError, match=r"^part 0 of 1075 would be empty \(1 of the 1075 parts\): 1074 samples"):
        ShardIter(store, 1, num_parts=1075, part_index=0, cache_dir=tmp_path / "c")
    with pytest.raises(LoaderError, match=r"^part 2 of 4 would be empty \(3 of the 4 parts\)"):
        make_store(tmp_path / "one", {"2024-01-02": 1})  # parts 0, 1 and 2 are empty
        ShardIter(tmp_path / "one", 1, num_parts=4, part_index=2, cache_dir=tmp_path / "c")


_PREFETCH = textwrap.dedent("""
    import os, sys, threading, time
    import mxnet as mx
    from loader import LoaderError, ShardIter
    when = sys.argv[3]
    it = ShardIter(sys.argv[1], 4, cache_dir=sys.argv[2])
    inside, closed, calls, real = threading.Event(), threading.Event(), [], it.reader.take
    def take():  # "blocked": the prefetch thread's second batch waits inside next() until close()
        calls.append(1)
        if when == "blocked" and len(calls) == 2:
            inside.set()
            closed.wait(10)
        return real()
    it.reader.take = take
    p = mx.io.PrefetchingIter(it)
    if when == "after":  # the prefetch thread gets the GIL only once close() blocks: after it began
        sys.setswitchinterval(100)
    assert p.iter_next()  # batch 0 taken: the prefetch thread asks for batch 1
    if when == "blocked":
        assert inside.wait(10)
    it.close()
    sys.setswitchinterval(0.005)
    closed.set()
    time.sleep(0.5)
    try:
        it.next()
    except LoaderError as exc:
        print("after close:", exc)
    ended = []
    waiter = threading.Thread(target=lambda: ended.append(p.iter_next()), daemon=True)
    waiter.start()
    waiter.join(10)
    print("wrapper:", ended[0] if ended else "still waiting after 10 s", "calls:", len(calls), flush=True)
    os._exit(0)  # PrefetchingIter.__del__ would join a thread that died
""")


@pytest.mark.parametrize("when", ["after", "blocked"])
def test_closing_under_prefetching_iter_leaves_no_traceback(tmp_path, when):
    """MXNet's PrefetchingIter asks for a batch ahead from its own thread (``after``: once close() has
    happened; ``blocked``: while close() happens): that thread ends as at the end of the data, no
    traceback, and the wrapper ends; a next() in the closing thread is still a LoaderError."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 40})
    script = tmp_path / "prefetch.py"
    script.write_text(_PREFETCH)
    out = subprocess.run([sys.executable, str(script), str(store), str(tmp_path / "c"), when], capture_output=True,
                         text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr
    assert "after close:" in out.stdout and "this ShardIter is closed" in out.stdout, out.stdout
    # "after": the thread never reached the reader; "blocked": it was inside it when close() came
    assert f"wrapper: False calls: {1 if when == 'after' else 2}" in out.stdout, out.stdout


def test_module_fit_with_labels_in_another_order(tmp_path):
    """Module and ShardIter both take ``label_names``, in the same order (the README's advice): a net
    with a head per label trains on labels asked in another order than the schema's."""
    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 16})
    with ShardIter(store, 8, label_names=["b", "a"], cache_dir=tmp_path / "c") as it:
        flat = mx.sym.flatten(mx.sym.var("seq_var"))
        head_b = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(flat, num_hidden=2), mx.sym.var("b"))
        head_a = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(flat, num_hidden=1), mx.sym.var("a"))
        mod = mx.mod.Module(mx.sym.Group([head_b, head_a]), data_names=["seq_var"], label_names=["b", "a"],
                            context=mx.cpu())
        mod.fit(it, num_epoch=1, optimizer_params={"learning_rate": 1e-6})
        assert [d.name for d in it.provide_label] == ["b", "a"]
        assert [lab.shape for lab in mod._exec_group.label_arrays[0][0][1:2]] == [(8, 2)]


def test_a_negative_window_count_is_refused_wherever_an_entry_is_read():
    """From a manifest (above) and from anything else that builds an entry (a saved state's shards)."""
    from shardgen.store.manifest import ShardEntry

    entry = {"date": "2024-01-02", "rec": "2024-01-02.rec", "idx": "2024-01-02.idx", "records": 5, "bytes": 100,
             "sha256": "0" * 64, "windows": -3}
    with pytest.raises(ValueError, match="shard 2024-01-02: windows must be >= 0, got -3"):
        ShardEntry.from_json(entry)
    assert ShardEntry.from_json({**entry, "windows": 9}).samples == 9


@pytest.mark.parametrize("field, value, verify", [("windows", 45, "crc"), ("sha256", "0" * 64, "sha256"),
                                                  ("records", 4, "crc"), ("date", "2024-01-03", "crc")])
def test_a_file_checked_for_one_entry_is_not_taken_as_checked_for_another(tmp_path, field, value, verify):
    """The shard check remembers files it found sound; the review of issue 56 found that the memory
    left out the window count (and would the sha256): checked once with the right entry, the same
    file then passed for an entry saying 45 windows for its 40."""
    import dataclasses
    import os

    from shardgen.errors import ShardError
    from shardgen.format.check import check_shard
    from shardgen.store.manifest import Manifest

    store = tmp_path / "s"
    make_store(store, {"2024-01-02": 40}, pack=8)
    m = Manifest.load(store / "manifest.json")
    entry = m.shards[0]
    fd = os.open(store / entry.rec, os.O_RDONLY)
    try:
        args = (fd, str(store / entry.rec), str(store / entry.idx))
        assert check_shard(*args, entry, m.schema, verify=verify).samples == 40
        with pytest.raises(ShardError):
            check_shard(*args, dataclasses.replace(entry, **{field: value}), m.schema, verify=verify)
        assert check_shard(*args, entry, m.schema, verify=verify).samples == 40  # the right one still passes
    finally:
        os.close(fd)
