"""An exit hook that lets a ``dist_sync`` worker exit: wait for MXNet's engine before MXNet shuts down.

A worker whose script ends right after its last ``trainer.step(...)`` still has kvstore pushes and
pulls in flight in MXNet's engine; MXNet's own exit hook (``MXNotifyShutdown``) then hangs in the
kvstore's finalisation, and the whole job with it (most runs, on loopback). ``mx.nd.waitall()``
before that hook fixes it. Importing ``loader`` registers this hook, so any script is protected.

atexit runs hooks last-registered first. The order at exit is:

1. ``_wait_for_engine`` (here): ``mx.nd.waitall()``, in a daemon thread joined for at most
   ``EXIT_WAIT_S`` seconds; a warning is logged if it does not finish, and exit goes on.
2. ``loader.shard_iter._close_all``: stops the threads of every live ``ShardIter``.
3. MXNet's hooks, registered when ``mxnet`` was imported, before either of ours.

This module imports ``shard_iter`` (and so ``mxnet``) before registering, which fixes that order.
"""

from __future__ import annotations

import atexit
import logging
import threading

import mxnet as mx

from . import shard_iter  # noqa: F401  (registers _close_all first: it must run after the wait below)

__all__ = ["EXIT_WAIT_S", "wait_for_engine"]

log = logging.getLogger(__name__)
EXIT_WAIT_S = 30.0  # seconds the exit hook waits for MXNet's engine before giving up


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


@atexit.register
def _wait_for_engine() -> None:
    wait_for_engine(EXIT_WAIT_S)
