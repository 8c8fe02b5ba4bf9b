"""Per-date work on a Dask cluster, through joblib's Dask backend (``[run] backend = "dask"``).

``[run] scheduler`` is ``"tcp://host:port"`` of a running scheduler, or ``"local"`` for a
``LocalCluster`` of ``jobs`` single-threaded worker processes on this machine. Workers write shard
files straight into the store (which must be on a filesystem they all see); only the process that
runs ``build`` publishes the manifest. Needs the optional extra: ``pip install '.[cluster]'``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from typing import Iterator

from .errors import ConfigError

__all__ = ["dask_client", "dask_parallel"]

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


@contextlib.contextmanager
def dask_parallel(scheduler: str, jobs: int) -> Iterator:
    """A joblib ``Parallel`` that runs on the cluster, yielding results as they complete."""
    import joblib

    client = dask_client(scheduler, jobs)
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
