"""Kept import path (transitional): the shard check lives in :mod:`shardgen.format.check`."""

from .format.check import VERIFY_MODES, ShardFrames, check_shard  # noqa: F401
