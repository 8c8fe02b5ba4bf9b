"""The sharding stage in-process: round trip, generator failures, processors, window, idempotence."""

import datetime as dt
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
from conftest import expected_windows, runs, write_config

from shardgen.config import load_config
from shardgen.format import unpack_samples
from shardgen.produce.build import build
from shardgen.store.manifest import Manifest
from shardgen.store.verify import verify_store

DATES = ["2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05"]
DAY = dt.date(2024, 1, 2)


def read_store(store):
    """Every sample of every published shard in date order, with the stock MXNet reader, as one
    row ``[x, labels, date]`` each (whatever the store's layout)."""
    manifest = Manifest.load(store / "manifest.json")
    out = {}
    for s in manifest.shards:
        r = mx.recordio.MXIndexedRecordIO(str(store / s.idx), str(store / s.rec), "r")
        rows, where = [], []
        for k in r.keys:
            header, _ = mx.recordio.unpack(r.read_idx(k))
            x, labels, days, position = unpack_samples(header.label, manifest.schema)
            rows.append(np.concatenate([x.reshape(len(x), -1), labels, days[:, None]], axis=1))
            where.append(position)
        r.close()
        out[s.date] = np.concatenate(rows)[np.argsort(np.concatenate(where), kind="stable")]
    return manifest, out


@pytest.mark.parametrize("stride, jobs", [(1, 1), (3, 2)])
def test_round_trip_equals_independent_windows(cfg_dir, stride, jobs):
    cfg = load_config(write_config(cfg_dir, stride=stride, jobs=jobs))
    report = build(cfg)
    assert not report.failed and sorted(d.isoformat() for d in report.published) == DATES
    manifest, data = read_store(cfg.store.dir)
    assert [s.date for s in manifest.shards] == DATES and manifest.generation >= 1
    for date in DATES:
        want = expected_windows(date, stride=stride)
        got = data[date]
        np.testing.assert_array_equal(got[:, :-1], want)
        day = (dt.date.fromisoformat(date) - dt.date(1970, 1, 1)).days
        assert (got[:, -1] == day).all()
    assert report.windows == sum(len(v) for v in data.values())
    assert verify_store(cfg.store.dir)[1] == []


def test_rerun_is_idempotent_and_does_not_regenerate(cfg_dir):
    cfg = load_config(write_config(cfg_dir))
    build(cfg)
    gen1 = Manifest.load(cfg.store.dir / "manifest.json").generation
    n_runs = len(runs(cfg_dir))
    report = build(cfg)
    assert report.skipped == 4 and not report.published
    assert Manifest.load(cfg.store.dir / "manifest.json").generation == gen1  # nothing changed
    assert len(runs(cfg_dir)) == n_runs
    # Unpublished but raw present: processed from the raw file, generator not run again.
    (cfg.store.dir / "manifest.json").unlink()
    for p in cfg.store.dir.glob("*.json"):
        p.unlink()
    report = build(cfg)
    assert len(report.published) == 4 and len(runs(cfg_dir)) == n_runs
    report = build(cfg, force=True)
    assert len(report.published) == 4 and len(runs(cfg_dir)) == n_runs + 4


def test_complete_unpublished_shards_are_adopted(cfg_dir):
    cfg = load_config(write_config(cfg_dir))
    build(cfg)
    (cfg.store.dir / "manifest.json").unlink()
    n_runs = len(runs(cfg_dir))
    report = build(cfg)
    assert len(report.published) == 4 and len(runs(cfg_dir)) == n_runs
    assert verify_store(cfg.store.dir)[1] == []


@pytest.mark.parametrize("mode, match", [
    ("fail", r"2024-01-03: generator exited with code 3; stderr: line one \| fake generator exploded"),
    ("garbage", r"2024-01-03: .*2024-01-03.npy: not a readable .npy"),
    ("truncated", r"2024-01-03: .*not a readable .npy"),
    ("empty", r"2024-01-03: .*not a readable .npy"),
    ("noout", r"2024-01-03: .*wrote no output file"),
    ("3d", r"2024-01-03: .*expected a 2-D array"),
    ("int", r"2024-01-03: .*expected float32/float64"),
    ("nan", r"2024-01-03: non-finite value in 'seq_var' at window 23"),
])
def test_bad_generator_fails_that_date_only(cfg_dir, mode, match):
    cfg = load_config(write_config(cfg_dir, modes={"2024-01-03": mode}, jobs=2))
    report = build(cfg)
    assert [d.isoformat() for d, _ in report.failed] == ["2024-01-03"]
    assert report.failed[0][1].count("\n") == 0
    assert re.search(match, report.failed[0][1]), report.failed[0][1]
    manifest = Manifest.load(cfg.store.dir / "manifest.json")
    assert [s.date for s in manifest.shards] == ["2024-01-02", "2024-01-04", "2024-01-05"]


