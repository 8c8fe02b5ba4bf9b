"""Per-date work on a Dask cluster, through joblib's Dask backend (``[run] backend = "dask"``).

``[run] scheduler`` is ``"tcp://host:port"`` of a running scheduler, or ``"local"`` for a
``LocalCluster`` of ``jobs`` single-threaded worker processes on this machine. Workers write shard
files straight into the store (which must be on a filesystem they all see); only the process that
runs ``build`` publishes the manifest. A processor module in the config's folder is uploaded to the
workers of a remote scheduler (``ship_plugin``). Needs the optional extra: ``pip install '.[cluster]'``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional

from shardgen.errors import ConfigError

__all__ = ["dask_client", "dask_parallel", "ship_plugin"]

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
            cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True,
                                   dashboard_address=None, silence_logs=logging.ERROR)
            client = Client(cluster)
        else:
            try:
                client = Client(scheduler, timeout="10s")
            except OSError as exc:
                raise ConfigError(f"run.scheduler {scheduler!r}: cannot connect ({exc})") from None
        _CLIENTS[key] = client
        log.info("dask: %s with %d workers", scheduler, len(client.scheduler_info().get("workers", {})))
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


@contextlib.contextmanager
def dask_parallel(scheduler: str, jobs: int, *, plugin: Optional[Path] = None) -> Iterator:
    """A joblib ``Parallel`` that runs on the cluster, yielding results as they complete.
    ``plugin``: the processor's file in the config folder, shipped to remote workers."""
    import joblib

    client = dask_client(scheduler, jobs)
    ship_plugin(client, scheduler, plugin)
    with joblib.parallel_config(backend="dask", wait_for_workers_timeout=60):
        yield joblib.Parallel(n_jobs=-1, return_as="generator_unordered"), client


@atexit.register
def _close_clients() -> None:
    for client in _CLIENTS.values():
        with contextlib.suppress(Exception):
            cluster = getattr(client, "cluster", None)
            client.close()
            if cluster is not None:
                cluster.close()
    _CLIENTS.clear()
