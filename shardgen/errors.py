"""The exception hierarchy: every message names the date, file or key and what was expected."""

from __future__ import annotations

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