def test_hanging_generator_is_killed_with_its_children(cfg_dir):
    import threading

    cfg = load_config(write_config(cfg_dir, modes={"2024-01-03": "hang"}, timeout=1.5, retries=1))
    children = cfg_dir / "modes.json.children"
    seen = {}  # pid -> command line, of each child observed running while the build ran

    def watch():
        while not done.is_set():
            for pid in (children.read_text().split() if children.exists() else []):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if str(cfg_dir / "modes.json").encode() in argv:
                    seen.setdefault(int(pid), argv)
            time.sleep(0.05)

    done = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        report = build(cfg, dates=[dt.date(2024, 1, 3)])
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - t0 < 15
    assert "timed out after 1.5s and was killed" in report.failed[0][1]
    assert "(after 2 attempts)" in report.failed[0][1]
    assert len(seen) == 2, f"expected one running child per attempt, saw {seen}"
    left = [pid for pid in seen if Path(f"/proc/{pid}").exists()
            and Path(f"/proc/{pid}/cmdline").read_bytes()]  # a zombie has an empty command line
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the generator's child survived the timeout"


def test_retries_with_backoff_then_success(cfg_dir):
    cfg = load_config(write_config(cfg_dir, modes={"2024-01-02": "flaky:2"}, retries=2, backoff=0.05))
    report = build(cfg, dates=[dt.date(2024, 1, 2)])
    assert not report.failed and runs(cfg_dir).count("2024-01-02") == 3
    cfg = load_config(write_config(cfg_dir / "b", modes={"2024-01-02": "flaky:5"}, retries=1))
    report = build(cfg, dates=[dt.date(2024, 1, 2)])
    assert "code 4" in report.failed[0][1] and runs(cfg_dir / "b").count("2024-01-02") == 2


def test_zero_windows_reported_and_remembered(cfg_dir):
    cfg = load_config(write_config(cfg_dir, modes={"2024-01-04": "few"}))
    report = build(cfg)
    assert [d.isoformat() for d, _ in report.empty] == ["2024-01-04"]
    assert "fewer than time_steps=5" in report.empty[0][1]
    assert not (cfg.store.dir / "2024-01-04.rec").exists()
    assert len(Manifest.load(cfg.store.dir / "manifest.json").shards) == 3
    n = len(runs(cfg_dir))
    (cfg.store.dir / "manifest.json").unlink()
    report = build(cfg)
    assert len(runs(cfg_dir)) == n and [d.isoformat() for d, _ in report.empty] == ["2024-01-04"]


@pytest.mark.parametrize("proc, match", [
    ("procs:bad_shape", r"2024-01-02: x must have shape \(n, 5, 4\), got \(26, 4, 4\)"),
    ("procs:wrong_dtype", r"2024-01-02: x must be float32, got float64"),
    ("procs:missing_label", r"2024-01-02: labels must be exactly \['a', 'b'\], got \['a'\]"),
    ("procs:raises", r"2024-01-02: processor raised RuntimeError at \S+/tests/procs\.py:28 \(in raises\): "
                     r"boom in user code"),
    ("procs:nan_label", r"2024-01-02: non-finite value in 'a' at window 2"),
])
def test_bad_processors(cfg_dir, proc, match):
    cfg = load_config(write_config(cfg_dir, process=proc, stride=None))
    report = build(cfg, dates=[dt.date(2024, 1, 2)])
    assert re.search(match, report.failed[0][1]), report.failed[0][1]
    assert not (cfg.store.dir / "2024-01-02.rec").exists()


def test_window_retires_oldest_without_deleting(cfg_dir):
    cfg = load_config(write_config(cfg_dir, window=2))
    build(cfg, end=dt.date(2024, 1, 3))
    build(cfg, start=dt.date(2024, 1, 4), end=dt.date(2024, 1, 5))
    m = Manifest.load(cfg.store.dir / "manifest.json")
    assert [s.date for s in m.shards] == ["2024-01-04", "2024-01-05"]
    assert [r.date for r in m.retired] == ["2024-01-02", "2024-01-03"]
    assert all(r.retired_generation == m.generation for r in m.retired)
    assert (cfg.store.dir / "2024-01-02.rec").exists()  # deleting is gc's job
    # A retired date is done: a later build does not bring it back.
    report = build(cfg)
    assert report.skipped == 4 and not report.published


