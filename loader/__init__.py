"""The training side: read a shardgen manifest through MXNet's native record iterator.

Importing ``loader`` changes nothing in the process, and neither does a ``ShardIter`` beyond its
exit hook (``loader.lifecycle``: it waits for MXNet's engine and closes the iterators before MXNet
shuts down). ``install_exit_guard()`` (called by you in a ``dist_sync`` worker script, or for you in
the workers of ``loader.tools.launch``) is what wraps ``sys.exit`` and ``mx.kv.create`` and lets a
failing worker end at once with its exit code instead of hanging in MXNet's kvstore teardown.
MXNet itself is the user's (CPU or CUDA wheel): ``loader.framework`` says what to install when it
is missing.
"""

from loader.framework import require_mxnet

require_mxnet()

from loader.errors import LoaderError  # noqa: E402
from loader.lifecycle import install_exit_guard  # noqa: E402
from loader.shard_iter import ShardIter  # noqa: E402
from loader.source.selection import to_datetime64  # noqa: E402

__all__ = ["ShardIter", "LoaderError", "install_exit_guard", "to_datetime64"]
