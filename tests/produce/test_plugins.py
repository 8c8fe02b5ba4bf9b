"""Processor plug-ins next to the config: found with no PYTHONPATH, in every worker, and import
errors that say where."""

import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import runs, shardgen_cli, write_config

from shardgen.config import load_config
from shardgen.errors import ConfigError
from shardgen.produce.build import build
from shardgen.store.manifest import Manifest

PLUGIN = """
from shardgen.process import sliding_windows

def windows(raw, date, *, time_steps, num_inputs, labels, offset):
    x, labs = sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels, stride=2)
    return x, {{**labs, "a": labs["a"] + offset + {bias}}}
"""


def plugin_config(folder, *, bias=0, jobs=1, name="myproc", **kw):
    cfg = write_config(folder, process=f"{name}:windows", stride=None, jobs=jobs, **kw)
    cfg.write_text(cfg.read_text().replace("[process]\n", "[process]\noffset = 1000.0\n"))
    (folder / f"{name}.py").write_text(PLUGIN.format(bias=bias))
    return cfg


def first_labels(store, date="2024-01-02"):
    import mxnet as mx
    r = mx.recordio.MXIndexedRecordIO(str(store / f"{date}.idx"), str(store / f"{date}.rec"), "r")
    header, _ = mx.recordio.unpack(r.read_idx(0))
    r.close()
    from shardgen.format import unpack_samples
    from shardgen.store.manifest import Manifest

    x, labels, days, position = unpack_samples(header.label, Manifest.load(store / "manifest.json").schema)
    first = int(position.argmin())  # the date's first window, as a one-sample record lays it out
    return np.concatenate([x[first].ravel(), labels[first], days[first:first + 1]])


@pytest.mark.parametrize("jobs", [1, 2])
def test_cli_build_finds_the_plugin_next_to_the_config_from_another_folder(tmp_path, jobs):
    cfg = plugin_config(tmp_path / "proj", jobs=jobs)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = shardgen_cli("build", "-c", cfg, cwd=elsewhere)  # cwd is neither the config's folder nor on sys.path
    assert r.returncode == 0, r.stderr
    assert "published 4 dates" in r.stdout
    m = Manifest.load(tmp_path / "proj" / "shards" / "manifest.json")
    assert [s.samples for s in m.shards] == [13] * 4  # 26 windows, stride 2 (the plug-in's own)
    assert first_labels(tmp_path / "proj" / "shards")[5 * 4] > 900  # label a carries the plug-in's offset


@pytest.mark.parametrize("jobs", [1, 2])
def test_two_configs_with_same_named_plugins_in_one_process(tmp_path, jobs):
    """Each config gets its own myproc.py (in this process and in reused loky workers); sys.path is left as it was."""
    before = list(sys.path)
    a = load_config(plugin_config(tmp_path / "a", bias=0, jobs=jobs))
    b = load_config(plugin_config(tmp_path / "b", bias=500, jobs=jobs))
    for cfg in (a, b, a):
        assert not build(cfg, dates=[dt.date(2024, 1, 2), dt.date(2024, 1, 3)], force=True).failed
    assert sys.path == before
    a_label = first_labels(a.store.dir)[5 * 4]
    b_label = first_labels(b.store.dir)[5 * 4]
    assert b_label - a_label == pytest.approx(500)


