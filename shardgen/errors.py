"""The exception hierarchy: every message names the date, file or key and what was expected."""

from __future__ import annotations

import errno

from shardgen.format.errors import ShardError, ShardgenError

__all__ = [
    "ShardgenError",
    "ConfigError",
    "GeneratorError",
    "RawDataError",
    "ProcessorError",
    "ShardError",
    "ManifestError",
    "LockError",
    "Interrupted",
    "ObjectStoreError",
    "StoreUnreachable",
    "CredentialsRefused",
    "NoSuchStore",
    "ObjectMismatch",
]


class ConfigError(ShardgenError):
    """The config file or a command-line argument is wrong (CLI exit code 2)."""


class GeneratorError(ShardgenError):
    """The generator failed, timed out or could not be started for a date."""


class RawDataError(ShardgenError):
    """The generator's output for a date is missing, not a valid .npy, or mis-shaped."""


class ProcessorError(ShardgenError):
    """The processor raised, or returned windows of the wrong shape, dtype or with NaNs."""


class ManifestError(ShardgenError):
    """The manifest is missing, unreadable or of an unknown format."""


class LockError(ShardgenError):
    """The store's lock is held by another process."""


class Interrupted(ShardgenError):
    """Work abandoned because a stop was requested (SIGINT/SIGTERM); nothing partial is published."""


class ObjectStoreError(ShardgenError):
    """An object store refused or failed a request; the message names the URL."""


class StoreUnreachable(ObjectStoreError):
    """The endpoint cannot be reached (down, refused, timed out) after the retries."""


class CredentialsRefused(ObjectStoreError):
    """The server refused our credentials, or there are none."""


class NoSuchStore(ObjectStoreError):
    """The bucket does not exist."""


class ObjectMismatch(ObjectStoreError):
    """An object's bytes differ from what the manifest or the upload says."""


EXIT_ENVIRONMENT = 3  # the CLI's exit code when the environment failed (see ``is_environment``)


def is_environment(exc: BaseException) -> bool:
    """A failure of the environment, not of a date or the config: the store cannot be reached (its
    endpoint is down, or its bucket does not exist) or refuses the credentials, or the disk is full
    or mounted read-only (the CLI exits ``EXIT_ENVIRONMENT``). An error raised while handling
    another (a ShardgenError that wraps the OSError, even ``from None``) is judged by that one too:
    the errno decides, not the words, which a host with LC_MESSAGES set writes in its own language."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (StoreUnreachable, CredentialsRefused, NoSuchStore)):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return True
        text = str(exc)
        if "the disk is full" in text or "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False
