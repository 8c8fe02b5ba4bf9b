"""The root of shardgen's errors and the shard error, here so the format package stands alone
(``shardgen.errors`` re-exports both and holds the rest of the hierarchy)."""

from __future__ import annotations

__all__ = ["ShardgenError", "ShardError"]


class ShardgenError(Exception):
    """Base class of every error shardgen raises on purpose."""


class ShardError(ShardgenError):
    """A shard on disk is incomplete, corrupt or does not match the manifest."""
