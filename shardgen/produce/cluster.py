"""Per-date work on a Dask cluster's workers (``[run] backend = "dask"``), never in the calling process.

``[run] scheduler`` is ``"tcp://host:port"`` of a running scheduler, or ``"local"`` for a
``LocalCluster`` of ``jobs`` single-threaded worker processes on this machine; at most ``jobs``
dates run at once either way. (Not through joblib's Dask backend: with ``n_jobs=-1`` it counts
the cluster's worker threads and, when that is 1, runs every task in the calling process.) Workers write shard
files straight into the store (which must be on a filesystem they all see); only the process that
runs ``build`` publishes the manifest. A processor module in the config's folder is uploaded to the
workers of a remote scheduler (``ship_plugin``). Needs the optional extra: ``pip install '.[cluster]'``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from shardgen.errors import ConfigError

__all__ = ["dask_client", "run_on_cluster", "ship_plugin"]

log = logging.getLogger(__name__)
_CLIENTS: dict = {}


def dask_client(scheduler: str, jobs: int):
    """A (cached) distributed Client for the scheduler address, or a LocalCluster for "local"."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ConfigError("run.backend = 'dask' needs dask[distributed]: pip install '.[cluster]'") from None
    key = (scheduler, jobs if scheduler == "local" else None)
    client = _CLIENTS.get(key)
    if client is None or client.status not in ("running", "connecting"):
        if scheduler == "local":
            # dashboard_address=None still binds Dask's default port 8787 (and warns if it is taken)
            cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True,
                                   dashboard_address=":0", silence_logs=logging.ERROR)
            client = Client(cluster)
        else:
            try:
                client = Client(scheduler, timeout="10s")
            except OSError as exc:
                raise ConfigError(f"run.scheduler {scheduler!r}: cannot connect ({exc})") from None
        if not _CLIENTS:
            atexit.register(_close_clients)  # with the first client, not at import
        _CLIENTS[key] = client
    return client


def ship_plugin(client, scheduler: str, plugin: Optional[Path]) -> None:
    """Make a processor module from the config's folder importable on the cluster's workers.

    A ``LocalCluster``'s workers read the config's folder themselves. Workers of a remote scheduler
    may not see it: the file is uploaded into each worker's directory (on its ``sys.path``; workers
    that join later get it too). A plug-in package (a folder) cannot be shipped this way."""
    if plugin is None or scheduler == "local":
        return
    if plugin.name == "__init__.py":
        raise ConfigError(f"process.function: the plug-in package {plugin.parent} cannot be shipped to the Dask "
                          f"workers of {scheduler}; install it on every worker, or make it a single .py file")
    client.upload_file(str(plugin), load=False)
    log.info("dask: uploaded %s to the workers", plugin)


def run_on_cluster(tasks: Iterable[tuple[Callable, tuple, dict]], scheduler: str, jobs: int, *,
                   plugin: Optional[Path] = None) -> Iterator:
    """The results of ``fn(*args, **kwargs)`` for every task (joblib's ``delayed`` triples), run on
    the cluster's workers, at most ``jobs`` at once, in completion order. ``plugin``: the
    processor's file in the config folder, shipped to remote workers. When the caller stops
    iterating, the tasks not started are dropped (their futures released)."""
    from dask.distributed import as_completed

    client = dask_client(scheduler, jobs)
    try:
        client.wait_for_workers(1, timeout=60)  # before the plugin ships and the workers are counted
    except TimeoutError:
        raise ConfigError(f"run.scheduler {scheduler!r}: no Dask worker joined within 60 s") from None
    log.info("dask: %s with %d workers", scheduler, len(client.scheduler_info().get("workers", {})))
    ship_plugin(client, scheduler, plugin)
    tasks = iter(tasks)
    dates: dict = {}  # future -> its date (the task's second argument: produce(cfg, date, ...))

    def submit(task: tuple) -> object:
        fn, args, kwargs = task
        future = client.submit(fn, *args, pure=False, **kwargs)
        dates[future] = args[1] if len(args) > 1 else args  # (what a failure names)
        return future

    done = as_completed([submit(t) for t in itertools.islice(tasks, jobs)])
    for future in done:
        for task in itertools.islice(tasks, 1):  # one finished: the next one starts
            done.add(submit(task))
        date = dates.pop(future)
        try:
            result = future.result()
            future.release()  # the cluster need not keep it (closing it would warn about losing it)
        except Exception as exc:  # noqa: BLE001 - produce() returns its own failures: this is the cluster's
            # A worker died running it (KilledWorker after Dask's retries), or the scheduler was lost.
            from shardgen.produce.pipeline import DateResult

            result = DateResult(date, "failed", message=f"{date}: the Dask worker running it was lost "
                                                        f"({type(exc).__name__}: {exc}); it is tried again on the "
                                                        "next run")
        yield result


def _close_clients() -> None:
    for client in _CLIENTS.values():
        with contextlib.suppress(Exception):
            cluster = getattr(client, "cluster", None)
            client.close()
            if cluster is not None:
                cluster.close()
    _CLIENTS.clear()
