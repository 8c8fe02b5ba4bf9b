"""Importing the loader changes nothing in the host process (issue 55); the first ``ShardIter``
adds its exit hook only, in a dist worker too (issue 63). The wrapped ``sys.exit``/``exit``/``quit``
and the one-dist-kvstore guard come with the exit guard, only when asked (``loader.install_exit_guard``,
or ``loader.tools.launch``)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, make_store

COUNTS = {"2024-01-02": 20, "2024-01-03": 13}

SEEN = textwrap.dedent("""
    import atexit, builtins, json, sys, weakref
    import mxnet.kvstore
    import importlib, pkgutil
    weakref.finalize(type("Kept", (), {})(), print)  # the standard library's own hook of its first finalizer

    def seen():
        return {"atexit": atexit._ncallbacks(), "sys.exit": repr(type(sys.exit)), "exit": repr(type(builtins.exit)),
                "quit": repr(type(builtins.quit)), "kvstore.create": mxnet.kvstore.create.__module__}
""")


def _run(script: str, *args, worker: bool = True, guard_env: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DMLC_ROLE", None)
    env.pop("SHARDGEN_EXIT_GUARD", None)
    if worker:
        env["DMLC_ROLE"] = "worker"  # the role under which the guard installs its hooks
    if guard_env:
        env["SHARDGEN_EXIT_GUARD"] = "1"  # what loader.tools.launch sets in its workers
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


ITERATORS = textwrap.dedent("""
    before = seen()
    import loader, shardgen
    for package in (loader, shardgen):  # the store side registers nothing at import either
        for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(m.name)
    after_import = seen()
    it = loader.ShardIter(sys.argv[1], batch_size=4)
    loader.ShardIter(sys.argv[1], batch_size=4).close()  # a second iterator adds nothing
    if sys.argv[2] == "call":
        assert loader.install_exit_guard() and loader.install_exit_guard()  # once, however often called
    after_iterators = seen()
    it.close()
    print(json.dumps([before, after_import, after_iterators]))
""")


def test_in_a_dist_worker_importing_the_loader_and_making_iterators_leave_the_process_as_found(tmp_path):
    """Issue 63: the first ShardIter of a DMLC_ROLE=worker process wrapped sys.exit, exit, quit and
    replaced mx.kv.create, unasked. Now only its exit hook is added (closing its own threads)."""
    make_store(tmp_path / "store", COUNTS)
    r = _run(SEEN + ITERATORS, tmp_path / "store", "none")
    assert r.returncode == 0, r.stderr
    before, after_import, after_iterators = json.loads(r.stdout.splitlines()[-1])
    assert after_import == before, "importing the loader changed the process"
    assert after_iterators == {**before, "atexit": before["atexit"] + 2}  # the exit hook and the lease's join


@pytest.mark.parametrize("how", ["call", "launcher"])
def test_the_exit_guard_asked_for_wraps_exit_and_guards_kvstore_create(tmp_path, how):
    """``loader.install_exit_guard()`` in the script, or the variable loader.tools.launch sets in its
    workers (the first ShardIter installs it then): the hooks of a dist worker, once each."""
    make_store(tmp_path / "store", COUNTS)
    r = _run(SEEN + ITERATORS, tmp_path / "store", how, guard_env=how == "launcher")
    assert r.returncode == 0, r.stderr
    before, after_import, after_iterators = json.loads(r.stdout.splitlines()[-1])
    assert after_import == before, "importing the loader changed the process"
    assert after_iterators["atexit"] == before["atexit"] + 2  # the exit hook and the lease's join, once each
    for name in ("sys.exit", "exit", "quit"):
        assert after_iterators[name] == "<class 'loader.exitcode._Recorded'>", name
    assert after_iterators["kvstore.create"] == "loader.lifecycle"


def test_the_exit_guard_outside_a_dist_worker_changes_nothing(tmp_path):
    make_store(tmp_path / "store", COUNTS)
    script = SEEN + textwrap.dedent("""
        before = seen()
        import loader
        print(json.dumps([loader.install_exit_guard(), before, seen()]))
    """)
    r = _run(script, worker=False)
    assert r.returncode == 0, r.stderr
    installed, before, after = json.loads(r.stdout.splitlines()[-1])
    assert installed is False and after == before


def test_outside_a_dist_worker_the_first_iterator_adds_the_exit_hook_only(tmp_path):
    make_store(tmp_path / "store", COUNTS)
    script = SEEN + textwrap.dedent("""
        before = seen()
        from loader import ShardIter
        ShardIter(sys.argv[1], batch_size=4).close()
        print(json.dumps([before, seen()]))
    """)
    r = _run(script, tmp_path / "store", worker=False)
    assert r.returncode == 0, r.stderr
    before, after = json.loads(r.stdout.splitlines()[-1])
    assert after == {**before, "atexit": before["atexit"] + 2}  # the exit hook and the lease's join


def test_a_dist_kvstore_made_before_the_first_iterator_counts_as_the_first(tmp_path):
    """The usual order (``kv = mx.kv.create("dist_sync")``, then ``for_kvstore(kv, ...)``), the exit
    guard asked for after both: a second ``mx.kv.create("dist_sync")`` is still the LoaderError,
    never MXNet's constructor (which hangs)."""
    make_store(tmp_path / "store", COUNTS)
    script = textwrap.dedent("""
        import sys
        import mxnet.kvstore as kvs
        from loader import LoaderError, ShardIter, install_exit_guard

        class Dist(kvs.KVStore):  # stands for the worker's KVStoreDist (a real one needs a job)
            type = "dist_sync"
            def __init__(self):
                pass
            def __del__(self):
                pass

        def create(name="local"):
            print("MXNet's constructor was called", flush=True)
            return Dist()

        kvs.create = create
        kv = Dist()
        ShardIter(sys.argv[1], batch_size=4).close()
        install_exit_guard()
        try:
            kvs.create("dist_sync")
        except LoaderError as exc:
            print(exc)
    """)
    r = _run(script, tmp_path / "store")
    assert r.returncode == 0, r.stderr
    assert "MXNet's constructor was called" not in r.stdout
    assert "this worker has a 'dist_sync' kvstore already" in r.stdout


@pytest.mark.parametrize("guard", [True, False])
def test_the_launcher_asks_for_the_exit_guard_in_its_workers_unless_told_not_to(tmp_path, capfd, guard):
    """``loader.tools.launch`` owns its workers: their first ShardIter installs the exit guard
    (``--no-exit-guard``: ``Job(exit_guard=False)``, even with the variable in the launcher's own
    environment, leaves them as Python made them)."""
    from loader.tools.launch import Job

    make_store(tmp_path / "store", COUNTS)
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(f"""
        import sys
        from loader import ShardIter
        ShardIter({str(tmp_path / "store")!r}, batch_size=4).close()
        print("sys.exit is", type(sys.exit).__name__)
    """))
    os.environ["SHARDGEN_EXIT_GUARD"] = "1"  # a launcher started from a guarded worker, say
    try:
        job = Job([sys.executable, str(worker)], workers=1, servers=1, grace_s=1, exit_guard=guard)
        job.start()
        assert job.wait(60) == 0
    finally:
        os.environ.pop("SHARDGEN_EXIT_GUARD")
    out = capfd.readouterr().out
    assert f"[worker 0] sys.exit is {'_Recorded' if guard else 'builtin_function_or_method'}" in out, out
