"""How the loader's process ends: the live iterators, the one exit hook that closes them, and the
exit guard that lets a ``dist_sync`` worker exit, whether it ends normally or fails.

Importing ``loader`` changes nothing in the process, and neither does a ``ShardIter`` beyond
registering the exit hook (``start()``, at the top of its construction; once, whichever thread
makes it). What changes the process (``sys.exit``, ``mx.kv.create``, the exit path) is the exit
guard, installed only when asked: by ``install_exit_guard()`` (``loader.install_exit_guard``) in a
worker script, or in the workers ``loader.tools.launch`` starts (it sets ``GUARD_ENV``, and the
first ``ShardIter`` then installs it).

*Normal end* (always). A worker whose script ends right after its last ``trainer.step(...)`` still
has kvstore pushes and pulls in flight in MXNet's engine; MXNet's own exit hook
(``MXNotifyShutdown``) then hangs in the kvstore's finalisation, and the whole job with it (most
runs, on loopback). ``mx.nd.waitall()`` before that hook fixes it.

*Failure* (with the guard). A worker that raises, or calls ``sys.exit(n)`` with n != 0, hangs in
the kvstore's teardown (ps-lite's finalize barrier waits for the other workers, which wait in
``trainer.step`` for it). In a guarded process with ``DMLC_ROLE=worker`` a failure
(``loader.exitcode``: the traceback has been printed by then) ends the process at once with its
code, MXNet's teardown skipped, so a launcher sees the failure and stops the job.

*A second dist kvstore* (with the guard). In a worker, ``mx.kv.create("dist_sync")`` a second time
(``Module.fit(it, kvstore="dist_sync")`` does it when the iterator's kvstore exists already) waits
forever in MXNet's constructor: a ps-lite barrier of a second customer, which the servers and the
scheduler never join. The guard makes that second call a ``LoaderError`` saying to pass the same
kvstore object; a dist kvstore made before the guard counts as the first.

The exit hook, ``_at_exit``, is registered once (by the first ``ShardIter`` or the guard);
``mxnet`` is imported by then (this module imports it, and registers MXNet's hook), and atexit runs
hooks last-registered first, so ours runs before MXNet's, whatever else was imported. Every
``ShardIter`` is ``track``-ed here from its construction. The order of the hook's steps is
``exit_steps``:

* normal exit: 1. ``wait_for_engine`` (``mx.nd.waitall()`` in a daemon thread joined for at most
  ``EXIT_WAIT_S`` seconds; a warning is logged if it does not finish, and exit goes on);
  2. ``close_iterators`` (``close_all``: stops the threads of every live ``ShardIter``; native
  threads still running at MXNet's shutdown crash the process, "pure virtual method called");
  then the hooks registered before ours, MXNet's among them.
* failing guarded worker: 1. ``close_iterators``; 2. ``flush`` (logging, stdout, stderr);
  3. ``exit_now`` (``os._exit(code)``): the hooks registered before ours (MXNet's among them) and
  the interpreter's teardown do not run.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import weakref
from typing import Any, Optional

import mxnet as mx

import loader.exitcode as exitcode

__all__ = ["EXIT_WAIT_S", "GUARD_ENV", "RANK_FILE", "start", "install_exit_guard", "track", "close_all",
           "wait_for_engine", "exit_steps", "report_rank"]

log = logging.getLogger(__name__)
EXIT_WAIT_S = 30.0  # seconds the exit hook waits for MXNet's engine before giving up
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every ShardIter not yet collected
GUARD_ENV = "SHARDGEN_EXIT_GUARD"  # "1" in a worker of loader.tools.launch: its first ShardIter installs the guard
_HOOKED: list[bool] = []  # the exit hook is registered (once, under _START)
_GUARDED: list[bool] = []  # install_exit_guard() ran in this dist worker (once, under _START)
_START = threading.Lock()


def track(iterator: Any) -> None:
    """Close ``iterator`` at exit (if it is still alive then)."""
    _LIVE.add(iterator)


def close_all() -> None:
    """Stop every live iterator's threads before the interpreter (and MXNet's engine) shuts down."""
    for it in list(_LIVE):
        it.close()
    from loader.pipeline.pipeline import join_closing  # dropped iterators' close threads (their finalizer ran already)

    join_closing(EXIT_WAIT_S)


def exit_steps(failure: Optional[int]) -> tuple[str, ...]:
    """The exit hook's steps, in order; ``failure`` is a failing worker's exit code, else None."""
    if failure is None:
        return ("wait_for_engine", "close_iterators")
    return ("close_iterators", "flush", "exit_now")


def wait_for_engine(timeout: float = EXIT_WAIT_S) -> bool:
    """``mx.nd.waitall()`` bounded in time: True if the engine finished within ``timeout`` seconds."""
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            mx.nd.waitall()
        except Exception as exc:  # an asynchronous MXNet error surfaces here; exit must go on
            failure.append(exc)

    try:
        thread = threading.Thread(target=wait, name="loader-exit-waitall", daemon=True)
        thread.start()
    except RuntimeError:  # Python 3.12+: no new threads at interpreter shutdown; wait unbounded
        wait()
        thread = None
    if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
            log.warning("loader: MXNet's engine did not finish its pending work within %gs at exit; "
                        "exiting anyway (the process may hang in MXNet's shutdown)", timeout)
            return False
    if failure:
        log.warning("loader: MXNet reported an error while finishing its pending work at exit: %s", failure[0])
    return True


def _flush() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be said there
            pass


def _is_worker() -> bool:
    return os.environ.get("DMLC_ROLE") == "worker"


def _at_exit() -> None:
    code = exitcode.failure_code() if _GUARDED and _is_worker() else None
    if code is not None:
        log.warning("loader: this dist worker is failing (exit code %d); exiting now, without MXNet's "
                    "kvstore shutdown (it would wait for the other workers forever)", code)
    try:
        for step in exit_steps(code):
            if step == "wait_for_engine":
                wait_for_engine(EXIT_WAIT_S)
            elif step == "close_iterators":
                close_all()
            elif step == "flush":
                _flush()
    finally:
        if code is not None:  # "exit_now", even if a step above raised
            os._exit(code)


def start() -> None:
    """The exit hook, once (idempotent and thread-safe), called by every ``ShardIter``; the exit
    guard too in a worker started by ``loader.tools.launch`` (``GUARD_ENV``), and nowhere else."""
    with _START:
        _hook()
    if os.environ.get(GUARD_ENV) == "1":
        install_exit_guard()


def install_exit_guard() -> bool:
    """Let this ``dist_sync`` worker end its job when it fails, instead of hanging in MXNet's kvstore
    teardown (idempotent; call it in your worker script, before or after making the kvstore;
    ``loader.tools.launch`` does it for its workers). In a process with ``DMLC_ROLE=worker`` it
    wraps ``sys.exit``, ``exit`` and ``quit`` to see the exit code (``loader.exitcode``), makes a
    second ``mx.kv.create("dist_*")`` a ``LoaderError`` instead of a hang, and makes a failure end
    the process with ``os._exit(code)`` once the iterators are closed; it returns True. Anywhere
    else it changes nothing and returns False."""
    if not _is_worker():
        return False
    with _START:
        if not _GUARDED:
            _GUARDED.append(True)
            exitcode.install()
            _one_dist_kvstore()
            _hook()
    return True


def _hook() -> None:
    if not _HOOKED:
        _HOOKED.append(True)
        atexit.register(_at_exit)


def _one_dist_kvstore() -> None:
    """``mx.kv.create`` (what ``Module`` and ``gluon.Trainer`` call with a kvstore name) refuses a
    second distributed kvstore in this process (one made before counts), instead of hanging in it."""
    import mxnet.kvstore as kvs

    create, made = kvs.create, [kv.type for kv in _dist_kvstores()]

    def create_once(name: str = "local") -> Any:
        if isinstance(name, str) and "dist" in name and made:
            from loader.errors import LoaderError

            raise LoaderError(f"mx.kv.create({name!r}): this worker has a {made[0]!r} kvstore already, and MXNet "
                              "1.9.1 waits forever in a second one (its ps-lite barrier is joined by no server): "
                              "pass the kvstore you made to the model, e.g. Module.fit(..., kvstore=kv) or "
                              "gluon.Trainer(..., kvstore=kv)")
        kv = create(name)
        if "dist" in getattr(kv, "type", ""):
            made.append(kv.type)
        return kv

    create_once.__doc__ = create.__doc__
    kvs.create = create_once


def _dist_kvstores() -> list:
    """The distributed kvstores this process holds already (made before the guard): one pass over
    the garbage collector's objects, once per guarded worker."""
    from mxnet.kvstore import KVStore

    return [o for o in gc.get_objects() if isinstance(o, KVStore) and "dist" in o.type]


RANK_FILE = "SHARDGEN_RANK_FILE"  # where a worker started by this launcher reports its kvstore rank


def report_rank(rank: int) -> None:
    """Tell ``loader.tools.launch`` this worker's kvstore rank, so its lines and messages carry it
    (nothing outside the launcher)."""
    path = os.environ.get(RANK_FILE)
    if not path:
        return
    try:
        with open(path + ".tmp", "w") as fh:
            fh.write(str(int(rank)))
        os.replace(path + ".tmp", path)
    except OSError:  # the launcher is gone: nobody to tell
        pass
