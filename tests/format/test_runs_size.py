"""Layout ``runs`` at its default size (issue 65, item 4): a store holds each raw row at most 1.3
times (a record of 64 windows repeated the 59 rows it shares with the next: 1.8x), stores written
with the old pack stay readable end to end, and a config left at the default tells how to go on
writing a store of the old one."""

import datetime as dt
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import shardgen_cli, write_config

from benchmarks.memmap import build_memmap
from loader import ShardIter
from shardgen.config import load_config
from shardgen.format import LabelSpec, Layout, Schema
from shardgen.process import sliding_windows
from shardgen.produce.writer import write_store
from shardgen.store.manifest import Manifest

T, C = 60, 32  # the question's shapes (the ten-year store: 2,000 rows a date)
LABELS = [LabelSpec("bd_return", 1), LabelSpec("eval_y", 4)]
OLD = Layout("runs", 64, T + 63)  # the default before issue 65


def config_schema(folder: Path, store_lines: str = "", process_lines: str = "") -> Schema:
    """The schema a real ``shardgen.toml`` of these shapes gives (what ``shardgen build`` writes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shardgen.toml").write_text(f"""
[generator]
command = ["gen", "{{date}}"]
output = "raw/{{date}}.npy"
[dates]
start = "2024-01-02"
[schema]
time_steps = {T}
num_inputs = {C}
labels = [{{ name = "bd_return", width = 1 }}, {{ name = "eval_y", width = 4 }}]
[process]
function = "shardgen.process:sliding_windows"
{process_lines}
[store]
dir = "shards"
{store_lines}
""")
    return load_config(folder / "shardgen.toml").schema


def raw_for(i: int, rows: int) -> np.ndarray:
    """A date's raw rows: C inputs, then 5 label columns; input 0 names the date and the row."""
    raw = np.random.default_rng(i).standard_normal((rows, C + 5)).astype(np.float32)
    raw[:, 0] = i * 100_000 + np.arange(rows)
    return raw


def write(store: Path, schema: Schema, rows: list) -> list:
    dates = [dt.date(2024, 1, 2) + dt.timedelta(days=i) for i in range(len(rows))]
    specs = [(d, sliding_windows(raw_for(i, r), d, time_steps=T, num_inputs=C, labels=LABELS), None)
             for i, (d, r) in enumerate(zip(dates, rows))]
    write_store(store, schema, specs, fsync=False)
    return dates


def stored_over_raw(store: Path, tmp_path: Path) -> float:
    """The store's bytes (.rec and .idx) over the raw rows': every row's C inputs once and each
    window's labels and day, as ``benchmarks.memmap.build_memmap`` saves them for the memmap loop."""
    stored = sum(p.stat().st_size for p in store.iterdir() if p.suffix in (".rec", ".idx"))
    folder = build_memmap(store, tmp_path / f"memmap-{store.name}")
    rows, labels = np.load(folder / "rows.npy"), np.load(folder / "labels.npy")
    m = Manifest.load(store / "manifest.json")
    assert len(labels) == m.samples and labels.shape[1] == 1 + 4 + 1  # bd_return, eval_y, day
    assert rows.shape == (3 * 2000, C)  # every row of every date, once
    return stored / (rows.nbytes + labels.nbytes)


def test_the_default_runs_layout_stores_each_raw_row_at_most_1_3_times(tmp_path):
    default = config_schema(tmp_path / "cfg")
    assert default.layout == Layout("runs", 512, T + 511)
    write(tmp_path / "default", default, [2000] * 3)
    write(tmp_path / "old", Schema.create(time_steps=T, num_inputs=C, data_name="seq_var", labels=LABELS,
                                          layout=OLD), [2000] * 3)
    new, old = stored_over_raw(tmp_path / "default", tmp_path), stored_over_raw(tmp_path / "old", tmp_path)
    assert new <= 1.3, f"the default layout stores {new:.2f}x the raw rows"
    assert old > 1.3, f"pack 64 stored {old:.2f}x the raw rows: this test could not fail"
    assert Manifest.load(tmp_path / "default" / "manifest.json").schema.record_floats * 4 < 100_000  # ~85 kB


@pytest.mark.parametrize("stride, pack, run_rows", [(1, 512, T + 511), (2, 256, T + 255 * 2), (3, 171, T + 170 * 3),
                                                   (600, 1, T)])
def test_the_default_pack_holds_about_512_windows_of_rows_at_any_stride(tmp_path, stride, pack, run_rows):
    schema = config_schema(tmp_path, process_lines=f"stride = {stride}")
    assert (schema.layout.kind, schema.pack, schema.layout.run_rows) == ("runs", pack, run_rows)


def test_a_set_pack_and_other_layouts_keep_their_knobs(tmp_path):
    assert config_schema(tmp_path / "a", "pack = 64", "stride = 3").layout == Layout("runs", 64, T + 63 * 3)
    assert config_schema(tmp_path / "b", "pack = 64\nrun_rows = 200").layout == Layout("runs", 64, 200)
    assert config_schema(tmp_path / "c", 'layout = "windows"', "stride = 3").layout == Layout("windows", 8)


