"""The training side: read a shardgen manifest through MXNet's native record iterator.

Importing ``loader`` changes nothing in the process: the exit hook (``loader.lifecycle``) that
waits for MXNet's engine before MXNet shuts down, so a ``dist_sync`` worker exits cleanly, and
ends a failing ``dist_sync`` worker at once with its exit code instead of hanging in MXNet's kvstore
teardown, starts with the first ``ShardIter``.
"""

from loader.errors import LoaderError
from loader.shard_iter import ShardIter
from loader.source.selection import to_datetime64

__all__ = ["ShardIter", "LoaderError", "to_datetime64"]