def test_syntax_error_names_file_and_line(tmp_path):
    cfg = write_config(tmp_path / "proj", process="myproc:windows", stride=None)
    (tmp_path / "proj" / "myproc.py").write_text("import numpy\n\ndef windows(raw, date:\n    pass\n")
    r = shardgen_cli("build", "-c", cfg, cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"syntax error in {tmp_path / 'proj' / 'myproc.py'}:3" in lines[0]
    assert "No module named" not in r.stderr and runs(tmp_path / "proj") == []


@pytest.mark.parametrize("body, match", [
    ("X = 1\nraise RuntimeError('no licence')\n", r"raised RuntimeError at {file}:2: no licence"),
    ("import numpy\nimport not_installed_anywhere\n",
     r"importing it failed at {file}:2: No module named 'not_installed_anywhere'"),
])
def test_import_time_errors_name_the_file(tmp_path, body, match):
    folder = tmp_path / "proj"
    cfg = write_config(folder, process="brokenproc:windows", stride=None)
    (folder / "brokenproc.py").write_text(body)
    with pytest.raises(ConfigError, match=match.format(file=folder / "brokenproc.py")):
        load_config(cfg)
    assert "brokenproc" not in sys.modules


KEYED = """
from shardgen.process import sliding_windows

def kw(raw, date, **options):
    return sliding_windows(raw, date, **options)

def offset(raw, date, *, time_steps, num_inputs, labels, offset):
    return sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels)

def no_labels(raw, date, *, time_steps, num_inputs):
    raise AssertionError("never called")

def tuples(raw, date, *, time_steps, num_inputs, labels):
    return sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels).as_windows()
"""


CALLED = "cannot be called as shardgen calls it (raw, date, time_steps=, num_inputs=, labels=, the [process] keys)"


@pytest.mark.parametrize("function, keys, message", [
    ("shardgen.process:sliding_windows", "strid = 2",
     "process.strid: 'shardgen.process:sliding_windows' takes no option 'strid' (its options: stride)"),
    ("keyed:offset", "offset = 1\nofset = 2",
     "process.ofset: 'keyed:offset' takes no option 'ofset' (its options: offset)"),
    ("keyed:kw", "time_steps = 3",
     "process.time_steps: shardgen passes time_steps to the processor itself; remove the key"),
    ("keyed:offset", "", f"process.function 'keyed:offset' {CALLED}: missing a required argument: 'offset'"),
    ("keyed:no_labels", "",
     f"process.function 'keyed:no_labels' {CALLED}: got an unexpected keyword argument 'labels'"),
])
def test_process_keys_are_checked_against_the_processor_when_the_config_loads(tmp_path, function, keys, message):
    """Before any generator runs: a key the processor cannot take (a typo) is exit 2, naming it."""
    cfg = write_config(tmp_path / "proj", process=function, stride=None)
    cfg.write_text(cfg.read_text().replace("[process]\n", f"[process]\n{keys}\n"))
    (tmp_path / "proj" / "keyed.py").write_text(KEYED)
    r = shardgen_cli("build", "-c", cfg, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, f"shardgen: error: {cfg.resolve()}: {message}\n")
    assert runs(tmp_path / "proj") == [] and not (tmp_path / "proj" / "shards").exists()


def test_keys_only_a_processor_s_options_take_are_warned_about_once(tmp_path):
    cfg = write_config(tmp_path / "proj", process="keyed:kw", stride=None, jobs=2)
    cfg.write_text(cfg.read_text().replace("[process]\n", "[process]\nstride = 2\n")
                   .replace("[store]\n", '[store]\nlayout = "runs"\n'))
    (tmp_path / "proj" / "keyed.py").write_text(KEYED)
    r = shardgen_cli("build", "-c", cfg, cwd=tmp_path)
    assert r.returncode == 0 and "published 4 dates" in r.stdout
    assert r.stderr == ("shardgen: warning: process.stride: not named by 'keyed:kw', only passed in its **options "
                        "(it names no options); a typo?\n")
    m = Manifest.load(tmp_path / "proj" / "shards" / "manifest.json")
    assert [s.samples for s in m.shards] == [13] * 4  # stride 2 did reach the processor


@pytest.mark.parametrize("function, layout, kind, said", [
    ("keyed:offset", "", "windows", True),  # a RunSpec in the plug-in's default layout: said once
    ("keyed:offset", 'layout = "windows"', "windows", False),  # the config's layout wins, and is not questioned
    ("keyed:offset", 'layout = "runs"', "runs", False),
    ("keyed:tuples", "", "windows", False),  # whole windows: the default suits them
    ("shardgen.process:sliding_windows", "", "runs", False),  # the default processor's default layout
])
def test_a_run_spec_in_the_default_windows_layout_is_said_once(tmp_path, function, layout, kind, said):
    cfg = write_config(tmp_path / "proj", process=function, stride=None, jobs=2)
    cfg.write_text(cfg.read_text().replace("[process]\n", "[process]\n" + "offset = 1\n" * (function == "keyed:offset"))
                   .replace("[store]\n", f"[store]\n{layout}\n"))
    (tmp_path / "proj" / "keyed.py").write_text(KEYED)
    r = shardgen_cli("build", "-c", cfg, cwd=tmp_path)
    assert r.returncode == 0 and "published 4 dates" in r.stdout, r.stderr
    m = Manifest.load(tmp_path / "proj" / "shards" / "manifest.json")
    assert m.schema.layout.kind == kind and [s.samples for s in m.shards] == [26] * 4
    lines = r.stderr.splitlines()
    assert len(lines) == said, r.stderr
    if said:
        assert re.fullmatch(r"shardgen: warning: 2024-01-0\d: 'keyed:offset' returned a RunSpec, stored in the layout "
                            r"'windows' \(store.layout is not set: the default for a plug-in\); store.layout = 'runs' "
                            r"stores each row once .*", lines[0]), lines[0]


def test_the_config_folder_wins_over_an_installed_module(tmp_path):
    # dask is installed (dev extra) and a loky build never imports it: the config's dask.py wins.
    cfg = plugin_config(tmp_path / "proj", name="dask")
    r = shardgen_cli("build", "-c", cfg, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert first_labels(tmp_path / "proj" / "shards")[5 * 4] > 900


def test_a_plugin_named_like_a_module_already_in_use_is_refused(tmp_path):
    cfg = plugin_config(tmp_path / "proj", name="json")
    with pytest.raises(ConfigError, match=r"proj/json.py has the name of the module 'json' this process already "
                                          r"uses .*rename the plug-in file"):
        load_config(cfg)
    import json
    assert json.dumps([1]) == "[1]"


@pytest.mark.slow
def test_a_remote_dask_cluster_gets_the_plugin_uploaded(tmp_path, monkeypatch):
    """A LocalCluster's workers share our filesystem: the plug-in is moved out of the config folder
    once it is uploaded, so a worker finds it only if the upload happened."""
    from dask.distributed import Client, LocalCluster

    import shardgen.produce.cluster as cluster_mod
    from shardgen.produce.cluster import _close_clients

    cfg_path = plugin_config(tmp_path / "proj", jobs=2)
    real_ship = cluster_mod.ship_plugin
    hidden = tmp_path / "hidden"

    def ship_then_hide(client, scheduler, plugin):
        real_ship(client, scheduler, plugin)
        hidden.mkdir()
        plugin.rename(hidden / plugin.name)  # the config folder no longer holds it

    monkeypatch.setattr(cluster_mod, "ship_plugin", ship_then_hide)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        cfg_path.write_text(cfg_path.read_text().replace(
            'backend = "loky"', f'backend = "dask"\nscheduler = "{cluster.scheduler_address}"'))
        report = build(load_config(cfg_path))
        assert not report.failed and len(report.published) == 4
        assert (hidden / "myproc.py").exists() and not (tmp_path / "proj" / "myproc.py").exists()
        shipped = client.run(lambda dask_worker: sorted(p.name for p in __import__("pathlib").Path(
            dask_worker.local_directory).glob("*.py")))
        assert all("myproc.py" in names for names in shipped.values())
        _close_clients()  # shardgen's cached client to this scheduler, before the cluster goes
    m = Manifest.load(tmp_path / "proj" / "shards" / "manifest.json")
    assert [s.samples for s in m.shards] == [13] * 4
    assert np.all(first_labels(tmp_path / "proj" / "shards")[5 * 4] > 900)


def note_pids(cfg_path, pids):
    """The plug-in of ``cfg_path`` appends the pid of the process that runs it to ``pids``."""
    with open(cfg_path.parent / "myproc.py", "a") as fh:
        fh.write(f"\n_windows = windows\n\ndef windows(raw, date, **kw):\n    import os\n"
                 f"    open({str(pids)!r}, 'a').write(str(os.getpid()) + chr(10))\n"
                 f"    return _windows(raw, date, **kw)\n")


def use_dask(cfg_path, scheduler):
    text = cfg_path.read_text()
    cfg_path.write_text(text.replace('backend = "loky"', f'backend = "dask"\nscheduler = "{scheduler}"'))


def test_a_dask_build_keeps_at_most_jobs_dates_on_the_cluster():
    """A remote scheduler with more worker threads than ``jobs``: a task starts when one ends."""
    import operator

    from dask.distributed import LocalCluster

    from shardgen.produce.cluster import _close_clients, run_on_cluster

    pulled = []

    def tasks():
        for i in range(6):
            pulled.append(i)
            yield operator.neg, (i,), {}

    with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=None) as cluster:
        try:
            results = run_on_cluster(tasks(), cluster.scheduler_address, 2)
            first = next(results)
            assert len(pulled) == 3  # two submitted, then one more as the first finished
            assert sorted([first, *results]) == [-5, -4, -3, -2, -1, 0]
        finally:
            _close_clients()


@pytest.mark.slow
def test_the_dask_backend_runs_the_dates_on_the_workers(tmp_path):
    """One worker (joblib's Dask backend ran every date in the calling process then)."""
    from dask.distributed import Client, LocalCluster

    from shardgen.produce.cluster import _close_clients

    cfg_path = plugin_config(tmp_path / "proj", jobs=2)
    pids = tmp_path / "pids.txt"
    note_pids(cfg_path, pids)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        use_dask(cfg_path, cluster.scheduler_address)
        try:
            report = build(load_config(cfg_path))
            workers = set(client.run(lambda: __import__("os").getpid()).values())
        finally:
            _close_clients()
    assert not report.failed and len(report.published) == 4
    ran = [int(p) for p in pids.read_text().split()]
    assert len(ran) == 4 and set(ran) == workers and os.getpid() not in ran, f"ran in {ran}, workers {workers}"


@pytest.mark.slow
def test_a_dask_worker_dying_on_a_date_fails_that_date_only(tmp_path):
    """A processor that kills its worker process (OOM killer, a segfault) on one date: Dask gives up
    on the task (KilledWorker, after allowed-failures retries); that date fails with one line, to be
    tried again, and the others are published (it came out of build as a traceback)."""
    import dask
    import distributed  # noqa: F401  its defaults in dask's config first: set() below would

    # otherwise create the 'distributed' key and delete all of it on exit (every later Dask test in
    # this process then failed with KeyError: 'distributed'; found by SHARDGEN_TEST_SHUFFLE=1)
    from shardgen.produce.cluster import _close_clients

    cfg_path = plugin_config(tmp_path / "proj", jobs=2)
    with open(cfg_path.parent / "myproc.py", "a") as fh:
        fh.write("\n_windows2 = windows\n\ndef windows(raw, date, **kw):\n    import os, signal\n"
                 "    if str(date) == '2024-01-03':\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                 "    return _windows2(raw, date, **kw)\n")
    use_dask(cfg_path, "local")
    try:
        with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
            report = build(load_config(cfg_path))
    finally:
        _close_clients()
    assert [str(d) for d, _ in report.failed] == ["2024-01-03"], report.failed
    message = report.failed[0][1]
    assert "the Dask worker running it was lost (KilledWorker" in message and "\n" not in message
    assert sorted(str(d) for d in report.published) == ["2024-01-02", "2024-01-04", "2024-01-05"]


@pytest.mark.slow
@pytest.mark.parametrize("jobs, late", [(1, 0), (3, 0), (1, 3)])
def test_dates_run_in_a_dask_worker_started_by_dask_s_own_cli(tmp_path, jobs, late):
    """``dask scheduler`` + one ``dask worker --no-nanny`` (the worker is that process): every
    date's processor runs in the worker's pid, whatever ``jobs`` says, never in the build's. A
    worker joining ``late`` seconds after the build started is waited for (CI saw "with 0
    workers" once without ``wait_for_workers``)."""
    dask = Path(sys.executable).with_name("dask")
    assert dask.exists(), "dask's CLI is part of the dev install (dask[distributed])"
    cfg_path = plugin_config(tmp_path / "proj", jobs=jobs)
    pids = tmp_path / "pids.txt"
    note_pids(cfg_path, pids)
    info = tmp_path / "scheduler.json"
    common = dict(cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs = [subprocess.Popen([str(dask), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(info)], **common)]
    start = None
    try:
        deadline = time.monotonic() + 60
        while not (info.exists() and info.stat().st_size):
            assert procs[0].poll() is None and time.monotonic() < deadline, "the dask scheduler did not start"
            time.sleep(0.05)
        address = json.loads(info.read_text())["address"]

        def worker():
            procs.append(subprocess.Popen([str(dask), "worker", "--no-nanny", "--nthreads", "1", "--no-dashboard",
                                           "--local-directory", str(tmp_path / "worker"), address], **common))

        start = threading.Timer(late, worker)
        start.start()
        use_dask(cfg_path, address)
        r = shardgen_cli("build", "-c", cfg_path, "-v", cwd=tmp_path, timeout=180)
    finally:
        if start is not None:
            start.join()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert r.returncode == 0, r.stderr
    assert "with 1 workers" in r.stderr
    ran = [int(p) for p in pids.read_text().split()]
    assert ran == [procs[1].pid] * 4, f"ran in {ran}, the worker is {procs[1].pid}"


def test_a_processor_raising_names_its_file_and_line(tmp_path):
    """Issue 54: a processor's exception gave no file:line (not even with -v). It names the line of
    the plug-in's own file the exception came through (here a call into numpy), in one line."""
    cfg = write_config(tmp_path, process="badproc:windows", stride=None, end="2024-01-02")
    (tmp_path / "badproc.py").write_text("import numpy as np\n\n\ndef windows(raw, date, **kw):\n"
                                         "    return np.stack([])\n")  # raised in numpy's own Python code
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert re.search(rf"2024-01-02: processor raised ValueError at {re.escape(str(tmp_path / 'badproc.py'))}:5 "
                     r"\(in windows\): need at least one array to stack", r.stderr), r.stderr