def test_jobs_1_runs_one_generator_at_a_time_and_the_next_one_while_a_date_is_written(cfg_dir):
    """jobs=1: generators never overlap each other, but the next date's generator runs while a
    date's windows are cut and written (a build costs little more than its generator alone)."""
    log = cfg_dir / "gen.log"
    path = write_config(cfg_dir, start="2024-01-02", end="2024-01-04", jobs=1, process="slow_proc:process")
    log.write_text("")
    (cfg_dir / "slow_proc.py").write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path
        from shardgen.process import sliding_windows

        def process(raw, date, **kw):
            # the next weekday's generator starts while this date is processed
            nxt = {{"2024-01-02": "2024-01-03", "2024-01-03": "2024-01-04"}}.get(date.isoformat())
            deadline = time.monotonic() + 10
            while nxt and "start " + nxt not in Path({str(log)!r}).read_text():
                if time.monotonic() > deadline:
                    raise RuntimeError("the next date's generator did not start while " + str(date) + " was processed")
                time.sleep(0.02)
            return sliding_windows(raw, date, **kw)
    """))
    text = path.read_text()
    gen = text[text.index("command = [") + len("command = ["):text.index("]\noutput")]
    wrapped = (f'command = ["/bin/sh", "-c", "echo start $0 >> {log}; sleep 0.2; \\"$@\\"; rc=$?; '
               f'echo end $0 >> {log}; exit $rc", "{{date}}", {gen}]\noutput')
    path.write_text(text[:text.index("command = [")] + wrapped + text[text.index("]\noutput") + len("]\noutput"):])
    report = build(load_config(path))
    assert not report.failed, report.failed
    assert len(report.published) == 3
    events = log.read_text().split("\n")
    kinds = [e.split()[0] for e in events if e]
    assert kinds == ["start", "end"] * 3, events  # never two generators at once


def test_jobs_1_a_bad_sidecar_of_a_later_date_fails_that_date_only(cfg_dir):
    """The date looked at ahead (is its shard complete?) fails alone, as it did before (review)."""
    cfg = load_config(write_config(cfg_dir, start="2024-01-02", end="2024-01-05", jobs=1))
    (cfg_dir / "shards").mkdir(parents=True, exist_ok=True)
    (cfg_dir / "shards" / "2024-01-03.json").write_text("{not json")
    report = build(cfg)
    assert sorted(report.published) == [dt.date(2024, 1, 2), dt.date(2024, 1, 4), dt.date(2024, 1, 5)]
    assert [d for d, _ in report.failed] == [dt.date(2024, 1, 3)]


def test_jobs_1_stopped_early_abandons_the_generator_running_ahead(cfg_dir):
    cfg = load_config(write_config(cfg_dir, start="2024-01-02", end="2024-01-05", jobs=1,
                                   modes={"*": "slow:4"}))
    t0 = time.monotonic()
    report = build(cfg, should_stop=lambda: True)
    took = time.monotonic() - t0
    assert report.published == [dt.date(2024, 1, 2)]
    assert took < 7, f"waited {took:.1f}s for the generator running ahead"


def test_jobs_1_holds_at_most_the_next_dates_raw_array(cfg_dir):
    """The pipeline lets go of each date's raw array once the date is written (review: a build
    held every date's raw array to its end)."""
    path = write_config(cfg_dir, start="2024-01-02", end="2024-01-12", jobs=1, process="count_raw:process")
    (cfg_dir / "count_raw.py").write_text(textwrap.dedent("""
        import gc, weakref
        from shardgen.process import sliding_windows
        REFS, MOST = [], [0]

        def process(raw, date, **kw):
            gc.collect()
            MOST[0] = max(MOST[0], sum(r() is not None for r in REFS))
            REFS.append(weakref.ref(raw))
            return sliding_windows(raw, date, **kw)
    """))
    report = build(load_config(path))
    assert len(report.published) == 9 and not report.failed
    import count_raw

    assert count_raw.MOST[0] <= 1, f"{count_raw.MOST[0]} earlier raw arrays alive while a date was processed"


