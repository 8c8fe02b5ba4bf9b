"""Importing the loader changes nothing in the host process (issue 55): the exit hook, the wrapped
``sys.exit``/``exit``/``quit`` and the one-dist-kvstore guard start with the first ``ShardIter``."""

import json
import os
import subprocess
import sys
import textwrap

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


def _run(script: str, *args, worker: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DMLC_ROLE", None)
    if worker:
        env["DMLC_ROLE"] = "worker"  # the role under which every hook is installed
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_importing_every_loader_module_changes_nothing_and_the_first_iterator_starts_the_hooks(tmp_path):
    make_store(tmp_path / "store", COUNTS)
    script = SEEN + textwrap.dedent("""
        before = seen()
        import loader, shardgen
        for package in (loader, shardgen):  # the store side registers nothing at import either
            for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(m.name)
        after_import = seen()
        it = loader.ShardIter(sys.argv[1], batch_size=4)
        loader.ShardIter(sys.argv[1], batch_size=4).close()  # a second iterator adds nothing
        after_iterators = seen()
        it.close()
        print(json.dumps([before, after_import, after_iterators]))
    """)
    r = _run(script, tmp_path / "store")
    assert r.returncode == 0, r.stderr
    before, after_import, after_iterators = json.loads(r.stdout.splitlines()[-1])
    assert after_import == before, "importing the loader changed the process"
    assert after_iterators["atexit"] == before["atexit"] + 2  # the exit hook and the lease's join, once each
    for name in ("sys.exit", "exit", "quit"):
        assert after_iterators[name] == "<class 'loader.exitcode._Recorded'>", name
    assert after_iterators["kvstore.create"] == "loader.lifecycle"


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
    """The usual order (``kv = mx.kv.create("dist_sync")``, then ``for_kvstore(kv, ...)``): a second
    ``mx.kv.create("dist_sync")`` is still the LoaderError, never MXNet's constructor (which hangs)."""
    make_store(tmp_path / "store", COUNTS)
    script = textwrap.dedent("""
        import sys
        import mxnet.kvstore as kvs
        from loader import LoaderError, ShardIter

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
        try:
            kvs.create("dist_sync")
        except LoaderError as exc:
            print(exc)
    """)
    r = _run(script, tmp_path / "store")
    assert r.returncode == 0, r.stderr
    assert "MXNet's constructor was called" not in r.stdout
    assert "this worker has a 'dist_sync' kvstore already" in r.stdout