def expected(dates: list, rows: list) -> Counter:
    out = Counter()
    for i, (d, r) in enumerate(zip(dates, rows)):
        x, labs = sliding_windows(raw_for(i, r), d, time_steps=T, num_inputs=C, labels=LABELS).as_windows(T)
        day = np.full((len(x), 1), (d - dt.date(1970, 1, 1)).days, np.float32)
        out.update(r.tobytes() for r in np.concatenate([x.reshape(len(x), -1), labs["bd_return"], labs["eval_y"], day],
                                                         axis=1))
    return out


@pytest.mark.parametrize("name", ["old pack 64", "default"])
def test_stores_of_the_old_and_the_new_pack_read_back_every_window_once(tmp_path, name):
    """ShardIter end to end (MXNet's native reader) over a store of each pack; the 100-row date
    (41 windows) is one record of the default pack."""
    schema = config_schema(tmp_path / "cfg", "pack = 64" if name.startswith("old") else "")
    assert schema.layout == (OLD if name.startswith("old") else Layout("runs", 512, T + 511))
    rows = [700, 100, 1300]
    dates = write(tmp_path / "store", schema, rows)
    m = Manifest.load(tmp_path / "store" / "manifest.json")
    assert [s.records for s in m.shards] == [-(-(r - T + 1) // schema.pack) for r in rows]
    want, seen = expected(dates, rows), Counter()
    with ShardIter(tmp_path / "store", 256, shuffle=True, seed=1, cache_dir=tmp_path / "cache") as it:
        for epoch in range(2):
            seen.clear()
            for b in it:
                n = b.data[0].shape[0] - b.pad
                cols = [b.data[0].asnumpy().reshape(len(b.data[0]), -1)] + \
                       [lab.asnumpy().reshape(len(lab), -1) for lab in b.label]
                seen.update(r.tobytes() for r in np.concatenate(cols, axis=1)[:n])
            assert seen == want, f"epoch {epoch}: exactly the raw data's windows, each once"
            it.reset()


def test_a_config_left_at_the_default_says_how_to_go_on_writing_a_store_of_the_old_pack(tmp_path):
    """``shardgen build`` into a store written with pack 64 by a config that does not set it: one
    message naming the settings that keep the store; with them set, the build adds its dates."""
    from conftest import C as CC
    from conftest import T as TT

    folder = tmp_path / "proj"
    cfg = write_config(folder, rows=30)
    old = Layout("runs", 64, TT + 63)
    schema = Schema.create(time_steps=TT, num_inputs=CC, data_name="seq_var",
                           labels=[LabelSpec("a", 1), LabelSpec("b", 2)], layout=old)
    raw = np.random.default_rng(0).standard_normal((30, CC + 3)).astype(np.float32)
    write_store(folder / "shards", schema, [(dt.date(2023, 12, 29), sliding_windows(
        raw, dt.date(2023, 12, 29), time_steps=TT, num_inputs=CC, labels=schema.labels[:-1]), None)], fsync=False)
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 2, r.stderr
    said = " ".join(r.stderr.split())
    assert "store.pack 64 -> 512" in said and "use a new store.dir" in said
    assert f"or set store.pack = 64 and store.run_rows = {TT + 63} under [store] to go on writing this one" in said
    assert "Traceback" not in r.stderr and len(Manifest.load(folder / "shards" / "manifest.json").shards) == 1
    cfg.write_text(cfg.read_text().replace('dir = "shards"', f'dir = "shards"\npack = 64\nrun_rows = {TT + 63}'))
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 0, r.stderr
    m = Manifest.load(folder / "shards" / "manifest.json")
    assert m.schema.layout == old and [s.date for s in m.shards][0] == "2023-12-29" and len(m.shards) == 5


def test_synthetic_store_writes_dates_of_random_rows_in_the_default_layout(tmp_path):
    """``benchmarks.stores.synthetic_store`` (the bench's ten-year store, 2,500 dates x 2,000 rows):
    weekdays, every stride-1 window of each date's rows, the layout a config left at the default gives."""
    from benchmarks.stores import synthetic_store

    m = synthetic_store(tmp_path / "syn", 3, 2000)
    assert m.schema == config_schema(tmp_path / "cfg")
    assert [s.date for s in m.shards] == ["2015-01-05", "2015-01-06", "2015-01-07"]
    assert [s.samples for s in m.shards] == [2000 - T + 1] * 3 and [s.records for s in m.shards] == [4] * 3
    assert stored_over_raw(tmp_path / "syn", tmp_path) <= 1.3
    rows = np.load(tmp_path / "memmap-syn" / "rows.npy")
    assert 0.9 < rows.std() < 1.1 and not np.array_equal(rows[:2000], rows[2000:4000])  # random, a date's own
    fri = synthetic_store(tmp_path / "week", 6, 100)
    assert [s.date for s in fri.shards][-2:] == ["2015-01-09", "2015-01-12"]  # Friday, then Monday