def test_failing_generators_leave_no_descriptors_and_any_descriptor_number_works(cfg_dir):
    """A build of many failing dates in a process that already has over 1024 descriptors open:
    each date fails alone (select() refused fds >= 1024; pidfds were left to the GC)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        cfg = load_config(write_config(cfg_dir, start="2024-01-02", end="2024-03-29", jobs=1,
                                       modes={"*": "fail", "2024-01-02": "ok"}))
        before = len(os.listdir("/proc/self/fd"))
        report = build(cfg)
        after = len(os.listdir("/proc/self/fd"))
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert report.published == [dt.date(2024, 1, 2)] and len(report.failed) == 63
    assert after - before <= 2, f"{after - before} descriptors left open by {len(report.failed)} failed dates"


def test_a_raw_value_that_overflows_float32_says_so():
    """1e300 in a float64 raw file is finite there; the cast made it inf, read as 'non-finite'
    (issue 44). Now the row, the column and the cast are named."""
    import datetime as dt

    import numpy as np

    from shardgen.errors import ProcessorError
    from shardgen.format import LabelSpec
    from shardgen.process import sliding_windows

    raw = np.zeros((20, 4))
    raw[7, 2] = -1e300
    with pytest.raises(ProcessorError, match=r"^2024-01-02: raw value -1e\+300 at row 7, column 2 overflows float32"):
        sliding_windows(raw, dt.date(2024, 1, 2), time_steps=3, num_inputs=3, labels=[LabelSpec("a", 1)])
    raw[7, 2] = np.nan  # a NaN is no overflow: the window check names it
    assert sliding_windows(raw, dt.date(2024, 1, 2), time_steps=3, num_inputs=3, labels=[LabelSpec("a", 1)])


def test_an_overflow_in_an_object_array_is_named_too():
    import datetime as dt

    import numpy as np

    from shardgen.errors import ProcessorError
    from shardgen.format import LabelSpec
    from shardgen.process import sliding_windows

    raw = np.zeros((20, 4)).astype(object)
    raw[3, 1] = 1e39
    with pytest.raises(ProcessorError, match=r"raw value 1e\+39 at row 3, column 1 overflows float32"):
        sliding_windows(raw, dt.date(2024, 1, 2), time_steps=3, num_inputs=3, labels=[LabelSpec("a", 1)])


def test_a_raw_file_that_fails_processing_is_generated_again_once_and_named(cfg_dir):
    """Issue 54: a NaN written once blocked its date for ever (the raw file exists, so a rebuild
    after the generator was fixed read it again), and the message did not name the file. Now the
    message names the raw file and what to do, and a raw file already there that fails processing
    is regenerated once: the fixed generator's output is published."""
    from shardgen.produce.pipeline import produce

    cfg = load_config(write_config(cfg_dir, end="2024-01-02", modes={"2024-01-02": "nan"}))
    raw = cfg_dir / "raw" / "2024-01-02.npy"
    report = build(cfg)
    assert len(report.failed) == 1 and runs(cfg_dir) == ["2024-01-02"]
    assert re.fullmatch(rf"2024-01-02: non-finite value in 'seq_var' at window \d+ \(row \d+; expected finite "
                        rf"float32\); raw file {re.escape(str(raw))}, written by the generator just now: fix the "
                        r"generator \(every build runs it again for this date\)", report.failed[0][1])
    report = build(cfg)  # the generator still writes NaN: run again once, named so
    assert runs(cfg_dir) == ["2024-01-02"] * 2
    assert f"raw file {raw}, written again by the generator after the file there failed too" in report.failed[0][1]
    dropped = produce(cfg, DAY, raw_only=True)  # a dropped-in file is never regenerated: say how to
    assert dropped.status == "failed" and runs(cfg_dir) == ["2024-01-02"] * 2
    assert dropped.message.endswith(f"; raw file {raw}: replace it with one that passes (or regenerate it: "
                                    "shardgen build --force --start 2024-01-02 --end 2024-01-02)")
    (cfg_dir / "modes.json").write_text("{}")  # the generator is fixed
    report = build(cfg)
    assert report.published == [DAY] and not report.failed and runs(cfg_dir) == ["2024-01-02"] * 3
    np.testing.assert_array_equal(read_store(cfg.store.dir)[1]["2024-01-02"][:, :-1], expected_windows("2024-01-02"))
