"""One boto3 S3 client per process (clients are thread-safe; a forked child makes its own), made
from the environment the standard AWS way, and how many tries a request gets (``attempts``)."""

from __future__ import annotations

import os
import threading

from shardgen.store.objfetch import ATTEMPTS
from shardgen.store.objurl import ObjectStoreError

__all__ = ["client", "attempts", "forget_clients", "endpoint"]

_clients: dict = {}  # pid -> (client, attempts)
_clients_lock = threading.RLock()  # re-entered when a finalizer (a lease release) runs during client creation


def client():
    """This process's boto3 S3 client."""
    return _session()[0]


def attempts() -> int:
    """Tries of one request or download: the AWS setting ``max_attempts`` (``AWS_MAX_ATTEMPTS``, or
    ``max_attempts`` in the profile of ``~/.aws/config``), default ``ATTEMPTS``. Our own loop makes
    them (botocore's retries are off), so every failure mode is counted the same way."""
    return _session()[1]


def _session() -> tuple:
    key = os.getpid()
    with _clients_lock:
        if key not in _clients:
            try:
                import boto3
                import botocore.session
                from botocore.config import Config
            except ImportError:
                raise ObjectStoreError("s3:// stores need boto3: pip install 'shardgen[s3]'") from None

            config = Config(connect_timeout=3, read_timeout=30, retries={"max_attempts": 1, "mode": "standard"},
                            max_pool_connections=32,
                            # S3-compatible servers may answer ranged GETs with whole-object checksums:
                            # we check sizes and hashes ourselves.
                            response_checksum_validation="when_required",
                            request_checksum_calculation="when_required")
            _clients.clear()
            core = botocore.session.get_session()
            try:
                tries = core.get_config_variable("max_attempts")
            except ValueError:
                tries = 0
            if tries is not None and (not isinstance(tries, int) or tries < 1):
                raise ObjectStoreError(f"AWS_MAX_ATTEMPTS (or max_attempts in the AWS config): expected a whole "
                                       f"number >= 1, got {os.environ.get('AWS_MAX_ATTEMPTS', tries)!r}")
            try:
                client = boto3.session.Session(botocore_session=core).client("s3", config=config)
            except ValueError as exc:  # e.g. AWS_ENDPOINT_URL without http:// or https://
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                raise ObjectStoreError(f"S3 endpoint {endpoint!r}: {exc} (an endpoint URL starts with http:// "
                                       "or https://)") from None
            _clients[key] = (client, ATTEMPTS if tries is None else tries)
        return _clients[key]


def forget_clients() -> None:
    """Drop the cached client: the next call makes one from the environment as it is now (a new
    endpoint or credentials)."""
    with _clients_lock:
        _clients.clear()


def endpoint() -> str:
    """The S3 endpoint's URL, for messages."""
    try:
        return client().meta.endpoint_url
    except Exception:  # noqa: BLE001 - only for messages
        return "the S3 endpoint"
