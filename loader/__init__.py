"""The training side: read a shardgen manifest through MXNet's native record iterator."""

from .errors import LoaderError
from .shard_iter import ShardIter, to_datetime64

__all__ = ["ShardIter", "LoaderError", "to_datetime64"]
